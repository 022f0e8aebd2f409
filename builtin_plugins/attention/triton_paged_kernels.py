"""Triton kernels of the ``triton_paged`` backend: KV-cache write and unified paged attention.

Both kernels take the layout of :mod:`chassis.core.attention`: flattened tokens, a paged cache
``[num_blocks, 2, block_size, num_kv_heads, head_dim]``, ``query_start_loc`` / ``seq_lens`` /
``block_table`` on the device. Nothing here reads a device tensor on the host, so a launch never
waits for the device and can be captured in a CUDA graph; grid sizes come from tensor shapes
and the Python ints of the metadata.

Written for Triton 3.6 (the GPU image) and 3.9 (this repository's CPU machines), using only
long-standing ``tl`` APIs. Loaded values are cast to float32 before any elementwise arithmetic:
besides being the numerically right thing, Triton's CPU interpreter computes bfloat16
arithmetic on the raw bits, so this is also what keeps the interpreter usable for tests.

An 8-bit cache (``torch.float8_e4m3fn`` / ``float8_e5m2``, ``--kv-cache-dtype fp8``) is a
compile-time variant of both kernels (they branch on the cache pointer's element type): the
write divides K/V by their per-tensor scales in float32, saturates to the format's finite
range and rounds to nearest even; attention casts each loaded K/V tile to the compute dtype
(exact: every fp8 value is a bfloat16/float16 value), folds ``k_scale`` into the score scale
and multiplies the output by ``v_scale``. Triton's
interpreter handles the fp8 types too, so the CPU tests run the same code. NVIDIA GPUs need
sm_89 or later (Ada, Hopper) for Triton's e4m3 conversions.

Decode steps can run as one launch instead of two or three (``paged_attention``'s
``fuse_kv_write`` / ``fuse_combine``; the backend's ``CHASSIS_FUSED_DECODE_ATTENTION=1``): the
attention kernel then writes the step's K/V itself and merges its KV splits in the last split
program to finish (see the comment above ``_paged_attention_kernel``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl

from chassis.core.attention import FP8_KV_DTYPES  # the kernels store and read both
from chassis.core.layers.triton_ops import (
    NUM_SPLIT_COUNTERS,
    check_launchable,
    is_interpreted,
    split_counters,
)

_LOG2E = 1.4426950408889634
#: upper bound on KV splits of one query block (split-KV "flash decoding")
MAX_KV_SPLITS = 16
#: a split gets at least this many KV tiles, so its partial result is worth the extra write
_MIN_TILES_PER_SPLIT = 4
#: the combine kernel's split lanes: one compiled variant for every split count
_SPLITS_PAD = triton.next_power_of_2(MAX_KV_SPLITS)
#: the same, as the attention kernel's fused merge reads it (a global the kernel may use)
_SPLIT_LANES = tl.constexpr(_SPLITS_PAD)


# ---------------------------------------------------------------------------------------------
# KV-cache write
# ---------------------------------------------------------------------------------------------


@triton.jit
def _store_to_cache(cache_ptr, offsets, x, scale, mask):
    """Store ``x`` at ``cache_ptr + offsets`` (where ``mask``) in the cache's element type.

    An 8-bit cache (the pointer's element type, so a compile-time branch) gets ``x / scale``
    saturated to the format's largest finite value and rounded to nearest even: the plain
    cast would give NaN or inf beyond the range. Other caches get ``x`` as it is (the
    model's dtype). The write kernel and the attention kernel's fused decode write both store
    through this, so the two paths store the same bits."""
    cache_ty = cache_ptr.dtype.element_ty
    if cache_ty.is_fp8():
        fp8_max = 448.0 if cache_ty == tl.float8e4nv else 57344.0  # e4m3fn, e5m2
        x = tl.minimum(tl.maximum(x.to(tl.float32) / scale, -fp8_max), fp8_max)
        x = x.to(cache_ty, fp_downcast_rounding="rtne")
    tl.store(cache_ptr + offsets, x, mask=mask)


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_scale,
    v_scale,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_c_block,
    stride_c_slot,
    stride_c_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """One program per token: copy its K and V (all kv heads) to cache slot ``slot_mapping[t]``
    (quantized for an 8-bit cache: :func:`_store_to_cache`)."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token: nothing to write
        return
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, DIM_PAD)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    cache_off = (
        block * stride_c_block
        + offset * stride_c_slot
        + heads[:, None] * stride_c_head
        + dims[None, :]
    )
    k = tl.load(
        key_ptr + token * stride_k_tok + heads[:, None] * stride_k_head + dims[None, :], mask=mask
    )
    _store_to_cache(k_cache_ptr, cache_off, k, k_scale, mask)
    v = tl.load(
        value_ptr + token * stride_v_tok + heads[:, None] * stride_v_head + dims[None, :], mask=mask
    )
    _store_to_cache(v_cache_ptr, cache_off, v, v_scale, mask)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store ``key``/``value [T, num_kv_heads, head_dim]`` into ``kv_cache`` at ``slot_mapping``.

    ``slot_mapping [T]`` holds ``block * block_size + offset`` per token, ``-1`` for padding
    tokens, which are skipped. ``kv_cache`` has the shape of
    :func:`chassis.core.attention.kv_cache_shape` and its dtype; K/V are cast to it on store.
    An 8-bit cache (:data:`FP8_KV_DTYPES`) stores ``key / k_scale`` and ``value / v_scale``
    saturated to its finite range, rounded to nearest even (as ``torch_paged.quantize_kv``).
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    if slot_mapping.shape[0] < num_tokens:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens"
        )
    _check_cache(kv_cache, num_kv_heads, head_dim)
    if num_tokens == 0:
        return
    key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
    kernel = check_launchable(_write_kv_kernel, key)
    k_cache, v_cache = kv_cache[:, 0], kv_cache[:, 1]
    kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        float(k_scale),
        float(v_scale),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(2),
        kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=kv_cache.shape[2],
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )


