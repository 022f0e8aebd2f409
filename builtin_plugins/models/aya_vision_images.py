"""Aya Vision (``AyaVisionForConditionalGeneration``: Cohere's Aya Vision 8B / 32B) with
images: the text config's decoder (Cohere2), the SigLIP tower, the pixel shuffle and the
SwiGLU projector.

The class is LLaVA-1.5's with another image side (:mod:`.llava_images`: composed over the
registered decoder of the text architecture; the language model's tensors renamed to it; the
LM head tied by the top-level flag; the image side whole on every tensor-parallel rank, never
adapted by LoRA) and, as the text-only :class:`~.llava.AyaVisionForConditionalGeneration`,
logits multiplied by Cohere2's ``logit_scale`` (as transformers from 5.25 and vLLM). The tower is
:mod:`.clip_vision`'s SigLIP (only the layers the selected state needs), the projector
:mod:`.aya_vision_projector`'s. An image arrives as its tiles (the front-end's,
:mod:`.aya_vision_processing`, InternVL's GOT-OCR2 tiling) with its prompt run: the run holds
``<|START_OF_IMG|>``, per tile a label (``TILE_1``..., the thumbnail's ``TILE_GLOBAL``) and
``tokens_per_tile`` ``<|IMG_PATCH|>`` tokens, then ``<|END_OF_IMG|>``; the feature covers the
whole run and :meth:`AyaVisionForConditionalGenerationWithImages.embed_multimodal` returns a
row per token of it: the tiles' rows in order at the ``<|IMG_PATCH|>`` tokens, the token
embeddings elsewhere (what HF computes there). Positions are the decoder's own (1D). Image
embeddings (``--enable-mm-embeds``: an image's tiles' rows, the processor writing the run
from their count) are spliced in the same way, the tower skipped.

A checkpoint whose tower is not SigLIP's is served as text only (a warning says why).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from chassis.builtin_plugins.models.aya_vision_projector import AyaVisionProjector, AyaVisionSpec
from chassis.builtin_plugins.models.clip_vision import ClipVisionTower, tower_kind
from chassis.builtin_plugins.models.image_item_inputs import image_run_inputs, image_tiles
from chassis.builtin_plugins.models.llava import AyaVisionForConditionalGeneration
from chassis.builtin_plugins.models.llava_images import (
    LlavaForConditionalGenerationWithImages,
    _warn_text_only,
)
from chassis.core.multimodal_embeds import EMBEDS_KEY
from chassis.core.placeholder_runs import splice_item_rows


class AyaVisionForConditionalGenerationWithImages(
    LlavaForConditionalGenerationWithImages, AyaVisionForConditionalGeneration
):
    """``AyaVisionForConditionalGeneration`` checkpoints with images (the module docstring).

    Not built itself: :meth:`class_for_config` returns the class of this one over the text
    config's decoder (or, for a tower not built here, the text-only Aya Vision class).
    """

    image_side_label = "SigLIP vision tower or Aya Vision projector"
    #: image embeddings as LLaVA's ``[rows, hidden]`` tensors, an image's rows its tiles'
    #: (the processor writes the run from their count; core/multimodal_embeds.py)
    image_embeds_form = "rows"

    text_only_class = AyaVisionForConditionalGeneration

    @classmethod
    def warn_text_only(cls, hf_config: Any, vision_config: Any) -> None:
        _warn_text_only("AyaVisionForConditionalGeneration", tower_kind(vision_config or {}))

    @classmethod
    def builds_tower(cls, vision_config: Any) -> bool:
        """SigLIP (``siglip_vision_model``) towers."""
        return tower_kind(vision_config) == "siglip_vision_model"

    def build_image_side(self, hf_config: Any) -> None:
        self.vision_spec = AyaVisionSpec.from_config(hf_config)
        self.vision_tower = ClipVisionTower(
            self.vision_spec.vision_config, self.vision_spec.feature_index
        )
        self.multi_modal_projector = AyaVisionProjector(
            self.vision_spec, int(hf_config.hidden_size)
        )
        self.image_token_id = int(hf_config.image_token_id)

    @classmethod
    def multimodal_processor(cls, model_dir: str, hf_config: Any) -> Any:
        """The front-end's image processor
        (:class:`~.aya_vision_processing.AyaVisionImageInputs`)."""
        from chassis.builtin_plugins.models.aya_vision_processing import AyaVisionImageInputs

        return AyaVisionImageInputs.from_pretrained(model_dir, hf_config)

    def embed_multimodal(self, modality: str, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """One image's rows, one per token of its run: ``inputs["pixel_values"]`` ``[tiles,
        C, S, S]`` (or with a leading 1) and ``inputs["placeholder_ids"]`` ``[length]`` (the
        run's token ids) -> ``[length, hidden_size]`` in the model's dtype. ``ValueError`` for
        another modality, a missing input, a wrong shape, or a run whose ``<|IMG_PATCH|>``
        count is not the image's rows. Given rows (image embeddings: ``inputs["image_embeds"]``
        ``[rows, hidden_size]`` with the run) are spliced in as they are, without the tower."""
        if EMBEDS_KEY in inputs and modality == "image" and "placeholder_ids" in inputs:
            image_rows, run = inputs[EMBEDS_KEY], inputs["placeholder_ids"]
        else:
            pixels, run = image_run_inputs(self, modality, inputs)
            features = self.image_features(image_tiles(pixels))
            image_rows = features.reshape(-1, features.shape[-1])
        # the image rows scaled as the decoder scales given rows (Granite's multiplier), the
        # run's text rows already are (its embed)
        image_rows = self.prompt_embeds_to_inputs(image_rows)
        return splice_item_rows(
            self.model.embed(run), run, self.image_token_id, image_rows, "image"
        )

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[tiles, C, S, S]`` -> ``[tiles, tokens_per_tile, hidden_size]`` (HF's
        ``get_image_features(...).pooler_output``)."""
        (state,) = self.vision_tower(pixel_values, [self.vision_spec.feature_index])
        return self.multi_modal_projector(state)
