"""Fused Triton ops (RMSNorm + residual, SiLU-and-mul, in-place RoPE) against torch references.

The kernel tests run in a child pytest with ``TRITON_INTERPRET=1`` (see
tests/test_triton_attention.py for why); the reference and dispatch tests run in-process.
"""

from __future__ import annotations

import pytest
import torch
from triton_compile_check import (
    INTERPRETED,
    TARGETS,
    compile_kernel,
    in_interpreter,
    interpreter_parent,
    not_in_interpreter,
    run_kernel_tests,
)

from chassis.core.layers import fused_ops

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to rounding: one rounding of the dtype, two for bfloat16.

    Triton's interpreter converts float32 to bfloat16 by truncation (the GPU rounds to
    nearest even), so a kernel result that is rounded twice may be two bfloat16 ulps off
    here; tests/gpu/ checks one ulp on the GPU.
    """
    tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1.6e-2}[expected.dtype]
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


def _randn(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@interpreter_parent
def test_ops_under_interpreter(request: pytest.FixtureRequest) -> None:
    run_kernel_tests(__file__, request)


# -- Triton kernels (interpreter) ---------------------------------------------------------------


@in_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 48])
def test_rms_norm_kernel(dtype: torch.dtype, hidden: int) -> None:
    from chassis.core.layers import triton_ops

    x = _randn(2, 3, hidden, dtype=dtype)
    residual = _randn(2, 3, hidden, dtype=dtype, seed=1)
    weight = (1 + 0.1 * _randn(hidden, dtype=torch.float32, seed=2)).to(dtype)
    _close(triton_ops.rms_norm(x, weight, 1e-6), fused_ops.rms_norm_ref(x, weight, 1e-6))
    out, new_residual = triton_ops.rms_norm(x, weight, 1e-6, residual)
    ref_out, ref_residual = fused_ops.rms_norm_ref(x, weight, 1e-6, residual)
    if dtype == torch.bfloat16:  # the interpreter truncates float32 -> bfloat16
        _close(new_residual, ref_residual)
    else:  # one correctly rounded add: bit-exact
        assert torch.equal(new_residual, ref_residual)
    _close(out, ref_out)


@in_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_kernel_on_strided_rows(dtype: torch.dtype) -> None:
    from chassis.core.layers import triton_ops

    x = _randn(5, 80, dtype=dtype)[:, :64]  # rows 80 apart
    weight = torch.ones(64, dtype=dtype)
    _close(triton_ops.rms_norm(x, weight, 1e-5), fused_ops.rms_norm_ref(x, weight, 1e-5))


@in_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [32, 40])
def test_silu_and_mul_kernel(dtype: torch.dtype, d: int) -> None:
    from chassis.core.layers import triton_ops

    x = 3 * _randn(2, 3, 2 * d, dtype=torch.float32).to(dtype)
    _close(triton_ops.silu_and_mul(x), fused_ops.silu_and_mul_ref(x))


def _cos_sin(max_position: int, rot_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rot_dim, 2).float() / rot_dim))
    freqs = torch.outer(torch.arange(max_position).float(), inv_freq)
    return freqs.cos(), freqs.sin()


@in_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rot_dim", [16, 8])  # whole head, partial rotary
def test_rotary_kernel_in_place(dtype: torch.dtype, is_neox: bool, rot_dim: int) -> None:
    from chassis.core.layers import triton_ops

    head_dim, num_q, num_k, tokens = 16, 4, 2, 5
    qkv = _randn(tokens, (num_q + 2 * num_k) * head_dim, dtype=dtype)
    q, k, _ = qkv.split([num_q * head_dim, num_k * head_dim, num_k * head_dim], dim=1)
    positions = torch.tensor([0, 7, 3, 30, 1])
    cos, sin = _cos_sin(32, rot_dim)
    ref_q, ref_k = q.clone(), k.clone()
    fused_ops.rotary_embedding_ref_(positions, ref_q, ref_k, cos, sin, head_dim, is_neox)
    untouched_v = qkv[:, (num_q + num_k) * head_dim :].clone()
    out_q, out_k = triton_ops.rotary_embedding_(positions, q, k, cos, sin, head_dim, is_neox)
    assert out_q is q and out_k is k
    _close(q, ref_q)
    _close(k, ref_k)
    assert torch.equal(qkv[:, (num_q + num_k) * head_dim :], untouched_v)


@in_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_kernels_match_the_model_layers(dtype: torch.dtype) -> None:
    """TritonLayerKernels (what the CUDA platform hands the layers) against the layers' torch
    code, including RoPE in HF's rounding order."""
    from chassis.core.layers import triton_ops
    from chassis.core.layers.activation import SiluAndMul
    from chassis.core.layers.norm import RMSNorm
    from chassis.core.layers.rotary import RotaryEmbedding

    kernels = triton_ops.TritonLayerKernels()
    head_dim, num_q, num_k, tokens = 16, 4, 2, 5
    rope = RotaryEmbedding(head_dim, 64, {"rope_type": "default", "rope_theta": 10000.0})
    qkv = _randn(tokens, (num_q + 2 * num_k) * head_dim, dtype=dtype)
    q = qkv[:, : num_q * head_dim].view(tokens, num_q, head_dim)
    k = qkv[:, num_q * head_dim : (num_q + num_k) * head_dim].view(tokens, num_k, head_dim)
    positions = torch.tensor([0, 7, 3, 60, 1])
    ref_q, ref_k = rope.forward_reference(positions, q, k)
    kernels.rotary_embedding_(positions, q, k, rope.cos_cache, rope.sin_cache)
    _close(q, ref_q)
    _close(k, ref_k)

    norm = RMSNorm(48, 1e-6).to(dtype)
    x, r = _randn(3, 48, dtype=dtype), _randn(3, 48, dtype=dtype, seed=1)
    with torch.no_grad():
        for got, want in zip(
            kernels.rms_norm(x, norm.weight, 1e-6, r), norm.forward_reference(x, r), strict=True
        ):
            _close(got, want)
    g = _randn(3, 40, dtype=dtype)
    _close(kernels.silu_and_mul(g), SiluAndMul().forward_reference(g))


