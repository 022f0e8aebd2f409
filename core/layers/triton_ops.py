"""Triton kernels for the fused elementwise ops of a decoder layer, and their launchers.

- :func:`rms_norm`: RMSNorm, optionally fused with the residual add before it.
- :func:`silu_and_mul`: ``silu(x[..., :d]) * x[..., d:]``.
- :func:`rotary_embedding_`: RoPE applied in place to flattened query and key.
- :func:`qk_norm_rotary_embedding_`: per-head RMSNorm of query and key, then RoPE, in place.

Each computes what its torch reference in :mod:`chassis.core.layers.fused_ops` computes, in
the same rounding order, in one pass over memory. Call them through ``fused_ops``, which picks
this module only for tensors on a device where Triton compiles (CUDA, ROCm). On the CPU they
run only under Triton's interpreter (``TRITON_INTERPRET=1`` set before ``triton`` is first
imported), which the tests use. Loaded values are cast to float32 before arithmetic: the
interpreter computes bfloat16 arithmetic on raw bits.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

__all__ = [
    "NUM_SPLIT_COUNTERS",
    "check_launchable",
    "is_interpreted",
    "qk_norm_rotary_embedding_",
    "rms_norm",
    "rotary_embedding_",
    "silu_and_mul",
    "split_counters",
]


def is_interpreted(kernel: Any) -> bool:
    """Whether ``kernel`` (a ``@triton.jit`` function) runs in Triton's interpreter
    (``TRITON_INTERPRET=1`` when triton was first imported) rather than compiled. Kernels
    that must work around the interpreter (it computes bfloat16 arithmetic on raw bits) ask
    this, not the device their tensors are on."""
    return type(kernel).__name__ == "InterpretedFunction"


def check_launchable(kernel, tensor: torch.Tensor):
    """Return ``kernel`` if it can run on ``tensor``'s device, else raise ``ValueError``.

    Compiled kernels need a CUDA/ROCm tensor; interpreted ones (``TRITON_INTERPRET=1``) take
    CPU tensors.
    """
    if tensor.device.type == "cpu" and not is_interpreted(kernel):
        raise ValueError(
            "Triton kernels need CUDA/ROCm tensors; got a CPU tensor. To run them on the CPU "
            "(slowly, for tests) set TRITON_INTERPRET=1 before triton is first imported."
        )
    return kernel


#: int32 counters in each (device, stream)'s buffer (:func:`split_counters`): a split launch
#: may use at most this many (one per group of programs whose partial results one of them
#: merges)
NUM_SPLIT_COUNTERS = 8192
#: (device type, index, stream) -> that stream's counters, all zero between launches
_SPLIT_COUNTERS: dict[tuple[str, int | None, int], torch.Tensor] = {}


def split_counters(device: torch.device) -> torch.Tensor:
    """The :data:`NUM_SPLIT_COUNTERS` int32 ticket counters of ``device``'s current stream,
    zero between launches (allocated zeroed on first use, kept for the process's life).

    For kernels whose programs split one result's work and merge it without a second
    launch ("the last to arrive merges"): each program of a group writes its partial result,
    takes a ticket from the group's counter with one ``atomic_add``, and the one that draws
    the last ticket merges the partials and stores 0 back. A launch must therefore leave
    every counter it touched at zero; then launches of one stream, which run one after
    another, can all share one buffer (the small-batch GEMV's split-K and ``triton_paged``'s
    split-KV merge do). Two streams get two buffers, so concurrent launches never share a
    counter. Under CUDA-graph capture the buffer of the capturing stream is baked into the
    graph, and replays use it on whatever stream they run: graphs captured on one stream must
    not be replayed concurrently (the engine replays one at a time). Call once on the
    capturing stream before capturing (the platform's warm-up does), so that the buffer is
    not allocated inside the capture.
    """
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device.type, device.index, stream)
    counters = _SPLIT_COUNTERS.get(key)
    if counters is None:
        counters = torch.zeros(NUM_SPLIT_COUNTERS, dtype=torch.int32, device=device)
        _SPLIT_COUNTERS[key] = counters
    return counters


# ---------------------------------------------------------------------------------------------
# RMSNorm (+ residual add)
# ---------------------------------------------------------------------------------------------


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    dtype = x.dtype
    x = x.to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        # the residual stream is rounded to the model dtype, as the unfused add would
        x = (x + r.to(tl.float32)).to(dtype)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
        x = x.to(tl.float32)
    variance = tl.sum(x * x, 0) / hidden
    normed = (x / tl.sqrt_rn(variance + eps)).to(dtype).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, normed * w, mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton RMSNorm over the last dim; reference :func:`chassis.core.layers.fused_ops.rms_norm_ref`."""
    hidden = x.shape[-1]
    x2 = _rows(x)
    out = torch.empty_like(x2)
    if residual is not None:
        r2 = _rows(residual)
        residual_out = torch.empty_like(x2)
    else:
        r2 = residual_out = x2  # unused by the kernel
    if x2.shape[0]:
        block_n = triton.next_power_of_2(hidden)
        check_launchable(_rms_norm_kernel, x)[(x2.shape[0],)](
            x2,
            r2,
            weight,
            out,
            residual_out,
            x2.stride(0),
            r2.stride(0),
            out.stride(0),
            residual_out.stride(0),
            hidden,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK_N=block_n,
            num_warps=_warps_for(block_n),
        )
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), residual_out.view(x.shape)


# ---------------------------------------------------------------------------------------------
# SiLU and mul
# ---------------------------------------------------------------------------------------------


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = gate.dtype
    gate = gate.to(tl.float32)
    # silu is rounded to the model dtype before the product, as F.silu(gate) * up does
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, act * up, mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Triton SwiGLU; reference :func:`chassis.core.layers.fused_ops.silu_and_mul_ref`."""
    d = x.shape[-1] // 2
    x2 = _rows(x)
    out = torch.empty(x2.shape[0], d, dtype=x.dtype, device=x.device)
    if x2.shape[0] and d:
        block = min(1024, triton.next_power_of_2(d))
        grid = (x2.shape[0], triton.cdiv(d, block))
        check_launchable(_silu_and_mul_kernel, x)[grid](
            x2, out, x2.stride(0), out.stride(0), d, BLOCK=block, num_warps=4
        )
    return out.view(*x.shape[:-1], d)


# ---------------------------------------------------------------------------------------------
# Rotary embedding, in place
# ---------------------------------------------------------------------------------------------


@triton.jit
def _rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    stride_q_tok,
    stride_k_tok,
    stride_cos,
    num_q_heads,
    num_k_heads,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    IS_NEOX: tl.constexpr,
    HF_ROUNDING: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    dtype = q_ptr.dtype.element_ty
    cos, sin = _cos_sin_row(
        positions_ptr, cos_ptr, sin_ptr, token, stride_cos, dtype, HALF, HALF_PAD, HF_ROUNDING
    )
    _rotate_heads(
        q_ptr + token * stride_q_tok, num_q_heads, cos, sin, dtype,
        HEAD_DIM, HALF, HALF_PAD, HEADS_PAD, IS_NEOX, HF_ROUNDING,
    )  # fmt: skip
    _rotate_heads(
        k_ptr + token * stride_k_tok, num_k_heads, cos, sin, dtype,
        HEAD_DIM, HALF, HALF_PAD, HEADS_PAD, IS_NEOX, HF_ROUNDING,
    )  # fmt: skip


@triton.jit
def _rotate_heads(
    row_ptr,
    num_heads,
    cos,
    sin,
    dtype: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    IS_NEOX: tl.constexpr,
    HF_ROUNDING: tl.constexpr,
):
    """Rotate the first ``2 * HALF`` dims of each of a token's ``num_heads`` heads."""
    pairs = tl.arange(0, HALF_PAD)
    pair_valid = pairs < HALF
    if IS_NEOX:  # dimension i pairs with i + HALF
        first = pairs
        second = pairs + HALF
    else:  # GPT-J: dimension 2i pairs with 2i + 1
        first = pairs * 2
        second = pairs * 2 + 1
    heads = tl.arange(0, HEADS_PAD)
    mask = (heads[:, None] < num_heads) & pair_valid[None, :]
    row = row_ptr + heads[:, None] * HEAD_DIM
    x1 = tl.load(row + first[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(row + second[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(row + first[None, :], _rot(x1, cos, x2, sin, -1.0, dtype, HF_ROUNDING), mask=mask)
    tl.store(row + second[None, :], _rot(x2, cos, x1, sin, 1.0, dtype, HF_ROUNDING), mask=mask)


@triton.jit
def _cos_sin_row(
    positions_ptr,
    cos_ptr,
    sin_ptr,
    token,
    stride_cos,
    dtype: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HF_ROUNDING: tl.constexpr,
):
    """``[1, HALF_PAD]`` float32 cos and sin at ``token``'s position (zero past ``HALF``);
    with ``HF_ROUNDING`` rounded to ``dtype`` first, as HF rotates in the model dtype."""
    pos = tl.load(positions_ptr + token).to(tl.int64)
    pairs = tl.arange(0, HALF_PAD)
    pair_valid = pairs < HALF
    cos = tl.load(cos_ptr + pos * stride_cos + pairs, mask=pair_valid, other=0.0)
    sin = tl.load(sin_ptr + pos * stride_cos + pairs, mask=pair_valid, other=0.0)
    cos = cos.to(tl.float32)[None, :]
    sin = sin.to(tl.float32)[None, :]
    if HF_ROUNDING:
        cos = cos.to(dtype).to(tl.float32)
        sin = sin.to(dtype).to(tl.float32)
    return cos, sin


@triton.jit
def _rot(a, cos, b, sin, sign, dtype: tl.constexpr, HF_ROUNDING: tl.constexpr):
    """``a * cos + sign * b * sin``: float32 with one rounding, or each product rounded to
    ``dtype`` before the sum (HF's order when it rotates in the model dtype)."""
    if HF_ROUNDING:
        ac = (a * cos).to(dtype).to(tl.float32)
        bs = (b * sin).to(dtype).to(tl.float32)
        return ac + sign * bs
    return a * cos + sign * (b * sin)


def rotary_embedding_(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    head_dim: int,
    is_neox: bool = True,
    hf_rounding: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton in-place RoPE; reference :func:`chassis.core.layers.fused_ops.rotary_embedding_ref_`.

    ``hf_rounding``: round cos/sin and each product to the tensors' dtype before the sum, as
    HF transformers (and :class:`~chassis.core.layers.rotary.RotaryEmbedding`) do, instead of
    one float32 rounding at the end.
    """
    num_tokens, num_q_heads, num_k_heads, half = _rope_shapes(
        positions, query, key, cos_cache, sin_cache, head_dim
    )
    if 2 * half > head_dim:
        raise ValueError(f"rotary dim {2 * half} exceeds head_dim {head_dim}")
    if num_tokens:
        check_launchable(_rotary_kernel, query)[(num_tokens,)](
            positions,
            query,
            key,
            cos_cache,
            sin_cache,
            query.stride(0),
            key.stride(0),
            cos_cache.stride(0),
            num_q_heads,
            num_k_heads,
            HEAD_DIM=head_dim,
            HALF=half,
            HALF_PAD=triton.next_power_of_2(half),
            HEADS_PAD=triton.next_power_of_2(max(num_q_heads, num_k_heads)),
            IS_NEOX=is_neox,
            HF_ROUNDING=hf_rounding,
            num_warps=4,
        )
    return query, key


# ---------------------------------------------------------------------------------------------
# Per-head RMSNorm of query and key, then RoPE (Qwen3's q_norm/k_norm), in place
# ---------------------------------------------------------------------------------------------


@triton.jit
def _qk_norm_rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    q_weight_ptr,
    k_weight_ptr,
    cos_ptr,
    sin_ptr,
    stride_q_tok,
    stride_k_tok,
    stride_cos,
    num_q_heads,
    num_k_heads,
    eps,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HEADS_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    dtype = q_ptr.dtype.element_ty
    cos, sin = _cos_sin_row(
        positions_ptr, cos_ptr, sin_ptr, token, stride_cos, dtype, HALF, HALF_PAD, True
    )
    _norm_rotate_heads(
        q_ptr + token * stride_q_tok, q_weight_ptr, num_q_heads, cos, sin, eps,
        HEAD_DIM, HALF, HALF_PAD, HEADS_PAD,
    )  # fmt: skip
    _norm_rotate_heads(
        k_ptr + token * stride_k_tok, k_weight_ptr, num_k_heads, cos, sin, eps,
        HEAD_DIM, HALF, HALF_PAD, HEADS_PAD,
    )  # fmt: skip


@triton.jit
def _norm_rotate_heads(
    row_ptr,
    weight_ptr,
    num_heads,
    cos,
    sin,
    eps,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HEADS_PAD: tl.constexpr,
):
    """RMSNorm each of a token's ``num_heads`` heads over ``HEAD_DIM``, then rotate-half RoPE,
    rounding to the model dtype where the unfused norm and rotary layers do."""
    heads = tl.arange(0, HEADS_PAD)
    pairs = tl.arange(0, HALF_PAD)
    pair_valid = pairs < HALF
    mask = (heads[:, None] < num_heads) & pair_valid[None, :]
    first = row_ptr + heads[:, None] * HEAD_DIM + pairs[None, :]
    x1 = tl.load(first, mask=mask, other=0.0)
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    variance = (tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / HEAD_DIM
    root = tl.sqrt_rn(variance + eps)[:, None]
    w1 = tl.load(weight_ptr + pairs, mask=pair_valid, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(weight_ptr + HALF + pairs, mask=pair_valid, other=0.0).to(tl.float32)[None, :]
    # the norm's output is rounded twice (normalized value, then scaled), as RMSNorm does
    y1 = ((x1 / root).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
    y2 = ((x2 / root).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    tl.store(first, _rot(y1, cos, y2, sin, -1.0, dtype, True), mask=mask)
    tl.store(first + HALF, _rot(y2, cos, y1, sin, 1.0, dtype, True), mask=mask)


def qk_norm_rotary_embedding_(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of ``query [T, Hq, D]`` and ``key [T, Hk, D]`` (weights ``[D]``), then
    rotate-half RoPE over the whole head in HF's rounding order, in place, in one kernel.

    Reference: :func:`chassis.core.layers.fused_ops.qk_norm_rotary_embedding_ref`. Replaces
    the two norms' launches, the rotary launch and, for steps of more than one token, the
    copies of the strided heads the norms need; each token's heads must be dense (views into
    a merged QKV output are).
    """
    if query.dim() != 3 or key.dim() != 3:
        raise ValueError("query and key must be [T, H, D]")
    head_dim = query.shape[-1]
    if key.shape[-1] != head_dim:
        raise ValueError(f"key head_dim {key.shape[-1]} != query head_dim {head_dim}")
    if q_weight.shape != (head_dim,) or k_weight.shape != (head_dim,):
        raise ValueError(f"q_weight and k_weight must be [{head_dim}]")
    num_tokens, num_q_heads, num_k_heads, half = _rope_shapes(
        positions, query, key, cos_cache, sin_cache, head_dim
    )
    if 2 * half != head_dim:
        raise ValueError(f"the fused op rotates whole heads: rotary dim {2 * half} != {head_dim}")
    if num_tokens:
        half_pad = triton.next_power_of_2(half)
        heads_pad = triton.next_power_of_2(max(num_q_heads, num_k_heads))
        check_launchable(_qk_norm_rotary_kernel, query)[(num_tokens,)](
            positions,
            query,
            key,
            q_weight,
            k_weight,
            cos_cache,
            sin_cache,
            query.stride(0),
            key.stride(0),
            cos_cache.stride(0),
            num_q_heads,
            num_k_heads,
            eps,
            HEAD_DIM=head_dim,
            HALF=half,
            HALF_PAD=half_pad,
            HEADS_PAD=heads_pad,
            num_warps=_warps_for(heads_pad * half_pad),
        )
    return query, key


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, last]`` with a contiguous last dim (a view when possible)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:  # leading dims not collapsible into one stride
        return x.reshape(-1, x.shape[-1]).contiguous()


def _rope_shapes(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    head_dim: int,
) -> tuple[int, int, int, int]:
    """``(tokens, query heads, key heads, rotary pairs)`` of a RoPE launch, after checking
    that each token's heads are dense and the cos/sin tables share a row-major layout."""
    num_tokens = positions.shape[0]
    num_q_heads = _heads_per_token(query, num_tokens, head_dim, "query")
    num_k_heads = _heads_per_token(key, num_tokens, head_dim, "key")
    if cos_cache.stride(-1) != 1 or sin_cache.stride() != cos_cache.stride():
        raise ValueError("cos_cache and sin_cache must be row-major with the same strides")
    return num_tokens, num_q_heads, num_k_heads, cos_cache.shape[-1]


def _heads_per_token(x: torch.Tensor, num_tokens: int, head_dim: int, name: str) -> int:
    """Heads of ``x`` (``[T, H, D]`` or ``[T, H * D]``), whose per-token part must be dense."""
    if x.shape[0] != num_tokens:
        raise ValueError(f"{name} has {x.shape[0]} tokens; positions has {num_tokens}")
    per_token = x.shape[1:].numel()
    if per_token % head_dim:
        raise ValueError(f"{name} row of {per_token} values is not whole heads of {head_dim}")
    dense = x.dim() == 2 and x.stride(1) == 1
    dense |= x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == head_dim
    if not dense:
        raise ValueError(f"{name} must be [T, H*D] or [T, H, D] with each token's heads dense")
    return per_token // head_dim


def _warps_for(block: int) -> int:
    return 1 if block <= 256 else 4 if block <= 2048 else 8 if block <= 8192 else 16


# ---------------------------------------------------------------------------------------------
# the CUDA/ROCm platforms' LayerKernels
# ---------------------------------------------------------------------------------------------


class TritonLayerKernels:
    """:class:`~chassis.core.layers.kernels.LayerKernels` by the Triton kernels above, for
    tensors on a CUDA/ROCm device (what ``Platform.layer_kernels`` of those platforms returns).
    """

    def handles(self, x: torch.Tensor) -> bool:
        from chassis.core.layers.kernels import is_inference_tensor_of_kernel_dtype

        return x.is_cuda and is_inference_tensor_of_kernel_dtype(x)

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> Any:
        return rms_norm(x, weight, eps, residual)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)

    def rotary_embedding_(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        cos_cache: torch.Tensor,
        sin_cache: torch.Tensor,
    ) -> None:
        rotary_embedding_(
            positions, query, key, cos_cache, sin_cache, query.shape[-1], hf_rounding=True
        )

    def qk_norm_rotary_embedding_(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        eps: float,
        cos_cache: torch.Tensor,
        sin_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return qk_norm_rotary_embedding_(
            positions, query, key, q_weight, k_weight, eps, cos_cache, sin_cache
        )

    def int4_linear(
        self,
        x: torch.Tensor,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        g_idx: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        from chassis.core.layers.triton_int4 import int4_linear

        return int4_linear(x, qweight, scales, zeros, g_idx, bias)

    def fused_moe(
        self,
        x: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        from chassis.core.layers.triton_moe import fused_moe

        return fused_moe(x, w13, w2, topk_weights, topk_ids)

    def fused_moe_clamped_swiglu(
        self,
        x: torch.Tensor,
        w13: torch.Tensor,
        b13: torch.Tensor,
        w2: torch.Tensor,
        b2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        alpha: float,
        limit: float,
    ) -> torch.Tensor:
        from chassis.core.layers.triton_moe import fused_moe_clamped_swiglu

        return fused_moe_clamped_swiglu(x, w13, b13, w2, b2, topk_weights, topk_ids, alpha, limit)
