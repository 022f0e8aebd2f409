"""The checks every image model here makes of one image feature's tensors before its tower
runs (``embed_multimodal``'s inputs), with the same ``ValueError`` messages for all."""

from __future__ import annotations

from collections.abc import Mapping

import torch


def image_run_inputs(
    model: object, modality: str, inputs: Mapping[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs["pixel_values"], inputs["placeholder_ids"])`` of an image whose feature
    covers its whole token run (the run's ids: the processor wrote tokens besides the image
    rows); ``ValueError``, naming ``model``'s class, for another modality than ``"image"``,
    and when either tensor is missing."""
    if modality != "image":
        raise ValueError(f"{type(model).__name__} takes images, not {modality!r} inputs")
    pixels, run = inputs.get("pixel_values"), inputs.get("placeholder_ids")
    if pixels is None or run is None:
        raise ValueError(
            f"image inputs need pixel_values and placeholder_ids (got {sorted(inputs)})"
        )
    return pixels, run


def image_tiles(pixels: torch.Tensor) -> torch.Tensor:
    """One image's tiles ``[tiles, C, H, W]``, given as such or with a leading 1;
    ``ValueError`` for any other shape (a feature holds one image)."""
    if pixels.dim() == 5 and pixels.shape[0] == 1:
        pixels = pixels[0]
    if pixels.dim() != 4:
        raise ValueError(
            "a feature holds one image: pixel_values [tiles, channels, height, width]; got "
            f"{tuple(pixels.shape)}"
        )
    return pixels
