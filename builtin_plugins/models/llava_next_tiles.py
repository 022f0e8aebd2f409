"""LLaVA-NeXT's "anyres" geometry: which grid of tiles an image is cut into, and which of
the tiles' feature rows and columns survive the unpadding, shared by the front-end (pixels
and the image's token count) and the model (packing the tower's rows).

An image of ``height x width`` pixels is fitted into the best of the checkpoint's
``image_grid_pinpoints`` (``[height, width]`` pairs, multiples of the tower's ``image_size``
``S``): the one that keeps the most of the image's pixels once scaled to fit (at most the
image's own count), ties broken by the least padding (:func:`best_resolution`). The image is
scaled to fit it (:func:`fitted_size`), centred on a black canvas of the pinpoint's size and
cut into ``S x S`` tiles, row-major; a base tile, the whole image resized to ``S x S``,
comes first. Each tile gives ``(S / patch)^2`` feature rows; the tiles' rows are laid out
as one grid of ``rows x cols`` features, the rows or columns that show only the canvas's
padding are cut away (:func:`unpadded_span`), and a learned ``image_newline`` row follows
each remaining row. Arithmetic (float ratios, rounding to 7 digits) is transformers', so the
counts agree with its processor and model to the token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

#: transformers' default ``image_grid_pinpoints`` (``LlavaNextConfig``'s and its image
#: processor's)
DEFAULT_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))


def parse_pinpoints(pinpoints: Any, tile: int) -> tuple[tuple[int, int], ...]:
    """A config's ``image_grid_pinpoints`` as ``(height, width)`` pairs; ``ValueError`` for
    an empty or malformed list or a side that is not a positive multiple of ``tile`` (the
    tower's ``image_size``: partial tiles are not supported)."""
    if not isinstance(pinpoints, Sequence) or isinstance(pinpoints, str) or not pinpoints:
        raise ValueError(
            f"image_grid_pinpoints must be a non-empty list of [height, width]; got {pinpoints!r}"
        )
    pairs = []
    for pair in pinpoints:
        if (
            not isinstance(pair, Sequence)
            or len(pair) != 2
            or any(isinstance(v, bool) or not isinstance(v, int) for v in pair)
        ):
            raise ValueError(f"image_grid_pinpoints entry {pair!r} is not [height, width]")
        height, width = int(pair[0]), int(pair[1])
        if height <= 0 or width <= 0 or height % tile or width % tile:
            raise ValueError(
                f"image_grid_pinpoints entry {[height, width]} is not a multiple of the vision "
                f"tower's image_size {tile} (partial tiles are not supported)"
            )
        pairs.append((height, width))
    return tuple(pairs)


def best_resolution(
    height: int, width: int, pinpoints: Sequence[tuple[int, int]]
) -> tuple[int, int]:
    """The pinpoint ``(height, width)`` an image of that size is fitted into: the most of its
    pixels kept once scaled to fit (capped at its own count), then the least canvas wasted;
    the first such pinpoint in the list. (An image so thin that no pinpoint keeps a whole row
    of it gets the least wasteful pinpoint, as in transformers.)"""
    best: tuple[int, int] | None = None
    most_kept, least_wasted = 0, float("inf")
    for pin_height, pin_width in pinpoints:
        scale = min(pin_width / width, pin_height / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        wasted = pin_width * pin_height - kept
        if kept > most_kept or (kept == most_kept and wasted < least_wasted):
            best, most_kept, least_wasted = (pin_height, pin_width), kept, wasted
    if best is None:
        raise ValueError("there are no grid pinpoints to fit the image into")
    return best


def fitted_size(height: int, width: int, target: tuple[int, int]) -> tuple[int, int]:
    """``(height, width)`` of the image scaled to fit ``target`` (one side equal to the
    target's, the other rounded up and capped)."""
    target_height, target_width = target
    scale_w, scale_h = target_width / width, target_height / height
    # (the float product rounded up, as transformers does: 100 * (84 / 300) is just over 28)
    if scale_w < scale_h:
        return min(math.ceil(height * scale_w), target_height), target_width
    return target_height, min(math.ceil(width * scale_h), target_width)


def unpadded_span(height: int, width: int, rows: int, cols: int) -> tuple[int, int, int, int]:
    """``(row_start, row_stop, col_start, col_stop)`` of a ``rows x cols`` feature grid that
    shows an image of ``height x width`` pixels centred with padding: the rows (for an image
    wider than the grid) or columns (otherwise) that show only padding are cut, the same
    number from each side."""
    if width / height > cols / rows:
        shown = int(round(height * (cols / width), 7))
        cut = (rows - shown) // 2
        return cut, rows - cut, 0, cols
    shown = int(round(width * (rows / height), 7))
    cut = (cols - shown) // 2
    return 0, rows, cut, cols - cut


def tile_grid(
    height: int, width: int, pinpoints: Sequence[tuple[int, int]], tile: int
) -> tuple[int, int]:
    """``(rows, cols)`` of tiles an image of that size is cut into (besides the base tile)."""
    pin_height, pin_width = best_resolution(height, width, pinpoints)
    return pin_height // tile, pin_width // tile


def num_image_tokens(
    height: int,
    width: int,
    pinpoints: Sequence[tuple[int, int]],
    tile: int,
    side: int,
    base_tokens: int,
) -> int:
    """Placeholder tokens of an image of ``height x width`` pixels: the base tile's
    ``base_tokens`` rows, then the unpadded feature grid with a newline row after each of its
    rows (``side``: features per tile side, ``image_size / patch_size``)."""
    grid_rows, grid_cols = tile_grid(height, width, pinpoints, tile)
    top, bottom, left, right = unpadded_span(height, width, grid_rows * side, grid_cols * side)
    return base_tokens + (bottom - top) * (right - left + 1)
