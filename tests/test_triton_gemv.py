"""The small-batch Triton GEMV (core/layers/triton_gemv.py) and the layer that uses it
(platforms/cuda_small_batch_linear.py, ``CHASSIS_TRITON_GEMV=1``).

The kernel runs in the shared ``TRITON_INTERPRET=1`` child (see tests/test_triton_attention.py
for why) at tiny shapes against ``gemv_ref``, on every launch path (split-K or not, dot or
multiply-and-reduce), and is compiled for the GPU targets without a GPU. The layer, the swap
and the platform's wiring run in-process. tests/gpu/test_gpu_triton_gemv.py checks the kernel
at Qwen3-0.6B's shapes and in a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from triton_compile_check import (
    TARGETS,
    compile_kernel,
    in_interpreter,
    interpreter_parent,
    not_in_interpreter,
    run_kernel_tests,
)

pytest.importorskip("triton")

from chassis.core.layers import triton_gemv, triton_ops
from chassis.core.layers.triton_gemv import (
    GemvConfig,
    add_rms_norm_gemv,
    add_rms_norm_gemv_ref,
    choose_config,
    gemv,
    gemv_ref,
    silu_and_mul_gemv_ref,
)
from chassis.core.lora.layers import LoRALinear, LoRAStepState
from chassis.platforms import cuda_small_batch_linear as sbl
from chassis.platforms.cuda_small_batch_linear import (
    SmallBatchLinear,
    small_batch_layers,
    use_small_batch_gemv,
)

#: one rounding of float32 sums in another order; two steps of a 16-bit dtype (the
#: interpreter converts float32 to bfloat16 by truncation), relative to outputs of O(1)
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tol = TOL[expected.dtype]
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


def _layer_tensors(
    rows: int, in_features: int, out_features: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [rows, in]``, ``weight [out, in]``, ``bias [out]`` with outputs of O(1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    weight = (torch.randn(out_features, in_features, generator=g) / in_features**0.5).to(dtype)
    return x, weight, torch.randn(out_features, generator=g).to(dtype)


@interpreter_parent
def test_gemv_under_interpreter(request: pytest.FixtureRequest) -> None:
    run_kernel_tests(__file__, request)


# -- the kernel (interpreter) ---------------------------------------------------------------


@in_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("shape", [(64, 40), (300, 72)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_kernel_matches_reference(shape: tuple[int, int], rows: int, dtype: torch.dtype) -> None:
    """The default launch config; 300 inputs end in a partial tile, 40 and 72 outputs in a
    partial block."""
    x, weight, bias = _layer_tensors(rows, *shape, dtype)
    for b in (None, bias):
        _close(gemv(x, weight, b), gemv_ref(x, weight, b))


#: every launch path: split or not, dot or multiply-and-reduce, whole or partial K tiles
CONFIGS = {
    "dot": GemvConfig(block_n=16, block_k=32, split_k=1, use_dot=True),
    "dot_split": GemvConfig(block_n=16, block_k=32, split_k=4, use_dot=True),
    "reduce": GemvConfig(block_n=16, block_k=64, split_k=1, use_dot=False),
    "reduce_split": GemvConfig(block_n=16, block_k=32, split_k=4, use_dot=False),
}


@in_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("in_features", [256, 300])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_launch_path_matches_reference(
    name: str, in_features: int, rows: int, dtype: torch.dtype
) -> None:
    x, weight, bias = _layer_tensors(rows, in_features, 40, dtype, seed=rows)
    for b in (None, bias):
        _close(gemv(x, weight, b, config=CONFIGS[name]), gemv_ref(x, weight, b))


@in_interpreter
def test_split_sums_in_a_fixed_order_and_leaves_the_counters_zero() -> None:
    """The last split to arrive adds the partials in split order: the same bits every call;
    the counters are zero again afterwards (the next launch starts from them). Splits that
    would get no tile are dropped (10 tiles in 4 splits of 3: 4 launched; 5 tiles: 3)."""
    x, weight, bias = _layer_tensors(3, 160, 40, torch.float32)
    config = GemvConfig(block_n=16, block_k=16, split_k=4, use_dot=False)
    first = gemv(x, weight, bias, config=config)
    assert torch.equal(first, gemv(x, weight, bias, config=config))
    _close(first, gemv_ref(x, weight, bias))
    assert all(not counters.any() for counters in triton_ops._SPLIT_COUNTERS.values())
    x, weight, bias = _layer_tensors(2, 80, 24, torch.float32)
    _close(gemv(x, weight, bias, config=config), gemv_ref(x, weight, bias))


@in_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["dot", "reduce_split"])
def test_silu_and_mul_input_matches_the_two_steps(name: str, dtype: torch.dtype) -> None:
    """``silu_and_mul=True``: the input is ``silu(gate) * up`` of a ``[rows, 2K]`` gate|up
    tensor, applied as tiles load; equal to SwiGLU then the GEMV (within a rounding), on a
    split and an unsplit path and a partial K tile."""
    gate_up, weight, bias = _layer_tensors(3, 2 * 300, 40, dtype, seed=7)
    weight = weight[:, :300].contiguous()
    for b in (None, bias):
        fused = gemv(gate_up, weight, b, config=CONFIGS[name], silu_and_mul=True)
        _close(fused, silu_and_mul_gemv_ref(gate_up, weight, b))
    with pytest.raises(ValueError, match="twice as many"):
        gemv(gate_up[:, :300], weight, silu_and_mul=True)


@in_interpreter
def test_layer_fuses_the_swiglu_activation_for_few_rows() -> None:
    """``SmallBatchLinear.forward_silu_and_mul``: one fused launch for few rows, SwiGLU then
    the layer for more; and the Llama MLP asks its down projection for it."""
    from chassis.builtin_plugins.models.llama import LlamaMLP
    from chassis.core.layers.activation import SiluAndMul

    linear = nn.Linear(48, 24, bias=False)
    layer = SmallBatchLinear(linear)
    with torch.inference_mode():
        few = torch.randn(2, 96)
        _close(layer.forward_silu_and_mul(few), silu_and_mul_gemv_ref(few, linear.weight))
        many = torch.randn(9, 96)
        expected = F.linear(SiluAndMul().forward_reference(many), linear.weight)
        torch.testing.assert_close(layer.forward_silu_and_mul(many), expected)
    mlp = LlamaMLP.__new__(LlamaMLP)
    nn.Module.__init__(mlp)
    mlp.gate_up_proj = SmallBatchLinear(nn.Linear(16, 96, bias=False))
    mlp.down_proj = layer
    mlp.act_fn = SiluAndMul()
    mlp.reduce_output = False
    calls = []
    original = layer.forward_silu_and_mul
    layer.forward_silu_and_mul = lambda h: calls.append(h.shape) or original(h)  # type: ignore[method-assign]
    with torch.inference_mode():
        x = torch.randn(1, 16)
        expected = silu_and_mul_gemv_ref(gemv_ref(x, mlp.gate_up_proj.weight), linear.weight)
        _close(mlp(x), expected)
    assert calls == [(1, 96)]


@in_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["dot_split", "reduce"])
def test_residual_add_and_rms_norm_input_match_the_two_steps(name: str, dtype: torch.dtype) -> None:
    """``add_rms_norm_gemv``: the input is RMSNorm(x + residual) (statistics over the whole
    row, 300 features: a partial tile), the residual stream comes back as ``x + residual`` in
    a new tensor (exactly, in float32), and the inputs are left as they were."""
    x, weight, bias = _layer_tensors(3, 300, 40, dtype, seed=11)
    residual, norm_weight, _ = _layer_tensors(3, 300, 300, dtype, seed=12)
    norm_weight = norm_weight[0].contiguous()
    x_before, residual_before = x.clone(), residual.clone()
    for b in (None, bias):
        out, stream = add_rms_norm_gemv(
            x, residual, norm_weight, 1e-6, weight, b, config=CONFIGS[name]
        )
        ref_out, ref_stream = add_rms_norm_gemv_ref(x, residual, norm_weight, 1e-6, weight, b)
        _close(out, ref_out)
        if dtype == torch.float32:
            assert torch.equal(stream, ref_stream)
        else:  # (the interpreter rounds float32 to bfloat16 by truncation; a GPU rounds)
            _close(stream, ref_stream)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)
    with pytest.raises(ValueError, match="residual must match x"):
        add_rms_norm_gemv(x, residual[:2], norm_weight, 1e-6, weight)
    with pytest.raises(ValueError, match="norm_weight must be"):
        add_rms_norm_gemv(x, residual, norm_weight[:8], 1e-6, weight)


@in_interpreter
def test_llama_mlp_takes_the_post_attention_norm_into_its_first_launch() -> None:
    """``LlamaMLP.forward_after_norm`` with swapped layers: the gate/up projection adds the
    residual and normalizes in its launch (an exact ``RMSNorm`` only), equal to the norm then
    the MLP; Gemma's norm takes the two steps."""
    from chassis.builtin_plugins.models.llama import LlamaMLP
    from chassis.core.layers.activation import SiluAndMul
    from chassis.core.layers.norm import GemmaRMSNorm, RMSNorm

    torch.manual_seed(0)
    mlp = LlamaMLP.__new__(LlamaMLP)
    nn.Module.__init__(mlp)
    mlp.gate_up_proj = SmallBatchLinear(nn.Linear(32, 96, bias=False))
    mlp.down_proj = SmallBatchLinear(nn.Linear(48, 32, bias=False))
    mlp.act_fn = SiluAndMul()
    mlp.reduce_output = False
    calls = []
    original = mlp.gate_up_proj.forward_add_rms_norm

    def counting(*args: object) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(type(args[2]).__name__)
        return original(*args)  # type: ignore[arg-type]

    mlp.gate_up_proj.forward_add_rms_norm = counting  # type: ignore[method-assign]
    x, residual = torch.randn(2, 32), torch.randn(2, 32)
    for norm in (RMSNorm(32), GemmaRMSNorm(32)):
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
        with torch.inference_mode():
            out, stream = mlp.forward_after_norm(x, residual, norm)
            normed, expected_stream = norm.forward_reference(x, residual)
            gate_up = gemv_ref(normed, mlp.gate_up_proj.weight)
            expected = silu_and_mul_gemv_ref(gate_up, mlp.down_proj.weight)
        _close(out, expected)
        torch.testing.assert_close(stream, expected_stream)
    assert calls == ["RMSNorm", "GemmaRMSNorm"]  # (the second fell back inside the layer)


