"""Triton fused mixture-of-experts: the GPU path of :class:`~chassis.core.layers.moe.FusedMoE`.

:func:`fused_moe` computes what :func:`~chassis.core.layers.moe.fused_experts_ref` computes,
in four device steps and no host read, so a decode step that runs it can be captured in a
CUDA graph:

1. :func:`moe_align` groups the ``T * k`` (token, slot) pairs by expert, each group padded to
   whole blocks of ``block_m`` rows, with torch ops whose output sizes follow from
   ``T``, ``k``, ``E`` and ``block_m`` alone.
2. ``_gate_up_kernel``: one grouped GEMM over all blocks, ``x[token] @ w13[e]^T``, with
   SiLU-and-mul fused into its epilogue: ``h [rows, I]``.
3. ``_down_kernel``: one grouped GEMM ``h @ w2[e]^T``, scaled by the pair's routing weight
   in float32 and written to the pair's row of a float32 ``[T * k, H]`` buffer.
4. torch sums each token's ``k`` rows in float32 and rounds once to ``x.dtype``: no atomic
   adds, so results are deterministic.

Rounding follows the reference: the gate and up matmuls, ``silu(gate)``, ``silu(gate) * up``
and the down matmul are each rounded to the model dtype; the weighting and the sum over the
``k`` experts are in float32, rounded once. Where it may differ: the matmuls accumulate in
float32 in another order than torch's, and ``exp`` is another approximation, so an
intermediate can land one rounding step apart (which the down matmul carries on); the ``k``
products are summed in slot order, the reference's in expert-id order (float32, last bits).
float32 inputs use IEEE float32 dots (no TF32), as torch's matmul does by default.

:func:`fused_moe_clamped_swiglu` runs the same kernels for gpt-oss's experts: a bias on each
matmul (added to the float32 sum before it rounds, as ``F.linear`` does) and the clamped
SwiGLU in the first epilogue instead of SiLU-and-mul (constexpr switches: with them off the
kernels are the plain ones).

On the CPU the kernels run only under Triton's interpreter (``TRITON_INTERPRET=1`` set
before ``triton`` is first imported), which the tests use; under it bfloat16 dot operands
are upcast to float32, since the interpreter multiplies bfloat16 as raw bits (the kernels ask
:func:`~chassis.core.layers.triton_ops.is_interpreted`, not the device).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from chassis.core.layers.kernels import KERNEL_DTYPES
from chassis.core.layers.moe import _check_shapes
from chassis.core.layers.triton_ops import check_launchable, is_interpreted

__all__ = ["MoeAlignment", "fused_moe", "fused_moe_clamped_swiglu", "max_blocks", "moe_align"]


# ---------------------------------------------------------------------------------------------
# grouping the (token, slot) pairs by expert, on the device
# ---------------------------------------------------------------------------------------------


class MoeAlignment(NamedTuple):
    """Where each (token, slot) pair goes in the grouped GEMMs (see :func:`moe_align`).

    ``sorted_pair_ids`` int32 ``[max_blocks * block_m]``: row ``r`` of the grouped GEMMs
    takes pair ``sorted_pair_ids[r]`` (the pair ``t * k + j`` is token ``t``'s slot ``j``);
    padding rows hold ``T * k``. ``block_expert_ids`` int32 ``[max_blocks]``: the expert of
    each block of ``block_m`` rows; ``-1`` for the blocks past the last group.
    ``num_rows_padded`` int32 ``[1]``: rows up to the end of the last group (on the device).
    """

    sorted_pair_ids: torch.Tensor
    block_expert_ids: torch.Tensor
    num_rows_padded: torch.Tensor


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most blocks of ``block_m`` rows that ``num_pairs`` pairs over ``num_experts``
    experts can need: each expert used (at most ``min(E, pairs)`` of them) pads its group
    by at most ``block_m - 1`` rows."""
    return (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    """Group the pairs of ``topk_ids [T, k]`` by expert, each group padded to a multiple of
    ``block_m`` rows and starting at one, experts in increasing id order and each group's
    pairs in increasing pair order.

    Runs on ``topk_ids``' device with no host read (no ``.item()``, ``nonzero``,
    ``bincount`` or boolean indexing; every output size follows from ``T``, ``k``,
    ``num_experts`` and ``block_m``), so it can be captured in a CUDA graph. Expert ids must
    be in ``[0, num_experts)``; checking that would read the device, so it is not checked.
    """
    if topk_ids.dim() != 2 or topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise ValueError(
            f"topk_ids must be a [tokens, k] integer tensor, got {tuple(topk_ids.shape)} "
            f"{topk_ids.dtype}"
        )
    if num_experts < 1 or block_m < 1:
        raise ValueError(f"num_experts ({num_experts}) and block_m ({block_m}) must be >= 1")
    device = topk_ids.device
    num_pairs = topk_ids.numel()
    experts = topk_ids.reshape(-1).long()
    # scatter_add_ rather than bincount: CUDA's bincount reads the maximum on the host
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, experts, torch.ones_like(experts))
    padded = (counts + (block_m - 1)) // block_m * block_m
    padded_ends = padded.cumsum(0)
    group_starts = counts.cumsum(0) - counts
    # stable: within an expert's group the pairs keep their order, so results are reproducible
    order = torch.argsort(experts, stable=True)
    sorted_experts = experts[order]
    rank_in_group = torch.arange(num_pairs, device=device) - group_starts[sorted_experts]
    rows = padded_ends[sorted_experts] - padded[sorted_experts] + rank_in_group
    blocks = max_blocks(num_pairs, num_experts, block_m)
    sorted_pair_ids = torch.full((blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids.scatter_(0, rows, order.to(torch.int32))
    # a block's expert is the first whose group ends after the block starts (empty groups
    # end where they start and are passed over); past the last group that is E: no expert
    block_starts = torch.arange(blocks, device=device) * block_m
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1)
    return MoeAlignment(
        sorted_pair_ids, block_experts.to(torch.int32), padded_ends[-1:].to(torch.int32)
    )


# ---------------------------------------------------------------------------------------------
# the grouped GEMMs
# ---------------------------------------------------------------------------------------------

#: the expert id ``_launch`` gives the blocks of pairs left out (id ``-1`` in ``topk_ids``:
#: expert parallelism): no GEMM runs for them and the down kernel writes their rows' zeros
_LEFT_OUT = -2


@triton.jit
def _block_and_tile(num_blocks, num_tiles_n, GROUP_M: tl.constexpr):
    """This program's (row block, column tile). Programs go through ``GROUP_M`` row blocks
    per column tile before the next tile, so a weight tile is read by consecutive programs
    (the blocks of one expert are consecutive) while it is in L2."""
    pid = tl.program_id(0)
    per_group = GROUP_M * num_tiles_n
    first_block = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_blocks - first_block, GROUP_M)
    block = first_block + (pid % per_group) % group_size
    tile_n = (pid % per_group) // group_size
    return block, tile_n


@triton.jit
def _gate_up_kernel(
    x_ptr,
    w13_ptr,
    b13_ptr,
    h_ptr,
    sorted_pairs_ptr,
    block_experts_ptr,
    num_pairs,
    hidden,
    inter,
    num_blocks,
    stride_x,
    stride_w_expert,
    stride_w_row,
    stride_b_expert,
    stride_h,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_FP32: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    CLAMPED_SWIGLU: tl.constexpr,
    ALPHA: tl.constexpr,
    LIMIT: tl.constexpr,
):
    """``h[r, n] = silu(gate) * up`` for the rows of one block and ``BLOCK_N`` columns of the
    intermediate dim: ``gate = x[token(r)] . w13[e, n]``, ``up = x[token(r)] . w13[e, I + n]``.

    ``HAS_BIAS``: ``b13[e, n]`` and ``b13[e, I + n]`` join gate and up before they round.
    ``CLAMPED_SWIGLU`` (gpt-oss): ``h = (clamp(up, -LIMIT, LIMIT) + 1) * g * sigmoid(ALPHA * g)``
    with ``g = min(gate, LIMIT)`` instead. Both off: the plain path (``b13_ptr`` unread)."""
    block, tile_n = _block_and_tile(num_blocks, tl.cdiv(inter, BLOCK_N), GROUP_M)
    expert = tl.load(block_experts_ptr + block)
    if expert < 0:  # past the last group, or _LEFT_OUT (the down kernel zeroes those rows)
        return
    rows = block.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + rows)
    row_valid = pairs < num_pairs
    tokens = (pairs // TOP_K).to(tl.int64)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = cols < inter
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens[:, None] * stride_x + ks[None, :]
    # [BLOCK_K, BLOCK_N] tiles of w13[e]^T: the gate rows, and the up rows I below them
    gate_ptrs = (
        w13_ptr
        + expert.to(tl.int64) * stride_w_expert
        + cols.to(tl.int64)[None, :] * stride_w_row
        + ks[:, None]
    )
    up_ptrs = gate_ptrs + inter * stride_w_row
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(hidden, BLOCK_K)):
        k_valid = ks < hidden - k * BLOCK_K
        a = tl.load(x_ptrs, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
        w_mask = k_valid[:, None] & col_valid[None, :]
        gate_w = tl.load(gate_ptrs, mask=w_mask, other=0.0)
        up_w = tl.load(up_ptrs, mask=w_mask, other=0.0)
        if DOT_FP32:
            a = a.to(tl.float32)
            acc_gate = tl.dot(a, gate_w.to(tl.float32), acc_gate, input_precision="ieee")
            acc_up = tl.dot(a, up_w.to(tl.float32), acc_up, input_precision="ieee")
        else:
            acc_gate = tl.dot(a, gate_w, acc_gate)
            acc_up = tl.dot(a, up_w, acc_up)
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    dtype = h_ptr.dtype.element_ty
    if HAS_BIAS:  # F.linear adds the bias to the float32 sum and rounds once
        b_ptrs = b13_ptr + expert.to(tl.int64) * stride_b_expert + cols
        acc_gate += tl.load(b_ptrs, mask=col_valid, other=0.0).to(tl.float32)[None, :]
        acc_up += tl.load(b_ptrs + inter, mask=col_valid, other=0.0).to(tl.float32)[None, :]
    # rounded where the reference's F.linear, its activation's ops and the product each round
    gate = acc_gate.to(dtype).to(tl.float32)
    up = acc_up.to(dtype).to(tl.float32)
    if CLAMPED_SWIGLU:
        # the clamps are exact; alpha * g, the sigmoid, g * sigmoid and up + 1 each round
        gate = tl.minimum(gate, LIMIT)
        up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
        scaled = (gate * ALPHA).to(dtype).to(tl.float32)
        sig = (1.0 / (1.0 + tl.exp(-scaled))).to(dtype).to(tl.float32)
        act = (gate * sig).to(dtype).to(tl.float32)
        up = (up + 1.0).to(dtype).to(tl.float32)
    else:
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    h_ptrs = h_ptr + rows[:, None] * stride_h + cols[None, :]
    tl.store(h_ptrs, act * up, mask=row_valid[:, None] & col_valid[None, :])


@triton.jit
def _down_kernel(
    h_ptr,
    w2_ptr,
    b2_ptr,
    out_ptr,
    sorted_pairs_ptr,
    block_experts_ptr,
    weights_ptr,
    num_pairs,
    hidden,
    inter,
    num_blocks,
    stride_h,
    stride_w_expert,
    stride_w_row,
    stride_b_expert,
    stride_out,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_FP32: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """``out[pair(r), n] = weight(pair(r)) * (h[r] . w2[e, n])`` (float32) for the rows of
    one block and ``BLOCK_N`` columns of the hidden dim; ``HAS_BIAS``: ``+ b2[e, n]`` before
    the product rounds (``b2_ptr`` unread without it)."""
    block, tile_n = _block_and_tile(num_blocks, tl.cdiv(hidden, BLOCK_N), GROUP_M)
    expert = tl.load(block_experts_ptr + block)
    if expert == -1:  # past the last group
        return
    rows = block.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + rows)
    row_valid = pairs < num_pairs
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = cols < hidden
    out_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * stride_out + cols[None, :]
    out_mask = row_valid[:, None] & col_valid[None, :]
    if expert < 0:  # _LEFT_OUT: the pairs' expert is on another rank; they add nothing
        tl.store(out_ptrs, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), mask=out_mask)
        return
    ks = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + rows[:, None] * stride_h + ks[None, :]
    w_ptrs = (
        w2_ptr
        + expert.to(tl.int64) * stride_w_expert
        + cols.to(tl.int64)[None, :] * stride_w_row
        + ks[:, None]
    )
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(inter, BLOCK_K)):
        k_valid = ks < inter - k * BLOCK_K
        # padding rows of h were never written: masked, they cannot bring a NaN in
        a = tl.load(h_ptrs, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_valid[:, None] & col_valid[None, :], other=0.0)
        if DOT_FP32:
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        b = tl.load(
            b2_ptr + expert.to(tl.int64) * stride_b_expert + cols, mask=col_valid, other=0.0
        )
        acc += b.to(tl.float32)[None, :]
    # the expert's output in the model dtype, as the reference's F.linear rounds it; then
    # weighted in float32
    y = acc.to(h_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weights_ptr + pairs, mask=row_valid, other=0.0).to(tl.float32)
    tl.store(out_ptrs, y * weight[:, None], mask=out_mask)


