"""gpt-oss's experts on the Triton fused MoE (``fused_moe_clamped_swiglu``, a bias on each
matmul and the clamped SwiGLU, core/layers/triton_moe.py) against the model's torch path,
:func:`chassis.builtin_plugins.models.gpt_oss.experts_reference`.

As tests/test_triton_moe.py: the kernels run in a child pytest with ``TRITON_INTERPRET=1``
on tiny shapes, and are compiled for the GPU targets without a GPU. The activations are
scaled so that both clamps bind on some elements. tests/gpu/test_gpu_triton_moe_gpt_oss.py
checks them at gpt-oss-20b's shape, under CUDA graphs and inside the engine.
"""

from __future__ import annotations

import pytest
import torch
from test_triton_ops import bfloat16_rounds_to_nearest  # noqa: F401  (a fixture)
from triton_compile_check import (
    INTERPRETED,
    TARGETS,
    compile_kernel,
    in_interpreter,
    interpreter_parent,
    not_in_interpreter,
    run_kernel_tests,
)

from chassis.builtin_plugins.models.gpt_oss import GptOssExperts, experts_reference
from chassis.core.layers.moe import select_experts

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
#: gpt-oss's alpha; a limit of 1.5 (as tests/test_gpt_oss.py's tiny model) binds often
ALPHA, LIMIT = 1.702, 1.5


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to rounding: seven roundings in a row where the reference rounds (gate and
    up with their biases, alpha * g, sigmoid, g * sigmoid, up + 1, the product, the down
    matmul with its bias); the interpreter truncates float32 to bfloat16 (the GPU rounds to
    nearest: test_bfloat16_rounds_where_the_reference_does)."""
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 4e-2}[expected.dtype]
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.isfinite(actual).all()
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


def _experts(
    tokens: int,
    hidden: int,
    inter: int,
    experts: int,
    top_k: int,
    dtype: torch.dtype,
    seed: int = 0,
    gain: float = 2.0,
) -> tuple[torch.Tensor, ...]:
    """``(x, w13, b13, w2, b2, weights, ids)``: gate and up of about ``gain`` standard
    deviations (so the clamps at :data:`LIMIT` bind), biases ``0.3 randn``, gpt-oss's routing
    (softmax over the top-k logits, rounded to the model dtype)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = (gain * torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype)
    b13 = (0.3 * torch.randn(experts, 2 * inter, generator=g)).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) / inter**0.5).to(dtype)
    b2 = (0.3 * torch.randn(experts, hidden, generator=g)).to(dtype)
    top, ids = torch.topk(torch.randn(tokens, experts, generator=g), top_k)
    weights = torch.softmax(top, dim=-1).to(dtype)
    return x, w13, b13, w2, b2, weights, ids


def _both(args: tuple[torch.Tensor, ...], alpha: float = ALPHA, limit: float = LIMIT):
    """``(kernel, reference)`` on the same operands."""
    from chassis.core.layers.triton_moe import fused_moe_clamped_swiglu

    return (
        fused_moe_clamped_swiglu(*args, alpha, limit),
        experts_reference(*args, alpha, limit),
    )


@interpreter_parent
def test_under_interpreter(request: pytest.FixtureRequest) -> None:
    run_kernel_tests(__file__, request)


# -- the kernels (interpreter) ------------------------------------------------------------------

#: (tokens, hidden, inter, experts, top_k): one token; top 4 of 8 (gpt-oss's k) with tokens
#: not a multiple of the block; k = 1; k = E; dims that are not powers of two
SHAPES = [
    (1, 32, 16, 4, 2),
    (13, 48, 24, 8, 4),
    (9, 32, 16, 8, 1),
    (6, 40, 20, 4, 4),
]


