"""``cpu_paged``: paged attention tuned for the CPU (the CPU platform's default backend).

Same contract and results as the reference ``torch_paged``; faster because everything that
depends only on the step's metadata (which cache rows each request reads and writes, the
masks) is computed once per step and reused by every layer, the cache is written and read
with ``index_copy_``/``index_select`` on a flat view instead of advanced indexing, and
attention runs in the model dtype (SDPA accumulates in float32 internally).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from chassis.core.attention import AttentionBackend, AttentionMetadata

_PLAN_KEY = "cpu_paged.plan"
#: decode batches with at most this many context rows in total use the elementwise path
#: (measured on SmolLM2, 2 vCPUs: batch 1 step 32.9 -> 26.9 ms, batch 8 33.6 -> 40.8 ms)
_ELEMENTWISE_MAX_ROWS = 1024


@dataclass
class _Prefill:
    token_slice: slice
    #: rows of the flat K view holding the request's context (V rows are + block_size)
    k_rows: torch.Tensor
    #: [query_len, seq_len] bool, True = may attend; None when the chunk is the whole context
    mask: torch.Tensor | None


@dataclass
class _Plan:
    #: flat-view rows where this step's K (and V = + block_size) go, only valid tokens
    write_k_rows: torch.Tensor
    write_tokens: torch.Tensor | None
    decode_tokens: torch.Tensor | None
    #: [num_decodes * max_len] rows of the decodes' contexts
    decode_k_rows: torch.Tensor | None
    #: [num_decodes, 1, 1, max_len] float32: 0 where a decode may attend, -inf elsewhere
    decode_bias: torch.Tensor | None
    decode_max_len: int
    prefills: list[_Prefill]


def _context_rows(block_table_row: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """Rows of the flat ``[num_blocks * 2 * block_size, kv_heads, dim]`` view holding K."""
    pos = torch.arange(length, device=block_table_row.device)
    blocks = block_table_row[pos // block_size].long()
    return blocks * (2 * block_size) + pos % block_size


def _make_plan(metadata: AttentionMetadata, block_size: int) -> _Plan:
    device = metadata.slot_mapping.device
    num_tokens = metadata.num_actual_tokens
    slots = metadata.slot_mapping[:num_tokens].long()
    valid = slots >= 0
    all_valid = bool(valid.all())
    write_tokens = None if all_valid else torch.nonzero(valid).squeeze(1)
    if not all_valid:
        slots = slots[valid]
    write_k_rows = (slots // block_size) * (2 * block_size) + slots % block_size

    starts = metadata.query_start_loc_cpu.tolist()
    seq_lens = metadata.seq_lens_cpu.tolist()
    decodes: list[int] = []
    prefills: list[_Prefill] = []
    for i in range(metadata.num_reqs):
        query_len = starts[i + 1] - starts[i]
        if query_len == 1:
            decodes.append(i)
        elif query_len > 1:
            seq_len = seq_lens[i]
            mask = None
            if query_len != seq_len:
                q_pos = torch.arange(seq_len - query_len, seq_len, device=device)
                mask = torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]
            prefills.append(
                _Prefill(
                    slice(starts[i], starts[i + 1]),
                    _context_rows(metadata.block_table[i], seq_len, block_size),
                    mask,
                )
            )
    decode_tokens = decode_k_rows = decode_bias = None
    decode_max_len = 0
    if decodes:
        decode_tokens = torch.tensor([starts[i] for i in decodes], device=device)
        lens = torch.tensor([seq_lens[i] for i in decodes], device=device)
        decode_max_len = max(seq_lens[i] for i in decodes)
        pos = torch.arange(decode_max_len, device=device)
        valid_pos = pos[None, :] < lens[:, None]  # [B, L]
        table = metadata.block_table[decodes]
        blocks = table[:, (pos // block_size)].long()
        rows = blocks * (2 * block_size) + pos % block_size
        # Positions past a request's length point anywhere valid (row 0); they are masked.
        decode_k_rows = torch.where(valid_pos, rows, 0).reshape(-1)
        decode_bias = torch.zeros(valid_pos.shape, dtype=torch.float32, device=device)
        decode_bias = decode_bias.masked_fill(~valid_pos, float("-inf"))[:, None, None, :]
    return _Plan(
        write_k_rows,
        write_tokens,
        decode_tokens,
        decode_k_rows,
        decode_bias,
        decode_max_len,
        prefills,
    )


class CpuPagedAttention(AttentionBackend):
    """Paged attention for the CPU: per-step plans shared by all layers, flat-view gathers."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        block_size = kv_cache.shape[2]
        plan = metadata.derived.get(_PLAN_KEY)
        if plan is None:
            plan = metadata.derived[_PLAN_KEY] = _make_plan(metadata, block_size)
        # [num_blocks, 2, block_size, KV, D] -> rows of [KV, D]; K of slot s in block b is row
        # b * 2 * block_size + s, its V is block_size rows later.
        flat = kv_cache.view(-1, self.num_kv_heads, self.head_dim)
        num_tokens = metadata.num_actual_tokens
        new_k, new_v = key[:num_tokens], value[:num_tokens]
        if plan.write_tokens is not None:
            new_k, new_v = new_k[plan.write_tokens], new_v[plan.write_tokens]
        flat.index_copy_(0, plan.write_k_rows, new_k.to(flat.dtype))
        flat.index_copy_(0, plan.write_k_rows + block_size, new_v.to(flat.dtype))

        output = torch.empty_like(query)
        group = self.num_heads // self.num_kv_heads
        for prefill in plan.prefills:
            q = query[prefill.token_slice].transpose(0, 1)[None]  # [1, H, Q, D]

            def context(rows: torch.Tensor, dtype: torch.dtype = query.dtype) -> torch.Tensor:
                kv = flat.index_select(0, rows).to(dtype)  # [L, KV, D]
                # Heads repeated, 4-D: what SDPA's fused CPU kernel takes (with enable_gqa or
                # 3-D inputs it falls back to the unfused math path, ~2x slower).
                return kv.repeat_interleave(group, dim=1).transpose(0, 1)[None]

            out = F.scaled_dot_product_attention(
                q,
                context(prefill.k_rows),
                context(prefill.k_rows + block_size),
                attn_mask=prefill.mask,
                is_causal=prefill.mask is None,
                scale=self.scale,
            )
            output[prefill.token_slice] = out[0].transpose(0, 1)
        if plan.decode_tokens is not None:
            output[plan.decode_tokens] = self._decode(query, flat, plan, block_size)
        return output

    def _decode(
        self, query: torch.Tensor, flat: torch.Tensor, plan: _Plan, block_size: int
    ) -> torch.Tensor:
        """All single-token queries at once, as two batched matmuls around a float32 softmax.

        For one query row, SDPA's CPU kernel costs far more than the arithmetic; plain
        matmuls over ``[decodes, kv_heads]`` batches (query heads of a group stacked as rows)
        do the same work as HF's eager attention.
        """
        assert plan.decode_tokens is not None and plan.decode_k_rows is not None
        assert plan.decode_bias is not None
        batch, kv_heads, dim = plan.decode_tokens.shape[0], self.num_kv_heads, self.head_dim
        group, length = self.num_heads // kv_heads, plan.decode_max_len
        dtype = query.dtype

        def context(rows: torch.Tensor) -> torch.Tensor:  # -> [B * KV, L, D], contiguous
            gathered = flat.index_select(0, rows).view(batch, length, kv_heads, dim)
            return gathered.transpose(1, 2).reshape(batch * kv_heads, length, dim).to(dtype)

        if batch * length <= _ELEMENTWISE_MAX_ROWS:
            return self._decode_elementwise(query, flat, plan, block_size)
        q = query[plan.decode_tokens].view(batch * kv_heads, group, dim)
        scores = torch.bmm(q, context(plan.decode_k_rows).transpose(1, 2)).float()
        scores = scores.view(batch, kv_heads, group, length) * self.scale + plan.decode_bias
        probs = torch.softmax(scores, dim=-1).to(dtype).view(batch * kv_heads, group, length)
        out = torch.bmm(probs, context(plan.decode_k_rows + block_size))  # [B * KV, group, D]
        return out.view(batch, self.num_heads, dim)

    def _decode_elementwise(
        self, query: torch.Tensor, flat: torch.Tensor, plan: _Plan, block_size: int
    ) -> torch.Tensor:
        """Small decode batches: broadcast multiply-and-sum in float32, no BLAS call.

        Inside a step, between the large oneDNN matmuls, each tiny ``bmm`` costs ~100 us of
        dispatch and thread hand-off; for a few hundred context rows plain vector ops are
        cheaper.
        """
        assert plan.decode_tokens is not None and plan.decode_k_rows is not None
        assert plan.decode_bias is not None
        batch, kv_heads, dim = plan.decode_tokens.shape[0], self.num_kv_heads, self.head_dim
        group, length = self.num_heads // kv_heads, plan.decode_max_len
        shape = (batch, length, kv_heads, 1, dim)
        q = query[plan.decode_tokens].float().view(batch, 1, kv_heads, group, dim)
        k = flat.index_select(0, plan.decode_k_rows).view(shape).float()
        scores = (q * k).sum(-1) * self.scale  # [B, L, KV, group]
        scores = scores + plan.decode_bias.view(batch, length, 1, 1)
        probs = torch.softmax(scores, dim=1).unsqueeze(-1)  # [B, L, KV, group, 1]
        v = flat.index_select(0, plan.decode_k_rows + block_size).view(shape).float()
        out = (probs * v).sum(1)  # [B, KV, group, D]
        return out.reshape(batch, self.num_heads, dim).to(query.dtype)