@in_interpreter
def test_rotary_kernel_on_3d_heads() -> None:
    from chassis.core.layers import triton_ops

    q = _randn(3, 2, 16, dtype=torch.float32)
    k = _randn(3, 1, 16, dtype=torch.float32, seed=1)
    positions = torch.tensor([5, 0, 2])
    cos, sin = _cos_sin(8, 16)
    ref_q, ref_k = q.clone(), k.clone()
    fused_ops.rotary_embedding_ref_(positions, ref_q, ref_k, cos, sin, 16)
    triton_ops.rotary_embedding_(positions, q, k, cos, sin, 16)
    _close(q, ref_q)
    _close(k, ref_k)


def _qwen3_heads(
    dtype: torch.dtype, tokens: int, num_q: int, num_k: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The q, k and v views of a merged QKV output (strided heads, as the model passes them)."""
    qkv = _randn(tokens, (num_q + 2 * num_k) * head_dim, dtype=dtype)
    q = qkv[:, : num_q * head_dim].view(tokens, num_q, head_dim)
    k = qkv[:, num_q * head_dim : (num_q + num_k) * head_dim].view(tokens, num_k, head_dim)
    return q, k, qkv[:, (num_q + num_k) * head_dim :]


@in_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [16, 12])  # power of two, padded half
def test_qk_norm_rotary_kernel_in_place(dtype: torch.dtype, head_dim: int) -> None:
    from chassis.core.layers import triton_ops

    num_q, num_k, tokens = 3, 2, 5
    q, k, v = _qwen3_heads(dtype, tokens, num_q, num_k, head_dim)
    q_weight = (1 + 0.2 * _randn(head_dim, dtype=torch.float32, seed=4)).to(dtype)
    k_weight = (1 + 0.2 * _randn(head_dim, dtype=torch.float32, seed=5)).to(dtype)
    positions = torch.tensor([0, 7, 3, 30, 1])
    cos, sin = _cos_sin(32, head_dim)
    args = (q_weight, k_weight, 1e-6, cos, sin)
    ref_q, ref_k = fused_ops.qk_norm_rotary_embedding_ref(positions, q, k, *args)
    untouched_v = v.clone()
    out_q, out_k = triton_ops.qk_norm_rotary_embedding_(positions, q, k, *args)
    assert out_q is q and out_k is k  # in place, into the merged QKV output
    _close(q, ref_q)
    _close(k, ref_k)
    assert torch.equal(v, untouched_v)


@pytest.fixture
def bfloat16_rounds_to_nearest(monkeypatch):
    """Make the interpreter round float32 -> bfloat16 to nearest even, as GPUs do (it
    truncates), so that a kernel's rounding points can be checked bit for bit. Patches a
    private function of Triton's interpreter; skips where it looks different."""
    import inspect

    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    convert = getattr(interpreter, "_convert_float", None)
    params = ["input", "input_dtype", "output_dtype", "rounding_mode"]
    if convert is None or list(inspect.signature(convert).parameters) != params:
        pytest.skip("this Triton's interpreter converts floats in another function")

    def round_to_nearest(input, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.bfloat16:
            values = torch.from_numpy(np.ascontiguousarray(input).view(np.float32).copy())
            bits = values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            return bits.reshape(np.shape(input))
        return convert(input, input_dtype, output_dtype, rounding_mode)

    monkeypatch.setattr(interpreter, "_convert_float", round_to_nearest)


@in_interpreter
@pytest.mark.parametrize("head_dim", [16, 12])
def test_qk_norm_rotary_kernel_rounds_where_the_layers_do(bfloat16_rounds_to_nearest, head_dim):
    """With the GPU's rounding, bfloat16 results equal the reference bit for bit: the kernel
    rounds the normalized value, the scaled value, cos/sin and each product where the unfused
    layers do (a kernel that skips one of these roundings fails here)."""
    from chassis.core.layers import triton_ops

    dtype = torch.bfloat16
    q, k, _ = _qwen3_heads(dtype, 9, 5, 3, head_dim)
    q_weight = (1 + 0.2 * _randn(head_dim, dtype=torch.float32, seed=4)).to(dtype)
    k_weight = (1 + 0.2 * _randn(head_dim, dtype=torch.float32, seed=5)).to(dtype)
    positions = torch.tensor([0, 7, 3, 30, 1, 12, 31, 2, 19])
    cos, sin = _cos_sin(32, head_dim)
    args = (q_weight, k_weight, 1e-6, cos, sin)
    ref_q, ref_k = fused_ops.qk_norm_rotary_embedding_ref(positions, q, k, *args)
    triton_ops.qk_norm_rotary_embedding_(positions, q, k, *args)
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)


@in_interpreter
def test_layer_kernels_round_where_the_layers_do(bfloat16_rounds_to_nearest) -> None:
    """With the GPU's rounding, the RMSNorm(+residual), SiLU-and-mul and RoPE kernels give
    the layers' bfloat16 results bit for bit on these inputs (the contract allows rare
    one-step differences from another sum order or exp; the interpreter has neither)."""
    from chassis.core.layers import triton_ops
    from chassis.core.layers.activation import SiluAndMul
    from chassis.core.layers.norm import RMSNorm
    from chassis.core.layers.rotary import RotaryEmbedding

    dtype, kernels = torch.bfloat16, triton_ops.TritonLayerKernels()
    rope = RotaryEmbedding(16, 64, {"rope_type": "default", "rope_theta": 10000.0})
    q, k, _ = _qwen3_heads(dtype, 7, 4, 2, 16)
    positions = torch.tensor([0, 63, 5, 17, 2, 40, 9])
    ref_q, ref_k = rope.forward_reference(positions, q.clone(), k.clone())
    kernels.rotary_embedding_(positions, q, k, rope.cos_cache, rope.sin_cache)
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)

    norm = RMSNorm(48, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * _randn(48, dtype=torch.float32, seed=3))
        x, r = _randn(9, 48, dtype=dtype), _randn(9, 48, dtype=dtype, seed=1)
        for got, want in zip(
            kernels.rms_norm(x, norm.weight, 1e-6, r), norm.forward_reference(x, r), strict=True
        ):
            assert torch.equal(got, want)
        assert torch.equal(kernels.rms_norm(x, norm.weight, 1e-6), norm.forward_reference(x))
    g = 3 * _randn(9, 80, dtype=torch.float32).to(dtype)
    assert torch.equal(kernels.silu_and_mul(g), SiluAndMul().forward_reference(g))


