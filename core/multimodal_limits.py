"""``--limit-mm-per-prompt`` (``limit_mm_per_prompt``): how many items of each modality one
prompt may carry, with vLLM's semantics.

The value is a JSON object from modality to a count, ``{"image": 2}``; vLLM's newer form
``{"image": {"count": 2, "width": 512, "height": 512}}`` is taken too (its size keys only
size vLLM's memory profiling, which chassis does not do for images: they are ignored). A
modality left out may have :data:`DEFAULT_LIMIT` items (vLLM's default); ``0`` refuses it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: vLLM's default limit of a modality the flag leaves out
DEFAULT_LIMIT = 999
#: the modalities the flag may name (vLLM's; images, the Qwen VL models' videos and
#: Qwen2-Audio's audio are taken)
LIMIT_MODALITIES = ("image", "video", "audio")


def parse_limits(value: Mapping[str, Any] | None) -> dict[str, int]:
    """``value`` as modality -> count; ``ValueError`` naming the flag for an unknown
    modality or a count that is not an integer >= 0."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(
            f'--limit-mm-per-prompt must be a JSON object like {{"image": 2}}; got {value!r}'
        )
    limits: dict[str, int] = {}
    for modality, given in value.items():
        if modality not in LIMIT_MODALITIES:
            raise ValueError(
                f"--limit-mm-per-prompt: unknown modality {modality!r}; known: "
                f"{', '.join(LIMIT_MODALITIES)}"
            )
        count = given.get("count") if isinstance(given, Mapping) else given
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(
                f"--limit-mm-per-prompt: the {modality} limit must be an integer >= 0 (or "
                f'{{"count": N}}); got {given!r}'
            )
        limits[modality] = count
    return limits


def check_item_count(limits: Mapping[str, int], modality: str, count: int) -> None:
    """vLLM's refusal (its message) of ``count`` items of ``modality`` over ``limits``
    (:func:`parse_limits`' answer; a modality it leaves out may have :data:`DEFAULT_LIMIT`)."""
    limit = limits.get(modality, DEFAULT_LIMIT)
    if count > limit:
        raise ValueError(
            f"At most {limit} {modality}(s) may be provided in one prompt. Set "
            "`--limit-mm-per-prompt` to increase this limit."
        )
