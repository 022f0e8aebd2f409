"""Qwen3-VL / Qwen3-VL-MoE images and videos -> the model's inputs (the front-end's
processor of :class:`~chassis.builtin_plugins.models.qwen3_vl.Qwen3VLImages` models).

Images as Qwen2-VL's (:class:`~.qwen2_vl_processing.Qwen2VLImageInputs`). A video
(``multi_modal_data={"video": frames}``: a ``[T, H, W, 3]`` ``uint8`` array, a list of PIL
images, or vLLM's ``(frames, metadata)``, what a chat ``video_url`` part loads to) becomes
``pixel_values_videos``, ``video_grid_thw`` ``[1, 3]`` and ``placeholder_ids``, the token ids
of its run: the prompt's one ``<|video_pad|>`` is replaced by transformers'
``Qwen3VLProcessor`` text for the video, a timestamp and ``<|vision_start|>`` ...
``<|vision_end|>`` around each temporal patch group's pad tokens (:mod:`.qwen3_vl_video`),
and the feature covers the whole run (the model embeds its text tokens as text).

The run's text is tokenized with the checkpoint's own tokenizer (loaded from the model
folder on the first video). ``mm_processor_kwargs``: ``min_pixels`` / ``max_pixels`` bound an
image's pixels, not a video's (as in transformers, whose video processor takes neither: a
video's frames are sized by the checkpoint's video ``size``, pixels over all its frames);
``fps``, the rate the caller sampled raw frames at (a video's metadata wins).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from chassis.builtin_plugins.models.qwen2_vl_media import Qwen2VLMediaInputs
from chassis.builtin_plugins.models.qwen2_vl_processing import Qwen2VLImageInputs
from chassis.builtin_plugins.models.qwen2_vl_video import frames_array, video_patches
from chassis.builtin_plugins.models.qwen3_vl_video import (
    DEFAULT_FPS,
    Qwen3VLVideoSettings,
    frame_indices,
    frame_size,
    group_seconds,
    video_run_text,
)
from chassis.builtin_plugins.models.run_writing_processor import RunWritingProcessor
from chassis.core.multimodal_inputs import video_frames_and_metadata


class Qwen3VLMediaInputs(RunWritingProcessor, Qwen2VLMediaInputs):
    """Images and videos of Qwen3-VL requests (module docstring). ``model_dir``: the
    checkpoint folder, whose tokenizer writes a video's run."""

    video_settings: Qwen3VLVideoSettings

    #: the modality whose placeholder token a video's rows sit at in its run (GLM-V's
    #: videos use the image token)
    video_row_modality = "video"

    def __init__(
        self,
        image_processor: Any,
        image_token_id: int,
        merge_size: int,
        video_settings: Qwen3VLVideoSettings,
        video_token_id: int,
        model_dir: str | Path,
    ) -> None:
        super().__init__(
            image_processor, image_token_id, merge_size, video_settings, video_token_id
        )
        self.model_dir = str(model_dir)
        self._tokenizer: Any = None
        self._lock = threading.Lock()

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, hf_config: Any) -> Qwen3VLMediaInputs:
        """As :meth:`Qwen2VLMediaInputs.from_pretrained`, with Qwen3-VL's video settings
        (:meth:`Qwen3VLVideoSettings.from_pretrained`)."""
        images = Qwen2VLImageInputs.from_pretrained(model_dir, hf_config)
        video_token_id = getattr(hf_config, "video_token_id", None)
        if video_token_id is None:
            raise ValueError("the model's config lacks video_token_id: it cannot take videos")
        return cls(
            images.image_processor,
            images.placeholder_token_ids["image"],
            images.merge_size,
            cls.video_settings_of(model_dir),
            int(video_token_id),
            model_dir,
        )

    @classmethod
    def video_settings_of(cls, model_dir: str | Path) -> Qwen3VLVideoSettings:
        """The checkpoint's video settings (:meth:`Qwen3VLVideoSettings.from_pretrained`)."""
        settings = Qwen3VLVideoSettings.from_pretrained(model_dir)
        assert isinstance(settings, Qwen3VLVideoSettings)
        return settings

    def tokenizer(self) -> Any:
        """The checkpoint's tokenizer, loaded once."""
        with self._lock:
            if self._tokenizer is None:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
            return self._tokenizer

    def min_video_frames(self) -> int:
        """The fewest frames a video may have: 1 (its last frame repeats to fill the last
        temporal patch)."""
        return 1

    def video_text(self, indices: list[int], fps: float, grid_t: int, tokens_per_group: int) -> str:
        """The text of a video's run: its ``grid_t`` temporal patch groups of
        ``tokens_per_group`` tokens, timed by the kept frames' ``indices`` at ``fps``
        (:func:`~.qwen3_vl_video.group_seconds`, :func:`~.qwen3_vl_video.video_run_text`)."""
        seconds = group_seconds(indices, fps, self.video_settings.temporal_patch_size)
        return video_run_text(seconds, tokens_per_group)

    def process_item(
        self, modality: str, item: Any, kwargs: Mapping[str, Any]
    ) -> tuple[int, dict[str, torch.Tensor]]:
        if modality != "video":
            return super().process_item(modality, item, kwargs)
        settings = self.video_settings
        frames, metadata = video_frames_and_metadata(item)
        array = frames_array(frames)
        count, height, width, _ = array.shape
        if count < self.min_video_frames():
            raise ValueError(
                f"a video needs at least {self.min_video_frames()} frames (the model's temporal "
                f"patch); got {count}"
            )
        # (the request's min_pixels / max_pixels bound images only: HF's Qwen3-VL and GLM-V
        # video processors take no such keys, only their own ``size``)
        size = frame_size(count, height, width, settings)
        pixels, grid = video_patches(array, settings, size=size)
        fps = float((metadata or {}).get("fps") or kwargs.get("fps") or DEFAULT_FPS)
        grid_t, grid_h, grid_w = (int(x) for x in grid[0])
        per_group = grid_h * grid_w // self.merge_size**2
        text = self.video_text(frame_indices(metadata, count), fps, grid_t, per_group)
        run = self.tokenizer().encode(text, add_special_tokens=False)
        row_token = self.placeholder_token_ids[self.video_row_modality]
        # (also catches a run of another group count than the grid's)
        if run.count(row_token) != grid_t * per_group:
            raise ValueError(
                f"the tokenizer of {self.model_dir!r} does not encode a video's run to "
                f"{grid_t * per_group} tokens of id {row_token} (is it the model's own?)"
            )
        return len(run), {
            "pixel_values_videos": pixels,
            "video_grid_thw": grid,
            "placeholder_ids": torch.tensor(run, dtype=torch.int64),
        }
