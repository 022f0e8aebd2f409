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

``mm_processor_kwargs``: ``min_pixels`` / ``max_pixels`` bound an image's pixels and a video's
pixels over all its frames; ``fps``, the rate the caller sampled raw frames at (a video's
metadata wins). Settings come from ``video_preprocessor_config.json`` (else
``preprocessor_config.json``, as transformers falls back) over ``Glm4vVideoProcessor``'s
defaults.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from chassis.builtin_plugins.models.glm4v_processing import IMAGE_PLACEHOLDER
from chassis.builtin_plugins.models.qwen2_vl_processing import Qwen2VLImageInputs
from chassis.builtin_plugins.models.qwen2_vl_video import VideoSettings, frames_array, video_patches
from chassis.builtin_plugins.models.qwen3_vl_media import Qwen3VLMediaInputs
from chassis.builtin_plugins.models.qwen3_vl_video import (
    DEFAULT_FPS,
    Qwen3VLVideoSettings,
    frame_indices,
    frame_size,
)
from chassis.core.multimodal_inputs import video_frames_and_metadata

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
    config: dict[str, Any] = {}
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        path = Path(model_dir) / name
        if path.is_file():
            config = json.loads(path.read_text())
            break
    else:
        raise ValueError(
            f"the checkpoint {str(model_dir)!r} has no video_preprocessor_config.json or "
            "preprocessor_config.json: its video settings are unknown"
        )
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

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, hf_config: Any) -> Glm4vMediaInputs:
        """The processor of the checkpoint in ``model_dir``: its image processor
        (``preprocessor_config.json``), video settings (:func:`glm4v_video_settings`) and
        tokenizer, with ``hf_config``'s ``image_token_id`` / ``video_token_id``."""
        images = Qwen2VLImageInputs.from_pretrained(model_dir, hf_config)
        video_token_id = getattr(hf_config, "video_token_id", None)
        if video_token_id is None:
            raise ValueError("the model's config lacks video_token_id: it cannot take videos")
        return cls(
            images.image_processor,
            images.placeholder_token_ids["image"],
            images.merge_size,
            glm4v_video_settings(model_dir),
            int(video_token_id),
            model_dir,
        )

    def prompt_placeholder(self, modality: str) -> str:
        return VIDEO_PLACEHOLDER if modality == "video" else IMAGE_PLACEHOLDER

    def process_item(
        self, modality: str, item: Any, kwargs: Mapping[str, Any]
    ) -> tuple[int, dict[str, torch.Tensor]]:
        if modality != "video":
            return super().process_item(modality, item, kwargs)
        settings = self.video_settings
        frames, metadata = video_frames_and_metadata(item)
        array = frames_array(frames)
        count, height, width, _ = array.shape
        if count < settings.temporal_patch_size:
            raise ValueError(
                f"a GLM-4.1V video needs at least {settings.temporal_patch_size} frames (its "
                f"temporal patch); got {count}"
            )
        size = frame_size(
            count, height, width, settings, kwargs.get("min_pixels"), kwargs.get("max_pixels")
        )
        pixels, grid = video_patches(array, settings, size=size)
        fps = float((metadata or {}).get("fps") or kwargs.get("fps") or DEFAULT_FPS)
        grid_t, grid_h, grid_w = (int(x) for x in grid[0])
        seconds = frame_seconds(frame_indices(metadata, count), fps, grid_t)
        per_group = grid_h * grid_w // self.merge_size**2
        run = self.tokenizer().encode(video_run_text(seconds, per_group), add_special_tokens=False)
        image_token = self.placeholder_token_ids["image"]
        if run.count(image_token) != grid_t * per_group:
            raise ValueError(
                f"the tokenizer of {self.model_dir!r} does not encode a video's run to "
                f"{grid_t * per_group} tokens of id {image_token} (is it the model's own?)"
            )
        return len(run), {
            "pixel_values_videos": pixels,
            "video_grid_thw": grid,
            "placeholder_ids": torch.tensor(run, dtype=torch.int64),
        }
