"""Fused Triton ops compiled on a real GPU at model shapes (run by tests/gpu/run_gpu_checks.sh).

On the GPU float32 -> 16-bit conversions round to nearest even (the CPU interpreter
truncates), and the residual stream must match the unfused add bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from chassis.core.layers import fused_ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU"),
]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
#: two roundings of the dtype (relative; the same absolute slack near zero): the kernel and
#: torch may each land one ulp apart on the intermediate and on the final rounding
ULP = {torch.bfloat16: 2**-6, torch.float16: 2**-9, torch.float32: 1e-5}


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    tol = ULP[expected.dtype]
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


def _randn(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, device="cuda", generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(300, 1024), (7, 4096), (3, 5, 896)], ids=str)
def test_rms_norm(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    from chassis.core.layers import triton_ops

    hidden = shape[-1]
    x, residual = _randn(*shape, dtype=dtype), _randn(*shape, dtype=dtype, seed=1)
    weight = (1 + 0.1 * _randn(hidden, dtype=torch.float32, seed=2)).to(dtype)
    _close(triton_ops.rms_norm(x, weight, 1e-6), fused_ops.rms_norm_ref(x, weight, 1e-6))
    out, new_residual = triton_ops.rms_norm(x, weight, 1e-6, residual)
    ref_out, ref_residual = fused_ops.rms_norm_ref(x, weight, 1e-6, residual)
    assert torch.equal(new_residual, ref_residual)
    _close(out, ref_out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype: torch.dtype) -> None:
    from chassis.core.layers import triton_ops

    x = 3 * _randn(300, 2 * 3072, dtype=torch.float32).to(dtype)
    _close(triton_ops.silu_and_mul(x), fused_ops.silu_and_mul_ref(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_a_fused_qkv_output(dtype: torch.dtype) -> None:
    from chassis.core.layers import triton_ops
    from chassis.core.layers.rotary import RotaryEmbedding

    heads, kv_heads, dim, tokens = 16, 8, 128, 300
    with torch.device("cuda"):
        rope = RotaryEmbedding(dim, 4096, {"rope_theta": 1_000_000.0, "rope_type": "default"})
    qkv = _randn(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1)
    positions = torch.randint(0, 4096, (tokens,), device="cuda")
    ref_q, ref_k = q.clone(), k.clone()
    fused_ops.rotary_embedding_ref_(positions, ref_q, ref_k, rope.cos_cache, rope.sin_cache, dim)
    v_before = v.clone()
    triton_ops.rotary_embedding_(positions, q, k, rope.cos_cache, rope.sin_cache, dim)
    _close(q, ref_q)
    _close(k, ref_k)
    assert torch.equal(v, v_before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_layer_kernels_match_the_layers_code(dtype: torch.dtype) -> None:
    """What the CUDA platform hands the layers (RoPE with HF's rounding, RMSNorm with the
    residual, SiLU-and-mul) against the layers' torch code, at Qwen3-0.6B shapes. The residual
    sum rounds once, as the torch code does, so it must be identical. RoPE rounds at the same
    points, yet on the H200 (2026-12-04) some elements came out one ulp apart (0.2197 vs
    0.2188 in bfloat16: the compiler may contract a multiply-add into one FMA), so it gets
    the two-rounding tolerance, as do RMSNorm's float32 sum and SiLU's exp."""
    from chassis.core.layers.activation import SiluAndMul
    from chassis.core.layers.norm import RMSNorm
    from chassis.core.layers.rotary import RotaryEmbedding
    from chassis.core.layers.triton_ops import TritonLayerKernels

    kernels = TritonLayerKernels()
    heads, kv_heads, dim, tokens = 16, 8, 128, 300
    with torch.device("cuda"):
        rope = RotaryEmbedding(dim, 4096, {"rope_theta": 1_000_000.0, "rope_type": "default"})
        norm = RMSNorm(1024, 1e-6).to(dtype)
    qkv = _randn(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    positions = torch.randint(0, 4096, (tokens,), device="cuda")
    ref_q, ref_k = rope.forward_reference(positions, q, k)
    kernels.rotary_embedding_(positions, q, k, rope.cos_cache, rope.sin_cache)
    _close(q, ref_q)
    _close(k, ref_k)

    x, r = _randn(tokens, 1024, dtype=dtype), _randn(tokens, 1024, dtype=dtype, seed=1)
    with torch.no_grad():
        out, summed = kernels.rms_norm(x, norm.weight, 1e-6, r)
        ref_out, ref_sum = norm.forward_reference(x, r)
    assert torch.equal(summed, ref_sum)
    _close(out, ref_out)
    g = _randn(tokens, 2 * 3072, dtype=dtype)
    _close(kernels.silu_and_mul(g), SiluAndMul().forward_reference(g))  # exp may differ


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rotary_at_qwen3_shapes(dtype: torch.dtype) -> None:
    """The fused per-head norm + RoPE (one launch for Qwen3's five) in place on a merged QKV
    output, against the reference and through the layer."""
    from chassis.core.layers import triton_ops
    from chassis.core.layers.norm import RMSNorm
    from chassis.core.layers.rotary import RotaryEmbedding

    heads, kv_heads, dim, tokens = 16, 8, 128, 300
    with torch.device("cuda"):
        rope = RotaryEmbedding(dim, 4096, {"rope_theta": 1_000_000.0, "rope_type": "default"})
        norms = (RMSNorm(dim, 1e-6).to(dtype), RMSNorm(dim, 1e-6).to(dtype))
    with torch.no_grad():
        norms[0].weight.copy_(1 + 0.2 * _randn(dim, dtype=torch.float32, seed=4))
        norms[1].weight.copy_(1 + 0.2 * _randn(dim, dtype=torch.float32, seed=5))
    qkv = _randn(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v_before = qkv[:, (heads + kv_heads) * dim :].clone()
    positions = torch.randint(0, 4096, (tokens,), device="cuda")
    args = (norms[0].weight, norms[1].weight, 1e-6, rope.cos_cache, rope.sin_cache)
    with torch.no_grad():
        ref_q, ref_k = fused_ops.qk_norm_rotary_embedding_ref(positions, q, k, *args)
        layer_q, layer_k = rope.forward_reference(positions, q, k, norms)
        got_q, got_k = rope(positions, q.clone(), k.clone(), norms)  # the layer's kernel path
        triton_ops.qk_norm_rotary_embedding_(positions, q, k, *args)
    assert torch.equal(ref_q, layer_q) and torch.equal(ref_k, layer_k)
    # A one-step difference in the normalized value (float32 division vs rsqrt, another sum
    # order) can move a rotated element by two roundings of values up to ~2: twice _close's.
    tol = 2 * ULP[dtype]
    for got, want in ((q, ref_q), (k, ref_k), (got_q, ref_q), (got_k, ref_k)):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], v_before)


def test_the_cuda_platform_hands_the_layers_the_triton_kernels() -> None:
    from chassis.core.layers.kernels import kernels_for
    from chassis.core.layers.triton_ops import TritonLayerKernels

    x = _randn(4, 64, dtype=torch.bfloat16)
    assert isinstance(kernels_for(x), TritonLayerKernels)
