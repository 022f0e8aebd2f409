"""Encoder-only models (BERT, ModernBERT, EmbeddingGemma) on a pooling engine: whole prompts,
one step each.

An encoder's tokens attend to every token of their prompt, the later ones too, so a
prompt cannot be computed in chunks over several steps, and a prefix-cache hit (which
skips computing the prefix) would leave the others nothing to attend to. Such a model
declares ``is_encoder_only`` (:class:`~chassis.core.model_interface.CausalLM`) and 0
attention layers: no KV cache is allocated (its blocks cost nothing,
``Worker.determine_num_blocks``), and the engine:

- turns chunked prefill off, so the scheduler admits a prompt only whole, in one step;
- turns prefix caching off;
- keeps ``--max-model-len`` within ``--max-num-batched-tokens``, since a prompt that one
  step cannot hold would never be scheduled: without ``--max-model-len`` the model's
  context is cut to the token budget (logged); a ``--max-model-len`` above the budget is
  refused at start. Prompts longer than ``--max-model-len`` are then refused per request,
  as for every model.

The model reads each request's boundaries from the step's attention metadata
(``query_start_loc_cpu``) and attends within them (:func:`bidirectional_attention`),
checking that every request's prompt is whole (``seq_lens`` equal to the query lengths).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from chassis.core.attention import AttentionMetadata
    from chassis.core.config import EngineConfig

logger = logging.getLogger(__name__)

#: the key of the padded layout in ``AttentionMetadata.derived`` (computed once per step)
_LAYOUT_KEY = "encoder_only_layout"


def apply_encoder_only_settings(
    config: EngineConfig, model_cls: Any, *, max_model_len_given: bool
) -> None:
    """For an encoder-only ``model_cls`` (its ``is_encoder_only``): turn chunked prefill and
    prefix caching off and keep ``config.max_model_len`` (resolved) within the token budget:
    lowered to ``--max-num-batched-tokens`` when the user did not set it
    (``max_model_len_given``), else a ``ValueError`` when it exceeds it. Nothing for other
    models."""
    if not getattr(model_cls, "is_encoder_only", False):
        return
    name = model_cls.__name__
    if config.enable_chunked_prefill or config.enable_prefix_caching:
        logger.info(
            "%s is an encoder (bidirectional attention over each prompt): every prompt runs "
            "whole in one step, without chunked prefill or prefix caching",
            name,
        )
    config.enable_chunked_prefill = False
    config.enable_prefix_caching = False
    assert config.max_model_len is not None
    budget = config.max_num_batched_tokens
    if budget >= config.max_model_len:
        return
    if max_model_len_given:
        raise ValueError(
            f"{name} is an encoder: each prompt is computed whole in one step, so "
            f"--max-num-batched-tokens ({budget}) must be >= --max-model-len "
            f"({config.max_model_len}); raise the first or lower the second"
        )
    logger.info(
        "%s is an encoder: each prompt is computed whole in one step, so max_model_len is "
        "the token budget, %d (the model's is %d; raise --max-num-batched-tokens for longer "
        "prompts)",
        name,
        budget,
        config.max_model_len,
    )
    config.max_model_len = budget


def whole_prompt_lengths(metadata: AttentionMetadata) -> torch.Tensor:
    """Each request's token count in the step (int64, on the host), after checking that it
    is the request's whole prompt (a ``RuntimeError`` otherwise: a scheduler that split a
    prompt or served part of it from the prefix cache)."""
    starts = metadata.query_start_loc_cpu.to(torch.int64)
    lengths = starts[1:] - starts[:-1]
    if not torch.equal(lengths, metadata.seq_lens_cpu.to(torch.int64)):
        raise RuntimeError(
            "an encoder-only model was given part of a prompt (chunked prefill or a "
            "prefix-cache hit): every request's whole prompt must be computed in one step; "
            "the engine turns both off for these models, a scheduler plugin must not split "
            "their prompts"
        )
    return lengths


def bidirectional_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    *,
    max_distance: int | None = None,
) -> torch.Tensor:
    """Attention of every token over all the tokens of its own request, none of another's.

    ``q``, ``k``, ``v``: ``[num_tokens, heads, head_dim]``, the requests' tokens one after
    the other as ``metadata.query_start_loc_cpu`` delimits them; returns
    ``[num_tokens, heads, head_dim]``. The requests are padded to the longest into one
    ``[R, heads, L, head_dim]`` batch with a key mask (one SDPA call); a lone request runs
    unpadded.

    ``max_distance``: a symmetric sliding window (the local layers of ModernBERT and
    EmbeddingGemma), each token attending only to the tokens of its request at most
    ``max_distance`` places before or after it; ``None``: the whole request. The masks are
    computed once per step and window.
    """
    num_tokens, heads, head_dim = q.shape
    layout = metadata.derived.get(_LAYOUT_KEY)
    if layout is None:
        layout = _padded_layout(metadata, num_tokens, q.device)
        metadata.derived[_LAYOUT_KEY] = layout
    flat_index, key_mask, num_reqs, longest = layout
    if max_distance is not None and longest > max_distance + 1:  # some keys out of reach
        band_key = f"{_LAYOUT_KEY}/band{max_distance}"
        band = metadata.derived.get(band_key)
        if band is None:
            band = _band_mask(metadata, longest, max_distance, flat_index is None, q.device)
            metadata.derived[band_key] = band
        key_mask = band
    if flat_index is None:  # one request: [1, heads, T, head_dim]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            attn_mask=key_mask,
            scale=scale,
        )
        return out[0].transpose(0, 1)

    def padded(x: torch.Tensor) -> torch.Tensor:
        buffer = x.new_zeros(num_reqs * longest, heads, head_dim)
        buffer[flat_index] = x
        return buffer.view(num_reqs, longest, heads, head_dim).transpose(1, 2)

    out = F.scaled_dot_product_attention(
        padded(q), padded(k), padded(v), attn_mask=key_mask, scale=scale
    )
    # [R, heads, L, dim] -> [R * L, heads, dim] -> the real tokens
    return out.transpose(1, 2).reshape(num_reqs * longest, heads, head_dim)[flat_index]


def _padded_layout(
    metadata: AttentionMetadata, num_tokens: int, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None, int, int]:
    """``(flat_index, key_mask, R, L)``: each token's row in the ``[R * L]`` padded batch,
    the ``[R, 1, 1, L]`` mask of real keys (``None`` when every request has ``L`` tokens),
    the request count and the longest request; ``flat_index`` is ``None`` for one request."""
    lengths = whole_prompt_lengths(metadata)
    if int(lengths.sum()) != num_tokens:
        raise RuntimeError(
            f"the step's requests hold {int(lengths.sum())} tokens, the forward got {num_tokens}"
        )
    num_reqs, longest = len(lengths), int(lengths.max())
    if num_reqs == 1:
        return None, None, 1, longest
    request = torch.repeat_interleave(torch.arange(num_reqs), lengths)
    offset = torch.arange(num_tokens) - (torch.cumsum(lengths, 0) - lengths)[request]
    flat_index = (request * longest + offset).to(device)
    key_mask = None
    if bool((lengths != longest).any()):
        key_mask = (torch.arange(longest)[None, :] < lengths[:, None])[:, None, None, :]
        key_mask = key_mask.to(device)
    return flat_index, key_mask, num_reqs, longest


def _band_mask(
    metadata: AttentionMetadata,
    longest: int,
    max_distance: int,
    single: bool,
    device: torch.device,
) -> torch.Tensor:
    """The mask of a symmetric window of ``max_distance`` places each side: ``[L, L]`` for
    one request (``single``), else ``[R, 1, L, L]`` with the padding keys off; a padding query row keeps
    every real key of its request (its output is dropped; a row with no key would be NaN)."""
    index = torch.arange(longest)
    band = (index[:, None] - index[None, :]).abs() <= max_distance
    if single:
        return band.to(device)
    lengths = whole_prompt_lengths(metadata)
    real = index[None, :] < lengths[:, None]  # [R, L]
    keys = real[:, None, :]  # [R, 1 (queries), L]
    queries = real[:, :, None]  # [R, L, 1]
    return ((band[None] | ~queries) & keys)[:, None].to(device)
