"""Qwen2-VL / Qwen2.5-VL images -> the model's inputs, as transformers' ``Qwen2VLProcessor``.

Each image goes through the checkpoint's own image processor (transformers'
``AutoImageProcessor`` over ``preprocessor_config.json``: ``Qwen2VLImageProcessor``, whose PIL
backend needs no torchvision): resized so both sides are multiples of ``patch_size *
merge_size`` with the pixel count in ``[min_pixels, max_pixels]``, normalized, and cut into
``grid_t * grid_h * grid_w`` patches of ``3 * temporal_patch_size * patch_size**2`` values
(``pixel_values``; ``image_grid_thw`` ``[1, 3]``). The language model sees
``grid_t * grid_h * grid_w / merge_size**2`` tokens per image: the prompt's one
``<|image_pad|>`` per image is expanded to that many (vLLM's prompt convention).

Per request, ``mm_processor_kwargs`` may set ``min_pixels`` and ``max_pixels`` (as vLLM's
Qwen2-VL takes them); any other key is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from chassis.core.image_loading import to_rgb
from chassis.core.multimodal_processing import MultiModalProcessor

#: the per-request processor kwargs honoured (vLLM's names)
PIXEL_KWARGS = ("min_pixels", "max_pixels")
#: the text standing for one image in a Qwen2-VL prompt (what its chat template writes)
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def _get(config: Any, name: str) -> Any:
    """A field of a sub-config that may be a config object or a plain dict."""
    if isinstance(config, Mapping):
        return config.get(name)
    return getattr(config, name, None)


class Qwen2VLImageInputs(MultiModalProcessor):
    """Images of Qwen2-VL and Qwen2.5-VL requests (see the module docstring).

    ``image_processor``: transformers' Qwen2-VL image processor; ``image_token_id``: the
    ``<|image_pad|>`` id; ``merge_size``: the vision tower's ``spatial_merge_size``.
    """

    def __init__(self, image_processor: Any, image_token_id: int, merge_size: int) -> None:
        if int(image_processor.merge_size) != merge_size:
            raise ValueError(
                f"the image processor's merge_size ({image_processor.merge_size}) differs from "
                f"the model's vision_config.spatial_merge_size ({merge_size})"
            )
        self.image_processor = image_processor
        self.merge_size = merge_size
        self.placeholder_token_ids = {"image": int(image_token_id)}

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, hf_config: Any) -> Qwen2VLImageInputs:
        """The processor of the checkpoint in ``model_dir`` (its ``preprocessor_config.json``)
        for the model of ``hf_config`` (its ``image_token_id`` and
        ``vision_config.spatial_merge_size``); ``ValueError`` when the folder has no image
        processor config."""
        from transformers import AutoImageProcessor

        if not (Path(model_dir) / "preprocessor_config.json").is_file():
            raise ValueError(
                f"the checkpoint {str(model_dir)!r} has no preprocessor_config.json: its image "
                "processor settings are unknown, so it cannot take images"
            )
        image_token_id = getattr(hf_config, "image_token_id", None)
        merge_size = _get(getattr(hf_config, "vision_config", None), "spatial_merge_size")
        if image_token_id is None or merge_size is None:
            raise ValueError(
                "the model's config lacks image_token_id or vision_config.spatial_merge_size: "
                "it cannot take images"
            )
        processor = AutoImageProcessor.from_pretrained(str(model_dir))
        return cls(processor, int(image_token_id), int(merge_size))

    def prompt_placeholder(self, modality: str) -> str:
        return IMAGE_PLACEHOLDER

    def check_kwargs(self, kwargs: Mapping[str, Any]) -> None:
        """``min_pixels`` / ``max_pixels`` only: integers > 0, the first at most the second
        (each defaults to the checkpoint's)."""
        unknown = sorted(set(kwargs) - set(PIXEL_KWARGS))
        if unknown:
            raise ValueError(
                f"mm_processor_kwargs: {', '.join(unknown)} not supported; this model takes "
                f"{' and '.join(PIXEL_KWARGS)}"
            )
        for name in PIXEL_KWARGS:
            value = kwargs.get(name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(
                    f"mm_processor_kwargs.{name} must be an integer > 0; got {value!r}"
                )
        low, high = self._pixel_bounds(kwargs)
        if low > high:
            raise ValueError(
                f"mm_processor_kwargs: min_pixels ({low}) must not exceed max_pixels ({high})"
            )

    def _pixel_bounds(self, kwargs: Mapping[str, Any]) -> tuple[int, int]:
        """The request's (min_pixels, max_pixels), the checkpoint's where it sets none."""
        size = self.image_processor.size
        low = kwargs.get("min_pixels") or _get(size, "shortest_edge")
        high = kwargs.get("max_pixels") or _get(size, "longest_edge")
        return int(low), int(high)

    def process_item(
        self, modality: str, item: Any, kwargs: Mapping[str, Any]
    ) -> tuple[int, dict[str, torch.Tensor]]:
        from PIL import Image

        if not isinstance(item, Image.Image):
            raise ValueError(
                f"an image must be a PIL.Image.Image; got {type(item).__name__} (image "
                "embeddings and arrays are not supported)"
            )
        extra: dict[str, Any] = {}
        if kwargs:
            low, high = self._pixel_bounds(kwargs)
            extra["size"] = {"shortest_edge": low, "longest_edge": high}
        try:
            out = self.image_processor(images=[to_rgb(item)], return_tensors="pt", **extra)
        except (ValueError, TypeError, OSError) as exc:  # e.g. an aspect ratio above 200
            raise ValueError(f"the image cannot be processed: {exc}") from None
        grid = out["image_grid_thw"]
        length = int(grid.prod()) // self.merge_size**2
        return length, {"pixel_values": out["pixel_values"], "image_grid_thw": grid}
