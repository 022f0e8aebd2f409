"""Llama 4 (``Llama4ForConditionalGeneration``: Scout, Maverick) with images: the Llama 4
language model, its vision tower and its projector.

The language model is the text-only class's (:mod:`.llama4`: chunked local attention, NoPE
layers, MoE; its tensors renamed from ``language_model.*`` / ``model.language_model.*``).
Besides, the class builds the tower with its pixel-shuffle adapter and the projector
(:mod:`.llama4_vision`), whole on every tensor-parallel rank and never adapted by LoRA, and
reads their tensors: ``vision_model.*`` and ``multi_modal_projector.*`` (what transformers
saves and the hub files hold), or ``model.vision_model.*`` and
``model.multi_modal_projector.*``. Positions are the decoder's own (1D).

An image arrives as its tiles (the front-end's, :mod:`.llama4_processing`: the grid's tiles,
then a global tile when there are several) with its prompt run (``<|image_start|>``, tile
separators, ``<|image|>``, ``<|patch|>`` tokens, ``<|image_end|>``); the feature covers the
whole run and :meth:`Llama4ForConditionalGenerationWithImages.embed_multimodal` returns a row
per token of it: the tiles' rows in order at the ``<|patch|>`` tokens (the config's
``image_token_id``), the token embeddings elsewhere, which is what HF's model feeds its
decoder there. Image embeddings (``--enable-mm-embeds``: an image's tiles' rows with its
``aspect_ratios``, the ``"tiles"`` form; the processor writes the run from the grid) are
spliced in the same way, the tower skipped.

A checkpoint whose image side cannot be built (no ``vision_config``, or widths HF's tower
could not run either) is served as text only (the class of :mod:`.llama4`; a warning says
why).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from typing import Any

import torch

from chassis.builtin_plugins.models.embeds_forward import DecoderOverEmbeds
from chassis.builtin_plugins.models.image_item_inputs import image_run_inputs, image_tiles
from chassis.builtin_plugins.models.image_side_weights import ImageSideWeights, renamed_by_prefix
from chassis.builtin_plugins.models.llama4 import Llama4ForConditionalGeneration
from chassis.builtin_plugins.models.llama4_processing import tiles_per_image
from chassis.builtin_plugins.models.llama4_vision import (
    Llama4Projector,
    Llama4VisionSpec,
    Llama4VisionTower,
)
from chassis.core.model_interface import CausalLM, ModelBuildContext
from chassis.core.multimodal_embeds import EMBEDS_KEY
from chassis.core.placeholder_runs import splice_item_rows

logger = logging.getLogger(__name__)

#: (checkpoint-name prefix, ours) of the image side, the first that matches applies
_IMAGE_PREFIXES = (
    ("model.vision_model.", "vision_model."),
    ("vision_model.", "vision_model."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("multi_modal_projector.", "multi_modal_projector."),
)


def image_side_name(name: str) -> str | None:
    """Checkpoint name -> our name of an image-side tensor, ``None`` for the language model's."""
    return renamed_by_prefix(name, _IMAGE_PREFIXES)


@functools.cache
def _warn_text_only(reason: str) -> None:
    """Say once per process why a Llama 4 checkpoint takes no images."""
    logger.warning(
        "Llama4ForConditionalGeneration: %s; this checkpoint is served as text only "
        "(requests with images are refused)",
        reason,
    )


class Llama4ForConditionalGenerationWithImages(
    ImageSideWeights, DecoderOverEmbeds, Llama4ForConditionalGeneration
):
    """``Llama4ForConditionalGeneration`` checkpoints with images (the module docstring)."""

    supported_modalities = frozenset({"image"})
    image_modules = ("vision_model.", "multi_modal_projector.")
    image_side_label = "Llama 4 vision model or projector"
    image_side_name = staticmethod(image_side_name)
    #: image embeddings as the tiles' rows with HF's ``aspect_ratios`` (tile rows and
    #: columns: the run's separators need them; core/multimodal_embeds.py)
    image_embeds_form = "tiles"
    #: ``(tile rows, tile columns) -> tiles`` of one image, by which the tiles form splits
    #: its rows among the images (the grid's tiles, then a global one when there are several)
    image_embeds_tiles = staticmethod(tiles_per_image)

    @classmethod
    def class_for_config(cls, hf_config: Any) -> type[CausalLM]:
        """This class; the text-only one (a warning says why) when the image side cannot be
        built: no ``vision_config``, or one HF's model could not run either."""
        try:
            Llama4VisionSpec.from_config(hf_config)
        except ValueError as exc:
            _warn_text_only(str(exc))
            return Llama4ForConditionalGeneration
        return cls

    def __init__(self, hf_config: Any, build_ctx: ModelBuildContext) -> None:
        super().__init__(hf_config, build_ctx)
        self.check_decoder_takes_embeds("Llama 4 images need")
        self.vision_spec = Llama4VisionSpec.from_config(hf_config)
        self.image_token_id = int(hf_config.image_token_id)
        self.vision_model = Llama4VisionTower(self.vision_spec)
        self.multi_modal_projector = Llama4Projector(self.vision_spec)

    @classmethod
    def multimodal_processor(cls, model_dir: str, hf_config: Any) -> Any:
        """The front-end's image processor (:class:`~.llama4_processing.Llama4ImageInputs`)."""
        from chassis.builtin_plugins.models.llama4_processing import Llama4ImageInputs

        return Llama4ImageInputs.from_pretrained(model_dir, hf_config)

    def embed_multimodal(self, modality: str, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """One image's rows, one per token of its run: ``inputs["pixel_values"]`` ``[tiles,
        C, S, S]`` (or with a leading 1) and ``inputs["placeholder_ids"]`` ``[length]`` (the
        run's token ids) -> ``[length, hidden_size]`` in the model's dtype. ``ValueError`` for
        another modality, a missing input, a wrong shape, or a run whose ``<|patch|>`` count
        is not the image's rows. Given rows (image embeddings: ``inputs["image_embeds"]``
        ``[rows, hidden_size]`` with the run) are spliced in as they are, without the tower."""
        if EMBEDS_KEY in inputs and modality == "image" and "placeholder_ids" in inputs:
            image_rows, run = inputs[EMBEDS_KEY], inputs["placeholder_ids"]
        else:
            pixels, run = image_run_inputs(self, modality, inputs)
            features = self.image_features(image_tiles(pixels))
            image_rows = features.reshape(-1, features.shape[-1])
        return splice_item_rows(
            self.model.embed(run), run, self.image_token_id, image_rows, "image"
        )

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[tiles, C, S, S]`` -> ``[tiles, tokens_per_tile, hidden_size]``: HF's
        ``get_image_features(...).last_hidden_state`` through ``multi_modal_projector``."""
        return self.multi_modal_projector(self.vision_model(pixel_values))