@in_interpreter
def test_llama_attention_takes_the_input_norm_into_its_qkv_launch() -> None:
    """``LlamaAttention.forward_after_norm`` with a swapped q/k/v projection hands the rest
    of the attention the fused launch's q/k/v (equal to the norm then the projection); a
    subclass with a forward of its own gets the two steps."""
    from chassis.builtin_plugins.models.llama import LlamaAttention
    from chassis.core.layers.norm import RMSNorm

    class OwnForward(LlamaAttention):
        def forward(self, positions, hidden_states, ctx):  # type: ignore[no-untyped-def]
            return ("own", hidden_states)

    torch.manual_seed(0)
    norm = RMSNorm(32)
    x, residual = torch.randn(3, 32), torch.randn(3, 32)
    for cls in (LlamaAttention, OwnForward):
        attn = cls.__new__(cls)
        nn.Module.__init__(attn)
        attn.qkv_proj = SmallBatchLinear(nn.Linear(32, 64, bias=True))
        fused_calls = []
        original = attn.qkv_proj.forward_add_rms_norm
        attn.qkv_proj.forward_add_rms_norm = (  # type: ignore[method-assign]
            lambda *a, original=original, calls=fused_calls: calls.append(1) or original(*a)
        )
        attn._attend_projected = lambda positions, qkv, ctx: ("projected", qkv)  # type: ignore[method-assign]
        with torch.inference_mode():
            (kind, value), stream = attn.forward_after_norm(None, x, residual, norm, None)
            normed, expected_stream = norm.forward_reference(x, residual)
            expected_qkv = gemv_ref(normed, attn.qkv_proj.weight, attn.qkv_proj.bias)
        torch.testing.assert_close(stream, expected_stream)
        if cls is LlamaAttention:
            assert kind == "projected" and fused_calls == [1]
            _close(value, expected_qkv)
        else:
            assert kind == "own" and fused_calls == []
            torch.testing.assert_close(value, normed)


