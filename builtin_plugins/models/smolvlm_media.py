"""SmolVLM2 images and videos -> the model's inputs (the front-end's processor of
:class:`~chassis.builtin_plugins.models.smolvlm.SmolVLMForConditionalGenerationWithImages`).

Images as Idefics3's (:class:`~.idefics3_processing.Idefics3ImageInputs`). A video
(``multi_modal_data={"video": frames}``: a ``[T, H, W, 3]`` ``uint8`` array, a list of PIL
images, or vLLM's ``(frames, metadata)``, what a chat ``video_url`` part loads to) is taken
frame by frame as given (no frame sampled or dropped: ``SmolVLMVideoProcessor``'s default
``do_sample_frames=False``; the caller or the chat loader sampled them) and becomes
``pixel_values`` ``[frames, 3, M, M]`` (one tile a frame, :mod:`.smolvlm_video`) and
``placeholder_ids``, the token ids of its run: the prompt's ``<video>`` (what the chat
template writes for a video: the tokenizer's one token, or that text where the tokenizer has
no such token) replaced by ``SmolVLMProcessor``'s text (an intro naming the frame count and
duration, each frame's timestamp and image tokens) as HF replaces it, before tokenizing: the
run's edges are tokenized with the prompt text next to them (:mod:`.smolvlm_prompt`).
``mm_processor_kwargs`` may set ``fps``, the rate the caller sampled raw frames at (a
video's metadata wins).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from chassis.builtin_plugins.models.idefics3_processing import Idefics3ImageInputs, Idefics3Tiles
from chassis.builtin_plugins.models.processor_files import video_processor_config
from chassis.builtin_plugins.models.qwen2_vl_video import frames_array
from chassis.builtin_plugins.models.qwen3_vl_video import frame_indices
from chassis.builtin_plugins.models.smolvlm_prompt import VIDEO_TOKEN, VideoPrompt
from chassis.builtin_plugins.models.smolvlm_video import (
    DEFAULT_FPS,
    frame_times,
    video_frames_steps,
    video_run_text,
)
from chassis.core.multimodal import MultiModalFeature
from chassis.core.multimodal_inputs import video_frames_and_metadata


class SmolVLMMediaInputs(Idefics3ImageInputs):
    """Images and videos of SmolVLM2 requests (module docstring). ``frames``: the video
    frame steps; ``video_token_id``: the ``<video>`` id (``None``: no videos)."""

    def __init__(
        self,
        tiles: Idefics3Tiles,
        image_seq_len: int,
        image_token_id: int,
        tokenizer: Any,
        frames: Idefics3Tiles,
        video_token_id: int | None,
    ) -> None:
        super().__init__(tiles, image_seq_len, image_token_id, tokenizer)
        if frames.tile != tiles.tile:
            raise ValueError(
                f"the video processor's max_image_size ({frames.tile}) differs from the image "
                f"processor's ({tiles.tile}): the model's rows per frame would not match"
            )
        self.frames = frames
        if video_token_id is not None:
            self.placeholder_token_ids = {"image": image_token_id, "video": video_token_id}
        self.video_prompt = VideoPrompt(tokenizer, video_token_id)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, hf_config: Any) -> SmolVLMMediaInputs:
        """As :meth:`Idefics3ImageInputs.from_pretrained`, with the video frame steps
        (:func:`~.smolvlm_video.video_frames_steps`) and the tokenizer's ``<video>``."""
        images = Idefics3ImageInputs.from_pretrained(model_dir, hf_config)
        frames = video_frames_steps(video_processor_config(model_dir))
        ids = images.tokenizer.encode(VIDEO_TOKEN, add_special_tokens=False)
        video_token_id = int(ids[0]) if len(ids) == 1 else None
        return cls(
            images.tiles,
            images.image_seq_len,
            images.image_token_id,
            images.tokenizer,
            frames,
            video_token_id,
        )

    def prompt_placeholder(self, modality: str) -> str:
        return VIDEO_TOKEN if modality == "video" else super().prompt_placeholder(modality)

    def check_kwargs(self, kwargs: Mapping[str, Any]) -> None:
        """``fps`` only: a number > 0."""
        unknown = sorted(set(kwargs) - {"fps"})
        if unknown:
            raise ValueError(
                f"mm_processor_kwargs: {', '.join(unknown)} not supported; this model takes fps"
            )
        fps = kwargs.get("fps")
        if fps is not None and (
            isinstance(fps, bool) or not isinstance(fps, int | float) or not fps > 0
        ):
            raise ValueError(f"mm_processor_kwargs.fps must be a number > 0; got {fps!r}")

    def process(
        self,
        prompt_token_ids: Sequence[int],
        items: Mapping[str, Sequence[Any]],
        kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """Images as Idefics3's; then each ``<video>`` (token or text) replaced by its
        video's run as text (:class:`~.smolvlm_prompt.VideoPrompt`). ``ValueError`` as
        :meth:`MultiModalProcessor.process`."""
        videos = list(items.get("video", ()))
        if not videos:
            return super().process(prompt_token_ids, items, kwargs)
        kwargs = dict(kwargs or {})
        others = {modality: values for modality, values in items.items() if modality != "video"}
        ids, features = super().process(prompt_token_ids, others, kwargs)
        pieces = self.video_prompt.pieces(ids)
        count = self.video_prompt.count(pieces)
        if count != len(videos):
            raise ValueError(
                f"the prompt has {count} video placeholder(s) ({VIDEO_TOKEN!r}) but "
                f"{len(videos)} video(s) were given: put one placeholder per video in the "
                "prompt, in the order of the videos"
            )
        runs = []
        for video in videos:
            _, tensors = self._process_one("video", video, kwargs)
            tensors = dict(tensors)
            runs.append((tensors.pop("placeholder_ids"), tensors))
        return self.video_prompt.place(pieces, features, runs)

    def process_item(
        self, modality: str, item: Any, kwargs: Mapping[str, Any]
    ) -> tuple[int, dict[str, torch.Tensor]]:
        if modality != "video":
            return super().process_item(modality, item, {})
        from PIL import Image

        frames, metadata = video_frames_and_metadata(item)
        array = frames_array(frames)
        pixels = np.stack([self.frames(Image.fromarray(frame))[0] for frame in array])
        fps = float((metadata or {}).get("fps") or kwargs.get("fps") or DEFAULT_FPS)
        times = frame_times(frame_indices(metadata, len(array)), fps)
        text = video_run_text(times, (metadata or {}).get("duration"), self.image_seq_len)
        run = self.tokenizer.encode(text, add_special_tokens=False)
        if run.count(self.image_token_id) != len(array) * self.image_seq_len:
            raise ValueError(
                "the tokenizer does not encode a video's run to "
                f"{len(array) * self.image_seq_len} <image> tokens (is it the model's own?)"
            )
        return len(run), {
            "pixel_values": torch.from_numpy(pixels),
            "placeholder_ids": torch.tensor(run, dtype=torch.int64),
        }
