"""Mistral 3 (``Mistral3ForConditionalGeneration``: Mistral Small 3.1/3.2, Ministral 3) with
images: the Mistral / Ministral 3 language model, Pixtral's vision tower and Mistral 3's
projector.

The language model is the text-only class's (:mod:`.mistral3`: the Llama/Mistral decoder,
Ministral 3's query scaling, its tensors renamed, the head tied by the text config). Besides,
the class builds the tower (:mod:`.pixtral_vision`, only the layers the selected hidden state
needs) and the projector (:mod:`.mistral3_vision`), whole on every tensor-parallel rank, and
reads their tensors: ``vision_tower.*`` and ``multi_modal_projector.*`` (hub files, and what
transformers 5 saves), ``model.vision_tower.*`` and ``model.multi_modal_projector.*`` (its
in-memory layout). Positions are the decoder's own (1D).

An image's feature covers its whole token run, ``[IMG]`` rows with their ``[IMG_BREAK]``
and ``[IMG_END]`` tokens (:mod:`.mistral3_processing`); :meth:`embed_multimodal` returns a
row for each: the projected image rows at the ``[IMG]`` tokens, in order, and the token
embeddings elsewhere, which is what HF's model feeds its decoder there.

A checkpoint whose image side is not built here (another tower, a list of feature layers)
is served as text only (the class of :mod:`.mistral3`; a warning says why).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from chassis.builtin_plugins.models.embeds_forward import DecoderOverEmbeds
from chassis.builtin_plugins.models.image_item_inputs import image_run_inputs
from chassis.builtin_plugins.models.image_side_weights import ImageSideWeights, renamed_by_prefix
from chassis.builtin_plugins.models.mistral3 import Mistral3ForConditionalGeneration
from chassis.builtin_plugins.models.mistral3_vision import (
    Mistral3Projector,
    Mistral3VisionSpec,
    unsupported_reason,
)
from chassis.builtin_plugins.models.pixtral_vision import PixtralVisionTower
from chassis.core.model_interface import CausalLM, ModelBuildContext
from chassis.core.placeholder_runs import splice_item_rows

logger = logging.getLogger(__name__)

#: (checkpoint-name prefix, ours) of the image side, the first that matches applies
_IMAGE_PREFIXES = (
    ("model.vision_tower.", "vision_tower."),
    ("vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("multi_modal_projector.", "multi_modal_projector."),
)


def image_side_name(name: str) -> str | None:
    """Checkpoint name -> our name of an image-side tensor, ``None`` for the language model's."""
    return renamed_by_prefix(name, _IMAGE_PREFIXES)


@functools.cache
def _warn_text_only(reason: str) -> None:
    """Say once per process why a Mistral 3 checkpoint takes no images."""
    logger.warning(
        "Mistral3ForConditionalGeneration: %s, so this checkpoint is served as text only "
        "(requests with images are refused)",
        reason,
    )


class Mistral3ForConditionalGenerationWithImages(
    ImageSideWeights, DecoderOverEmbeds, Mistral3ForConditionalGeneration
):
    """``Mistral3ForConditionalGeneration`` checkpoints with images (the module
    docstring)."""

    supported_modalities = frozenset({"image"})
    #: no image embeddings (core/multimodal_embeds.py): the run's layout needs the grid
    image_embeds_refusal = (
        "its image runs end each row of [IMG] tokens with [IMG_BREAK], and the rows alone do "
        "not say the image's grid of rows and columns (vLLM takes no embeddings for it either)"
    )

    @classmethod
    def class_for_config(cls, hf_config: Any) -> type[CausalLM]:
        """This class; the text-only one when the image side is not built here."""
        reason = unsupported_reason(hf_config)
        if reason is not None:
            _warn_text_only(reason)
            return Mistral3ForConditionalGeneration
        return cls

    def __init__(self, hf_config: Any, build_ctx: ModelBuildContext) -> None:
        super().__init__(hf_config, build_ctx)
        self.vision_spec = Mistral3VisionSpec.from_config(hf_config)
        self.image_token_id = int(hf_config.image_token_id)
        self.vision_tower = PixtralVisionTower(
            self.vision_spec.vision_config, self.vision_spec.feature_index
        )
        self.multi_modal_projector = Mistral3Projector(self.vision_spec, int(hf_config.hidden_size))

    @classmethod
    def multimodal_processor(cls, model_dir: str, hf_config: Any) -> Any:
        """The front-end's image processor
        (:class:`~.mistral3_processing.Mistral3ImageInputs`)."""
        from chassis.builtin_plugins.models.mistral3_processing import Mistral3ImageInputs

        return Mistral3ImageInputs.from_pretrained(model_dir, hf_config)

    # -- inputs ---------------------------------------------------------------------------------

    def embed_multimodal(self, modality: str, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """One image's rows, one per token of its run: ``inputs["pixel_values"]``
        ``[1, C, H, W]`` (or ``[C, H, W]``; sides multiples of one token's square) and
        ``inputs["placeholder_ids"]`` ``[length]`` (the run's token ids) -> ``[length,
        hidden_size]`` in the model's dtype. ``ValueError`` for another modality, a missing
        input, a wrong shape, or a run whose ``[IMG]`` count is not the image's."""
        pixels, run = image_run_inputs(self, modality, inputs)
        if pixels.dim() == 4:
            if pixels.shape[0] != 1:
                raise ValueError(
                    f"a feature holds one image; pixel_values is {tuple(pixels.shape)}"
                )
            pixels = pixels[0]
        (image_rows,) = self.image_features([pixels])
        return splice_item_rows(
            self.model.embed(run), run, self.image_token_id, image_rows, "image"
        )

    def image_features(self, images: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Images ``[C, H, W]`` each -> ``[H/(P*m) * W/(P*m), hidden_size]`` each (HF's
        ``get_image_features(...).pooler_output``); ``ValueError`` for pixel sides that are
        not multiples of one token's square."""
        spec = self.vision_spec
        unit = spec.pixels_per_token
        out = []
        for pixels in images:
            if pixels.dim() != 3 or pixels.shape[1] % unit or pixels.shape[2] % unit:
                raise ValueError(
                    f"pixel_values must be [channels, H, W] with H and W multiples of {unit} "
                    f"(patch_size x spatial_merge_size); got {tuple(pixels.shape)}"
                )
            states = self.vision_tower(pixels, spec.feature_index)
            rows, cols = pixels.shape[1] // spec.patch_size, pixels.shape[2] // spec.patch_size
            out.append(self.multi_modal_projector(states, rows, cols))
        return out

    # -- weights (ImageSideWeights; module docstring) -------------------------------------------

    image_side_label = "Pixtral vision tower or Mistral 3 projector"
    image_side_name = staticmethod(image_side_name)

    def image_tensor_unused(self, ours: str) -> bool:
        prefix = "vision_tower."
        return ours.startswith(prefix) and self.vision_tower.is_unused(ours[len(prefix) :])
