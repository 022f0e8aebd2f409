"""LLaVA-OneVision images and videos -> the model's inputs, as transformers'
``LlavaOnevisionProcessor`` over its ``LlavaOnevisionImageProcessor`` (the PIL backend), in
PIL and numpy; videos as :mod:`.llava_onevision_video` says (``<video>``, one per video).

An image alone in its prompt takes LLaVA-NeXT's "anyres" steps
(:class:`~.llava_next_processing.AnyresPreprocessing`: the best of the grid pinpoints, the
image fitted and centred on a black canvas, cut into tiles of the tower's side ``S``, the
whole image resized to ``size`` as the base tile first, then each tile resized to ``size``,
rescaled and normalized) with OneVision's defaults (``size`` 384 x 384, no centre crop,
transformers' 36 pinpoints from 384 x 384 to 2304 x 2304; llava-hf's files set SigLIP's mean
and std of 0.5). It stands for the base tile's rows plus the unpadded, capped grid with a
newline row per grid row (:func:`~.llava_onevision_geometry.num_image_tokens`).

An image among several of one request's prompt (HF's ``batch_num_images`` > 1) is not tiled:
it is padded to a square of the mean colour (``int(mean * 255)``), resized to ``size``,
rescaled and normalized (one tile), and stands for that tile's rows and one newline row.

Inputs: ``pixel_values`` ``[tiles, 3, S, S]`` float32 and ``image_sizes`` ``[1, 2]`` (the
image's height and width). No per-request processor kwargs are taken.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from chassis.builtin_plugins.models.image_pixels import preprocess_image
from chassis.builtin_plugins.models.llava_next_processing import (
    AnyresPreprocessing,
    LlavaNextImageInputs,
)
from chassis.builtin_plugins.models.llava_next_tiles import parse_pinpoints
from chassis.builtin_plugins.models.llava_onevision_geometry import max_tiles, num_image_tokens
from chassis.builtin_plugins.models.llava_onevision_video import VideoFrames, num_video_tokens
from chassis.builtin_plugins.models.llava_processing import (
    CLIP_MEAN,
    CLIP_STD,
    ClipPreprocessing,
)
from chassis.builtin_plugins.models.llava_vision import LlavaVisionSpec
from chassis.builtin_plugins.models.processor_files import image_processor_source
from chassis.core.multimodal import MultiModalFeature

_PROCESSOR_TYPES = ("LlavaOnevisionImageProcessor", "LlavaOnevisionImageProcessorFast")
#: transformers' ``LlavaOnevisionImageProcessor`` defaults for what a config leaves out
_DEFAULTS: dict[str, Any] = {
    "size": {"height": 384, "width": 384},
    "image_mean": CLIP_MEAN,
    "image_std": CLIP_STD,
    "resample": 3,
    "image_grid_pinpoints": [[h * 384, w * 384] for h in range(1, 7) for w in range(1, 7)],
}
#: the internal processing kwarg that marks an image among several of one prompt (never a
#: client's: :meth:`LlavaOnevisionMediaInputs.process` refuses every client kwarg)
_AMONG_SEVERAL = "_llava_onevision_among_several"
#: the text standing for one video in a LLaVA-OneVision prompt
VIDEO_PLACEHOLDER = "<video>"


def onevision_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """A ``LlavaOnevisionImageProcessor`` config with transformers' defaults filled in;
    ``ValueError`` for another processor type."""
    kind = str(config.get("image_processor_type") or _PROCESSOR_TYPES[0])
    if kind.removesuffix("Pil") not in _PROCESSOR_TYPES:
        raise ValueError(
            f"image processor {kind!r} is not supported for LLaVA-OneVision images; "
            "supported: LlavaOnevisionImageProcessor"
        )
    return {**_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}


def anyres_steps(settings: Mapping[str, Any], side: int) -> AnyresPreprocessing:
    """LLaVA-NeXT's anyres steps with OneVision's settings: tiles of ``crop_size`` when it
    centre-crops, else of ``size``'s height (as transformers cuts them)."""
    size = settings["size"]
    crop = settings.get("crop_size") if settings.get("do_center_crop") else None
    if crop is None:
        edge = size.get("height", size.get("shortest_edge")) if isinstance(size, Mapping) else size
        crop = {"height": edge, "width": edge}
    return AnyresPreprocessing.from_dict(
        {
            **settings,
            "image_processor_type": "LlavaNextImageProcessor",
            "crop_size": crop,
            "do_center_crop": bool(settings.get("do_center_crop")),
        },
        side,
    )


def square_steps(settings: Mapping[str, Any]) -> ClipPreprocessing:
    """The steps of an image among several: padded to a square of the mean colour, then
    resized, (cropped,) rescaled and normalized as one tile."""
    return ClipPreprocessing.from_dict(
        {
            **settings,
            "image_processor_type": "LlavaImageProcessor",
            "do_pad": True,
            "do_center_crop": bool(settings.get("do_center_crop")),
        }
    )


