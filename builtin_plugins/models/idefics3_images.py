"""Idefics3 (``Idefics3ForConditionalGeneration``: HuggingFaceM4/Idefics3-8B-Llama3) and
SmolVLM (``SmolVLMForConditionalGeneration``: HuggingFaceTB/SmolVLM-256M/500M/2.2B-Instruct,
SmolVLM2's images) with images: the text config's decoder (Llama), the SigLIP-like tower and
the pixel-shuffle connector.

The classes are LLaVA-1.5's with another image side and other tensor names
(:mod:`.llava_images`: composed over the registered decoder of the text architecture; the
LM head tied by the top-level ``tie_word_embeddings``; the image side whole on every
tensor-parallel rank, never adapted by LoRA). The language model is ``model.text_model.*``
(and ``lm_head.*``), the tower ``model.vision_model.*`` and the connector
``model.connector.*`` (:mod:`.idefics3_vision`). An image arrives as its tiles (the
front-end's, :mod:`.idefics3_processing`: a grid of tiles and a global image, or one image)
with its prompt run, which holds ``<fake_token_around_image>``, the tile labels
(``<row_r_col_c>``, ``<global-img>``), newlines and ``rows_per_tile`` ``<image>`` tokens per
tile; the feature covers the whole run and ``embed_multimodal`` returns a row per token of
it: the tiles' rows in order at the ``<image>`` tokens, the token embeddings elsewhere (what
HF's ``inputs_merger`` computes there). Positions are the decoder's own (1D).

A checkpoint whose tower is not Idefics3's is served as text only (a warning says why).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from chassis.builtin_plugins.models.idefics3_vision import (
    Idefics3Connector,
    Idefics3VisionSpec,
    Idefics3VisionTower,
    builds_tower,
)
from chassis.builtin_plugins.models.image_item_inputs import image_run_inputs
from chassis.builtin_plugins.models.image_side_weights import renamed_by_prefix
from chassis.builtin_plugins.models.llava import LlavaForConditionalGeneration
from chassis.builtin_plugins.models.llava_images import (
    LlavaForConditionalGenerationWithImages,
    _warn_text_only,
)
from chassis.core.placeholder_runs import splice_item_rows

#: (checkpoint-name prefix, ours) of the image side, the first that matches applies
_IMAGE_PREFIXES = (
    ("model.vision_model.", "vision_tower."),
    ("model.connector.", "multi_modal_projector."),
)


def image_side_name(name: str) -> str | None:
    """Checkpoint name -> our name of an image-side tensor, ``None`` for the language model's."""
    return renamed_by_prefix(name, _IMAGE_PREFIXES)


class Idefics3ForConditionalGeneration(LlavaForConditionalGeneration):
    """``Idefics3ForConditionalGeneration`` / ``SmolVLMForConditionalGeneration`` served as
    text only: the language model ``model.text_model.*`` and ``lm_head.*``; the tower and
    connector never read. Not built itself (:meth:`class_for_config`)."""

    language_model_prefixes = (("model.text_model.", "model."),)
    vision_prefixes = tuple(prefix for prefix, _ in _IMAGE_PREFIXES)


class Idefics3ForConditionalGenerationWithImages(
    LlavaForConditionalGenerationWithImages, Idefics3ForConditionalGeneration
):
    """Idefics3 / SmolVLM checkpoints with images (the module docstring).

    Not built itself: :meth:`class_for_config` returns the class of this one over the text
    config's decoder (or, for a tower not built here, the text-only class).
    """

    image_side_label = "Idefics3 vision tower or connector"
    image_side_name = staticmethod(image_side_name)
    #: no image embeddings: each image's run labels its tiles by their place in the image's
    #: grid, which a row count does not give (core/multimodal_embeds.py)
    image_embeds_form = None
    image_embeds_refusal = (
        "each image's token run labels its tiles by row and column (<row_i_col_j>), and the "
        "rows alone do not say the image's tile grid (vLLM cannot expand them either)"
    )

    text_only_class = Idefics3ForConditionalGeneration

    @classmethod
    def warn_text_only(cls, hf_config: Any, vision_config: Any) -> None:
        """Names the checkpoint's architecture (Idefics3 or SmolVLM)."""
        architectures = getattr(hf_config, "architectures", None) or [cls.__name__]
        _warn_text_only(str(architectures[0]), getattr(vision_config, "model_type", None))

    @classmethod
    def builds_tower(cls, vision_config: Any) -> bool:
        """Idefics3 / SmolVLM (``idefics3_vision``, ``smolvlm_vision``) towers."""
        return builds_tower(vision_config)

    def build_image_side(self, hf_config: Any) -> None:
        self.vision_spec = Idefics3VisionSpec.from_config(hf_config)
        self.vision_tower = Idefics3VisionTower(self.vision_spec)
        self.multi_modal_projector = Idefics3Connector(self.vision_spec, int(hf_config.hidden_size))
        self.image_token_id = int(hf_config.image_token_id)

    @classmethod
    def multimodal_processor(cls, model_dir: str, hf_config: Any) -> Any:
        """The front-end's image processor
        (:class:`~.idefics3_processing.Idefics3ImageInputs`)."""
        from chassis.builtin_plugins.models.idefics3_processing import Idefics3ImageInputs

        return Idefics3ImageInputs.from_pretrained(model_dir, hf_config)

    def embed_multimodal(self, modality: str, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """One image's rows, one per token of its run: ``inputs["pixel_values"]`` ``[tiles,
        C, T, T]`` (or with a leading 1) and ``inputs["placeholder_ids"]`` ``[length]`` (the
        run's token ids) -> ``[length, hidden_size]`` in the model's dtype. ``ValueError`` for
        another modality, a missing input, a wrong shape, or a run whose ``<image>`` count is
        not the image's rows."""
        pixels, run = image_run_inputs(self, modality, inputs)
        if pixels.dim() == 5 and pixels.shape[0] == 1:
            pixels = pixels[0]
        features = self.image_features(pixels)
        image_rows = features.reshape(-1, features.shape[-1])
        # the image rows scaled as the decoder scales given rows (Granite's multiplier), the
        # run's text rows already are (its embed)
        image_rows = self.prompt_embeds_to_inputs(image_rows)
        return splice_item_rows(
            self.model.embed(run), run, self.image_token_id, image_rows, "image"
        )

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[tiles, C, T, T]`` -> ``[tiles, rows_per_tile, hidden_size]`` (HF's
        ``get_image_features(...).pooler_output``, per tile)."""
        return self.multi_modal_projector(self.vision_tower(pixel_values))
