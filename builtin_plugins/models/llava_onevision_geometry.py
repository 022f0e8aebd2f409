"""LLaVA-OneVision's image geometry on top of LLaVA-NeXT's "anyres" one
(:mod:`.llava_next_tiles`): the cap on an image's feature grid, and an image's token count.

After the unpadding, OneVision bounds an image's grid of ``rows x cols`` features by its
``vision_aspect_ratio`` (``"anyres_max_N"``: at most about ``N`` tiles' worth, ``N * side^2``
features, ``side`` the features per tile side). When the grid holds more than 1.1 times that
(in side length: ``sqrt(rows * cols / (N * side^2)) > 1.1``), it is resized bilinearly to
``int(rows // ratio) x int(cols // ratio)`` (:func:`capped_grid`); a ``image_newline`` row
then follows each grid row, as in LLaVA-NeXT. An image alone in its prompt is packed so (base
tile first); an image among several of one prompt is its base tile only, padded to a square,
and one newline row (:mod:`.llava_onevision_processing`). Arithmetic is transformers', so the
counts agree with its processor and model to the token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from chassis.builtin_plugins.models.llava_next_tiles import tile_grid, unpadded_span

#: transformers' default ``vision_aspect_ratio`` (``LlavaOnevisionConfig``'s)
DEFAULT_ASPECT_RATIO = "anyres_max_9"


def max_tiles(vision_aspect_ratio: str | None) -> int:
    """``N`` of an ``"anyres_max_N"`` setting (``None``: the default, 9); ``ValueError`` for
    another form (transformers reads only this one)."""
    value = DEFAULT_ASPECT_RATIO if vision_aspect_ratio is None else vision_aspect_ratio
    prefix = "anyres_max_"
    digits = value[len(prefix) :] if isinstance(value, str) and value.startswith(prefix) else ""
    if not digits.isdigit() or int(digits) < 1:
        raise ValueError(
            f"vision_aspect_ratio {vision_aspect_ratio!r} is not supported (anyres_max_N, N >= 1)"
        )
    return int(digits)


def capped_grid(rows: int, cols: int, side: int, tiles: int) -> tuple[int, int] | None:
    """The ``(rows, cols)`` an unpadded grid is resized to when it exceeds ``tiles`` tiles of
    ``side x side`` features by the 1.1 margin; ``None`` when it is kept as it is."""
    ratio = math.sqrt(rows * cols / (tiles * side**2))
    if ratio <= 1.1:
        return None
    return int(rows // ratio), int(cols // ratio)


def num_image_tokens(
    height: int,
    width: int,
    pinpoints: Sequence[tuple[int, int]],
    tile: int,
    side: int,
    base_tokens: int,
    tiles: int,
) -> int:
    """Placeholder tokens of an image of ``height x width`` pixels alone in its prompt: the
    base tile's ``base_tokens`` rows, then the unpadded, capped grid with a newline row after
    each of its rows."""
    grid_rows, grid_cols = tile_grid(height, width, pinpoints, tile)
    top, bottom, left, right = unpadded_span(height, width, grid_rows * side, grid_cols * side)
    rows, cols = bottom - top, right - left
    rows, cols = capped_grid(rows, cols, side, tiles) or (rows, cols)
    return base_tokens + rows * (cols + 1)
