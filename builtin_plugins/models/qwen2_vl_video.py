"""Qwen2-VL / Qwen2.5-VL video frames -> the tower's patches, as transformers'
``Qwen2VLVideoProcessor`` does.

The caller gives the frames (vLLM's offline video input): a ``numpy`` array ``[T, H, W, 3]``
of ``uint8`` or a list of PIL images of one size. They are taken as they are: no frame is
sampled or dropped by fps (HF's video processor does not sample by default either). Each
frame is resized to the size ``smart_resize`` gives (both sides multiples of ``patch_size *
merge_size``, the pixel count in ``[min_pixels, max_pixels]``; bicubic, with PIL as the
image path does, where HF's video processor resizes with torchvision: frames that need no
resize give the same values, resized ones differ by interpolation rounding), rescaled and
normalized with the checkpoint's mean and std; the frame count is padded to a multiple of
``temporal_patch_size`` by repeating the last frame, and the frames are cut into
``grid_t * grid_h * grid_w`` patches of ``3 * temporal_patch_size * patch_size**2`` values in
HF's order (merge groups of ``merge_size x merge_size`` patches contiguous).

Settings come from the checkpoint's ``video_preprocessor_config.json``, or, as transformers
falls back, its ``preprocessor_config.json``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from chassis.builtin_plugins.models.processor_files import video_processor_config

#: transformers' ``OPENAI_CLIP_MEAN`` / ``OPENAI_CLIP_STD`` (the processor class defaults)
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple:
    """The (height, width) a frame is resized to: each a multiple of ``factor``, near the
    original aspect ratio, the area within ``[min_pixels, max_pixels]`` (the rule of
    Qwen2-VL's processors); ``ValueError`` for an aspect ratio over 200."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"the video's aspect ratio must be under 200; frames are {height}x{width}")
    new_h = max(factor, round(height / factor) * factor)
    new_w = max(factor, round(width / factor) * factor)
    if new_h * new_w > max_pixels:
        scale = math.sqrt(height * width / max_pixels)
        new_h = max(factor, math.floor(height / scale / factor) * factor)
        new_w = max(factor, math.floor(width / scale / factor) * factor)
    elif new_h * new_w < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        new_h = math.ceil(height * scale / factor) * factor
        new_w = math.ceil(width * scale / factor) * factor
    return new_h, new_w


@dataclass(frozen=True)
class VideoSettings:
    """A checkpoint's video processing settings (transformers' names)."""

    min_pixels: int
    max_pixels: int
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = _CLIP_MEAN
    image_std: tuple[float, ...] = _CLIP_STD
    rescale_factor: float = 1 / 255

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> VideoSettings:
        """The settings of the checkpoint in ``model_dir`` (module docstring);
        ``ValueError`` when it has neither config file."""
        return cls.from_dict(video_processor_config(model_dir))

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> VideoSettings:
        """From a processor config: ``size`` ``{shortest_edge, longest_edge}`` (in pixels)
        or ``min_pixels`` / ``max_pixels`` (which win, as in transformers); transformers'
        video defaults (128 to 768 tokens of 28x28 pixels) for bounds it lacks."""
        size = config.get("size") or {}
        low = config.get("min_pixels") or size.get("shortest_edge") or 128 * 28 * 28
        high = config.get("max_pixels") or size.get("longest_edge") or 768 * 28 * 28
        kwargs: dict[str, Any] = {"min_pixels": int(low), "max_pixels": int(high)}
        for name in ("patch_size", "temporal_patch_size", "merge_size"):
            if config.get(name) is not None:
                kwargs[name] = int(config[name])
        for name in ("image_mean", "image_std"):
            if config.get(name) is not None:
                kwargs[name] = tuple(float(x) for x in config[name])
        if config.get("rescale_factor") is not None:
            kwargs["rescale_factor"] = float(config["rescale_factor"])
        return cls(**kwargs)


def frames_array(video: Any) -> np.ndarray:
    """A video's frames as ``[T, H, W, 3]`` ``uint8``: ``video`` such an array, or a list of
    PIL images of one size (made RGB). ``ValueError`` naming what is wrong otherwise."""
    from PIL import Image

    if isinstance(video, list | tuple):
        if not video or not all(isinstance(f, Image.Image) for f in video):
            raise ValueError(
                "a video given as a list must be a non-empty list of PIL images (its frames)"
            )
        sizes = {f.size for f in video}
        if len(sizes) != 1:
            raise ValueError(f"a video's frames must share one size; got {sorted(sizes)}")
        video = np.stack([np.asarray(f.convert("RGB")) for f in video])
    if not isinstance(video, np.ndarray):
        raise ValueError(
            "a video must be a numpy array [frames, height, width, 3] of uint8 or a list of PIL "
            f"images; got {type(video).__name__}"
        )
    if video.dtype != np.uint8:
        raise ValueError(f"a video array must be uint8 (0..255); got {video.dtype}")
    if video.ndim != 4 or video.shape[-1] != 3 or 0 in video.shape:
        raise ValueError(
            f"a video array must be [frames, height, width, 3] with none empty; got shape "
            f"{list(video.shape)}"
        )
    return video


def video_patches(
    video: Any,
    settings: VideoSettings,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    size: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``pixel_values_videos`` ``[grid_t*grid_h*grid_w, 3*tp*p*p]`` float32 and
    ``video_grid_thw`` ``[1, 3]`` of one video (module docstring); ``min_pixels`` /
    ``max_pixels`` override the settings' bounds per frame; ``size`` (height, width; both
    multiples of ``patch_size * merge_size``), when given, is the frame size instead of
    ``smart_resize``'s (Qwen3-VL sizes a video by all its frames, :mod:`.qwen3_vl_video`)."""
    from PIL import Image

    frames = frames_array(video)
    count, height, width, _ = frames.shape
    p, tp, m = settings.patch_size, settings.temporal_patch_size, settings.merge_size
    new_h, new_w = size or smart_resize(
        height,
        width,
        p * m,
        min_pixels or settings.min_pixels,
        max_pixels or settings.max_pixels,
    )
    if (new_h, new_w) != (height, width):
        frames = np.stack(
            [
                np.asarray(Image.fromarray(f).resize((new_w, new_h), Image.Resampling.BICUBIC))
                for f in frames
            ]
        )
    # fused rescale + normalize, as HF's video processor: (x - mean/r) / (std/r)
    mean = np.asarray(settings.image_mean, dtype=np.float32) / np.float32(settings.rescale_factor)
    std = np.asarray(settings.image_std, dtype=np.float32) / np.float32(settings.rescale_factor)
    pixels = (frames.astype(np.float32) - mean) / std  # [T, H, W, C]
    pixels = pixels.transpose(0, 3, 1, 2)  # [T, C, H, W]
    if pad := -count % tp:
        pixels = np.concatenate([pixels, np.repeat(pixels[-1:], pad, axis=0)])
    grid_t, grid_h, grid_w = pixels.shape[0] // tp, new_h // p, new_w // p
    patches = pixels.reshape(grid_t, tp, 3, grid_h // m, m, p, grid_w // m, m, p)
    # (t, row group, column group, row in group, column in group, C, tp, py, px)
    patches = patches.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    flat = np.ascontiguousarray(patches).reshape(grid_t * grid_h * grid_w, 3 * tp * p * p)
    grid = torch.tensor([[grid_t, grid_h, grid_w]], dtype=torch.int64)
    return torch.from_numpy(flat), grid