@in_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_layer_fuses_the_qk_norms(dtype: torch.dtype, monkeypatch) -> None:
    """RotaryEmbedding with Qwen3's q/k norms on the Triton kernels (one fused launch) against
    the layers' torch code."""
    from chassis.core.layers import triton_ops
    from chassis.core.layers.norm import RMSNorm
    from chassis.core.layers.rotary import RotaryEmbedding

    triton_kernels = triton_ops.TritonLayerKernels()
    launches = []
    fused = triton_kernels.qk_norm_rotary_embedding_
    monkeypatch.setattr(
        triton_kernels, "qk_norm_rotary_embedding_", lambda *a: launches.append(1) or fused(*a)
    )
    monkeypatch.setattr("chassis.core.layers.rotary.kernels_for", lambda x: triton_kernels)

    rope = RotaryEmbedding(16, 64, {"rope_type": "default", "rope_theta": 10000.0})
    norms = (RMSNorm(16, 1e-6).to(dtype), RMSNorm(16, 1e-6).to(dtype))
    with torch.no_grad():
        norms[0].weight.copy_(1 + 0.2 * _randn(16, dtype=torch.float32, seed=4))
        norms[1].weight.copy_(1 + 0.2 * _randn(16, dtype=torch.float32, seed=5))
    q, k, _ = _qwen3_heads(dtype, 4, 4, 2, 16)
    positions = torch.tensor([0, 63, 5, 17])
    with torch.no_grad():
        ref_q, ref_k = rope.forward_reference(positions, q.clone(), k.clone(), norms)
        got_q, got_k = rope(positions, q, k, norms)
    assert launches == [1]
    if dtype == torch.bfloat16:
        # Four truncating roundings in a row under the interpreter (norm, scale, two products)
        # can land four bfloat16 ulps off; tests/gpu/ checks it with the GPU's rounding.
        for got, want in ((got_q, ref_q), (got_k, ref_k)):
            torch.testing.assert_close(got, want, atol=3.2e-2, rtol=3.2e-2)
    else:
        _close(got_q, ref_q)
        _close(got_k, ref_k)


