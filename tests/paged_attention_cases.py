"""Test helpers for paged-attention backends: random mixed batches and a dense reference.

:func:`make_batch` builds one step of a batch that mixes prefill chunks over cached prefixes
and decodes, with block tables that are non-contiguous permutations, stale entries past each
request's blocks, padding tokens (slot ``-1``) and a cache whose unwritten slots hold NaN (a
backend that reads past a sequence shows it). :func:`dense_attention` is the obviously-correct
float32 answer, computed from the K/V each request should see.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from chassis.core.attention import AttentionMetadata, kv_cache_shape


@dataclass
class PagedBatch:
    query: torch.Tensor  # [T, Hq, D]
    key: torch.Tensor  # [T, Hk, D] this step's new tokens
    value: torch.Tensor
    kv_cache: torch.Tensor  # prefixes written, new tokens not yet
    expected_cache: torch.Tensor  # kv_cache after a correct write of key/value
    metadata: AttentionMetadata
    #: per request: (prefix_len, query_len, context K [S, Hk, D], context V [S, Hk, D])
    contexts: list[tuple[int, int, torch.Tensor, torch.Tensor]]

    def kernel_args(self, scale: float) -> dict[str, Any]:
        """The keyword arguments of ``triton_paged_kernels.paged_attention`` for this step."""
        m = self.metadata
        return dict(
            query_start_loc=m.query_start_loc,
            seq_lens=m.seq_lens,
            block_table=m.block_table,
            num_reqs=m.num_reqs,
            max_query_len=m.max_query_len,
            max_seq_len=m.max_seq_len,
            scale=scale,
        )


def make_batch(
    specs: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    num_pad_tokens: int = 0,
    seed: int = 0,
    unwritten_fill: float = float("nan"),
    num_blocks: int | None = None,
    max_blocks: int | None = None,
) -> PagedBatch:
    """One step for requests ``specs = [(cached prefix length, query length), ...]``.

    Cache slots no request owns hold ``unwritten_fill`` (NaN: a kernel that multiplies them
    even by a zero weight fails; a large finite value: one that gives them weight fails).
    ``num_blocks`` / ``max_blocks`` fix the cache and block-table sizes (default: just enough),
    so that batches of different lengths can share shapes (CUDA-graph replay tests).
    """
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    seq_lens = [p + q for p, q in specs]
    blocks_per_req = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = num_blocks or sum(blocks_per_req) + 3  # a few never used
    order = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max_blocks or max(blocks_per_req) + 2
    block_table = torch.randint(0, num_blocks, (len(specs), max_blocks), generator=gen)
    kv_cache = torch.full(
        kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim), unwritten_fill, dtype=dtype
    )
    expected = kv_cache.clone()
    queries, keys, values, slots, contexts = [], [], [], [], []
    for i, (prefix_len, query_len) in enumerate(specs):
        mine = [order.pop() for _ in range(blocks_per_req[i])]
        block_table[i, : len(mine)] = torch.tensor(mine)
        seq_len = prefix_len + query_len
        ctx_k, ctx_v = (
            randn(seq_len, num_kv_heads, head_dim),
            randn(seq_len, num_kv_heads, head_dim),
        )
        pos = torch.arange(seq_len)
        blk, off = torch.tensor(mine, dtype=torch.long)[pos // block_size], pos % block_size
        expected[blk, 0, off], expected[blk, 1, off] = ctx_k, ctx_v
        cached = pos < prefix_len  # written by earlier steps
        kv_cache[blk[cached], 0, off[cached]] = ctx_k[cached]
        kv_cache[blk[cached], 1, off[cached]] = ctx_v[cached]
        slots += (blk * block_size + off)[~cached].tolist()
        queries.append(randn(query_len, num_heads, head_dim))
        keys.append(ctx_k[prefix_len:])
        values.append(ctx_v[prefix_len:])
        contexts.append((prefix_len, query_len, ctx_k, ctx_v))
    queries.append(randn(num_pad_tokens, num_heads, head_dim))
    keys.append(randn(num_pad_tokens, num_kv_heads, head_dim))
    values.append(randn(num_pad_tokens, num_kv_heads, head_dim))
    slots += [-1] * num_pad_tokens

    qsl = [0]
    for _, q in specs:
        qsl.append(qsl[-1] + q)
    query_start_loc = torch.tensor(qsl, dtype=torch.int32)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    metadata = AttentionMetadata(
        num_actual_tokens=qsl[-1],
        num_reqs=len(specs),
        query_start_loc=query_start_loc.to(device),
        seq_lens=seq_lens_t.to(device),
        block_table=block_table.to(torch.int32).to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64).to(device),
        max_query_len=max(q for _, q in specs),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens_t,
    )
    return PagedBatch(
        query=torch.cat(queries).to(device),
        key=torch.cat(keys).to(device),
        value=torch.cat(values).to(device),
        kv_cache=kv_cache.to(device),
        expected_cache=expected.to(device),
        metadata=metadata,
        contexts=contexts,
    )


def dense_attention(
    batch: PagedBatch,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    attention_chunk_size: int | None = None,
) -> torch.Tensor:
    """float32 causal attention of the batch's real tokens: ``[num_actual_tokens, Hq, D]``;
    each query sees at most the last ``sliding_window`` positions (its own included), and
    with ``attention_chunk_size`` ``C`` only those of its own chunk (``k // C == q // C``),
    scores are ``cap * tanh(score / cap)`` with ``logits_soft_cap``, and with ``sinks``
    (``[Hq]`` logits) head ``h``'s softmax denominator gains ``exp(sinks[h])``."""
    outs = []
    start = 0
    for prefix_len, query_len, ctx_k, ctx_v in batch.contexts:
        q = batch.query[start : start + query_len].float().cpu()  # [q, Hq, D]
        start += query_len
        group = q.shape[1] // ctx_k.shape[1]
        k = ctx_k.float().repeat_interleave(group, dim=1)  # [S, Hq, D]
        v = ctx_v.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if logits_soft_cap is not None:
            scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
        q_pos = prefix_len + torch.arange(query_len)[:, None]
        k_pos = torch.arange(k.shape[0])[None, :]
        visible = k_pos <= q_pos  # [q, S]
        if sliding_window is not None:
            visible &= k_pos > q_pos - sliding_window
        if attention_chunk_size is not None:
            visible &= k_pos // attention_chunk_size == q_pos // attention_chunk_size
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is None:
            probs = scores.softmax(-1)
        else:  # written out: exp(s - m) / (exp(sink - m) + sum exp(s - m))
            sink = sinks.float().cpu()[:, None, None]  # [Hq, 1, 1]
            top = torch.maximum(scores.amax(-1, keepdim=True), sink)
            weights = torch.exp(scores - top)
            probs = weights / (weights.sum(-1, keepdim=True) + torch.exp(sink - top))
        outs.append(torch.einsum("hqk,khd->qhd", probs, v))
    return torch.cat(outs)