@in_interpreter
def test_kernel_takes_leading_dimensions_views_and_no_rows() -> None:
    x, weight, bias = _layer_tensors(6, 64, 24, torch.float32)
    x = x.view(2, 3, 64)
    _close(gemv(x, weight, bias), gemv_ref(x, weight, bias))
    assert gemv(x[:0], weight, bias).shape == (0, 3, 24)
    # rows of a wider tensor (stride 128): the row stride is the kernel's argument
    wide = torch.randn(4, 128)
    _close(gemv(wide[:, :64], weight, None), gemv_ref(wide[:, :64], weight, None))
    # a weight whose rows are a slice of a wider matrix (unit stride along K, row stride 128)
    wide_weight = torch.randn(24, 128)
    _close(gemv(wide[:, :64], wide_weight[:, :64]), gemv_ref(wide[:, :64], wide_weight[:, :64]))


@in_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_runs_the_kernel_for_few_rows_and_f_linear_for_more(dtype: torch.dtype) -> None:
    """Under the interpreter the layer sends CPU tensors of up to 8 rows to the kernel."""
    linear = nn.Linear(96, 40, dtype=dtype)
    layer = SmallBatchLinear(linear)
    calls = []
    original = triton_gemv.gemv

    def counting(*args: torch.Tensor, **kwargs: object) -> torch.Tensor:
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    triton_gemv.gemv = counting
    try:
        with torch.inference_mode():
            for shape in [(1, 96), (2, 4, 96), (8, 96)]:
                x = torch.randn(*shape).to(dtype)
                _close(layer(x), gemv_ref(x, linear.weight, linear.bias))
            x = torch.randn(9, 96).to(dtype)
            assert torch.equal(layer(x), F.linear(x, linear.weight, linear.bias))
    finally:
        triton_gemv.gemv = original
    assert calls == [(1, 96), (2, 4, 96), (8, 96)]