class LlavaOnevisionMediaInputs(LlavaNextImageInputs):
    """Images and videos of LLaVA-OneVision requests (the module docstring): an image's
    token count depends on its size, and on whether other images share its prompt; a video's
    on its frame count. ``video``: the frames' steps and the ``<video>`` id (``None``: the
    model's config names no video token, and videos are refused)."""

    def __init__(
        self,
        preprocessing: AnyresPreprocessing,
        square: ClipPreprocessing,
        image_token_id: int,
        spec: LlavaVisionSpec,
        tiles: int,
        video: tuple[VideoFrames, int] | None = None,
    ) -> None:
        super().__init__(preprocessing, image_token_id, spec)
        self.square = square
        #: the grid's cap in tiles (the model config's ``vision_aspect_ratio``)
        self.max_tiles = tiles
        self.video_frames = video[0] if video is not None else None
        if video is not None:
            self.placeholder_token_ids = {**self.placeholder_token_ids, "video": int(video[1])}

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, hf_config: Any) -> LlavaOnevisionMediaInputs:
        """The processor of the checkpoint in ``model_dir`` (its ``preprocessor_config.json``)
        for the model of ``hf_config``; ``ValueError`` when the folder has no image processor
        config, its settings are not supported (tiles or squares other than the tower's
        ``image_size``), or its ``image_grid_pinpoints`` differ from the model config's."""
        path, image_token_id = image_processor_source(model_dir, hf_config)
        spec = LlavaVisionSpec.from_config(hf_config)
        side = int(spec.vision_config.image_size)
        settings = onevision_settings(json.loads(path.read_text()))
        preprocessing = anyres_steps(settings, side)
        square = square_steps(settings)
        if square.fixed_size() != (side, side):
            raise ValueError(
                f"{path} makes images of another size than the vision tower's {side}x{side} "
                "(image_size): its size / crop settings are not supported"
            )
        model_pinpoints = parse_pinpoints(
            getattr(hf_config, "image_grid_pinpoints", None) or _DEFAULTS["image_grid_pinpoints"],
            side,
        )
        if model_pinpoints != preprocessing.pinpoints:
            raise ValueError(
                f"{path} has image_grid_pinpoints {[list(p) for p in preprocessing.pinpoints]}, "
                f"but the model's config has {[list(p) for p in model_pinpoints]}"
            )
        tiles = max_tiles(getattr(hf_config, "vision_aspect_ratio", None))
        video_token_id = getattr(hf_config, "video_token_id", None)
        video = None
        if video_token_id is not None:
            video = (VideoFrames.from_pretrained(model_dir, side), int(video_token_id))
        return cls(preprocessing, square, image_token_id, spec, tiles, video)

    def num_tokens(self, height: int, width: int) -> int:
        """Placeholder tokens of an image of ``height x width`` pixels alone in its prompt."""
        side = int(self.spec.vision_config.image_size) // int(self.spec.vision_config.patch_size)
        base = self.spec.tokens_per_image
        return num_image_tokens(
            height, width, self.anyres.pinpoints, self.anyres.tile, side, base, self.max_tiles
        )

    def prompt_placeholder(self, modality: str) -> str:
        return VIDEO_PLACEHOLDER if modality == "video" else super().prompt_placeholder(modality)

    def process(
        self,
        prompt_token_ids: Sequence[int],
        items: Mapping[str, Sequence[Any]],
        kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """As the base class's, each image tiled when it is the prompt's only one and one
        square tile when there are several (the module docstring)."""
        super().check_kwargs(dict(kwargs or {}))  # no client kwargs
        several = len(items.get("image", ())) > 1
        return super().process(prompt_token_ids, items, {_AMONG_SEVERAL: True} if several else {})

    def check_kwargs(self, kwargs: Mapping[str, Any]) -> None:
        """Only this class's own marker (set by :meth:`process`); a client's are refused
        before it is added."""
        super().check_kwargs({k: v for k, v in kwargs.items() if k != _AMONG_SEVERAL})

    def process_item(
        self, modality: str, item: Any, kwargs: Mapping[str, Any]
    ) -> tuple[int, dict[str, torch.Tensor]]:
        if modality == "video" and self.video_frames is not None:
            pixels = self.video_frames(item)
            side = int(self.spec.vision_config.image_size) // int(
                self.spec.vision_config.patch_size
            )
            return num_video_tokens(pixels.shape[0], side), {"pixel_values_videos": pixels}
        if not kwargs.get(_AMONG_SEVERAL):
            return super().process_item(modality, item, kwargs)
        pixels = preprocess_image(item, self.square)
        tensors = {
            "pixel_values": torch.from_numpy(pixels)[None],
            "image_sizes": torch.tensor([[item.height, item.width]], dtype=torch.int64),
        }
        return self.spec.tokens_per_image + 1, tensors
