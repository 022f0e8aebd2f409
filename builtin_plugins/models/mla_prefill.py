"""MLA's expanded prefill: which requests of a step take it, and the pieces it runs.

:class:`~chassis.builtin_plugins.models.deepseek_v2.MultiHeadLatentAttention` attends in the
absorbed form (queries moved into the ``kv_lora_rank + qk_rope_head_dim`` latent space,
attention over the cached latent, values out through ``W_UV``). For a request with many query
tokens in a step (a prefill chunk) the expanded form costs fewer FLOPs: the latent of the
request's whole context (cached prefix + this chunk) is read back from the paged cache,
``kv_b_proj`` expands it into per-head keys (``qk_nope_head_dim``, then the shared
``rope(k_pe)``) and values (``v_head_dim``), and ordinary causal attention runs over heads of
``qk_nope_head_dim + qk_rope_head_dim``. Decodes stay absorbed (expanding a long context for
one query costs far more than it saves).

Which requests run expanded (:func:`plan_step`) is set by :data:`MLA_PREFILL_ENV`, read when
the layer is built:

- ``auto`` (the default): a request with at least 2 query tokens whose expanded form
  costs fewer FLOPs than its absorbed form by :func:`expanded_is_cheaper` (at DeepSeek's
  widths a prefill without a cached prefix always does; a short chunk or a
  speculative-decoding check over a long context stays absorbed);
- ``expanded``: every request with at least 2 query tokens (vLLM's split);
- ``absorbed``: none (the previous behaviour, the reference the tests compare with).

Either way a step expands at most ``max(EXPANDED_CONTEXT_TOKENS, its token count)`` context
tokens (the expanded keys and values are materialized whole; :func:`plan_step`).

A step with no such request runs exactly the absorbed code of before (no host reads: decode
steps and captured device graphs are untouched); so does tracing under ``torch.compile``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from chassis.core.attention import FP8_KV_DTYPES, AttentionMetadata

#: environment variable choosing the MLA prefill path: ``auto``, ``expanded`` or ``absorbed``
MLA_PREFILL_ENV = "CHASSIS_MLA_PREFILL"
MLA_PREFILL_MODES = ("auto", "expanded", "absorbed")
#: the fewest query tokens of a request in a step that may run expanded
MIN_EXPANDED_QUERY_LEN = 2
#: the context tokens a step may expand, or its own token count if more (:func:`plan_step`)
EXPANDED_CONTEXT_TOKENS = 8192
#: the key :func:`plan_step` memoizes its plan under in ``AttentionMetadata.derived``
_PLAN_KEY = "mla_prefill_plan"


def mla_prefill_mode() -> str:
    """:data:`MLA_PREFILL_ENV`'s value (``auto`` when unset); another value is a
    ``ValueError`` naming the choices."""
    mode = os.environ.get(MLA_PREFILL_ENV, "").strip().lower() or "auto"
    if mode not in MLA_PREFILL_MODES:
        raise ValueError(
            f"{MLA_PREFILL_ENV} must be one of {', '.join(MLA_PREFILL_MODES)}; got {mode!r}"
        )
    return mode


@dataclass(frozen=True)
class MlaShape:
    """The widths the cost model needs (one head's; the count of heads cancels out)."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


def attended_pairs(query_len: int, seq_len: int) -> int:
    """The (query, key) pairs causal attention scores for the last ``query_len`` of
    ``seq_len`` tokens: query ``j`` sees ``seq_len - query_len + j + 1`` keys."""
    return query_len * (seq_len - query_len) + query_len * (query_len + 1) // 2


def absorbed_flops(shape: MlaShape, query_len: int, seq_len: int) -> int:
    """FLOPs per head of the absorbed form: each query's ``W_UK`` and ``W_UV`` products, and
    scores over ``kv_lora_rank + qk_rope_head_dim`` plus values of ``kv_lora_rank``."""
    rank = shape.kv_lora_rank
    per_query = 2 * shape.qk_nope_head_dim * rank + 2 * rank * shape.v_head_dim
    per_pair = 2 * (rank + shape.qk_rope_head_dim) + 2 * rank
    return query_len * per_query + attended_pairs(query_len, seq_len) * per_pair


def expanded_flops(shape: MlaShape, query_len: int, seq_len: int) -> int:
    """FLOPs per head of the expanded form: ``kv_b_proj`` over every context token, and
    scores over ``qk_nope_head_dim + qk_rope_head_dim`` plus values of ``v_head_dim``."""
    per_key = 2 * shape.kv_lora_rank * (shape.qk_nope_head_dim + shape.v_head_dim)
    per_pair = 2 * (shape.qk_nope_head_dim + shape.qk_rope_head_dim) + 2 * shape.v_head_dim
    return seq_len * per_key + attended_pairs(query_len, seq_len) * per_pair


def expanded_is_cheaper(shape: MlaShape, query_len: int, seq_len: int) -> bool:
    """Whether the expanded form costs fewer FLOPs for the last ``query_len`` of ``seq_len``
    tokens (``auto``'s rule). Both forms multiply each new token once by ``rank x (nope +
    v)`` numbers (the expansion, or the absorption), and a (query, key) pair costs less
    expanded when ``2 * kv_lora_rank > qk_nope_head_dim + v_head_dim`` (every released
    DeepSeek: 1024 > 256). Then with no cached prefix it always does from 2 tokens on; over
    a cached prefix of ``P`` tokens the expansion of the prefix must be paid back by the
    narrower scores: at V3's shapes when ``query_len * (P + (query_len + 1) / 2) > 170.7 *
    P``, about 171 query tokens over a long prefix (``tests/perf/mla_prefill_flops.py``)."""
    return expanded_flops(shape, query_len, seq_len) < absorbed_flops(shape, query_len, seq_len)


@dataclass
class StepPlan:
    """How one step's requests split between the two forms (the same for every layer)."""

    #: token rows (device, int64) of the requests that run expanded, in request order
    expanded_rows: torch.Tensor
    #: their query lengths and context lengths (host)
    expanded_query_lens: list[int]
    expanded_seq_lens: list[int]
    #: ``[sum(expanded_seq_lens)]`` (device, int64): the cache slot of every context token
    #: of those requests, request after request, position 0 first
    context_slots: torch.Tensor
    #: token rows of the other requests, and the step's metadata cut down to them; ``None``
    #: when every request runs expanded
    absorbed_rows: torch.Tensor | None
    absorbed_metadata: AttentionMetadata | None
    #: slots of the expanded requests' new tokens (device): where their latents are written
    expanded_slots: torch.Tensor


def plan_step(
    metadata: AttentionMetadata, shape: MlaShape, mode: str, block_size: int
) -> StepPlan | None:
    """The step's split (for a paged cache of ``block_size``), or ``None`` when every
    request runs absorbed (decided from ``max_query_len`` alone when it is below
    :data:`MIN_EXPANDED_QUERY_LEN`, so a decode step reads nothing on the host). Memoized in
    ``metadata.derived`` (every layer reads the same plan). A step with ``attend_limit``
    (not a DeepSeek feature) runs absorbed.

    Requests are taken in order, each while the context they expand adds up to at most
    ``max(EXPANDED_CONTEXT_TOKENS, num_actual_tokens)``: the expanded keys and values of a
    whole context are materialized at once, and the start-up's memory profile (whole
    prefills of ``--max-num-batched-tokens`` tokens, every one expanded) covers at most that
    many; a request past the budget runs absorbed (a short chunk over a very long prefix)."""
    if mode == "absorbed" or metadata.max_query_len < MIN_EXPANDED_QUERY_LEN:
        return None
    if metadata.attend_limit is not None:
        return None
    if _PLAN_KEY in metadata.derived:
        return metadata.derived[_PLAN_KEY]
    plan = _make_plan(metadata, shape, mode, block_size)
    metadata.derived[_PLAN_KEY] = plan
    return plan


def _make_plan(
    metadata: AttentionMetadata, shape: MlaShape, mode: str, block_size: int
) -> StepPlan | None:
    starts = metadata.query_start_loc_cpu.tolist()
    seq_lens = metadata.seq_lens_cpu.tolist()
    expanded: list[int] = []
    absorbed: list[int] = []
    budget = max(EXPANDED_CONTEXT_TOKENS, metadata.num_actual_tokens)
    for i in range(metadata.num_reqs):
        query_len = starts[i + 1] - starts[i]
        take = (
            query_len >= MIN_EXPANDED_QUERY_LEN
            and seq_lens[i] <= budget
            and (mode == "expanded" or expanded_is_cheaper(shape, query_len, seq_lens[i]))
        )
        if take:
            budget -= seq_lens[i]
        (expanded if take else absorbed).append(i)
    if not expanded:
        return None
    device = metadata.slot_mapping.device

    def rows_of(reqs: list[int]) -> torch.Tensor:
        rows = [t for i in reqs for t in range(starts[i], starts[i + 1])]
        return torch.tensor(rows, dtype=torch.int64).to(device)

    # every context position of the expanded requests, and the block-table row it reads
    query_lens = [starts[i + 1] - starts[i] for i in expanded]
    lens = [seq_lens[i] for i in expanded]
    positions = torch.cat([torch.arange(n) for n in lens]).to(device)
    owner = torch.repeat_interleave(torch.tensor(expanded), torch.tensor(lens)).to(device)
    blocks = metadata.block_table[owner, positions // block_size].long()
    expanded_rows = rows_of(expanded)
    absorbed_rows = rows_of(absorbed) if absorbed else None
    return StepPlan(
        expanded_rows=expanded_rows,
        expanded_query_lens=query_lens,
        expanded_seq_lens=lens,
        context_slots=blocks * block_size + positions % block_size,
        absorbed_rows=absorbed_rows,
        absorbed_metadata=(
            None if absorbed_rows is None else sub_metadata(metadata, absorbed, absorbed_rows)
        ),
        expanded_slots=metadata.slot_mapping[expanded_rows],
    )


def sub_metadata(
    metadata: AttentionMetadata, reqs: list[int], rows: torch.Tensor
) -> AttentionMetadata:
    """``metadata`` for requests ``reqs`` alone, whose token rows (device, int64) are
    ``rows`` (their tokens packed in that order, no padding): what a backend runs the
    absorbed requests of a split step on."""
    starts = metadata.query_start_loc_cpu.tolist()
    query_lens = [starts[i + 1] - starts[i] for i in reqs]
    device = metadata.slot_mapping.device
    index = torch.tensor(reqs, dtype=torch.int64)
    new_starts = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    seq_lens_cpu = metadata.seq_lens_cpu[index]
    return AttentionMetadata(
        num_actual_tokens=rows.numel(),
        num_reqs=len(reqs),
        query_start_loc=new_starts.to(device),
        seq_lens=seq_lens_cpu.to(device),
        block_table=metadata.block_table[index.to(device)],
        slot_mapping=metadata.slot_mapping[rows],
        max_query_len=max(query_lens),
        max_seq_len=int(seq_lens_cpu.max()),
        query_start_loc_cpu=new_starts,
        seq_lens_cpu=seq_lens_cpu,
    )


def read_cache_rows(kv_cache: torch.Tensor, slots: torch.Tensor, scale: float) -> torch.Tensor:
    """``[len(slots), D]``: the K plane's vectors (one KV head) at ``slots``; an 8-bit cache's
    dequantized (times ``scale``, in float32)."""
    block_size = kv_cache.shape[2]
    rows = kv_cache[slots // block_size, 0, slots % block_size, 0]
    if rows.dtype in FP8_KV_DTYPES:
        return rows.float() * scale
    return rows


def varlen_causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """Dense causal attention over packed requests, the generic implementation (torch SDPA,
    one call per request): a varlen kernel (FlashAttention's) may replace it.

    :param query: ``[sum(query_lens), H, Dqk]``, request after request; request ``i``'s
        queries are the last ``query_lens[i]`` of its ``seq_lens[i]`` positions
    :param key: ``[sum(seq_lens), H, Dqk]``, every position of each request's context
    :param value: ``[sum(seq_lens), H, Dv]`` (``Dv`` may differ from ``Dqk``)
    :return: ``[sum(query_lens), H, Dv]``; query ``j`` attends to positions
        ``0 .. seq_len - query_len + j``
    """
    out = query.new_empty(query.shape[0], query.shape[1], value.shape[-1])
    q_start = k_start = 0
    for q_len, s_len in zip(query_lens, seq_lens, strict=True):
        q = query[q_start : q_start + q_len].transpose(0, 1)  # [H, Q, D]
        k = key[k_start : k_start + s_len].transpose(0, 1)
        v = value[k_start : k_start + s_len].transpose(0, 1)
        if q_len == s_len:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:  # SDPA's is_causal aligns top-left: the chunk's offset needs a mask
            q_pos = torch.arange(s_len - q_len, s_len, device=query.device)
            mask = torch.arange(s_len, device=query.device)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out[q_start : q_start + q_len] = o.transpose(0, 1)
        q_start += q_len
        k_start += s_len
    return out