# -- launch configs and argument checks --------------------------------------------------------


def test_default_configs_at_qwen3_shapes() -> None:
    """What :func:`choose_config`'s docstring promises for Qwen3-0.6B at batch 1 and 8."""
    splits = {(4096, 1024): 2, (1024, 2048): 8, (6144, 1024): 2, (1024, 3072): 8, (151936, 1024): 1}
    for (n, k), split in splits.items():
        for rows in (1, 8):
            config = choose_config(rows, n, k, torch.bfloat16)
            assert config.split_k == split, (n, k)
            assert config.block_k == 128 and config.use_dot
            assert config.block_n == (64 if n == 151936 else 32)
    assert choose_config(1, 40, 24, torch.float32).block_k == 32  # no tile past K's power of 2


def test_config_and_argument_checks() -> None:
    with pytest.raises(ValueError, match="power of two"):
        GemvConfig(block_n=24)
    with pytest.raises(ValueError, match="at least 16"):
        GemvConfig(block_n=8, use_dot=True)
    x, weight, bias = _layer_tensors(2, 64, 24, torch.float32)
    with pytest.raises(ValueError, match="at most 8 rows"):
        gemv(torch.randn(9, 64), weight)
    with pytest.raises(ValueError, match="takes 64 features"):
        gemv(torch.randn(2, 32), weight)
    with pytest.raises(ValueError, match="share one of"):
        gemv(x.bfloat16(), weight)
    with pytest.raises(ValueError, match="unit stride along in"):
        gemv(x, weight.t().contiguous().t())
    with pytest.raises(ValueError, match="bias must be a contiguous"):
        gemv(x, weight, bias[:12])
    with pytest.raises(ValueError, match="unit stride along its last"):
        gemv(torch.randn(64, 2).t(), weight)


@not_in_interpreter
def test_compiled_kernel_refuses_cpu_tensors() -> None:
    x, weight, bias = _layer_tensors(2, 64, 24, torch.float32)
    with pytest.raises(ValueError, match="CUDA/ROCm tensors"):
        gemv(x, weight, bias)


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: str(t[0]))
def test_kernel_compiles_for_gpu_targets(target: tuple) -> None:
    """Each launch path the heuristic or a sweep can take, compiled for sm_90 and gfx942."""
    # (dtype, USE_DOT, SPLIT_K, BLOCK_M, EVEN_K)
    variants = [
        ("*bf16", True, 1, 16, True),
        ("*bf16", True, 8, 16, True),
        ("*bf16", False, 1, 1, True),
        ("*bf16", False, 2, 1, False),
        ("*fp16", False, 4, 8, True),
        ("*fp32", True, 2, 16, False),
    ]
    for dtype, use_dot, split_k, block_m, even_k in variants:
        compile_kernel(
            triton_gemv._gemv_kernel,
            target,
            dict(
                HAS_BIAS=True,
                SILU_AND_MUL=split_k == 8,  # (down_proj's launch: split 8 ways at Qwen3)
                # (gate/up's launch with the post-attention norm: unsplit bf16 here)
                ADD_RMS_NORM=(dtype, split_k) == ("*bf16", 1),
                K_POW2=1024,
                SPLIT_K=split_k,
                USE_DOT=use_dot,
                FLOAT32_DOT=dtype == "*fp32",
                EVEN_K=even_k,
                BLOCK_M=block_m,
                BLOCK_N=32,
                BLOCK_K=128,
            ),
            pointer_types={
                **{name: dtype for name in ("x_ptr", "w_ptr", "bias_ptr", "out_ptr")},
                "ws_ptr": "*fp32",
                "counter_ptr": "*i32",
                **{name: dtype for name in ("res_ptr", "norm_w_ptr", "res_out_ptr")},
            },
            float_args=("eps",),
        )


# -- the layer and the swap ---------------------------------------------------------------------


