"""Qwen2-VL / Qwen2.5-VL's M-RoPE positions of a prompt with images and videos (HF's
``get_rope_index``).

Text tokens get three equal components, counting up from where the previous token left
off. An image's or video's ``t x (h / merge) x (w / merge)`` tokens (row-major over the
merged grid) get ``(start + floor(frame * interval), start + row, start + column)``,
``start`` being the position the item begins at and ``interval`` 1 except for Qwen2.5-VL's
videos (``tokens_per_second * second_per_grid_t``, computed in float32 as transformers
does); the text after it continues at ``start + max(h, w) / merge``, one past the item's
largest spatial component (transformers 5's rule, which leaves a video's temporal
components out: transformers 4 and the Qwen reference continue one past the largest of
all three, which differs for a video whose scaled temporal extent is the larger). The tokens after the prompt (generated ones) have all three
components ``p + delta`` at sequence index ``p``, ``delta`` being the prompt's largest
position + 1 - its length (zero or negative: images take fewer positions than tokens).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

#: ``(offset, length, (t, h, w), interval)``: a video whose temporal index is scaled
VisionItem = tuple[int, int, tuple[int, int, int], float]


def mrope_positions(
    num_tokens: int,
    images: Sequence[tuple[int, int, tuple[int, int, int]] | VisionItem],
    merge: int,
) -> tuple[np.ndarray, int]:
    """``[3, num_tokens]`` int64 positions and the delta of the tokens after the prompt.

    :param images: ``(offset, length, (t, h, w))`` per image or video: its first placeholder
        token's index, its number of placeholder tokens, its grid in patches
        (``image_grid_thw`` / ``video_grid_thw``); a fourth element, when given, is the
        temporal ``interval`` (module docstring; 1 without it)
    :param merge: the tower's ``spatial_merge_size``
    :raises ValueError: an image whose token count is not ``t * h * w / merge**2``, or whose
        tokens overlap another's or lie outside the prompt
    """
    positions = np.empty((3, num_tokens), dtype=np.int64)
    index = 0  # the next token to place
    start = 0  # its position
    for item in sorted(images, key=lambda image: image[0]):
        offset, length, (t, h, w) = item[:3]
        interval = item[3] if len(item) > 3 else None  # type: ignore[misc]
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
        frames = np.arange(t)
        if interval is not None:
            # float32 product, then truncated: transformers' (arange * interval).long()
            frames = (frames.astype(np.float32) * np.float32(interval)).astype(np.int64)
        frame, row, col = np.meshgrid(frames, np.arange(rows), np.arange(cols), indexing="ij")
        positions[:, offset : offset + length] = start + np.stack(
            [frame.ravel(), row.ravel(), col.ravel()]
        )
        start += max(rows, cols)
        index = offset + length
    positions[:, index:] = np.arange(start, start + num_tokens - index)
    end = int(positions.max()) + 1 if num_tokens else 0
    return positions, end - num_tokens
