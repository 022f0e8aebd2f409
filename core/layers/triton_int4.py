"""The Triton W4A16 GEMM: ``y = x @ W.T + bias`` with ``W`` as packed 4-bit codes (or 8-bit
ones, W8A16: the same kernel, ``BITS`` a compile-time constant, one variant each).

Layout and reference: :mod:`chassis.core.layers.int4_linear`. Each program computes a
``[BLOCK_M, BLOCK_N]`` tile of ``y``, walking the input dimension ``BLOCK_K`` rows at a
time: it loads the int32 words holding those rows' codes, shifts each row's code out,
reads each row's group from ``g_idx`` (so act-order checkpoints and group sizes that are not
a multiple of ``BLOCK_K`` need nothing special) and its scale and zero point, dequantizes the
tile in float32, rounds it to the activation dtype as the reference does, and accumulates
``x_tile @ w_tile`` in float32. Called through :class:`~chassis.core.layers.triton_ops.
TritonLayerKernels` for CUDA/ROCm tensors; on the CPU only under Triton's interpreter
(``TRITON_INTERPRET=1``), where the product is taken in float32 (the interpreter computes
bfloat16 arithmetic on raw bits). Float32 activations multiply in IEEE float32, not TF32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from chassis.core.layers.int4_linear import code_bits
from chassis.core.layers.triton_ops import check_launchable, is_interpreted

__all__ = ["int4_linear"]


@triton.jit
def _int4_linear_kernel(
    x_ptr,
    qweight_ptr,
    scales_ptr,
    zeros_ptr,
    g_idx_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_qk,
    stride_sg,
    stride_zg,
    stride_om,
    HAS_BIAS: tl.constexpr,
    FLOAT32_DOT: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    # int64 rows: rows x out_features may pass 2**31 elements in a long prefill
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        mask_kn = mask_k[:, None] & mask_n[None, :]
        # each row's int32 word (32 / BITS rows share one) and its code within it
        words = tl.load(
            qweight_ptr + (offs_k[:, None] // (32 // BITS)) * stride_qk + offs_n[None, :],
            mask=mask_kn,
            other=0,
        )
        codes = (words >> ((offs_k[:, None] % (32 // BITS)) * BITS)) & ((1 << BITS) - 1)
        groups = tl.load(g_idx_ptr + offs_k, mask=mask_k, other=0)
        scales = tl.load(
            scales_ptr + groups[:, None] * stride_sg + offs_n[None, :], mask=mask_kn, other=0.0
        )
        zeros = tl.load(
            zeros_ptr + groups[:, None] * stride_zg + offs_n[None, :], mask=mask_kn, other=0
        )
        w = ((codes - zeros.to(tl.int32)).to(tl.float32) * scales.to(tl.float32)).to(dtype)
        if FLOAT32_DOT:
            # IEEE float32, not TF32: float32 models get float32 products
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0)
        acc = acc.to(dtype).to(tl.float32) + bias.to(tl.float32)
    tl.store(
        out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
        acc.to(dtype),
        mask=mask_m[:, None] & mask_n[None, :],
    )


def _block_m(rows: int) -> int:
    # tl.dot needs tiles of at least 16; decode steps have few rows
    return 16 if rows <= 16 else 32 if rows <= 32 else 64


def int4_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    g_idx: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """``x [..., in] -> [..., out]`` in ``x``'s dtype, as
    :func:`~chassis.core.layers.int4_linear.int4_linear_ref` computes it (float32 sums in
    another order: results may differ from it by a rounding step of the output dtype).
    ``ValueError`` when the kernel cannot run on ``x``'s device, or when a weight tensor's
    columns are not adjacent (the kernel indexes them with unit column strides; copying here
    would hide an allocation per call from CUDA-graph capture)."""
    for name, tensor in (("qweight", qweight), ("scales", scales), ("zeros", zeros)):
        if tensor.dim() != 2 or tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be 2-D with adjacent columns (stride {tensor.stride()})")
    if g_idx.dim() != 1 or g_idx.stride(0) != 1 or (bias is not None and bias.stride(-1) != 1):
        raise ValueError("g_idx and bias must be contiguous vectors")
    kernel = check_launchable(_int4_linear_kernel, x)
    bits = code_bits(qweight, g_idx)
    in_features, out_features = g_idx.numel(), qweight.shape[1]
    if x.shape[-1] != in_features:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {in_features}")
    rows = x.reshape(-1, in_features)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], out_features, dtype=x.dtype, device=x.device)
    if rows.shape[0] == 0:
        return out.reshape(*x.shape[:-1], out_features)
    block_m, block_n, block_k = _block_m(rows.shape[0]), 64, 64
    grid = (triton.cdiv(rows.shape[0], block_m), triton.cdiv(out_features, block_n))
    kernel[grid](
        rows,
        qweight,
        scales,
        zeros,
        g_idx,
        bias if bias is not None else scales,
        out,
        rows.shape[0],
        out_features,
        in_features,
        rows.stride(0),
        qweight.stride(0),
        scales.stride(0),
        zeros.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        FLOAT32_DOT=x.dtype == torch.float32 or is_interpreted(kernel),
        BITS=bits,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
    )
    return out.reshape(*x.shape[:-1], out_features)
