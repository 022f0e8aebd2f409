"""Qwen3-VL / Qwen3-VL-MoE video frames -> the tower's patches and the prompt's run of
tokens, as transformers' ``Qwen3VLVideoProcessor`` and ``Qwen3VLProcessor`` do.

The frames are taken as the caller gives them (none sampled or dropped: HF's processor with
``do_sample_frames=False``, what vLLM passes for frames its loader already sampled); a video
needs at least ``temporal_patch_size`` frames (HF refuses fewer). Unlike Qwen2-VL, the frame
size is chosen for the whole clip (:func:`frame_size`): ``round(frames / tp) * tp * height
* width`` must lie in the size bounds (``size.shortest_edge`` / ``size.longest_edge``, in
pixels over all frames), and with the config's ``cap_pixels_per_frame`` each frame's share
is capped first as HF caps it. Resizing, normalization and the patch order are Qwen2-VL's
(:func:`~.qwen2_vl_video.video_patches`; PIL bicubic where HF resizes with torchvision, so
frames that need resizing differ by interpolation rounding).

In the prompt, each temporal patch group (``tp`` frames) is written as ``<{t:.1f}
seconds><|vision_start|>`` + ``<|video_pad|>`` x ``grid_h * grid_w / merge**2`` +
``<|vision_end|>``, ``t`` the mean of the group's first and last frame times, each frame's
time ``frames_indices[i] / fps`` (:func:`group_seconds`): ``fps`` the video's own rate and
``frames_indices`` the kept frames (a loaded video's metadata), else the request's ``fps``
with the frames numbered 0, 1, ...; without either, 24 frames per second, transformers'
default.

Settings: the checkpoint's ``video_preprocessor_config.json``, or its
``preprocessor_config.json`` as transformers falls back, over the Qwen3-VL video
processor's defaults (patch 16, mean and std 0.5, 128 to 768 tokens of 32x32 pixels).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from chassis.builtin_plugins.models.qwen2_vl_video import VideoSettings

#: transformers' ``Qwen3VLVideoProcessor`` class defaults that differ from Qwen2-VL's
QWEN3_VL_VIDEO_DEFAULTS: dict[str, Any] = {
    "size": {"shortest_edge": 128 * 32 * 32, "longest_edge": 768 * 32 * 32},
    "patch_size": 16,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}
#: the frame rate assumed when neither the video nor the request gives one (transformers')
DEFAULT_FPS = 24.0
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
VIDEO_PAD = "<|video_pad|>"


@dataclass(frozen=True)
class Qwen3VLVideoSettings(VideoSettings):
    """:class:`VideoSettings` whose pixel bounds count all of a clip's frames, and HF's
    per-frame cap (``cap_pixels_per_frame``, off unless the config sets it;
    ``max_video_tokens`` tokens a frame at most under it)."""

    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 768

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> Qwen3VLVideoSettings:
        """From a processor config over :data:`QWEN3_VL_VIDEO_DEFAULTS` (a config's ``size``
        replaces the default bounds whole)."""
        merged = {**QWEN3_VL_VIDEO_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
        settings = super().from_dict(merged)
        assert isinstance(settings, Qwen3VLVideoSettings)
        return dataclasses.replace(
            settings,
            cap_pixels_per_frame=bool(config.get("cap_pixels_per_frame") or False),
            max_video_tokens=int(config.get("max_video_tokens") or 768),
        )


def frame_size(
    num_frames: int,
    height: int,
    width: int,
    settings: Qwen3VLVideoSettings,
) -> tuple[int, int]:
    """The (height, width) every frame of a clip of ``num_frames`` frames of ``height x
    width`` is resized to (module docstring): multiples of ``patch_size * merge_size``, near
    the aspect ratio, within the settings' pixel bounds over all frames (a request's
    ``min_pixels`` / ``max_pixels`` bound its images only, as HF's video processors take
    neither). ``ValueError`` for fewer frames than ``temporal_patch_size`` or an aspect ratio
    over 200."""
    factor = settings.patch_size * settings.merge_size
    tp = settings.temporal_patch_size
    low = settings.min_pixels
    high = settings.max_pixels
    if num_frames < tp:
        raise ValueError(
            f"a Qwen3-VL video needs at least {tp} frames (its temporal patch); got {num_frames}"
        )
    if settings.cap_pixels_per_frame:
        per_frame = min(settings.max_video_tokens * factor * factor, high // num_frames)
        high = max(per_frame, int(low * 1.05)) * num_frames
    if height < factor or width < factor:
        # a side under one token is scaled up first, keeping the aspect ratio (truncated)
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"the video's aspect ratio must be under 200; frames are {height}x{width}")
    new_h = round(height / factor) * factor
    new_w = round(width / factor) * factor
    frames = round(num_frames / tp) * tp
    if frames * new_h * new_w > high:
        beta = math.sqrt(num_frames * height * width / high)
        new_h = max(factor, math.floor(height / beta / factor) * factor)
        new_w = max(factor, math.floor(width / beta / factor) * factor)
    elif frames * new_h * new_w < low:
        beta = math.sqrt(low / (num_frames * height * width))
        new_h = math.ceil(height * beta / factor) * factor
        new_w = math.ceil(width * beta / factor) * factor
    return new_h, new_w


def group_seconds(indices: Sequence[int], fps: float, temporal_patch_size: int) -> list[float]:
    """The time of each temporal patch group: the frames' times ``index / fps`` (the last
    index repeated to fill the last group, as its frame is), then the mean of each group's
    first and last."""
    padded = list(indices)
    if not padded:
        raise ValueError("a video has no frames")
    padded += [padded[-1]] * (-len(padded) % temporal_patch_size)
    times = [index / fps for index in padded]
    return [
        (times[i] + times[i + temporal_patch_size - 1]) / 2
        for i in range(0, len(times), temporal_patch_size)
    ]


def video_run_text(seconds: Sequence[float], tokens_per_group: int) -> str:
    """The text that replaces a video's ``<|video_pad|>`` (module docstring)."""
    group = f"{VISION_START}{VIDEO_PAD * tokens_per_group}{VISION_END}"
    return "".join(f"<{t:.1f} seconds>{group}" for t in seconds)


def frame_indices(metadata: Mapping[str, Any] | None, num_frames: int) -> list[int]:
    """The kept frames' indices in the source video: the metadata's ``frames_indices``
    (``ValueError`` when they are not one per frame), else ``0 .. num_frames - 1``."""
    indices = (metadata or {}).get("frames_indices")
    if indices is None:
        return list(range(num_frames))
    indices = [int(i) for i in indices]
    if len(indices) != num_frames:
        raise ValueError(
            f"a video's metadata 'frames_indices' has {len(indices)} entries for its "
            f"{num_frames} frames (one per frame expected)"
        )
    return indices
