"""InternVL (``InternVLForConditionalGeneration``: OpenGVLab's InternVL3 / 3.5 ``-hf``
checkpoints) with images: the text config's decoder, the InternViT tower, the pixel shuffle
and the projector.

The class is LLaVA-1.5's with another image side (:mod:`.llava_images`: composed over the
registered decoder of the text architecture, Qwen2 for InternVL3, Qwen3 for InternVL3.5; the
language model's tensors renamed to it; the LM head tied by the top-level flag; the image
side whole on every tensor-parallel rank, never adapted by LoRA). The tower and projector are
:mod:`.internvl_vision`'s, read from ``vision_tower.*`` / ``multi_modal_projector.*`` (what
transformers saves) or ``model.vision_tower.*`` / ``model.multi_modal_projector.*`` (its
in-memory names). An image arrives as its tiles (the front-end's,
:mod:`.internvl_processing`: the grid's tiles, then a thumbnail when there are several);
each tile gives ``tokens_per_tile`` rows, and the image's rows are its tiles' in order, which
the runner puts in place of the image's ``<IMG_CONTEXT>`` tokens (between ``<img>`` and
``</img>``). Positions are the decoder's own (1D).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from chassis.builtin_plugins.models.image_item_inputs import image_tiles
from chassis.builtin_plugins.models.internvl_vision import (
    TOWER_TYPE,
    InternVLProjector,
    InternVLVisionSpec,
    InternVLVisionTower,
    pixel_shuffle,
)
from chassis.builtin_plugins.models.llava_images import LlavaForConditionalGenerationWithImages


class InternVLForConditionalGenerationWithImages(LlavaForConditionalGenerationWithImages):
    """``InternVLForConditionalGeneration`` checkpoints with images (the module docstring).

    Not built itself: :meth:`class_for_config` returns the class of this one over the text
    config's decoder.
    """

    @classmethod
    def builds_tower(cls, vision_config: Any) -> bool:
        """InternViT (``internvl_vision``) towers."""
        model_type = (
            vision_config.get("model_type")
            if isinstance(vision_config, dict)
            else getattr(vision_config, "model_type", None)
        )
        return model_type == TOWER_TYPE

    def build_image_side(self, hf_config: Any) -> None:
        self.vision_spec = InternVLVisionSpec.from_config(hf_config)
        self.vision_tower = InternVLVisionTower(self.vision_spec)
        self.multi_modal_projector = InternVLProjector(self.vision_spec, int(hf_config.hidden_size))

    @classmethod
    def multimodal_processor(cls, model_dir: str, hf_config: Any) -> Any:
        """The front-end's image processor (:class:`~.internvl_processing.InternVLImageInputs`)."""
        from chassis.builtin_plugins.models.internvl_processing import InternVLImageInputs

        return InternVLImageInputs.from_pretrained(model_dir, hf_config)

    def item_rows(self, modality: str, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """One image's rows: ``inputs["pixel_values"]`` ``[tiles, C, S, S]`` (or with a
        leading 1) -> ``[tiles * tokens_per_tile, hidden_size]`` in the model's dtype, the
        tiles' rows in order. ``ValueError`` for another modality, a missing input or a wrong
        shape."""
        if modality != "image":
            raise ValueError(f"{type(self).__name__} takes images, not {modality!r} inputs")
        pixels = inputs.get("pixel_values")
        if pixels is None:
            raise ValueError(f"image inputs lack pixel_values (got {sorted(inputs)})")
        pixels = image_tiles(pixels)
        features = self.image_features(pixels)
        return features.reshape(-1, features.shape[-1])

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[tiles, C, S, S]`` -> ``[tiles, tokens_per_tile, hidden_size]`` (HF's
        ``get_image_features``)."""
        spec = self.vision_spec
        state = self.vision_tower(pixel_values)[:, 1:]  # "default": the class row dropped
        grid = state.reshape(state.shape[0], spec.side, spec.side, state.shape[-1])
        shuffled = pixel_shuffle(grid, spec.shuffle)
        rows = shuffled.reshape(shuffled.shape[0], -1, shuffled.shape[-1])  # row-major
        return self.multi_modal_projector(rows)