def test_layer_shares_the_linear_parameters() -> None:
    linear = nn.Linear(64, 24)
    layer = SmallBatchLinear(linear)
    assert layer.weight is linear.weight and layer.bias is linear.bias
    assert layer.weight.data_ptr() == linear.weight.data_ptr()
    assert list(layer.state_dict()) == list(linear.state_dict())
    with torch.no_grad():  # an in-place update (load_weights, sleep mode) is seen at once
        linear.weight.mul_(2)
    x = torch.randn(20, 64)
    assert torch.equal(layer(x), F.linear(x, linear.weight, linear.bias))
    no_bias = SmallBatchLinear(nn.Linear(64, 24, bias=False))
    assert no_bias.bias is None and "bias=False" in repr(no_bias)


@not_in_interpreter
@pytest.mark.parametrize("rows", [1, 8, 9])
def test_layer_runs_f_linear_on_cpu_tensors(rows: int) -> None:
    linear = nn.Linear(64, 24).bfloat16()
    layer = SmallBatchLinear(linear)
    x = torch.randn(rows, 64).bfloat16()
    assert torch.equal(layer(x), F.linear(x, linear.weight, linear.bias))


class _Subclassed(nn.Linear):
    """A layer with a forward of its own (must not be swapped)."""


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 16)
        self.custom = _Subclassed(32, 16)
        self.adapted = LoRALinear(
            nn.Linear(32, 16, bias=False),
            [(0, 16)],
            LoRAStepState(torch.zeros(16, 2), active=True),
            max_loras=2,
            max_rank=4,
        )
        self.head = nn.Linear(16, 48, bias=False)
        self.shared_head = self.head  # one module under two names (a shared head)


def test_swap_replaces_exactly_the_plain_linear_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    block = _Block()
    # nothing is swapped on the CPU (the kernel runs on GPUs)
    assert use_small_batch_gemv(block) == 0 and type(block.proj) is nn.Linear
    names = [name for name, _ in block.named_parameters()]
    params = {name: p for name, p in block.named_parameters()}
    monkeypatch.setattr(sbl, "GEMV_DEVICE_TYPES", ("cuda", "cpu"))
    assert use_small_batch_gemv(block) == 3
    assert type(block.proj) is SmallBatchLinear
    assert type(block.custom) is _Subclassed
    assert type(block.adapted) is LoRALinear
    assert type(block.adapted.base_layer) is SmallBatchLinear
    assert block.head is block.shared_head and type(block.head) is SmallBatchLinear
    assert [name for name, _ in block.named_parameters()] == names
    assert all(p is params[name] for name, p in block.named_parameters())
    assert len(small_batch_layers(block)) == 3
    assert use_small_batch_gemv(block) == 0  # (already swapped)
    # layers of another dtype are left alone
    assert not sbl.can_swap(nn.Linear(4, 4).to(torch.float64))


def test_lora_wrapper_adds_its_deltas_over_the_swapped_layer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker wraps LoRA layers first, then the platform swaps their base layers: the
    adapter's delta is still added (through the GEMV under the interpreter, else F.linear)."""
    torch.manual_seed(0)
    state = LoRAStepState(torch.zeros(16, 2), active=True)
    lora = LoRALinear(nn.Linear(32, 16), [(0, 16)], state, max_loras=2, max_rank=4)
    lora.set_slot(1, 0, torch.randn(4, 32), torch.randn(16, 4))
    state.token_mask[:3, 1] = 1
    x = torch.randn(3, 32)
    with torch.inference_mode():
        expected = lora(x)
        monkeypatch.setattr(sbl, "GEMV_DEVICE_TYPES", ("cuda", "cpu"))
        assert use_small_batch_gemv(lora) == 1
        _close(lora(x), expected)


def test_cuda_platform_swaps_only_with_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    from chassis.platforms.cuda import CudaPlatform

    monkeypatch.setattr(sbl, "GEMV_DEVICE_TYPES", ("cuda", "cpu"))
    block = _Block()
    monkeypatch.delenv("CHASSIS_TRITON_GEMV", raising=False)
    CudaPlatform().prepare_model(block)
    assert type(block.proj) is nn.Linear
    monkeypatch.setenv("CHASSIS_TRITON_GEMV", "0")
    CudaPlatform().prepare_model(block)
    assert type(block.proj) is nn.Linear
    monkeypatch.setenv("CHASSIS_TRITON_GEMV", "1")
    CudaPlatform().prepare_model(block)
    assert type(block.proj) is SmallBatchLinear and len(small_batch_layers(block)) == 3