@in_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_matches_the_torch_path(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    _close(*_both(_experts(*shape, dtype=dtype)))


@in_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
def test_uneven_loads_and_experts_without_tokens(dtype: torch.dtype) -> None:
    """Top 4 of 8 experts: expert 5 takes every token (two 16-row blocks), 0 most, 2 and 7
    a few, and 1, 3, 4 and 6 none (their groups do not exist)."""
    *operands, weights, _ = _experts(20, 32, 16, 8, 4, dtype=dtype, seed=3)
    ids = torch.tensor([[5, 0, 2, 7], [0, 5, 7, 2], [5, 2, 0, 7], [7, 0, 5, 2], [0, 5, 2, 7]])
    ids = ids.repeat(4, 1)
    ids[1::2, 2:] = ids[1::2, 2:].flip(1)  # other slots, so the pairs' order varies
    _close(*_both((*operands, weights, ids)))
    # one expert alone: every other group empty
    _close(*_both((*operands, weights[:, :1] * 0 + 1, torch.full((20, 1), 6))))


@in_interpreter
def test_gpt_oss_limit_and_large_activations() -> None:
    """gpt-oss's own alpha and limit (7), with gate and up large enough to pass it."""
    args = _experts(11, 32, 24, 4, 2, dtype=torch.float32, seed=4, gain=12.0)
    got, expected = _both(args, 1.702, 7.0)
    gate_up = torch.nn.functional.linear(args[0], args[1][0], args[2][0])
    assert (gate_up > 7.0).any() and (gate_up < -7.0).any()  # both clamps bind
    _close(got, expected)


@in_interpreter
def test_strided_tokens_and_no_tokens() -> None:
    x, *rest = _experts(5, 32, 16, 4, 2, dtype=torch.float32)
    wide = torch.cat([x, torch.full_like(x, float("nan"))], dim=1)[:, :32]  # rows 64 apart
    got, _ = _both((wide, *rest))
    _close(got, experts_reference(x, *rest, ALPHA, LIMIT))
    w13, b13, w2, b2, weights, ids = rest
    empty, _ = _both((x[:0], w13, b13, w2, b2, weights[:0], ids[:0]))
    assert empty.shape == (0, 32) and empty.dtype == torch.float32


@in_interpreter
@pytest.mark.usefixtures("bfloat16_rounds_to_nearest")
@pytest.mark.parametrize("shape", [(13, 48, 24, 8, 4), (6, 40, 20, 4, 4)], ids=str)
def test_bfloat16_rounds_where_the_reference_does(shape: tuple[int, ...]) -> None:
    """With the GPU's rounding (to nearest even), bfloat16 results equal the torch path bit
    for bit on these inputs: the kernels add each bias before the matmul rounds, and round
    alpha * g, the sigmoid, g * sigmoid, up + 1 and the product where torch does (a kernel
    that skips or adds a rounding fails here)."""
    got, expected = _both(_experts(*shape, dtype=torch.bfloat16, seed=1))
    assert torch.equal(got, expected)


@in_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt_oss_experts_run_the_platform_kernel(dtype: torch.dtype, monkeypatch) -> None:
    """GptOssExperts with TritonLayerKernels as the platform's kernels (what the CUDA and
    ROCm platforms hand it) calls the kernel once, gives the torch path's result, and no
    longer blocks graph capture; the plain fused_moe stays unused."""
    from chassis.core.layers.triton_ops import TritonLayerKernels

    kernels = TritonLayerKernels()
    calls = []
    fused = kernels.fused_moe_clamped_swiglu
    monkeypatch.setattr(
        kernels, "fused_moe_clamped_swiglu", lambda *a: calls.append(1) or fused(*a)
    )
    monkeypatch.setattr(kernels, "fused_moe", None)
    monkeypatch.setattr("chassis.builtin_plugins.models.gpt_oss.kernels_for", lambda x: kernels)
    x, w13, b13, w2, b2, _, _ = _experts(11, 32, 16, 8, 4, dtype=dtype, seed=2)
    experts = GptOssExperts(8, 32, 16, ALPHA, LIMIT).to(dtype)
    for name, value in dict(w13=w13, b13=b13, w2=w2, b2=b2).items():
        getattr(experts, name).data.copy_(value)
    weights, ids = select_experts(torch.randn(11, 8), 4, True)
    weights = weights.to(dtype)
    assert experts.graph_capture_blocker() is None
    with torch.no_grad():
        got = experts(x, weights, ids)
    assert calls == [1]
    _close(got, experts.forward_reference(x, weights, ids))


# -- in-process: operand checks, the CPU default ------------------------------------------------


def test_rejects_bad_biases_and_constants() -> None:
    from chassis.core.layers.triton_moe import fused_moe_clamped_swiglu as fused

    x, w13, b13, w2, b2, weights, ids = _experts(3, 32, 16, 4, 2, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"must be \[4, 32\] and \[4, 32\]"):
        fused(x, w13, b13[:, :16], w2, b2, weights, ids, ALPHA, LIMIT)
    with pytest.raises(ValueError, match=r"must be \[4, 32\] and \[4, 32\]"):
        fused(x, w13, b13, w2, b2[:2], weights, ids, ALPHA, LIMIT)
    with pytest.raises(ValueError, match=r"must be torch\.float32 as x is"):
        fused(x, w13, b13.half(), w2, b2, weights, ids, ALPHA, LIMIT)
    with pytest.raises(ValueError, match="contiguous in their last dimension"):
        fused(x, w13, b13.t().contiguous().t(), w2, b2, weights, ids, ALPHA, LIMIT)
    with pytest.raises(ValueError, match="must be finite"):
        fused(x, w13, b13, w2, b2, weights, ids, ALPHA, float("inf"))
    with pytest.raises(ValueError, match="must share"):  # the plain kernel's checks as well
        fused(x, w13.half(), b13, w2, b2, weights, ids, ALPHA, LIMIT)
    if not INTERPRETED:  # compiled kernels take CUDA/ROCm tensors only
        with pytest.raises(ValueError, match="CUDA/ROCm"):
            fused(x, w13, b13, w2, b2, weights, ids, ALPHA, LIMIT)


def test_on_the_cpu_the_experts_run_the_torch_path() -> None:
    """The CPU platform offers no kernels: the torch path runs and blocks graph capture."""
    x, w13, b13, w2, b2, weights, ids = _experts(7, 32, 16, 4, 2, dtype=torch.float32)
    experts = GptOssExperts(4, 32, 16, ALPHA, LIMIT)
    for name, value in dict(w13=w13, b13=b13, w2=w2, b2=b2).items():
        getattr(experts, name).data.copy_(value)
    with torch.no_grad():
        got = experts(x, weights, ids)
    assert torch.equal(got, experts_reference(x, w13, b13, w2, b2, weights, ids, ALPHA, LIMIT))
    reason = experts.graph_capture_blocker()
    assert reason is not None and "fused_moe_clamped_swiglu" in reason


# -- compiled for the GPUs, without one -----------------------------------------------------------


@not_in_interpreter
@pytest.mark.parametrize("target", TARGETS, ids=lambda t: f"{t[0]}-{t[1]}")
def test_kernels_compile_for_gpu_targets(target) -> None:
    """gpt-oss's variant (biases, clamped SwiGLU at alpha 1.702, limit 7, top 4), bfloat16,
    decode (16-row blocks) and prefill (64-row blocks, 8 warps) configurations, routing
    weights in bfloat16 as gpt-oss rounds them; and a float32 model."""
    pytest.importorskip("triton")
    from chassis.core.layers import triton_moe

    ints = {"sorted_pairs_ptr": "*i32", "block_experts_ptr": "*i32"}
    swiglu = dict(HAS_BIAS=True, CLAMPED_SWIGLU=True, ALPHA=1.702, LIMIT=7.0)
    for block_m, block_n, warps in ((16, 32, 4), (64, 64, 8)):
        tiles = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=64, GROUP_M=8, DOT_FP32=False)
        compile_kernel(
            triton_moe._gate_up_kernel,
            target,
            dict(TOP_K=4, **tiles, **swiglu),
            pointer_types=ints,
            num_warps=warps,
        )
        compile_kernel(
            triton_moe._down_kernel,
            target,
            dict(**tiles, HAS_BIAS=True),
            pointer_types={**ints, "out_ptr": "*fp32", "weights_ptr": "*bf16"},
            num_warps=warps,
        )
    fp32 = {
        n: "*fp32" for n in ("x_ptr", "w13_ptr", "b13_ptr", "h_ptr", "w2_ptr", "b2_ptr", "out_ptr")
    }
    tiles = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, DOT_FP32=True)
    compile_kernel(
        triton_moe._gate_up_kernel,
        target,
        dict(TOP_K=4, **tiles, **swiglu),
        pointer_types={**ints, **fp32},
    )
    compile_kernel(
        triton_moe._down_kernel,
        target,
        dict(**tiles, HAS_BIAS=True),
        pointer_types={**ints, **fp32, "weights_ptr": "*fp32"},
    )