@not_in_interpreter
@pytest.mark.parametrize("target", TARGETS, ids=lambda t: f"{t[0]}-{t[1]}")
def test_kernels_compile_for_gpu_targets(target) -> None:
    pytest.importorskip("triton")
    from chassis.core.layers import triton_ops

    for has_residual in (True, False):
        compile_kernel(
            triton_ops._rms_norm_kernel,
            target,
            dict(HAS_RESIDUAL=has_residual, BLOCK_N=1024),
            float_args=("eps",),
        )
    compile_kernel(triton_ops._silu_and_mul_kernel, target, dict(BLOCK=1024))
    for is_neox, hf_rounding in ((True, False), (False, False), (True, True)):
        compile_kernel(
            triton_ops._rotary_kernel,
            target,
            dict(
                HEAD_DIM=128,
                HALF=64,
                HALF_PAD=64,
                HEADS_PAD=16,
                IS_NEOX=is_neox,
                HF_ROUNDING=hf_rounding,
            ),
            pointer_types={"positions_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32"},
        )
    compile_kernel(
        triton_ops._qk_norm_rotary_kernel,
        target,
        dict(HEAD_DIM=128, HALF=64, HALF_PAD=64, HEADS_PAD=16),
        float_args=("eps",),
        pointer_types={"positions_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32"},
    )


