"""GLM-4.1V / GLM-4.5V images and videos -> the model's inputs, as transformers'
``Glm4vProcessor`` with its ``Glm4vVideoProcessor``.

Images as :class:`~.glm4v_processing.Glm4vImageInputs`. A video (``multi_modal_data={"video":
frames}``: a ``[T, H, W, 3]`` ``uint8`` array, a list of PIL images, or vLLM's ``(frames,
metadata)``, what a chat ``video_url`` part loads to) becomes ``pixel_values_videos``,
``video_grid_thw`` ``[1, 3]`` and ``placeholder_ids``, the token ids of its run:

- **Frames** are taken as the caller gives them (HF's processor with
  ``do_sample_frames=False``: the caller or the chat loader sampled them); at least
  ``temporal_patch_size`` (2) of them, as HF requires. The frame size is chosen for the whole
  clip by GLM's ``smart_resize`` (the same rule as Qwen3-VL's, :func:`~.qwen3_vl_video.
  frame_size`: ``round(T / 2) * 2 * h * w`` within ``size.shortest_edge`` ..
  ``size.longest_edge``); resize (PIL bicubic where HF uses torchvision), CLIP's mean and std
  and the patch order are Qwen2-VL's (:func:`~.qwen2_vl_video.video_patches`).
- **Prompt**: the chat template writes ``<|begin_of_video|><|video|><|end_of_video|>``; its
  ``<|video|>`` becomes, per temporal patch group, ``<|begin_of_image|>`` + ``<|image|>`` x
  ``grid_h * grid_w / merge**2`` + ``<|end_of_image|>`` + the group's time in whole seconds
  (``int``), HF's ``replace_video_token``: the times of every second frame, ``frames_indices[i]
  / fps``, with ``fps`` the video's own rate and ``frames_indices`` the kept frames (a loaded
  video's metadata), else the request's ``fps`` with the frames numbered 0, 1, ...; without
  either 24 frames per second, transformers' default. The video's rows sit at the
  ``<|image|>`` tokens of its run (GLM's video frames use the image token).

``mm_processor_kwargs``: ``min_pixels`` / ``max_pixels`` bound an image's pixels, not a video's
(HF's ``Glm4vVideoProcessor`` takes neither: a video's frames are sized by the checkpoint's
video ``size``, pixels over all its frames); ``fps``, the rate the caller sampled raw frames at (a video's
metadata wins). Settings come from ``video_preprocessor_config.json`` (else
``preprocessor_config.json``, as transformers falls back) over ``Glm4vVideoProcessor``'s
defaults.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from chassis.builtin_plugins.models.glm4v_processing import IMAGE_PLACEHOLDER
from chassis.builtin_plugins.models.processor_files import video_processor_config
from chassis.builtin_plugins.models.qwen2_vl_video import VideoSettings
from chassis.builtin_plugins.models.qwen3_vl_media import Qwen3VLMediaInputs
from chassis.builtin_plugins.models.qwen3_vl_video import Qwen3VLVideoSettings

#: the text standing for one video in a GLM-4.1V prompt (what its chat template writes)
VIDEO_PLACEHOLDER = "<|begin_of_video|><|video|><|end_of_video|>"
#: ``Glm4vVideoProcessor``'s class defaults (transformers 5)
GLM4V_VIDEO_DEFAULTS: dict[str, Any] = {
    "size": {"shortest_edge": 112 * 112, "longest_edge": 28 * 28 * 2 * 30000},
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}


def glm4v_video_settings(model_dir: str | Path) -> Qwen3VLVideoSettings:
    """The checkpoint's video settings (module docstring); the pixel bounds count all of a
    clip's frames, as Qwen3-VL's (no per-frame cap)."""
    config = video_processor_config(model_dir)
    merged = {**GLM4V_VIDEO_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
    # (GLM's video processor reads only ``size`` for its bounds)
    merged.pop("min_pixels", None)
    merged.pop("max_pixels", None)
    base = VideoSettings.from_dict(merged)
    return Qwen3VLVideoSettings(**dataclasses.asdict(base))


def frame_seconds(indices: list[int], fps: float, num_groups: int) -> list[int]:
    """HF's ``replace_video_token`` times: every second frame's ``index / fps``, the first
    ``num_groups`` of them (the last repeated when short), truncated to whole seconds."""
    times = [index / fps for index in indices[::2]][:num_groups]
    while len(times) < num_groups:
        times.append(times[-1] if times else 0)
    return [int(t) for t in times]


def video_run_text(seconds: list[int], tokens_per_group: int) -> str:
    """The text that replaces a video's ``<|video|>`` (module docstring)."""
    group = f"<|begin_of_image|>{'<|image|>' * tokens_per_group}<|end_of_image|>"
    return "".join(f"{group}{t}" for t in seconds)


class Glm4vMediaInputs(Qwen3VLMediaInputs):
    """Images and videos of GLM-4.1V / GLM-4.5V requests (module docstring): the image
    path of :class:`~.glm4v_processing.Glm4vImageInputs`, the run-writing video path and
    tokenizer of Qwen3-VL's processor with GLM's placeholders, timestamps and settings."""

    video_row_modality = "image"

    @classmethod
    def video_settings_of(cls, model_dir: str | Path) -> Qwen3VLVideoSettings:
        """GLM's video settings (:func:`glm4v_video_settings`)."""
        return glm4v_video_settings(model_dir)

    def prompt_placeholder(self, modality: str) -> str:
        return VIDEO_PLACEHOLDER if modality == "video" else IMAGE_PLACEHOLDER

    def min_video_frames(self) -> int:
        """A whole temporal patch (HF refuses fewer frames)."""
        return self.video_settings.temporal_patch_size

    def video_text(self, indices: list[int], fps: float, grid_t: int, tokens_per_group: int) -> str:
        """GLM's run (module docstring): :func:`frame_seconds`, :func:`video_run_text`."""
        return video_run_text(frame_seconds(indices, fps, grid_t), tokens_per_group)
