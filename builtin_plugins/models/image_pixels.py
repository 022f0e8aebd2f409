"""The check and error translation every image processor here applies to one image item."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


def preprocess_image(item: Any, transform: Callable[[Any], np.ndarray]) -> np.ndarray:
    """``transform(item)`` (a model's resize / crop / tile / normalize steps) for an image
    item, which must be a non-empty ``PIL.Image.Image``; every refusal, the transform's
    ``ValueError`` and ``OSError`` included, is a ``ValueError`` a client can act on."""
    from PIL import Image

    if not isinstance(item, Image.Image):
        raise ValueError(
            f"an image must be a PIL.Image.Image; got {type(item).__name__} (image "
            "embeddings and arrays are not supported)"
        )
    if item.width < 1 or item.height < 1:
        raise ValueError(f"the image is empty ({item.width}x{item.height} pixels)")
    try:
        return transform(item)
    except (ValueError, OSError) as exc:
        raise ValueError(f"the image cannot be processed: {exc}") from None
