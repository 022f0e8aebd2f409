"""LLaVA-OneVision video frames -> the model's inputs, as transformers'
``LlavaOnevisionVideoProcessor`` makes them, and a video's placeholder count.

The caller gives the frames (vLLM's offline video input: a ``[T, H, W, 3]`` ``uint8`` array,
a list of PIL images of one size, or the ``(frames, metadata)`` a chat ``video_url`` part
loads to, :mod:`chassis.core.video_loading`). They are taken as they are: no frame is
sampled (HF's processor samples none by default, ``do_sample_frames`` off). Each frame is
resized to ``size`` (384 x 384 by default; bicubic with PIL, as the image path does, where
HF's video processor resizes with torchvision: frames already of that size give the same
values, resized ones differ by interpolation rounding), rescaled and normalized with the
checkpoint's mean and std: ``pixel_values_videos`` ``[T, 3, S, S]`` float32.

The model pools each frame's ``side x side`` feature rows to ``ceil(side / 2)`` a side
(bilinear) and ends the video with one ``image_newline`` row: ``T * ceil(side / 2)^2 + 1``
placeholder tokens (:func:`num_video_tokens`, transformers' count). Settings come from the
checkpoint's ``video_preprocessor_config.json`` or, as transformers falls back, its
``preprocessor_config.json``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from chassis.builtin_plugins.models.llava_processing import (
    CLIP_MEAN,
    CLIP_STD,
    ClipPreprocessing,
)
from chassis.builtin_plugins.models.processor_files import video_processor_config
from chassis.builtin_plugins.models.qwen2_vl_video import frames_array
from chassis.core.multimodal_inputs import video_frames_and_metadata

#: transformers' ``LlavaOnevisionVideoProcessor`` defaults for what a config leaves out
_DEFAULTS: dict[str, Any] = {
    "size": {"height": 384, "width": 384},
    "image_mean": CLIP_MEAN,
    "image_std": CLIP_STD,
    "resample": 3,
}


def pooled_side(side: int) -> int:
    """Feature rows per side of a pooled frame (``side``: the tower's per tile)."""
    return math.ceil(side / 2)


def num_video_tokens(frames: int, side: int) -> int:
    """Placeholder tokens of a video of ``frames`` frames: the pooled rows of each, then one
    newline row."""
    return frames * pooled_side(side) ** 2 + 1


class VideoFrames:
    """The per-frame steps of a checkpoint (the module docstring) for a tower of ``side``
    pixels."""

    def __init__(self, steps: ClipPreprocessing) -> None:
        self.steps = steps

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, side: int) -> VideoFrames:
        """The steps of the checkpoint in ``model_dir``; ``ValueError`` when it has neither
        config file, or its frames would not be the tower's ``side x side`` square."""
        return cls.from_dict(video_processor_config(model_dir), side)

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], side: int) -> VideoFrames:
        """From a processor config (the video processor's, or the image processor's);
        ``ValueError`` for settings that would not make ``side x side`` frames."""
        settings = {**_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
        steps = ClipPreprocessing.from_dict(
            {
                **settings,
                "image_processor_type": "CLIPImageProcessor",
                "do_pad": False,
                "do_center_crop": bool(settings.get("do_center_crop")),
            }
        )
        if steps.fixed_size() != (side, side):
            raise ValueError(
                f"the video processor settings make frames of another size than the vision "
                f"tower's {side}x{side} (image_size): not supported"
            )
        return cls(steps)

    def __call__(self, video: Any) -> torch.Tensor:
        """A video item -> ``pixel_values_videos`` ``[T, 3, S, S]`` float32; ``ValueError``
        for an item that is no video."""
        from PIL import Image

        frames, _ = video_frames_and_metadata(video)  # (no sampling: the metadata is unused)
        array = frames_array(frames)
        pixels = np.stack([self.steps(Image.fromarray(frame)) for frame in array])
        return torch.from_numpy(pixels)
