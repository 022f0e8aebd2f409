"""Qwen2-VL / Qwen2.5-VL's M-RoPE positions of a prompt with images (HF's ``get_rope_index``).

Text tokens get three equal components, counting up from where the previous token left
off. An image's ``t x (h / merge) x (w / merge)`` tokens (row-major over the merged grid)
get ``(start + frame, start + row, start + column)``, ``start`` being the position the
image begins at; the text after it continues at ``start + max(h, w) / merge``, one past the
image's largest component. The tokens after the prompt (generated ones) have all three
components ``p + delta`` at sequence index ``p``, ``delta`` being the prompt's largest
position + 1 - its length (zero or negative: images take fewer positions than tokens).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def mrope_positions(
    num_tokens: int, images: Sequence[tuple[int, int, tuple[int, int, int]]], merge: int
) -> tuple[np.ndarray, int]:
    """``[3, num_tokens]`` int64 positions and the delta of the tokens after the prompt.

    :param images: ``(offset, length, (t, h, w))`` per image: its first placeholder token's
        index, its number of placeholder tokens, its grid in patches (``image_grid_thw``)
    :param merge: the tower's ``spatial_merge_size``
    :raises ValueError: an image whose token count is not ``t * h * w / merge**2``, or whose
        tokens overlap another's or lie outside the prompt
    """
    positions = np.empty((3, num_tokens), dtype=np.int64)
    index = 0  # the next token to place
    start = 0  # its position
    for offset, length, (t, h, w) in sorted(images, key=lambda image: image[0]):
        rows, cols = h // merge, w // merge
        if h % merge or w % merge or length != t * rows * cols:
            raise ValueError(
                f"an image of grid {t}x{h}x{w} (spatial merge {merge}) has {length} placeholder "
                f"tokens; it needs {t * (h // merge) * (w // merge)}"
            )
        if offset < index or offset + length > num_tokens:
            raise ValueError(
                f"image placeholders {offset}..{offset + length} overlap another image's or lie "
                f"outside the prompt of {num_tokens} tokens"
            )
        text = offset - index
        positions[:, index:offset] = np.arange(start, start + text)
        start += text
        frame, row, col = np.meshgrid(np.arange(t), np.arange(rows), np.arange(cols), indexing="ij")
        positions[:, offset : offset + length] = start + np.stack(
            [frame.ravel(), row.ravel(), col.ravel()]
        )
        start += max(rows, cols)
        index = offset + length
    positions[:, index:] = np.arange(start, start + num_tokens - index)
    end = int(positions.max()) + 1 if num_tokens else 0
    return positions, end - num_tokens