# -- references and dispatch (in-process) ---------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_references_agree_with_the_model_layers(dtype: torch.dtype) -> None:
    """The fused ops' references compute what chassis.core.layers' modules' torch code
    (``forward_reference``; ``forward`` may run a platform kernel) computes."""
    from chassis.core.layers.activation import SiluAndMul
    from chassis.core.layers.norm import RMSNorm
    from chassis.core.layers.rotary import RotaryEmbedding

    norm = RMSNorm(64, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * _randn(64, dtype=torch.float32, seed=3))
    x, residual = _randn(4, 64, dtype=dtype), _randn(4, 64, dtype=dtype, seed=1)
    with torch.no_grad():
        assert torch.equal(fused_ops.rms_norm_ref(x, norm.weight, 1e-6), norm.forward_reference(x))
        for got, want in zip(
            fused_ops.rms_norm_ref(x, norm.weight, 1e-6, residual),
            norm.forward_reference(x, residual),
            strict=True,
        ):
            assert torch.equal(got, want)
    assert torch.equal(fused_ops.silu_and_mul_ref(x), SiluAndMul().forward_reference(x))

    rope = RotaryEmbedding(16, 32, {"rope_theta": 10000.0, "rope_type": "default"})
    positions = torch.tensor([0, 9, 31, 4])
    q, k = _randn(4, 2, 16, dtype=dtype), _randn(4, 1, 16, dtype=dtype, seed=1)
    want_q, want_k = rope.forward_reference(positions, q, k)
    fused_ops.rotary_embedding_ref_(positions, q, k, rope.cos_cache, rope.sin_cache, 16)
    if dtype == torch.float32:
        assert torch.equal(q, want_q) and torch.equal(k, want_k)
    else:
        # The module rotates in the model dtype, as HF does; the fused op rotates in float32
        # and rounds once, so 16-bit results agree within a rounding step.
        torch.testing.assert_close(q, want_q, rtol=1.6e-2, atol=1e-2)
        torch.testing.assert_close(k, want_k, rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rotary_reference_is_the_layers_composition(dtype: torch.dtype) -> None:
    """The fused op's reference computes what Qwen3's attention layers compute unfused:
    RMSNorm per head, then RotaryEmbedding's rotation (bit for bit)."""
    from chassis.core.layers.norm import RMSNorm
    from chassis.core.layers.rotary import RotaryEmbedding

    rope = RotaryEmbedding(16, 32, {"rope_theta": 10000.0, "rope_type": "default"})
    norms = (RMSNorm(16, 1e-6).to(dtype), RMSNorm(16, 1e-6).to(dtype))
    with torch.no_grad():
        norms[0].weight.copy_(1 + 0.2 * _randn(16, dtype=torch.float32, seed=4))
        norms[1].weight.copy_(1 + 0.2 * _randn(16, dtype=torch.float32, seed=5))
    positions = torch.tensor([0, 9, 31, 4])
    q, k = _randn(4, 2, 16, dtype=dtype), _randn(4, 1, 16, dtype=dtype, seed=1)
    with torch.no_grad():
        want_q, want_k = rope.forward_reference(positions, q, k, norms)
        got_q, got_k = fused_ops.qk_norm_rotary_embedding_ref(
            positions, q, k, norms[0].weight, norms[1].weight, 1e-6, rope.cos_cache, rope.sin_cache
        )
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_qk_norm_rotary_kernel_rejects_what_it_cannot_fuse() -> None:
    pytest.importorskip("triton")
    from chassis.core.layers import triton_ops

    q, k = torch.zeros(2, 4, 16), torch.zeros(2, 2, 16)
    w = torch.ones(16)
    cos, sin = _cos_sin(4, 16)
    positions = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="rotates whole heads"):
        triton_ops.qk_norm_rotary_embedding_(positions, q, k, w, w, 1e-6, *_cos_sin(4, 8))
    with pytest.raises(ValueError, match=r"must be \[16\]"):
        triton_ops.qk_norm_rotary_embedding_(positions, q, k, torch.ones(8), w, 1e-6, cos, sin)
    with pytest.raises(ValueError, match=r"\[T, H, D\]"):
        triton_ops.qk_norm_rotary_embedding_(positions, q.view(2, 64), k, w, w, 1e-6, cos, sin)
    if not INTERPRETED:
        with pytest.raises(ValueError, match="CUDA/ROCm tensors"):
            triton_ops.qk_norm_rotary_embedding_(positions, q, k, w, w, 1e-6, cos, sin)


