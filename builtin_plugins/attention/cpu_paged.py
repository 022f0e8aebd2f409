"""``cpu_paged``: paged attention tuned for the CPU (the CPU platform's default backend).

Same contract as the reference ``torch_paged``, and the same results within the dtype's
tolerance (the bfloat16 kernels round softmax weights to bfloat16 before p.v); faster
because

- everything that depends only on the step's metadata (which cache rows each request reads
  and writes, masks, per-row block tables) is computed once per step and reused by every
  layer;
- with the compiled kernels (``platforms/cpu_kernels``), a layer's new K/V rows go into the
  cache in one ``chassis_cpu::write_kv`` call, and every decode is one row of a single
  ``chassis_cpu::decode_attention`` call, which reads K/V in place through the block table;
- prefill chunks go to one ``chassis_cpu::prefill_attention`` call (16 query rows share
  each K/V load) where it runs (bf16 on AVX512-BF16): a typical step makes one or two
  attention calls per layer. Elsewhere, short chunks (context up to
  :data:`KERNEL_MAX_PREFILL_CONTEXT`) are rows of the decode call, and longer ones run
  SDPA's tiled CPU kernel per request, on the new K/V directly when the chunk is the whole
  context (nothing cached to gather);
- without the kernels (``CHASSIS_CPU_KERNELS=0``, no compiler) decodes are one SDPA call over
  whole gathered blocks, and every prefill chunk goes to SDPA.

A sliding window and a logit soft cap (``sliding_window``, ``logits_soft_cap``) run on every
path: the compiled kernels take both as arguments (a row's loop starts at its window, so a
windowed layer reads about the window, not the context, and the cap is a vectorized tanh on
the scores); the SDPA paths add the window to their masks, over only the K/V rows a chunk's
window reaches, and with a cap, which SDPA cannot apply, compute
``softmax(cap * tanh(s / cap)) . v`` explicitly in float32. The plan stays shared by layers
whatever their options: what depends on the window (the SDPA masks) is memoized in it keyed
by the window, so layers with different windows (Gemma's local and global layers) share a
step's plan without seeing each other's masks. A layer with neither option does exactly
what it did before they existed. Block-table entries before a window may be the null block
(the KV cache manager released those blocks when every layer has a window): the kernels
start past them, the SDPA paths mask them (the null block holds zeros).

Chunked local attention (``attention_chunk_size``, Llama 4's RoPE layers) takes a path of its
own, in torch: the compiled kernels know no chunk. A step whose every context fits in one chunk
(``max_seq_len <= attention_chunk_size``: no query has a chunk start past 0) is plain causal
attention and takes the paths above, kernels included. Otherwise each request's queries are cut
at chunk boundaries, and each piece's keys, the rows from its chunk's start to its last query
(the request's context end under an ``attend_limit``), are gathered once per step (memoized in
the metadata, shared by every chunked layer) and attended with SDPA under a mask that starts
each query at its own chunk (the window, a cap and sinks, if a layer has them too, as on the
SDPA paths). A piece reads at most one chunk of rows, so a long prefill costs
``O(query * chunk)``, not ``O(query * context)``.

Attention sinks (``sinks``, gpt-oss) run on every path too: the compiled kernels start each
row's online softmax with the head's sink logit as its running maximum and a denominator of
1 (a position of weight ``exp(sink)`` and no value), and the SDPA paths, which cannot apply
them, compute the softmax explicitly in float32 with the sink in the denominator.

A step with ``attend_limit`` (bidirectional image blocks: ``supports_attend_limit``) sends
every prefill chunk to the SDPA paths, whose masks then bound each row by its limit instead of
its position (the window still counts back from the position); its decodes, whose limit is
their own position, stay on the kernels. Steps without one are planned as before.

The cache is addressed through its strides (:func:`cache_rows`, the kernels' ``stride(0)`` /
``stride(1)``), never as one contiguous block of K and V planes, so a cache whose V plane
aliases its K plane (``stride(1) == 0``: ``core.attention.alias_kv_planes``, DeepSeek's
latent cache) works on every path (``supports_aliased_kv_planes``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from chassis.core.attention import AttentionBackend, AttentionMetadata
from chassis.platforms import cpu_kernels

_PLAN_KEY = "cpu_paged.plan"
#: without the tiled prefill kernel (see ``prefill_attention_supported``), prefill chunks over
#: at most this many positions are attended row by row (each row re-reads its context from
#: cache); longer ones go to SDPA's tiled kernel
KERNEL_MAX_PREFILL_CONTEXT = 512


@dataclass
class _Prefill:
    token_slice: slice
    #: rows of the :func:`cache_rows` view holding the request's context K (V rows are + the
    #: V plane's offset); None when the chunk is the whole context (attend over the new K/V
    #: directly)
    k_rows: torch.Tensor | None
    #: [query_len, seq_len] bool, True = may attend; None when causal over the chunk itself
    mask: torch.Tensor | None
    seq_len: int = 0
    #: layers with a window or a cap, built on first use per window (None: causal only):
    #: (first context position the chunk's window reaches, [query_len, seq_len - that] mask)
    masks: dict[int | None, tuple[int, torch.Tensor]] = field(default_factory=dict)
    #: [query_len] int64, the last position each row may attend to (``attend_limit``);
    #: None: its own (causal)
    limits: torch.Tensor | None = None

    def window_mask(self, window: int | None, device: torch.device) -> tuple[int, torch.Tensor]:
        """``(k_lo, mask)``: the chunk's rows attend to context positions ``k_lo ..`` where
        ``mask [query_len, seq_len - k_lo]`` is True (causal, and within ``window``)."""
        cached = self.masks.get(window)
        if cached is None:
            query_len = self.token_slice.stop - self.token_slice.start
            prefix = self.seq_len - query_len
            k_lo = 0 if window is None else max(0, prefix - window + 1)
            q_pos = torch.arange(prefix, self.seq_len, device=device)[:, None]
            k_pos = torch.arange(k_lo, self.seq_len, device=device)[None, :]
            mask = k_pos <= (q_pos if self.limits is None else self.limits[:, None])
            if window is not None:
                mask &= k_pos > q_pos - window
            cached = self.masks[window] = (k_lo, mask)
        return cached


@dataclass
class _Rows:
    """Query rows attended one by one over their own context: every decode, and with the
    compiled kernel every token of a short prefill chunk (row j of a chunk over
    ``seq_len`` positions sees the first ``seq_len - query_len + j + 1``)."""

    #: token index of each row; None when the rows are tokens 0..n-1 in order
    tokens: torch.Tensor | None
    count: int
    #: [n, max_blocks] int32 and [n] int32: each row's blocks and context length
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    #: SDPA fallback only (no compiled kernels; then the rows are decodes), built on first use:
    #: the block ids each row reads, flattened (padding entries 0), and the [n, 1, 1, L] bool
    #: mask (True where a decode may attend)
    blocks: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    #: the same mask for layers with a sliding window, per window
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class _Tiled:
    """Prefill chunks for ``chassis_cpu::prefill_attention`` (int32 tensors): chunk i's
    blocks, context length, first token in the step and query length."""

    block_table: torch.Tensor
    seq_lens: torch.Tensor
    token_starts: torch.Tensor
    query_lens: torch.Tensor


@dataclass
class _Plan:
    #: int64 cache slot of each of this step's tokens (-1: padding, not written)
    slots: torch.Tensor
    #: :func:`cache_rows` rows where this step's K go (V: + the V plane's offset), only
    #: valid tokens
    write_k_rows: torch.Tensor
    write_tokens: torch.Tensor | None
    rows: _Rows | None
    tiled: _Tiled | None
    #: prefill chunks for SDPA: all of them without the compiled kernels, the long ones with
    #: the row kernel, none with the tiled prefill kernel
    prefills: list[_Prefill]
    #: the whole output is the rows' output (no SDPA prefills, no padding)
    rows_only: bool
    #: the cache layout the rows are of (:func:`cache_rows`)
    rows_per_block: int


def cache_rows(kv_cache: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """``(rows, rows_per_block, v_offset)``: ``kv_cache`` ``[num_blocks, 2, block_size, KV,
    D]`` seen through its strides as rows of ``[KV, D]`` (a view, no copy): K of slot ``s``
    in block ``b`` is row ``b * rows_per_block + s``, its V ``v_offset`` rows later. A
    contiguous cache has ``rows_per_block = 2 * block_size``, ``v_offset = block_size``; one
    whose V plane aliases its K plane ``block_size`` and 0. Each position's ``[KV, D]`` must
    be dense and the planes and blocks whole positions apart (``ValueError`` otherwise)."""
    num_blocks, _, block_size, kv_heads, dim = kv_cache.shape
    s_block, s_plane, s_pos, s_head, s_dim = kv_cache.stride()
    if (s_dim, s_head, s_pos) != (1, dim, kv_heads * dim) or s_block % s_pos or s_plane % s_pos:
        raise ValueError(
            "cpu_paged needs each cache position's [kv_heads, head_dim] dense and the planes "
            f"and blocks whole positions apart; got strides {kv_cache.stride()} for shape "
            f"{tuple(kv_cache.shape)}"
        )
    rows_per_block, v_offset = s_block // s_pos, s_plane // s_pos
    num_rows = (num_blocks - 1) * rows_per_block + v_offset + block_size
    return kv_cache.as_strided((num_rows, kv_heads, dim), (s_pos, dim, 1)), rows_per_block, v_offset


def _context_rows(
    block_table_row: torch.Tensor, length: int, block_size: int, rows_per_block: int
) -> torch.Tensor:
    """Rows of the :func:`cache_rows` view holding the K of positions ``0 .. length - 1``."""
    pos = torch.arange(length, device=block_table_row.device)
    blocks = block_table_row[pos // block_size].long()
    return blocks * rows_per_block + pos % block_size


def _make_plan(
    metadata: AttentionMetadata,
    block_size: int,
    rows_per_block: int,
    num_rows: int,
    kernel_max_context: int,
    tile_prefills: bool = False,
) -> _Plan:
    """Every prefill chunk goes to the tiled prefill kernel when ``tile_prefills``; otherwise
    those whose context is at most ``kernel_max_context`` become rows of the row kernel, with
    the decodes (0: no kernels, decodes take the SDPA row path), and longer ones go to SDPA.
    With ``metadata.attend_limit`` every prefill chunk goes to SDPA, its masks bounded by the
    limits. Cache rows are :func:`cache_rows`' of a cache with ``rows_per_block``."""
    device = metadata.slot_mapping.device
    num_tokens = metadata.num_actual_tokens
    attend_limit = metadata.attend_limit
    if attend_limit is not None:  # (the kernels bound rows by their positions)
        tile_prefills, kernel_max_context = False, 0
    all_slots = slots = metadata.slot_mapping[:num_tokens].long().contiguous()
    valid = slots >= 0
    all_valid = bool(valid.all())
    write_tokens = None if all_valid else torch.nonzero(valid).squeeze(1)
    if not all_valid:
        slots = slots[valid]
    write_k_rows = (slots // block_size) * rows_per_block + slots % block_size

    starts = metadata.query_start_loc_cpu.tolist()
    seq_lens = metadata.seq_lens_cpu.tolist()
    # one entry per query row attended on its own: (request, token, context length)
    row_req: list[np.ndarray] = []
    row_tok: list[np.ndarray] = []
    row_len: list[np.ndarray] = []
    prefills: list[_Prefill] = []
    tiled: list[tuple[int, int, int, int]] = []  # (request, first token, query len, seq len)
    for i in range(metadata.num_reqs):
        query_len, seq_len = starts[i + 1] - starts[i], seq_lens[i]
        if query_len == 0:
            continue
        if query_len > 1 and tile_prefills:
            tiled.append((i, starts[i], query_len, seq_len))
            continue
        if query_len == 1 or seq_len <= kernel_max_context:
            # token j of the chunk sees positions 0 .. seq_len - query_len + j
            row_req.append(np.full(query_len, i))
            row_tok.append(np.arange(starts[i], starts[i + 1]))
            row_len.append(np.arange(seq_len - query_len + 1, seq_len + 1))
            continue
        mask = k_rows = limits = None
        if attend_limit is not None:
            limits = attend_limit[starts[i] : starts[i + 1]].to(device, torch.long)
        if query_len != seq_len or limits is not None:
            q_pos = torch.arange(seq_len - query_len, seq_len, device=device)
            last = q_pos if limits is None else limits
            mask = torch.arange(seq_len, device=device)[None, :] <= last[:, None]
        if query_len != seq_len:
            k_rows = _context_rows(metadata.block_table[i], seq_len, block_size, rows_per_block)
        prefills.append(
            _Prefill(slice(starts[i], starts[i + 1]), k_rows, mask, seq_len, limits=limits)
        )
    rows_plan = None
    if row_req:
        reqs, toks, lens = (np.concatenate(x) for x in (row_req, row_tok, row_len))
        in_order = bool((toks == np.arange(len(toks))).all())
        num_blocks = -(-int(lens.max()) // block_size)
        index = torch.from_numpy(reqs).to(device)
        rows_plan = _Rows(
            tokens=None if in_order else torch.from_numpy(toks).to(device),
            count=len(toks),
            block_table=metadata.block_table[index, :num_blocks].to(torch.int32).contiguous(),
            seq_lens=torch.from_numpy(lens.astype(np.int32)).to(device),
        )
    tiled_plan = None
    if tiled:
        reqs, first, q_lens, lens = (list(x) for x in zip(*tiled, strict=True))
        num_blocks = -(-max(lens) // block_size)
        index = torch.tensor(reqs, device=device)

        def i32(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=device)

        tiled_plan = _Tiled(
            block_table=metadata.block_table[index, :num_blocks].to(torch.int32).contiguous(),
            seq_lens=i32(lens),
            token_starts=i32(first),
            query_lens=i32(q_lens),
        )
    rows_only = not prefills and tiled_plan is None and rows_plan is not None
    rows_only = rows_only and rows_plan.tokens is None and rows_plan.count == num_rows
    return _Plan(
        all_slots,
        write_k_rows,
        write_tokens,
        rows_plan,
        tiled_plan,
        prefills,
        rows_only,
        rows_per_block,
    )


class CpuPagedAttention(AttentionBackend):
    """Paged attention for the CPU: per-step plans shared by all layers, one decode call."""

    #: on every path (see the module docstring)
    supports_sliding_window = True
    #: on the torch path of the module docstring
    supports_chunked_attention = True
    supports_logits_soft_cap = True
    supports_attention_sinks = True
    #: every path addresses the cache through its strides (the module docstring)
    supports_aliased_kv_planes = True
    #: through the SDPA paths (the module docstring)
    supports_attend_limit = True

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int,
        scale: float,
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        sinks: torch.Tensor | None = None,
        attention_chunk_size: int | None = None,
    ) -> None:
        super().__init__(
            num_heads,
            head_dim,
            num_kv_heads,
            scale,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
            sinks=sinks,
            attention_chunk_size=attention_chunk_size,
        )
        #: the compiled ops (``torch.ops.chassis_cpu``) or None for the torch fallback
        self.kernels: Any | None = cpu_kernels.load()
        #: the kernels' trailing ``(window, cap[, sinks])`` arguments (0 / absent: off); empty
        #: with no option, so that every call is exactly the one made before options existed
        self._kernel_options: tuple[Any, ...] = ()
        if sliding_window is not None or logits_soft_cap is not None or sinks is not None:
            self._kernel_options = (sliding_window or 0, logits_soft_cap or 0.0)
        if sinks is not None:
            # the parameter itself: the kernels read its values (any float dtype) at each call
            self._kernel_options += (sinks,)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        block_size = kv_cache.shape[2]
        # [num_blocks, 2, block_size, KV, D] -> rows of [KV, D]; K of slot s in block b is row
        # b * rows_per_block + s, its V is v_offset rows later (0: V aliases K)
        flat, rows_per_block, v_offset = cache_rows(kv_cache)
        # one plan per step and cache layout (every layer of a model has the same layout;
        # a cache of another one on the same metadata gets a plan of its own beside it)
        plan_key = _PLAN_KEY
        plan = metadata.derived.get(plan_key)
        if plan is not None and plan.rows_per_block != rows_per_block:
            plan_key = f"{_PLAN_KEY}.{rows_per_block}"
            plan = metadata.derived.get(plan_key)
        if plan is None:
            max_context = KERNEL_MAX_PREFILL_CONTEXT if self.kernels is not None else 0
            tile = self._tiles_prefills(query.dtype, kv_cache.dtype)
            plan = _make_plan(
                metadata, block_size, rows_per_block, query.shape[0], max_context, tile
            )
            metadata.derived[plan_key] = plan
        if self.kernels is not None and key.dtype == value.dtype == kv_cache.dtype:
            self.kernels.write_kv(key, value, kv_cache, plan.slots)
        else:
            num_tokens = metadata.num_actual_tokens
            new_k, new_v = key[:num_tokens], value[:num_tokens]
            if plan.write_tokens is not None:
                new_k, new_v = new_k[plan.write_tokens], new_v[plan.write_tokens]
            flat.index_copy_(0, plan.write_k_rows, new_k.to(flat.dtype))
            flat.index_copy_(0, plan.write_k_rows + v_offset, new_v.to(flat.dtype))
        chunk = self.attention_chunk_size
        if chunk is not None and metadata.max_seq_len > chunk:  # else no chunk starts past 0
            return self._chunked(query, flat, v_offset, metadata, block_size, rows_per_block)

        if plan.rows_only:
            assert plan.rows is not None
            return self._rows(query, kv_cache, plan.rows)
        output = torch.empty_like(query)
        if plan.tiled is not None:
            assert self.kernels is not None
            t = plan.tiled
            self.kernels.prefill_attention(
                query,
                kv_cache,
                t.block_table,
                t.seq_lens,
                t.token_starts,
                t.query_lens,
                self.scale,
                output,
                *self._kernel_options,
            )
        if self._kernel_options:
            self._prefills_with_options(query, key, value, flat, v_offset, plan, output)
        else:
            group = self.num_heads // self.num_kv_heads
            for prefill in plan.prefills:
                q = query[prefill.token_slice].transpose(0, 1)[None]  # [1, H, Q, D]

                def heads(kv: torch.Tensor) -> torch.Tensor:  # [L, KV, D] -> [1, H, L, D]
                    # Heads repeated, 4-D: what SDPA's fused CPU kernel takes (with enable_gqa or
                    # 3-D inputs it falls back to the unfused math path, ~2x slower).
                    return kv.to(query.dtype).repeat_interleave(group, dim=1).transpose(0, 1)[None]

                if prefill.k_rows is None:
                    k, v = key[prefill.token_slice], value[prefill.token_slice]
                else:
                    k = flat.index_select(0, prefill.k_rows)
                    v = flat.index_select(0, prefill.k_rows + v_offset)
                out = F.scaled_dot_product_attention(
                    q,
                    heads(k),
                    heads(v),
                    attn_mask=prefill.mask,
                    is_causal=prefill.mask is None,
                    scale=self.scale,
                )
                output[prefill.token_slice] = out[0].transpose(0, 1)
        if plan.rows is not None:
            tokens = plan.rows.tokens
            if tokens is None:
                output[: plan.rows.count] = self._rows(query, kv_cache, plan.rows)
            else:
                output[tokens] = self._rows(query, kv_cache, plan.rows)
        return output

    def _chunked(
        self,
        query: torch.Tensor,
        flat: torch.Tensor,
        v_offset: int,
        metadata: AttentionMetadata,
        block_size: int,
        rows_per_block: int,
    ) -> torch.Tensor:
        """Chunked local attention of every request (the module docstring), ``[T, H, D]``."""
        chunk = self.attention_chunk_size
        assert chunk is not None
        window = self.sliding_window
        key = f"cpu_paged.chunked.{chunk}.{window}.{rows_per_block}"
        parts = metadata.derived.get(key)
        if parts is None:
            parts = metadata.derived[key] = _chunked_parts(
                metadata, chunk, window, block_size, rows_per_block
            )
        output = torch.zeros_like(query)
        group = self.num_heads // self.num_kv_heads
        sink = None if self.sinks is None else self.sinks.view(-1, 1, 1)  # [H, 1, 1]
        for token_slice, rows, mask in parts:
            q = query[token_slice].transpose(0, 1)  # [H, Q, D]
            # [L, KV, D] -> [H, L, D]
            k = flat.index_select(0, rows).to(query.dtype)
            v = flat.index_select(0, rows + v_offset).to(query.dtype)
            k = k.repeat_interleave(group, dim=1).transpose(0, 1)
            v = v.repeat_interleave(group, dim=1).transpose(0, 1)
            if self.logits_soft_cap is None and sink is None:
                out = F.scaled_dot_product_attention(
                    q[None], k[None], v[None], attn_mask=mask, scale=self.scale
                )[0]
            else:
                out = _explicit_attention(q, k, v, mask, self.scale, self.logits_soft_cap, sink)
            output[token_slice] = out.transpose(0, 1)
        return output

    def _tiles_prefills(self, dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
        """Whether prefill chunks go to ``chassis_cpu::prefill_attention``."""
        if self.kernels is None or cache_dtype != dtype:
            return False
        group = self.num_heads // self.num_kv_heads
        return bool(self.kernels.prefill_attention_supported(dtype, self.head_dim, group))

    def _rows(self, query: torch.Tensor, kv_cache: torch.Tensor, plan: _Rows) -> torch.Tensor:
        """The rows' attention, ``[n, H, D]``, in one call."""
        q = query[: plan.count] if plan.tokens is None else query[plan.tokens]
        if self.kernels is not None and kv_cache.dtype == query.dtype:
            return self.kernels.decode_attention(
                q, kv_cache, plan.block_table, plan.seq_lens, self.scale, *self._kernel_options
            )
        return self._decode_sdpa(q, kv_cache, plan)

    def _prefills_with_options(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        flat: torch.Tensor,
        v_offset: int,
        plan: _Plan,
        output: torch.Tensor,
    ) -> None:
        """The SDPA prefill chunks of a layer with a window, a cap or sinks: each over the
        context rows its window reaches, with the window in the mask; capped ones and ones
        with sinks explicitly."""
        sink = None if self.sinks is None else self.sinks.view(-1, 1, 1)  # [H, 1, 1]
        group = self.num_heads // self.num_kv_heads
        for prefill in plan.prefills:
            k_lo, mask = prefill.window_mask(self.sliding_window, query.device)
            if prefill.k_rows is None:
                k, v = key[prefill.token_slice][k_lo:], value[prefill.token_slice][k_lo:]
            else:
                rows = prefill.k_rows[k_lo:]
                k, v = flat.index_select(0, rows), flat.index_select(0, rows + v_offset)
            q = query[prefill.token_slice].transpose(0, 1)  # [H, Q, D]
            # [L, KV, D] -> [H, L, D]
            k = k.to(query.dtype).repeat_interleave(group, dim=1).transpose(0, 1)
            v = v.to(query.dtype).repeat_interleave(group, dim=1).transpose(0, 1)
            if self.logits_soft_cap is None and sink is None:
                out = F.scaled_dot_product_attention(
                    q[None], k[None], v[None], attn_mask=mask, scale=self.scale
                )[0]
            else:
                out = _explicit_attention(q, k, v, mask, self.scale, self.logits_soft_cap, sink)
            output[prefill.token_slice] = out.transpose(0, 1)

    def _decode_sdpa(self, q: torch.Tensor, kv_cache: torch.Tensor, plan: _Rows) -> torch.Tensor:
        """Torch fallback: whole context blocks gathered, the GQA group as the query length.

        One ``index_select`` each from the K plane ``kv_cache[:, 0]`` and the V plane
        ``kv_cache[:, 1]`` (``[num_blocks, block_size, KV, D]`` views) leaves them contiguous
        as ``[n, L, KV, D]``; the query heads of a group become the query *length* of a
        ``[n, KV, group, D]`` query, so SDPA's fused kernel runs once without repeating K/V
        heads (no causal mask: every row sees its whole context).
        """
        batch, kv_heads, dim = plan.count, self.num_kv_heads, self.head_dim
        block_size = kv_cache.shape[2]
        if plan.blocks is None or plan.mask is None:
            num_blocks = plan.block_table.shape[1]
            lens = plan.seq_lens[:, None].long()
            used = torch.arange(num_blocks, device=q.device)[None, :] * block_size < lens
            # Blocks past a request's length are padding (their table entries arbitrary):
            # read block 0 there, masked out below.
            plan.blocks = torch.where(used, plan.block_table.long(), 0).reshape(-1)
            pos = torch.arange(num_blocks * block_size, device=q.device)
            plan.mask = (pos[None, :] < lens)[:, None, None, :]
        mask = plan.mask
        window = self.sliding_window
        if window is not None:
            mask = plan.window_masks.get(window)
            if mask is None:
                pos = torch.arange(plan.mask.shape[-1], device=q.device)
                lens = plan.seq_lens[:, None].long()
                in_window = (pos[None, :] >= lens - window)[:, None, None, :]
                mask = plan.window_masks[window] = plan.mask & in_window
        length = mask.shape[-1]
        blocks = plan.blocks

        def context(plane: torch.Tensor) -> torch.Tensor:  # -> [n, KV, L, D] (a strided view)
            gathered = plane.index_select(0, blocks).to(q.dtype)
            return gathered.view(batch, length, kv_heads, dim).transpose(1, 2)

        if self.logits_soft_cap is not None or self.sinks is not None:
            out = _explicit_attention(
                q.reshape(batch, kv_heads, -1, dim),
                context(kv_cache[:, 0]),
                context(kv_cache[:, 1]),
                mask,
                self.scale,
                self.logits_soft_cap,
                None if self.sinks is None else self.sinks.view(kv_heads, -1, 1),
            )
            return out.reshape(batch, self.num_heads, dim)
        out = F.scaled_dot_product_attention(
            q.reshape(batch, kv_heads, -1, dim),
            context(kv_cache[:, 0]),
            context(kv_cache[:, 1]),
            attn_mask=mask,
            scale=self.scale,
        )
        return out.reshape(batch, self.num_heads, dim)


def _chunked_parts(
    metadata: AttentionMetadata,
    chunk: int,
    window: int | None,
    block_size: int,
    rows_per_block: int,
) -> list[tuple[slice, torch.Tensor, torch.Tensor]]:
    """Per piece of a request's tokens this step that lie in one chunk: ``(its tokens, the
    cache rows of positions from that chunk's start to its last key, [Q, L] mask)``; the mask
    (True = may attend) bounds each query below by its chunk start (and its window) and above
    by its position (or its ``attend_limit``, when the piece's keys run to the context end)."""
    device = metadata.slot_mapping.device
    starts = metadata.query_start_loc_cpu.tolist()
    seq_lens = metadata.seq_lens_cpu.tolist()
    limits = metadata.attend_limit
    parts = []
    for i in range(metadata.num_reqs):
        query_len, seq_len = starts[i + 1] - starts[i], seq_lens[i]
        prefix = seq_len - query_len
        q_lo = prefix
        while q_lo < seq_len:  # no iteration for a request without tokens this step
            k_lo = q_lo // chunk * chunk
            q_hi = min(k_lo + chunk, seq_len)  # this chunk's queries: q_lo .. q_hi - 1
            first = starts[i] + q_lo - prefix
            tokens = slice(first, first + q_hi - q_lo)
            q_pos = torch.arange(q_lo, q_hi, device=device)[:, None]
            last = q_pos
            k_hi = q_hi
            if limits is not None:  # a limit may pass the piece's last position
                last = limits[tokens].to(device, torch.long)[:, None]
                k_hi = seq_len
            k_pos = torch.arange(k_lo, k_hi, device=device)
            blocks = metadata.block_table[i][k_pos // block_size].long()
            rows = blocks * rows_per_block + k_pos % block_size
            # every key is in the piece's chunk: only the upper bound (and a window) remain
            mask = k_pos[None, :] <= last
            if window is not None:
                mask &= k_pos[None, :] > q_pos - window
            parts.append((tokens, rows, mask))
            q_lo = q_hi
    return parts


#: float32 score elements per piece of :func:`_explicit_attention` (64 MiB)
_EXPLICIT_PIECE = 1 << 24


def _explicit_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    cap: float | None,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention with what SDPA cannot apply, in float32, returned in q's dtype: scores
    ``s = q.k * scale``, soft-capped to ``cap * tanh(s / cap)`` when ``cap`` is set, and a
    softmax whose denominator gains ``exp(sink)`` when ``sink`` is given.

    ``q [..., Q, D]``, ``k``/``v [..., L, D]`` (same leading dims), ``mask`` broadcastable to
    ``[..., Q, L]`` (True = may attend; every row sees at least one position), ``sink``
    broadcastable to ``[..., Q, 1]`` (the head's sink logit). Query rows go in pieces so the
    scores of a long chunk never take more than :data:`_EXPLICIT_PIECE` elements at once.
    """
    num_q, length = q.shape[-2], k.shape[-2]
    per_row = max(1, q[..., :1, :1].numel() * length)
    step = max(1, _EXPLICIT_PIECE // per_row)
    kt, vf = k.float().transpose(-1, -2), v.float()
    sink_f = None if sink is None else sink.float()
    pieces = []
    for lo in range(0, num_q, step):
        rows = q[..., lo : lo + step, :].float()
        piece_mask = mask if mask.shape[-2] == 1 else mask[..., lo : lo + step, :]
        if cap is None:
            scores = (rows @ kt) * scale
        else:
            scores = torch.tanh((rows @ kt) * (scale / cap)) * cap
        scores = scores.masked_fill(~piece_mask, float("-inf"))
        if sink_f is None:
            pieces.append(torch.softmax(scores, dim=-1) @ vf)
            continue
        piece_sink = sink_f if sink_f.shape[-2] == 1 else sink_f[..., lo : lo + step, :]
        top = torch.maximum(scores.amax(dim=-1, keepdim=True), piece_sink)
        weights = torch.exp(scores - top)
        denominator = weights.sum(dim=-1, keepdim=True) + torch.exp(piece_sink - top)
        pieces.append((weights @ vf) / denominator)
    out = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-2)
    return out.to(q.dtype)
