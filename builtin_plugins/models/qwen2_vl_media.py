"""Qwen2-VL / Qwen2.5-VL images and videos -> the model's inputs (the front-end's processor
of :class:`~chassis.builtin_plugins.models.qwen2_vl.Qwen2VLForConditionalGeneration`).

Images as :class:`~chassis.builtin_plugins.models.qwen2_vl_processing.Qwen2VLImageInputs`.
A video (``multi_modal_data={"video": frames}``: a ``[T, H, W, 3]`` ``uint8`` array or a list
of PIL images, :mod:`.qwen2_vl_video`) becomes ``pixel_values_videos``, ``video_grid_thw``
``[1, 3]`` and ``second_per_grid_t`` ``[1]`` (float32: ``temporal_patch_size / fps``, the
seconds one temporal patch spans, which Qwen2.5-VL's temporal positions scale by); its one
``<|video_pad|>`` in the prompt (``<|vision_start|><|video_pad|><|vision_end|>``) is expanded
to ``grid_t * grid_h * grid_w / merge_size**2`` tokens.

``fps`` is the rate at which the caller sampled the frames (``mm_processor_kwargs={"fps":
2.0}``); without it the frames are taken as 24 per second, what transformers' Qwen2.5-VL
processor assumes for frames given without metadata. A video given as vLLM's ``(frames,
metadata)`` (what a chat ``video_url`` part loads to, :mod:`chassis.core.video_loading`)
is timed by its metadata instead, as transformers' processor times it: its kept frames per
second of video (:func:`~chassis.core.multimodal_inputs.sampled_fps`).
``min_pixels`` / ``max_pixels`` bound each frame as they bound an image.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from chassis.builtin_plugins.models.qwen2_vl_processing import PIXEL_KWARGS, Qwen2VLImageInputs
from chassis.builtin_plugins.models.qwen2_vl_video import VideoSettings, video_patches
from chassis.core.multimodal_inputs import sampled_fps, video_frames_and_metadata

#: the text standing for one video in a Qwen2-VL prompt (what its chat template writes)
VIDEO_PLACEHOLDER = "<|vision_start|><|video_pad|><|vision_end|>"
#: the frame rate assumed when the request gives none (transformers' default for frames
#: without metadata)
DEFAULT_FPS = 24.0


class Qwen2VLMediaInputs(Qwen2VLImageInputs):
    """Images and videos of Qwen2-VL / Qwen2.5-VL requests (module docstring).

    ``video_settings``: the checkpoint's video processing settings; ``video_token_id``: the
    ``<|video_pad|>`` id.
    """

    def __init__(
        self,
        image_processor: Any,
        image_token_id: int,
        merge_size: int,
        video_settings: VideoSettings,
        video_token_id: int,
    ) -> None:
        super().__init__(image_processor, image_token_id, merge_size)
        if video_settings.merge_size != merge_size:
            raise ValueError(
                f"the video processor's merge_size ({video_settings.merge_size}) differs from "
                f"the model's vision_config.spatial_merge_size ({merge_size})"
            )
        self.video_settings = video_settings
        self.placeholder_token_ids = {"image": int(image_token_id), "video": int(video_token_id)}

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, hf_config: Any) -> Qwen2VLMediaInputs:
        """As :meth:`Qwen2VLImageInputs.from_pretrained`, with the video settings
        (:meth:`VideoSettings.from_pretrained`) and ``hf_config.video_token_id``."""
        images = Qwen2VLImageInputs.from_pretrained(model_dir, hf_config)
        video_token_id = getattr(hf_config, "video_token_id", None)
        if video_token_id is None:
            raise ValueError("the model's config lacks video_token_id: it cannot take videos")
        return cls(
            images.image_processor,
            images.placeholder_token_ids["image"],
            images.merge_size,
            VideoSettings.from_pretrained(model_dir),
            int(video_token_id),
        )

    def prompt_placeholder(self, modality: str) -> str:
        return VIDEO_PLACEHOLDER if modality == "video" else super().prompt_placeholder(modality)

    def check_kwargs(self, kwargs: Mapping[str, Any]) -> None:
        """``min_pixels`` / ``max_pixels`` as for images; ``fps`` a number > 0."""
        fps = kwargs.get("fps")
        if fps is not None and (
            isinstance(fps, bool) or not isinstance(fps, int | float) or not fps > 0
        ):
            raise ValueError(f"mm_processor_kwargs.fps must be a number > 0; got {fps!r}")
        unknown = sorted(set(kwargs) - {*PIXEL_KWARGS, "fps"})
        if unknown:
            raise ValueError(
                f"mm_processor_kwargs: {', '.join(unknown)} not supported; this model takes "
                f"{', '.join(PIXEL_KWARGS)} and fps"
            )
        super().check_kwargs({k: v for k, v in kwargs.items() if k != "fps"})

    def process_item(
        self, modality: str, item: Any, kwargs: Mapping[str, Any]
    ) -> tuple[int, dict[str, torch.Tensor]]:
        if modality != "video":
            pixel_kwargs = {k: v for k, v in kwargs.items() if k != "fps"}
            return super().process_item(modality, item, pixel_kwargs)
        frames, metadata = video_frames_and_metadata(item)
        pixels, grid = video_patches(
            frames, self.video_settings, kwargs.get("min_pixels"), kwargs.get("max_pixels")
        )
        # (a video's own timing wins over the request's fps, as in transformers)
        fps = (sampled_fps(metadata) if metadata else None) or kwargs.get("fps") or DEFAULT_FPS
        fps = float(fps)
        seconds = torch.tensor([self.video_settings.temporal_patch_size / fps])
        length = int(grid.prod()) // self.merge_size**2
        return length, {
            "pixel_values_videos": pixels,
            "video_grid_thw": grid,
            "second_per_grid_t": seconds.to(torch.float32),
        }