def test_rotary_layer_fuses_only_plain_rms_norms_of_the_tensors_dtype(monkeypatch) -> None:
    """The fused q/k-norm + RoPE runs only for this package's RMSNorm with weights in the
    tensors' dtype and one eps; otherwise the norm modules are called as they are (a
    subclass's own forward included), then the rotation."""
    from chassis.core.layers import rotary
    from chassis.core.layers.norm import RMSNorm

    class DoubledNorm(RMSNorm):  # a plugin's norm with other semantics
        def forward(self, x, residual=None):
            return 2 * super().forward(x)

    class Recorder:
        def __init__(self) -> None:
            self.fused: list[str] = []

        def qk_norm_rotary_embedding_(self, positions, query, key, *rest):
            self.fused.append("fused")
            return query, key

        def rotary_embedding_(self, positions, query, key, cos, sin):
            pass  # rotation in place: not what this test looks at

    recorder = Recorder()
    monkeypatch.setattr(rotary, "kernels_for", lambda x: recorder)
    rope = rotary.RotaryEmbedding(16, 32, {"rope_theta": 10000.0, "rope_type": "default"})
    q = _randn(3, 2, 16, dtype=torch.bfloat16)
    k = _randn(3, 1, 16, dtype=torch.bfloat16, seed=1)
    positions = torch.tensor([0, 1, 2])
    bf16 = torch.bfloat16
    cases = {
        "plain": (RMSNorm(16, 1e-6).to(bf16), RMSNorm(16, 1e-6).to(bf16), True),
        "subclass": (DoubledNorm(16, 1e-6).to(bf16), RMSNorm(16, 1e-6).to(bf16), False),
        "eps": (RMSNorm(16, 1e-6).to(bf16), RMSNorm(16, 1e-5).to(bf16), False),
        "float32 weights": (RMSNorm(16, 1e-6), RMSNorm(16, 1e-6), False),
    }
    for name, (q_norm, k_norm, fuses) in cases.items():
        recorder.fused.clear()
        with torch.no_grad():
            got_q, _ = rope(positions, q.clone(), k.clone(), (q_norm, k_norm))
        assert recorder.fused == (["fused"] if fuses else []), name
        if not fuses:
            with torch.no_grad():
                assert torch.equal(got_q, q_norm(q.clone())), name  # the module's own result


def test_platforms_hand_the_triton_kernels_only_device_tensors() -> None:
    """Which kernels the layers run is the platform's choice: the CUDA/ROCm platforms offer the
    Triton ops, which take only CUDA tensors; CPU tensors never reach them."""
    pytest.importorskip("triton")
    from chassis.core.layers.triton_ops import TritonLayerKernels
    from chassis.platforms.cuda import CudaPlatform

    assert isinstance(CudaPlatform().layer_kernels(), TritonLayerKernels)
    assert not TritonLayerKernels().handles(torch.zeros(1))


def test_rotary_reference_rejects_a_rotary_dim_wider_than_the_head() -> None:
    cos, sin = _cos_sin(4, 32)
    q, k = torch.zeros(1, 16), torch.zeros(1, 16)
    with pytest.raises(ValueError, match="exceeds head_dim"):
        fused_ops.rotary_embedding_ref_(torch.tensor([0]), q, k, cos, sin, 16)
