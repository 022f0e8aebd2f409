"""LLaVA-OneVision (``LlavaOnevisionForConditionalGeneration``: llava-hf's
llava-onevision-qwen2-*-ov-hf) with images and videos: LLaVA-NeXT's model (:mod:`.llava_next_images`:
the text config's decoder, here Qwen2; a SigLIP or CLIP tower; the projector; anyres tiles
and ``image_newline``) with OneVision's packing.

An image's inputs are as LLaVA-NeXT's (``pixel_values`` ``[tiles, 3, S, S]``, ``image_sizes``
``[1, 2]``) and its rows are packed as HF's ``LlavaOnevisionModel.pack_image_features`` packs
them: with more than one tile (an image alone in its prompt), the base tile's rows, then the
tiles' unpadded feature grid, resized bilinearly when it exceeds the config's
``vision_aspect_ratio`` (:func:`~.llava_onevision_geometry.capped_grid`), each grid row
followed by ``image_newline``; with one tile (an image among several of one prompt, see
:mod:`.llava_onevision_processing`), that tile's rows and one ``image_newline`` row.

A video's frames (``pixel_values_videos`` ``[T, 3, S, S]``, :mod:`.llava_onevision_video`)
go through the same tower and projector as one batch; each frame's ``side x side`` rows are
pooled bilinearly to ``ceil(side / 2)`` a side (HF's ``apply_pooling``), and one
``image_newline`` row ends the video (HF's ``get_video_features``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch.nn import functional

from chassis.builtin_plugins.models.llava_next_images import (
    LlavaNextForConditionalGenerationWithImages,
)
from chassis.builtin_plugins.models.llava_next_tiles import tile_grid, unpadded_span
from chassis.builtin_plugins.models.llava_onevision_geometry import capped_grid, max_tiles
from chassis.core.model_interface import ModelBuildContext


class LlavaOnevisionForConditionalGenerationWithImages(LlavaNextForConditionalGenerationWithImages):
    """``LlavaOnevisionForConditionalGeneration`` checkpoints with images (the module
    docstring).

    Not built itself: :meth:`class_for_config` returns the class of this one over the text
    config's decoder (or, for a tower not built here, the text-only class).
    """

    supported_modalities = frozenset({"image", "video"})

    def __init__(self, hf_config: Any, build_ctx: ModelBuildContext) -> None:
        super().__init__(hf_config, build_ctx)
        #: the grid's cap, in tiles (``vision_aspect_ratio``'s ``anyres_max_N``)
        self.max_tiles = max_tiles(getattr(hf_config, "vision_aspect_ratio", None))

    @classmethod
    def multimodal_processor(cls, model_dir: str, hf_config: Any) -> Any:
        """The front-end's image processor
        (:class:`~.llava_onevision_processing.LlavaOnevisionMediaInputs`)."""
        from chassis.builtin_plugins.models.llava_onevision_processing import (
            LlavaOnevisionMediaInputs,
        )

        return LlavaOnevisionMediaInputs.from_pretrained(model_dir, hf_config)

    def item_rows(self, modality: str, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """An image's rows (LLaVA-NeXT's inputs, OneVision's packing), or a video's:
        ``inputs["pixel_values_videos"]`` ``[T, C, S, S]`` -> ``[T * ceil(side / 2)^2 + 1,
        hidden_size]``. ``ValueError`` for another modality, a missing input or a wrong
        shape."""
        if modality == "image":
            return super().item_rows(modality, inputs)
        if modality != "video":
            raise ValueError(f"{type(self).__name__} takes images and videos, not {modality!r}")
        pixels = inputs.get("pixel_values_videos")
        if pixels is None:
            raise ValueError(f"video inputs lack pixel_values_videos (got {sorted(inputs)})")
        if pixels.dim() == 5 and pixels.shape[0] == 1:
            pixels = pixels[0]
        if pixels.dim() != 4 or pixels.shape[0] < 1:
            raise ValueError(
                "a feature holds one video: pixel_values_videos [frames, channels, height, "
                f"width]; got {tuple(pixels.shape)}"
            )
        return self.video_rows(self.image_features(pixels))

    def video_rows(self, features: torch.Tensor) -> torch.Tensor:
        """A video's projected frames ``[T, side * side, hidden]`` -> its rows: each frame
        pooled to ``ceil(side / 2)`` a side, then one ``image_newline`` row."""
        frames, side, dim = features.shape[0], self.side, features.shape[-1]
        planes = features.reshape(frames, side, side, dim).permute(0, 3, 1, 2)
        pooled_side = math.ceil(side / 2)
        pooled = functional.interpolate(planes, [pooled_side, pooled_side], mode="bilinear")
        rows = pooled.permute(0, 2, 3, 1).reshape(-1, dim)
        return torch.cat([rows, self.image_newline.to(rows.dtype)[None]])

    def pack(self, features: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """An image's projected tiles ``[tiles, side * side, hidden]`` (base first) -> its
        rows ``[tokens, hidden]`` (the module docstring)."""
        if height < 1 or width < 1:
            raise ValueError(f"image_sizes {[height, width]} is not a size")
        dim = features.shape[-1]
        newline = self.image_newline.to(features.dtype)
        if features.shape[0] == 1:
            return torch.cat([features[0], newline[None]])
        grid_rows, grid_cols = tile_grid(height, width, self.pinpoints, self.tile)
        if features.shape[0] != 1 + grid_rows * grid_cols:
            raise ValueError(
                f"a {width}x{height} image has 1 tile (among other images) or "
                f"{1 + grid_rows * grid_cols} (the base and {grid_rows}x{grid_cols}); "
                f"pixel_values has {features.shape[0]}"
            )
        side = self.side
        # [rows, cols, side, side, dim] -> one grid [rows * side, cols * side, dim]
        grid = features[1:].reshape(grid_rows, grid_cols, side, side, dim)
        grid = grid.permute(0, 2, 1, 3, 4).reshape(grid_rows * side, grid_cols * side, dim)
        top, bottom, left, right = unpadded_span(height, width, grid.shape[0], grid.shape[1])
        grid = grid[top:bottom, left:right]
        capped = capped_grid(grid.shape[0], grid.shape[1], side, self.max_tiles)
        if capped is not None:
            # (HF resizes the [dim, rows, cols] map bilinearly, corners not aligned)
            planes = grid.permute(2, 0, 1)[None]
            grid = functional.interpolate(planes, list(capped), mode="bilinear")[0]
            grid = grid.permute(1, 2, 0)
        rows = torch.cat([grid, newline.expand(grid.shape[0], 1, dim)], dim=1).reshape(-1, dim)
        return torch.cat([features[0], rows])