# ---------------------------------------------------------------------------------------------
# the entry point
# ---------------------------------------------------------------------------------------------


class _LaunchConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int


#: row blocks per column tile in the programs' order (see _block_and_tile)
_GROUP_M = 8


def _launch_config(num_pairs: int, num_experts: int, n: int, k: int) -> _LaunchConfig:
    """Tiles for a GEMM of ``n`` output columns over ``k``: row blocks sized to the average
    rows per expert (16, the smallest ``tl.dot`` tile, for decode steps, where most experts
    get one or two rows; up to 64 for long prefills); 64-deep, and 64 columns wide, or 32
    with 16-row blocks, so that a decode step's few blocks still spread over the
    multiprocessors (tiles shrink to fit tiny test shapes)."""
    per_expert = triton.cdiv(num_pairs, num_experts)
    block_m = min(64, max(16, triton.next_power_of_2(per_expert)))
    block_n = min(32 if block_m == 16 else 64, max(16, triton.next_power_of_2(n)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    return _LaunchConfig(block_m, block_n, block_k, 4 if block_m < 64 else 8)


def _dot_in_fp32(x: torch.Tensor) -> bool:
    """float32 models: IEEE float32 dots. Triton's interpreter computes bfloat16 dots on raw
    bits, so under it bfloat16 operands are upcast too (exact products either way)."""
    interpreted = is_interpreted(_gate_up_kernel)  # both kernels: one mode per process
    return x.dtype == torch.float32 or (interpreted and x.dtype == torch.bfloat16)


def _check_operands(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> None:
    _check_shapes(x, w13, w2, topk_weights, topk_ids)
    if x.dtype not in KERNEL_DTYPES or w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(
            f"x, w13 and w2 must share one of {KERNEL_DTYPES}; got {x.dtype}, {w13.dtype}, "
            f"{w2.dtype}"
        )
    if not topk_weights.dtype.is_floating_point:
        raise ValueError(f"topk_weights must be floating point, got {topk_weights.dtype}")
    if topk_ids.shape[1] < 1:
        raise ValueError("topk_ids must choose at least one expert per token")
    devices = {t.device for t in (x, w13, w2, topk_weights, topk_ids)}
    if len(devices) > 1:
        raise ValueError(f"all operands must be on one device, got {sorted(map(str, devices))}")
    if w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("w13 and w2 must be contiguous in their last dimension")


def _check_biases(x: torch.Tensor, w13: torch.Tensor, b13: torch.Tensor, b2: torch.Tensor) -> None:
    num_experts, two_inter, hidden = w13.shape
    if b13.shape != (num_experts, two_inter) or b2.shape != (num_experts, hidden):
        raise ValueError(
            f"b13 {tuple(b13.shape)} and b2 {tuple(b2.shape)} must be "
            f"[{num_experts}, {two_inter}] and [{num_experts}, {hidden}] (w13 is "
            f"{tuple(w13.shape)})"
        )
    if b13.dtype != x.dtype or b2.dtype != x.dtype:
        raise ValueError(f"b13 and b2 must be {x.dtype} as x is; got {b13.dtype}, {b2.dtype}")
    if b13.device != x.device or b2.device != x.device:
        raise ValueError(f"b13 and b2 must be on {x.device}, got {b13.device}, {b2.device}")
    if b13.stride(-1) != 1 or b2.stride(-1) != 1:
        raise ValueError("b13 and b2 must be contiguous in their last dimension")


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Triton MoE experts: ``[T, H]`` in ``x.dtype``; reference
    :func:`chassis.core.layers.moe.fused_experts_ref` (same arguments; rounding in the
    module docstring).

    ``x [T, H]``; ``w13 [E, 2I, H]`` (gate rows, then up rows); ``w2 [E, H, I]``;
    ``topk_weights [T, k]`` (any float dtype); ``topk_ids [T, k]`` in ``[0, E)``, or ``-1``
    for a pair left out (its expert is on another rank: expert parallelism). No host
    read: a call can be captured in a CUDA graph and replayed with new values in the same
    tensors. Scratch: ``h`` in the model dtype (up to ``T*k + (E+1)*(block_m - 1)`` rows of
    ``I``) and ``T * k * H`` float32.
    """
    _check_operands(x, w13, w2, topk_weights, topk_ids)
    return _launch(x, w13, w2, topk_weights, topk_ids, None, None)


def fused_moe_clamped_swiglu(
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
    """gpt-oss's experts: :func:`fused_moe` with a bias on each matmul and the clamped
    SwiGLU; ``[T, H]`` in ``x.dtype``. Reference: the torch path of
    :class:`chassis.builtin_plugins.models.gpt_oss.GptOssExperts`
    (:func:`~chassis.builtin_plugins.models.gpt_oss.experts_reference`, same arguments).

    ``expert_e(x) = act(x @ w13[e].T + b13[e]) @ w2[e].T + b2[e]`` with
    ``act(gate, up) = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``,
    ``g = min(gate, limit)``; ``b13 [E, 2I]`` (gate biases, then up biases, as ``w13``'s
    rows), ``b2 [E, H]``, in ``x.dtype``. Each matmul plus bias rounds once to the model
    dtype (as ``F.linear`` does), and so do ``alpha * g``, the sigmoid, ``g * sigmoid``,
    ``up + 1`` and the product, as the reference's ops round; the weighted sum over a token's
    experts is float32, rounded once. ``alpha`` and ``limit`` are compile-time constants of
    the kernel (one compilation per model). No host read, as :func:`fused_moe`.
    """
    _check_operands(x, w13, w2, topk_weights, topk_ids)
    _check_biases(x, w13, b13, b2)
    alpha, limit = float(alpha), float(limit)
    if not (math.isfinite(alpha) and math.isfinite(limit)):
        raise ValueError(f"alpha ({alpha}) and limit ({limit}) must be finite")
    return _launch(x, w13, w2, topk_weights, topk_ids, (b13, b2), (alpha, limit))


def _launch(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    biases: tuple[torch.Tensor, torch.Tensor] | None,
    swiglu: tuple[float, float] | None,
) -> torch.Tensor:
    """Both entry points, their operands checked: align, the two grouped GEMMs, the sum."""
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    if num_experts == 0:  # a rank that holds no expert (fewer experts than ranks)
        return torch.zeros_like(x)
    if num_tokens == 0 or inter == 0:
        if biases is not None and num_tokens and top_k:
            # no intermediate columns: each expert gives its down bias
            ids = topk_ids.long()
            held = (ids >= 0).unsqueeze(-1)  # -1: another rank's expert gives nothing here
            b2 = torch.where(held, biases[1].float()[ids.clamp(min=0)], 0.0)
            return (b2 * topk_weights.float().unsqueeze(-1)).sum(dim=1).to(x.dtype)
        return torch.zeros_like(x)
    if x.stride(-1) != 1:
        x = x.contiguous()
    num_pairs = num_tokens * top_k
    weights = topk_weights.reshape(-1)
    dot_fp32 = _dot_in_fp32(x)
    # without biases the kernels never read these pointers: any tensor stands in
    b13, b2 = biases if biases is not None else (w13, w2)
    alpha, limit = swiglu if swiglu is not None else (0.0, 0.0)

    up_cfg = _launch_config(num_pairs, num_experts, inter, hidden)
    down_cfg = _launch_config(num_pairs, num_experts, hidden, inter)
    block_m = up_cfg.block_m
    # pairs of id -1 (their expert is on another rank) form a last group, E, whose blocks
    # are marked _LEFT_OUT: the gate/up kernel passes over them (as over the blocks past the
    # last group, -1) and the down kernel writes zeros in their rows, so every row of `out`
    # is written once and it needs no zeroing pass of its own (a pass over T * k * H floats)
    ids = torch.where(topk_ids < 0, num_experts, topk_ids)
    sorted_pairs, block_experts, _ = moe_align(ids, num_experts + 1, block_m)
    block_experts = torch.where(block_experts == num_experts, _LEFT_OUT, block_experts)
    num_blocks = block_experts.shape[0]
    h = torch.empty(num_blocks * block_m, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)

    grid = (num_blocks * triton.cdiv(inter, up_cfg.block_n),)
    check_launchable(_gate_up_kernel, x)[grid](
        x,
        w13,
        b13,
        h,
        sorted_pairs,
        block_experts,
        num_pairs,
        hidden,
        inter,
        num_blocks,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        b13.stride(0),
        h.stride(0),
        TOP_K=top_k,
        BLOCK_M=block_m,
        BLOCK_N=up_cfg.block_n,
        BLOCK_K=up_cfg.block_k,
        GROUP_M=_GROUP_M,
        DOT_FP32=dot_fp32,
        HAS_BIAS=biases is not None,
        CLAMPED_SWIGLU=swiglu is not None,
        ALPHA=alpha,
        LIMIT=limit,
        num_warps=up_cfg.num_warps,
    )
    grid = (num_blocks * triton.cdiv(hidden, down_cfg.block_n),)
    check_launchable(_down_kernel, x)[grid](
        h,
        w2,
        b2,
        out,
        sorted_pairs,
        block_experts,
        weights,
        num_pairs,
        hidden,
        inter,
        num_blocks,
        h.stride(0),
        w2.stride(0),
        w2.stride(1),
        b2.stride(0),
        out.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=down_cfg.block_n,
        BLOCK_K=down_cfg.block_k,
        GROUP_M=_GROUP_M,
        DOT_FP32=dot_fp32,
        HAS_BIAS=biases is not None,
        num_warps=down_cfg.num_warps,
    )
    # the k weighted rows of each token, summed in float32 and rounded once
    return out.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)
