"""What the engine core refuses of a request's images (before the scheduler sees it).

The front-end builds a request's :class:`~chassis.core.multimodal.MultiModalFeature` list
and checks the model takes images; the engine core checks again what it must rely on (the
placeholder ranges key the prefix cache and place the encoder rows) and refuses what it
does not serve with images yet: speculative decoding (drafts would be proposed from text
embeddings and 1-D positions) and pooling engines (the pooler never sees images). Every
refusal is the request's fault (HTTP 400) and names the feature.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from chassis.core.config import EngineConfig
    from chassis.core.multimodal import MultiModalFeature


def multimodal_refusal(
    config: EngineConfig,
    prompt_len: int,
    features: Sequence[MultiModalFeature],
    model_modalities: frozenset[str],
    model_name: str,
    bidirectional_blocks: bool = False,
) -> str | None:
    """Why an engine of ``config`` cannot serve a request whose prompt of ``prompt_len``
    tokens carries ``features``, or ``None`` (always for a request without features).
    ``model_modalities`` are the model's ``supported_modalities``, ``model_name`` its class
    name (for the message); ``bidirectional_blocks`` its ``bidirectional_image_blocks``
    (then an item longer than ``--max-num-batched-tokens`` is refused: its tokens must be
    computed in one step, :mod:`chassis.core.bidirectional_blocks`)."""
    if not features:
        return None
    modalities = sorted({f.modality for f in features})
    unsupported = [m for m in modalities if m not in model_modalities]
    if unsupported:
        return (
            f"{model_name} does not take {' or '.join(unsupported)} inputs "
            f"(it takes: {', '.join(sorted(model_modalities)) or 'text only'})"
        )
    refusal = engine_mode_refusal(config, modalities) or placeholder_range_error(
        prompt_len, features
    )
    if refusal is None and bidirectional_blocks:
        refusal = block_budget_error(config.max_num_batched_tokens, features, model_name)
    return refusal


def block_budget_error(
    max_num_batched_tokens: int, features: Sequence[MultiModalFeature], model_name: str
) -> str | None:
    """Why ``features`` cannot be scheduled by a model whose items' tokens attend to each
    other both ways (each item's tokens in one step), or ``None``."""
    for index, feature in enumerate(features):
        if feature.length > max_num_batched_tokens:
            return (
                f"{feature.modality} {index} has {feature.length} placeholder tokens, which "
                f"{model_name} computes in one step (they attend to each other both ways), "
                f"but --max-num-batched-tokens is {max_num_batched_tokens}: raise it to at "
                f"least {feature.length}"
            )
    return None


def engine_mode_refusal(config: EngineConfig, modalities: Iterable[str]) -> str | None:
    """Why an engine of ``config`` serves no request with ``modalities`` inputs whatever its
    model (a front-end may ask first, before it processes the items), or ``None``."""
    what = " and ".join(sorted(set(modalities)))
    if not what:
        return None
    if config.runner == "pooling":
        return f"{what} inputs are not supported with --runner pooling yet"
    if config.speculative_config is not None:
        return (
            f"{what} inputs are not supported with speculative decoding (--speculative-config) yet"
        )
    return None


def placeholder_range_error(prompt_len: int, features: Sequence[MultiModalFeature]) -> str | None:
    """Why ``features``' placeholder ranges are not usable in a prompt of ``prompt_len``
    tokens, or ``None``: each must be non-empty and inside the prompt, and they must be in
    prompt order without overlapping (the prefix-cache keys and the runner rely on it)."""
    previous_end = 0
    for index, feature in enumerate(features):
        where = (
            f"{feature.modality} {index} (placeholder tokens {feature.offset}..{feature.end - 1})"
        )
        if feature.offset < 0 or feature.length <= 0 or feature.end > prompt_len:
            return f"{where} is not inside the prompt of {prompt_len} tokens"
        if feature.offset < previous_end:
            return f"{where} overlaps or precedes the item before it (items in prompt order)"
        previous_end = feature.end
    return None
