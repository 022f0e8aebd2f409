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
) -> str | None:
    """Why an engine of ``config`` cannot serve a request whose prompt of ``prompt_len``
    tokens carries ``features``, or ``None`` (always for a request without features).
    ``model_modalities`` are the model's ``supported_modalities``, ``model_name`` its class
    name (for the message)."""
    if not features:
        return None
    modalities = sorted({f.modality for f in features})
    unsupported = [m for m in modalities if m not in model_modalities]
    if unsupported:
        return (
            f"{model_name} does not take {' or '.join(unsupported)} inputs "
            f"(it takes: {', '.join(sorted(model_modalities)) or 'text only'})"
        )
    return engine_mode_refusal(config, modalities) or placeholder_range_error(prompt_len, features)


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