# ---------------------------------------------------------------------------------------------
# Unified paged attention (prefill chunks over cached prefixes + decodes in one launch)
# ---------------------------------------------------------------------------------------------
#
# Grid: (query blocks, head programs, kv splits). A program owns BLOCK_Q consecutive query
# tokens of one request and HEADS_PER_PROGRAM query heads that share one kv head, i.e.
# BLOCK_M = BLOCK_Q * HEADS_PER_PROGRAM rows (row r = token r // HEADS_PER_PROGRAM, head
# r % HEADS_PER_PROGRAM), so every K/V tile it loads serves them all. HEADS_PER_PROGRAM is the
# whole GQA group (one head program per kv head), except for heads too wide for a group's rows
# to fit the GPU's shared memory (DeepSeek's 576-wide latent shared by up to 128 query heads):
# then a group is split over GROUP // HEADS_PER_PROGRAM programs, head program p covering query
# heads p * HEADS_PER_PROGRAM onwards, of kv head p // (GROUP // HEADS_PER_PROGRAM). Request
# i's query blocks are numbered from qsl[i] // BLOCK_Q + i, which leaves each request at least
# ceil(q_len_i / BLOCK_Q) numbers; the total is T // BLOCK_Q + num_reqs, known on the host
# without reading the device. A program finds its request by binary search over
# query_start_loc and exits at once when its block lies past the request's query. When every
# request's query fits one block (decode-like steps, ONE_BLOCK_PER_REQ) the grid is num_reqs
# instead and program r is request r: no search, no idle programs.


# Arguments that change from step to step are not specialized (Triton would otherwise compile
# a variant per value class: == 1, divisible by 16, other), so an eager step of a new shape
# never compiles mid-run: the request count, the block table's row stride (its width follows
# the longest sequence) and the split count. One kernel per tile shape and SPLIT_KV remains.
#
# A sliding window (SLIDING_WINDOW) hides keys more than ``sliding_window - 1`` positions
# before each row's own and lets a block start its KV loop at the first tile its earliest row
# can see: a windowed layer reads about ``window + BLOCK_Q`` positions per block whatever the
# context length. A soft cap (SOFT_CAP) replaces the scaled score ``s`` by
# ``cap * tanh(s / cap)``; tanh is written with exp2 (see the kernel), which the compiler and
# the interpreter both have. Attention sinks (HAS_SINKS, gpt-oss) start each row's online
# softmax from its head's sink logit, as if it were a position already seen (running max =
# the sink, sum = 1, no value); with the KV split only split 0 carries it, so the combine
# counts it once. A per-token attend limit (HAS_LIMIT: bidirectional image blocks,
# ``AttentionMetadata.attend_limit``) bounds each row's keys by its loaded limit instead of its
# position (the window still counts back from the position) and reads the request's whole
# context. Chunked local attention (CHUNKED, Llama 4: ``attention_chunk_size``) hides keys
# before the start of each row's chunk, ``floor(pos / chunk) * chunk``, and, as the window
# does, starts a block's KV loop at its first row's chunk start. All five are constexpr
# switches: the kernel without them is the plain one, unchanged.
#
# Two more constexpr switches fold the launches around a decode step into this kernel
# (``paged_attention(fuse_kv_write=..., fuse_combine=...)``, the backend's
# CHASSIS_FUSED_DECODE_ATTENTION=1; at batch 1 each extra launch costs about as much as the
# work it does):
#
# - FUSED_COMBINE (with SPLIT_KV): each split program writes its partials as before, then takes
#   a ticket from the counter of its (query block, head program) with one atomic add; the
#   program that draws the last ticket merges every split's partials, row by row in the
#   combine kernel's own arithmetic (:func:`_merge_split_row`, which both call), stores the
#   output and zeroes the counter for the stream's next launch (the counters:
#   ``triton_ops.split_counters``). No _combine_kernel launch.
# - FUSED_WRITE (decode-only launches: every request has one query token, at position
#   seq_len - 1, in the request's last KV tile): the program whose KV range holds that tile
#   stores the token's K and V of its kv head at ``slot_mapping[token]`` (slot -1: nothing),
#   quantized as _write_kv_kernel does (:func:`_store_to_cache`), and a CTA barrier orders
#   those stores before the KV loop reads the tile back. That program is the only one to read
#   that position of that kv head: the other splits end before the last tile, and the host
#   fuses only when one head program covers a kv head's whole query group and the V plane
#   does not alias the K plane. No _write_kv_kernel launch.
@triton.jit(
    do_not_specialize=["num_reqs", "stride_bt", "num_splits", "sliding_window", "chunk_size"]
)
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    sinks_ptr,
    attend_limit_ptr,
    key_ptr,
    value_ptr,
    slot_mapping_ptr,
    counter_ptr,
    num_reqs,
    scale_log2,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_c_block,
    stride_c_slot,
    stride_c_head,
    stride_bt,
    num_splits,
    sliding_window,
    chunk_size,
    cap_in_log2,
    cap_out_log2,
    k_scale,
    v_scale,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    SPLIT_KV: tl.constexpr,
    DOT_FP32: tl.constexpr,
    ONE_BLOCK_PER_REQ: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    CHUNKED: tl.constexpr,
    FUSED_WRITE: tl.constexpr,
    FUSED_COMBINE: tl.constexpr,
):
    q_block = tl.program_id(0)
    head_program = tl.program_id(1)
    kv_head = head_program // (GROUP // HEADS_PER_PROGRAM)
    split = tl.program_id(2)

    if ONE_BLOCK_PER_REQ:
        # every request's query fits one block (decode-like steps): program r is request r
        req = q_block
        q_start = tl.load(query_start_loc_ptr + req)
        q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
        first_q = tl.full([], 0, tl.int32)
    else:
        # which request: the last r with query_start_loc[r] // BLOCK_Q + r <= q_block
        lo = tl.full([], 0, tl.int32)
        hi = lo + num_reqs
        while lo + 1 < hi:
            mid = (lo + hi) // 2
            mid_start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
            if mid_start <= q_block:
                lo = mid
            else:
                hi = mid
        req = lo
        q_start = tl.load(query_start_loc_ptr + req)
        q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
        first_q = (q_block - (q_start // BLOCK_Q + req)) * BLOCK_Q
    if first_q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    prefix_len = seq_len - q_len  # context tokens cached before this step's chunk

    rows = tl.arange(0, BLOCK_M)
    tok_in_block = rows // HEADS_PER_PROGRAM
    q_idx = first_q + tok_in_block  # index of the row's token within the request's query
    row_valid = (tok_in_block < BLOCK_Q) & (q_idx < q_len)
    q_head = head_program * HEADS_PER_PROGRAM + rows % HEADS_PER_PROGRAM
    # last context position each row may attend to (causal over prefix + chunk)
    q_pos = prefix_len + q_idx
    dims = tl.arange(0, DIM_PAD)
    dim_valid = dims < HEAD_DIM

    q_tok = (q_start + q_idx).to(tl.int64)
    q = tl.load(
        q_ptr + q_tok[:, None] * stride_q_tok + q_head[:, None] * stride_q_head + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)

    if HAS_LIMIT:
        # the last position each row may attend to (beyond its own inside an image block)
        q_last = tl.load(attend_limit_ptr + q_tok, mask=row_valid, other=0)
        kv_end = seq_len  # (every limit is below it)
    else:
        q_last = q_pos
        # keys this block needs: 0 .. kv_end - 1 (the block's last query token sees kv_end - 1)
        kv_end = tl.minimum(seq_len, prefix_len + first_q + BLOCK_Q)
    num_tiles = tl.cdiv(kv_end, TILE_N)
    if SLIDING_WINDOW:
        # the block's first row sees nothing before kv_start, and later rows even less: the
        # tiles wholly before it are skipped (and the KV split divides only what is left)
        kv_start = tl.maximum(prefix_len + first_q - sliding_window + 1, 0)
    else:
        kv_start = tl.full([], 0, tl.int32)
    if CHUNKED:
        # the block's first row's chunk starts at or before every later row's
        kv_start = tl.maximum(kv_start, (prefix_len + first_q) // chunk_size * chunk_size)
    first_tile = kv_start // TILE_N
    if SPLIT_KV:
        tiles_per_split = tl.cdiv(num_tiles - first_tile, num_splits)
        tile_lo = first_tile + split * tiles_per_split
        tile_hi = tl.minimum(num_tiles, tile_lo + tiles_per_split)
    else:
        tile_lo = first_tile
        tile_hi = num_tiles

    if FUSED_WRITE:
        # A decode-only launch (the host checked): q_len == 1, the token sits at seq_len - 1,
        # in the last tile, which a window or chunk never skips (a token sees itself). The
        # program whose range ends with that tile (the only one without the split) writes.
        if (tile_lo < num_tiles) & (tile_hi == num_tiles):
            new_tok = q_start.to(tl.int64)
            slot = tl.load(slot_mapping_ptr + new_tok).to(tl.int64)
            if slot >= 0:  # -1: a CUDA graph's padding row, nothing to write
                slot_off = (slot // BLOCK_SIZE) * stride_c_block
                slot_off += (slot % BLOCK_SIZE) * stride_c_slot + kv_head * stride_c_head
                k_new = tl.load(
                    key_ptr + new_tok * stride_k_tok + kv_head * stride_k_head + dims,
                    mask=dim_valid,
                )
                _store_to_cache(k_cache_ptr, slot_off + dims, k_new, k_scale, dim_valid)
                v_new = tl.load(
                    value_ptr + new_tok * stride_v_tok + kv_head * stride_v_head + dims,
                    mask=dim_valid,
                )
                _store_to_cache(v_cache_ptr, slot_off + dims, v_new, v_scale, dim_valid)
        # The KV loop reads the slot back through the block table, with other threads than
        # the ones that stored it: a CTA barrier makes every thread's global stores before it
        # visible to every thread of the program after it (and keeps the compiler's loads of
        # the first tiles after it).
        tl.debug_barrier()

    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:
        # the head's sink logit in the log2 domain of the scores (1.44... = log2(e)); only
        # split 0 counts it (without the split, the one program is split 0)
        sink = tl.load(sinks_ptr + q_head).to(tl.float32) * 1.4426950408889634
        row_max = tl.where(split == 0, sink, row_max)
        row_sum = tl.where(split == 0, 1.0, row_sum)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    cols = tl.arange(0, TILE_N)
    for tile in range(tile_lo, tile_hi):
        k_pos = tile * TILE_N + cols
        k_valid = k_pos < kv_end
        block = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=k_valid, other=0).to(tl.int64)
        kv_off = block * stride_c_block + (k_pos % BLOCK_SIZE) * stride_c_slot
        kv_off += kv_head * stride_c_head
        k_t = tl.load(  # [DIM_PAD, TILE_N]: K transposed for q @ k^T
            k_cache_ptr + kv_off[None, :] + dims[:, None],
            mask=dim_valid[:, None] & k_valid[None, :],
            other=0.0,
        )
        v = tl.load(
            v_cache_ptr + kv_off[:, None] + dims[None, :],
            mask=k_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )
        if k_cache_ptr.dtype.element_ty.is_fp8():
            # 8-bit cache (a compile-time branch on the pointer type): widen the tiles to the
            # compute dtype (exact); k_scale is folded into the score scale on the host,
            # v_scale multiplies the result below
            k_t = k_t.to(q.dtype)
            v = v.to(q.dtype)
        if DOT_FP32:
            scores = tl.dot(q, k_t.to(tl.float32), input_precision="ieee")
        else:
            scores = tl.dot(q, k_t)
        if SOFT_CAP:
            # cap * tanh(s / cap) in the log2 domain: tanh(x) = 1 - 2 / (exp(2x) + 1), which
            # saturates to +-1 without NaN (exp2 overflows to inf or underflows to 0);
            # cap_in_log2 = 2 * scale * log2(e) / cap, cap_out_log2 = cap * log2(e)
            tanh = 1.0 - 2.0 / (tl.exp2(scores * cap_in_log2) + 1.0)
            scores = tanh * cap_out_log2
        else:
            scores = scores * scale_log2
        visible = k_valid[None, :] & (k_pos[None, :] <= q_last[:, None])
        if SLIDING_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - sliding_window)
        if CHUNKED:
            visible = visible & (k_pos[None, :] >= q_pos[:, None] // chunk_size * chunk_size)
        scores = tl.where(visible, scores, float("-inf"))

        new_max = tl.maximum(row_max, tl.max(scores, 1))
        # rows that have seen no key yet keep -inf; use 0 so exp2 gives 0, not NaN
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        correction = tl.exp2(row_max - safe_max)
        p = tl.exp2(scores - safe_max[:, None])
        row_sum = row_sum * correction + tl.sum(p, 1)
        acc = acc * correction[:, None]
        if DOT_FP32:
            acc = tl.dot(p, v.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
        row_max = new_max

    if k_cache_ptr.dtype.element_ty.is_fp8():
        acc = acc * v_scale  # the cache holds v / v_scale; linear, so splits combine as before
    if SPLIT_KV:
        # partial results [T, NUM_HEADS, num_splits(, DIM_PAD)], merged by _combine_kernel or
        # by the fused merge below; an empty split still writes (max -inf, sum 0) so the merge
        # needs no other signal
        part = (q_tok * NUM_HEADS + q_head) * num_splits + split
        tl.store(part_max_ptr + part, row_max, mask=row_valid)
        tl.store(part_sum_ptr + part, row_sum, mask=row_valid)
        tl.store(
            part_acc_ptr + part[:, None] * DIM_PAD + dims[None, :],
            acc,
            mask=row_valid[:, None],
        )
        if FUSED_COMBINE:
            # The last of the splits of this (query block, head program) to get here merges
            # them all. Every thread's partial stores happen before the ticket (the barrier);
            # the ticket's atomic (acq_rel, GPU scope) publishes them to the program that
            # draws the last ticket and makes the others' visible to it, which then reads
            # them from L2 (.cg loads in _merge_split_row: L1 is not coherent across SMs).
            tl.debug_barrier()
            counter = counter_ptr + q_block * (NUM_HEADS // HEADS_PER_PROGRAM) + head_program
            ticket = tl.atomic_add(counter, 1, sem="acq_rel")
            if ticket == num_splits - 1:
                # the block's rows that hold a token, in row order (token-major)
                num_rows = tl.minimum(q_len - first_q, BLOCK_Q) * HEADS_PER_PROGRAM
                for r in range(0, num_rows):
                    _merge_split_row(
                        out_ptr,
                        part_acc_ptr,
                        part_max_ptr,
                        part_sum_ptr,
                        (q_start + first_q + r // HEADS_PER_PROGRAM).to(tl.int64),
                        head_program * HEADS_PER_PROGRAM + r % HEADS_PER_PROGRAM,
                        num_splits,
                        stride_o_tok,
                        stride_o_head,
                        NUM_HEADS,
                        HEAD_DIM,
                        DIM_PAD,
                        _SPLIT_LANES,
                    )
                tl.store(counter, 0)  # zero again for the stream's next split launch
    else:
        out = acc / tl.where(row_sum > 0.0, row_sum, 1.0)[:, None]
        tl.store(
            out_ptr
            + q_tok[:, None] * stride_o_tok
            + q_head[:, None] * stride_o_head
            + dims[None, :],
            out,
            mask=row_valid[:, None] & dim_valid[None, :],
        )


@triton.jit
def _merge_split_row(
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    token,
    head,
    num_splits,
    stride_o_tok,
    stride_o_head,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    """Merge the ``num_splits`` online-softmax partial results ``(acc, max, sum)`` of output
    row (``token`` (int64), query ``head``) and store the row: ``sum_s w_s acc_s / sum_s w_s
    sum_s`` with ``w_s = exp2(max_s - max)``; an empty split (max -inf, sum 0) weighs 0.

    The loads are ``.cg`` (from L2): in the fused merge the partials were stored by other
    programs of the same launch, which an SM's L1 may hold stale lines of. The combine kernel
    and the fused merge both call this, so they compute each row with the same operations."""
    splits = tl.arange(0, SPLITS_PAD)
    split_valid = splits < num_splits
    dims = tl.arange(0, DIM_PAD)
    base = (token * NUM_HEADS + head) * num_splits
    maxes = tl.load(
        part_max_ptr + base + splits,
        mask=split_valid,
        other=float("-inf"),
        cache_modifier=".cg",
    )
    sums = tl.load(part_sum_ptr + base + splits, mask=split_valid, other=0.0, cache_modifier=".cg")
    global_max = tl.max(maxes, 0)
    safe_max = tl.where(global_max == float("-inf"), 0.0, global_max)
    weights = tl.exp2(maxes - safe_max)  # empty splits: exp2(-inf) = 0
    total = tl.sum(sums * weights, 0)
    acc = tl.load(
        part_acc_ptr + (base + splits)[:, None] * DIM_PAD + dims[None, :],
        mask=split_valid[:, None],
        other=0.0,
        cache_modifier=".cg",
    )
    out = tl.sum(acc * weights[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + token * stride_o_tok + head * stride_o_head + dims,
        out,
        mask=dims < HEAD_DIM,
    )


@triton.jit(do_not_specialize=["num_reqs", "num_splits"])
def _combine_kernel(
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    query_start_loc_ptr,
    num_reqs,
    num_splits,
    stride_o_tok,
    stride_o_head,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    """One program per (token, q head): merge the splits' online-softmax partial results."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if token >= tl.load(query_start_loc_ptr + num_reqs):
        return  # a padding token: no partial results were written for it
    _merge_split_row(
        out_ptr,
        part_acc_ptr,
        part_max_ptr,
        part_sum_ptr,
        token,
        head,
        num_splits,
        stride_o_tok,
        stride_o_head,
        NUM_HEADS,
        HEAD_DIM,
        DIM_PAD,
        SPLITS_PAD,
    )


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes and split count of one :func:`paged_attention` launch."""

    block_m: int
    block_q: int
    tile_n: int
    num_splits: int
    num_warps: int
    num_stages: int
    #: query heads of one GQA group per program (a divisor of the group); ``None``: the
    #: whole group. ``block_q`` is then ``block_m // heads_per_program``
    heads_per_program: int | None = None

    def heads_of(self, group: int) -> int:
        """The query heads one program takes of a group of ``group``."""
        return group if self.heads_per_program is None else self.heads_per_program


#: head dims up to this keep a GQA group's rows in one program; wider heads (DeepSeek's
#: 576-wide latent, padded to 1024) take 16 rows of 16-position tiles, which a group of 128
#: query heads would overflow the shared memory with (~165 KB for 16 rows of 32-position
#: tiles, ~99 KB of 16-position ones; 512 KB for 128 rows, compiled for Hopper): their
#: group is split over programs of at most :data:`WIDE_HEAD_ROWS` heads
MAX_GROUPED_HEAD_DIM = 256
WIDE_HEAD_ROWS = 16


def _heads_per_program(group: int) -> int:
    """The largest divisor of ``group`` up to :data:`WIDE_HEAD_ROWS`."""
    return max(d for d in range(1, min(group, WIDE_HEAD_ROWS) + 1) if group % d == 0)


@lru_cache(maxsize=8)
def _multiprocessor_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_launch_config(
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    num_tokens: int,
    num_reqs: int,
    max_query_len: int,
    max_seq_len: int,
    device: torch.device,
    num_splits: int | None = None,
    sliding_window: int | None = None,
    attention_chunk_size: int | None = None,
) -> LaunchConfig:
    """Pick tiles from the step's Python-int shape facts (never from device tensors).

    Decode-like steps (every request's query fits one small block) use 16-row blocks, and when
    those leave the GPU's multiprocessors idle the KV range of each block is split over up to
    :data:`MAX_KV_SPLITS` programs whose partial results a second kernel combines. The split
    count only changes speed, never the result: each program derives its KV range from the
    request's actual ``seq_len``, so a CUDA graph captured with one ``max_seq_len`` replays
    correctly with others. With ``sliding_window`` a block reads at most about the window's
    positions, which bounds the useful split count instead of ``max_seq_len``. ``num_splits``
    forces a split count (tests). Heads wider than :data:`MAX_GROUPED_HEAD_DIM` (DeepSeek's
    576-wide latent) take 16 rows of 16-position tiles with 8 warps, a GQA group of more
    than 16 heads split over programs (``heads_per_program``), so one program's tiles fit
    the shared memory.
    """
    group = num_heads // num_kv_heads
    heads_per_program = None
    if head_dim > MAX_GROUPED_HEAD_DIM:
        # wide heads: 16 rows, 16-position tiles, the group split over programs if need be
        heads = _heads_per_program(group)
        heads_per_program = None if heads == group else heads
        block_m, block_q = WIDE_HEAD_ROWS, WIDE_HEAD_ROWS // heads
        decode_like = max_query_len <= block_q
        tile_n = 16
    else:
        rows = max(1, max_query_len) * group
        block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
        block_m = max(block_m, triton.next_power_of_2(group))
        block_q = block_m // group
        decode_like = max_query_len <= block_q
        tile_n = 32 if decode_like else 64
    if num_splits is None:
        num_splits = 1
        if decode_like and device.type == "cuda":
            # one query block per request, one program per head program
            programs = max(1, num_reqs) * num_heads // (heads_per_program or group)
            target = 2 * _multiprocessor_count(device)
            kv_len = max_seq_len
            if sliding_window is not None:  # + a tile: the window's start is not tile-aligned
                kv_len = min(kv_len, sliding_window + tile_n)
            if attention_chunk_size is not None:  # a row reads at most its chunk
                kv_len = min(kv_len, attention_chunk_size + tile_n)
            max_useful = max(1, math.ceil(kv_len / (tile_n * _MIN_TILES_PER_SPLIT)))
            num_splits = max(1, min(MAX_KV_SPLITS, math.ceil(target / programs), max_useful))
    elif not 1 <= num_splits <= MAX_KV_SPLITS:
        raise ValueError(f"num_splits must be in 1..{MAX_KV_SPLITS}; got {num_splits}")
    # (wide heads: a 16 x 1024 float32 accumulator is 128 registers a thread over 4 warps)
    wide = head_dim > MAX_GROUPED_HEAD_DIM
    num_warps = 4 if (block_m <= 32 or head_dim <= 64) and not wide else 8
    return LaunchConfig(
        block_m, block_q, tile_n, num_splits, num_warps, 2, heads_per_program=heads_per_program
    )


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    out: torch.Tensor,
    *,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    num_reqs: int,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    attend_limit: torch.Tensor | None = None,
    attention_chunk_size: int | None = None,
    num_splits: int | None = None,
    config: LaunchConfig | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    fuse_kv_write: bool = False,
    fuse_combine: bool = False,
) -> LaunchConfig:
    """Causal paged attention of a mixed prefill/decode batch into ``out``; returns the config.

    With ``key``, ``value`` and ``slot_mapping`` (all three or none) it first stores the
    step's K/V into ``kv_cache`` as :func:`write_kv_cache` does (same bits): by that kernel,
    or, with ``fuse_kv_write`` in a launch :func:`fused_kv_write_blocker` finds no reason
    against (a decode-only step: ``max_query_len == 1``), inside the attention kernel, one
    launch fewer. The fused write stores only the requests' tokens (``query_start_loc``):
    tokens past them must be padding (slot ``-1``), as in the engine's CUDA graphs.
    ``fuse_combine`` merges the KV splits' partial results inside the attention kernel (the
    last split of each query block to finish does it, with the combine kernel's arithmetic)
    instead of launching the combine kernel; it needs one counter of the stream's
    ``triton_ops.split_counters`` per (query block, head program), and launches the combine
    kernel where the grid has more. Neither changes the result.

    :param query: ``[T, num_heads, head_dim]`` (last dim contiguous)
    :param kv_cache: ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``, the query's
        dtype or an 8-bit one (:data:`FP8_KV_DTYPES`) holding ``k / k_scale``, ``v / v_scale``
    :param out: ``[T, num_heads, head_dim]``; rows of tokens outside the ``num_reqs``
        requests (padding) are unspecified afterwards
    :param query_start_loc: ``[>= num_reqs + 1]`` int32 cumulative query lengths
    :param seq_lens: ``[>= num_reqs]`` int32 context lengths including this step's tokens
    :param block_table: ``[>= num_reqs, max_blocks]`` int32 physical block ids
    :param max_query_len: bound on query lengths (picks tiles; any upper bound is correct)
    :param max_seq_len: bound on ``seq_lens`` (sizes the KV split; any value is correct)
    :param sliding_window: each query sees only the last ``sliding_window`` positions, its own
        included (``None``: all); KV tiles wholly before a query block's window are not read
    :param attention_chunk_size: chunked local attention: the query at position ``p`` sees
        only positions ``floor(p / C) * C .. p`` (``None``: off); tiles wholly before a query
        block's first chunk start are not read
    :param logits_soft_cap: scaled scores ``s`` become ``cap * tanh(s / cap)`` (``None``: off)
    :param sinks: ``[num_heads]`` attention-sink logits on the query's device (any float
        dtype, read as float32): head ``h``'s softmax denominator gains ``exp(sinks[h])``
        (``None``: off)
    :param attend_limit: ``[>= T]`` int32 on the query's device, the last context position
        each token may attend to (``AttentionMetadata.attend_limit``; ``None``: its own)
    :param num_splits: force the KV split count (tests); ``None`` chooses
    :param k_scale: an 8-bit cache's K dequantization scale (ignored for other caches)
    :param v_scale: the same for V
    :param key: ``[T, num_kv_heads, head_dim]``, this step's keys (one row per query token;
        last dim contiguous, or copied)
    :param value: the same shape, this step's values
    :param slot_mapping: ``[>= T]`` the tokens' cache slots, ``-1`` for padding
    :param fuse_kv_write: write ``key``/``value`` inside the attention kernel where possible
    :param fuse_combine: merge the KV splits inside the attention kernel where possible
    :param config: launch with these tiles instead of :func:`choose_launch_config`'s (tuning
        sweeps; any valid config gives the same result): ``block_m`` a power of two and a
        multiple of the heads per program (``heads_per_program``, a divisor of the GQA group;
        unset: the group) with ``block_q == block_m // heads``, ``tile_n`` a power of two
        >= 16, ``num_splits`` in 1..:data:`MAX_KV_SPLITS`
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if attention_chunk_size is not None and attention_chunk_size < 1:
        raise ValueError(f"attention_chunk_size must be >= 1 or None, got {attention_chunk_size}")
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise ValueError(f"logits_soft_cap must be > 0 or None, got {logits_soft_cap}")
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
            f"({num_kv_heads}) of the cache"
        )
    _check_cache(kv_cache, num_kv_heads, head_dim)
    if sinks is not None and (
        tuple(sinks.shape) != (num_heads,)
        or sinks.device != query.device
        or not sinks.dtype.is_floating_point
    ):
        raise ValueError(
            f"sinks must be a float [{num_heads}] tensor on {query.device}; got "
            f"{sinks.dtype} {tuple(sinks.shape)} on {sinks.device}"
        )
    if attend_limit is not None and (
        attend_limit.dtype != torch.int32
        or attend_limit.device != query.device
        or attend_limit.dim() != 1
        or attend_limit.shape[0] < num_tokens
    ):
        raise ValueError(
            f"attend_limit must be an int32 [>= {num_tokens}] tensor on {query.device}; got "
            f"{attend_limit.dtype} {tuple(attend_limit.shape)} on {attend_limit.device}"
        )
    kv_fp8 = kv_cache.dtype in FP8_KV_DTYPES
    if kv_cache.dtype != query.dtype and not kv_fp8:
        raise ValueError(
            f"kv_cache dtype {kv_cache.dtype} != query dtype {query.dtype} (and not one of "
            f"the 8-bit cache dtypes {', '.join(map(str, FP8_KV_DTYPES))})"
        )
    if not kv_fp8:
        k_scale = v_scale = 1.0  # (a 16/32-bit cache holds K/V as they are)
    if out.shape != query.shape or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(query.shape)} with a contiguous last dim")
    new_kv = (key is not None, value is not None, slot_mapping is not None)
    if any(new_kv) and not all(new_kv):
        raise ValueError("key, value and slot_mapping go together (all three or none)")
    if key is not None and value is not None and slot_mapping is not None:
        kv_shape = (num_tokens, num_kv_heads, head_dim)
        if key.shape != kv_shape or value.shape != kv_shape:
            raise ValueError(
                f"key and value must be {kv_shape}; got {tuple(key.shape)} and {tuple(value.shape)}"
            )
        if slot_mapping.dim() != 1 or slot_mapping.shape[0] < num_tokens:
            raise ValueError(
                f"slot_mapping must have >= {num_tokens} entries; got {tuple(slot_mapping.shape)}"
            )
    if config is None:
        config = choose_launch_config(
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            num_tokens=num_tokens,
            num_reqs=num_reqs,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            device=query.device,
            num_splits=num_splits,
            sliding_window=sliding_window,
            attention_chunk_size=attention_chunk_size,
        )
    else:
        _check_config(config, num_heads // num_kv_heads)
    group = num_heads // num_kv_heads
    heads_per_program = config.heads_of(group)
    fused_write = (
        key is not None
        and fuse_kv_write
        and num_tokens > 0
        and num_reqs > 0
        and fused_kv_write_blocker(
            group=group,
            heads_per_program=heads_per_program,
            max_query_len=max_query_len,
            kv_cache=kv_cache,
        )
        is None
    )
    if key is not None and value is not None and slot_mapping is not None and not fused_write:
        write_kv_cache(key, value, kv_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    if num_tokens == 0 or num_reqs == 0:
        return config
    query = _last_dim_contiguous(query)
    kernel = check_launchable(_paged_attention_kernel, query)
    dim_pad = max(16, triton.next_power_of_2(head_dim))
    splits = config.num_splits
    if splits > 1:
        f32 = dict(dtype=torch.float32, device=query.device)
        part_acc = torch.empty(num_tokens, num_heads, splits, dim_pad, **f32)
        part_max = torch.empty(num_tokens, num_heads, splits, **f32)
        part_sum = torch.empty(num_tokens, num_heads, splits, **f32)
    else:  # unused by the kernel; any tensor of the right device will do
        part_acc = part_max = part_sum = out
    # Decode-like steps (each request's query fits one block) get one program per request and
    # need no search for it; otherwise query blocks are numbered across requests (see the kernel).
    one_block_per_req = max_query_len <= config.block_q
    num_q_blocks = num_reqs if one_block_per_req else num_tokens // config.block_q + num_reqs
    grid = (num_q_blocks, num_heads // heads_per_program, splits)
    # one ticket counter per (query block, head program); a grid with more merges in a
    # second kernel
    fused_combine = fuse_combine and splits > 1 and grid[0] * grid[1] <= NUM_SPLIT_COUNTERS
    counters = split_counters(query.device) if fused_combine else seq_lens  # (else unused)
    if fused_write:
        assert key is not None and value is not None and slot_mapping is not None
        key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
        new_key, new_value, slots = key, value, slot_mapping
    else:  # unused by the kernel; tensors of the right device and types will do
        new_key, new_value, slots = query, query, seq_lens
    # unused by the kernel without the option (constexpr-gated); 0 and 1.0 keep the types fixed
    cap = logits_soft_cap or 1.0
    scale = scale * k_scale  # q . (k_scale * stored k) = k_scale * (q . stored k)
    kernel[grid](
        query,
        kv_cache[:, 0],
        kv_cache[:, 1],
        out,
        part_acc,
        part_max,
        part_sum,
        block_table,
        seq_lens,
        query_start_loc,
        sinks if sinks is not None else out,  # unused without HAS_SINKS
        attend_limit if attend_limit is not None else seq_lens,  # unused without HAS_LIMIT
        new_key,
        new_value,
        slots,
        counters,
        num_reqs,
        scale * _LOG2E,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_table.stride(0),
        splits,
        sliding_window or 0,
        attention_chunk_size or 1,
        2.0 * scale * _LOG2E / cap,
        cap * _LOG2E,
        float(k_scale),
        float(v_scale),
        new_key.stride(0) if fused_write else 0,
        new_key.stride(1) if fused_write else 0,
        new_value.stride(0) if fused_write else 0,
        new_value.stride(1) if fused_write else 0,
        NUM_HEADS=num_heads,
        GROUP=group,
        HEADS_PER_PROGRAM=heads_per_program,
        HEAD_DIM=head_dim,
        DIM_PAD=dim_pad,
        BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_Q=config.block_q,
        BLOCK_M=config.block_m,
        TILE_N=config.tile_n,
        SPLIT_KV=splits > 1,
        DOT_FP32=_dot_in_fp32(query),
        ONE_BLOCK_PER_REQ=one_block_per_req,
        SLIDING_WINDOW=sliding_window is not None,
        SOFT_CAP=logits_soft_cap is not None,
        HAS_SINKS=sinks is not None,
        HAS_LIMIT=attend_limit is not None,
        CHUNKED=attention_chunk_size is not None,
        FUSED_WRITE=fused_write,
        FUSED_COMBINE=fused_combine,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if splits > 1 and not fused_combine:
        combine = check_launchable(_combine_kernel, query)
        combine[(num_tokens, num_heads)](
            out,
            part_acc,
            part_max,
            part_sum,
            query_start_loc,
            num_reqs,
            splits,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            DIM_PAD=dim_pad,
            SPLITS_PAD=_SPLITS_PAD,
            num_warps=4,
        )
    return config


def fused_kv_write_blocker(
    *, group: int, heads_per_program: int, max_query_len: int, kv_cache: torch.Tensor
) -> str | None:
    """Why a launch cannot write the step's K/V inside the attention kernel (``None``: it can).

    The fused write is safe when exactly one program reads back each position it writes
    before anyone else may: every request has one query token (``max_query_len == 1``, so
    the token is the last position of its context and only the program of the split holding
    the last tile reads it), one head program covers a kv head's whole query group
    (``heads_per_program == group``; DeepSeek's wide latent heads spread a group over
    programs, which would read the slot while another writes it), and the cache's V plane is
    not its K plane (MLA's aliased planes, ``kv_cache.stride(1) == 0``: K and V of the
    same slot would be two writers' stores to one address).
    """
    if max_query_len != 1:
        return f"not a decode-only step (max_query_len {max_query_len})"
    if heads_per_program != group:
        return f"a kv head's {group} query heads are spread over programs of {heads_per_program}"
    if kv_cache.stride(1) == 0:
        return "the cache's V plane aliases its K plane"
    return None


def _check_config(config: LaunchConfig, group: int) -> None:
    def power_of_two(n: int) -> bool:
        return n >= 1 and n & (n - 1) == 0

    problems = []
    heads = config.heads_of(group)
    if heads < 1 or group % heads:
        problems.append(f"heads_per_program {heads} must divide the GQA group {group}")
        heads = group
    if not power_of_two(config.block_m) or config.block_m < 16 or config.block_m % heads:
        problems.append(
            f"block_m {config.block_m} must be a power of two >= 16 and a multiple of "
            f"the heads per program {heads} (GQA group {group})"
        )
    if config.block_q != config.block_m // heads:
        what = "group" if heads == group else "heads_per_program"
        problems.append(f"block_q must be block_m // {what} = {config.block_m // heads}")
    if not power_of_two(config.tile_n) or config.tile_n < 16:
        problems.append(f"tile_n {config.tile_n} must be a power of two >= 16")
    if not 1 <= config.num_splits <= MAX_KV_SPLITS:
        problems.append(f"num_splits {config.num_splits} must be in 1..{MAX_KV_SPLITS}")
    if config.num_warps < 1 or config.num_stages < 1:
        problems.append("num_warps and num_stages must be >= 1")
    if problems:
        raise ValueError(f"invalid launch config {config}: " + "; ".join(problems))


def _dot_in_fp32(query: torch.Tensor) -> bool:
    """Whether the kernel should upcast ``tl.dot`` operands to float32.

    float32 inputs: yes, with IEEE precision (no TF32 rounding). 16-bit inputs compiled: no,
    the tensor cores take them natively. Triton's interpreter computes bfloat16 dots on raw
    bits, so under it bfloat16 is upcast (float16 is exact in the interpreter and is not).
    """
    if query.dtype == torch.float32:
        return True
    return is_interpreted(_paged_attention_kernel) and query.dtype == torch.bfloat16


def _check_cache(kv_cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError(
            "kv_cache must be [num_blocks, 2, block_size, num_kv_heads, head_dim]; got "
            f"{tuple(kv_cache.shape)}"
        )
    if kv_cache.shape[3] != num_kv_heads or kv_cache.shape[4] != head_dim:
        raise ValueError(
            f"kv_cache holds {kv_cache.shape[3]} kv heads of dim {kv_cache.shape[4]}; "
            f"expected {num_kv_heads} of dim {head_dim}"
        )
    if kv_cache.stride(4) != 1:
        raise ValueError("kv_cache must be contiguous in its last (head_dim) dimension")


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()
