"""LLaVA-1.5 (``LlavaForConditionalGeneration``) with images: the text config's decoder, a
CLIP (or SigLIP) vision tower and LLaVA's projector.

The class is composed over the registered decoder of the text architecture as the text-only
LLaVA-style class is (:mod:`.llava`: one class per decoder, the language model's tensors
renamed to it, the LM head tied by the top-level flag). Besides, it builds the vision tower
(:mod:`.clip_vision`, only the layers the selected states need) and the projector
(:mod:`.llava_vision`), whole on every tensor-parallel rank, and reads their tensors:
``vision_tower.vision_model.*`` (hub files), ``vision_tower.*`` (what transformers 5
saves), ``model.vision_tower.*`` (its in-memory layout), ``multi_modal_projector.*`` and
``model.multi_modal_projector.*``. Each image becomes ``tokens_per_image`` rows of the
language model's width (:meth:`LlavaForConditionalGenerationWithImages.embed_multimodal`),
which the runner puts in place of the image's placeholder tokens. Positions are the
decoder's own (1D).

A checkpoint whose tower is neither CLIP's nor SigLIP's is served as text only (the class of
:mod:`.llava`; a warning says why), so its text keeps working.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from typing import Any

import torch

from chassis.builtin_plugins.models.clip_vision import ClipVisionTower, tower_kind
from chassis.builtin_plugins.models.embeds_forward import DecoderOverEmbeds
from chassis.builtin_plugins.models.image_side_weights import ImageSideWeights, renamed_by_prefix
from chassis.builtin_plugins.models.llava import LlavaForConditionalGeneration
from chassis.builtin_plugins.models.llava_vision import LlavaProjector, LlavaVisionSpec
from chassis.core.model_interface import CausalLM, ModelBuildContext

logger = logging.getLogger(__name__)

#: (checkpoint-name prefix, ours) of the image side, the first that matches applies
_IMAGE_PREFIXES = (
    ("model.vision_tower.vision_model.", "vision_tower."),
    ("model.vision_tower.", "vision_tower."),
    ("vision_tower.vision_model.", "vision_tower."),
    ("vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("multi_modal_projector.", "multi_modal_projector."),
)


def image_side_name(name: str) -> str | None:
    """Checkpoint name -> our name of an image-side tensor, ``None`` for the language model's."""
    return renamed_by_prefix(name, _IMAGE_PREFIXES)


@functools.cache
def _warn_text_only(architecture: str, tower: str | None) -> None:
    """Say once per process why a LLaVA checkpoint takes no images."""
    logger.warning(
        "%s with a %r vision tower: only CLIP and SigLIP towers are supported, so this "
        "checkpoint is served as text only (requests with images are refused)",
        architecture,
        tower,
    )


class LlavaForConditionalGenerationWithImages(
    ImageSideWeights, DecoderOverEmbeds, LlavaForConditionalGeneration
):
    """``LlavaForConditionalGeneration`` checkpoints with images (the module docstring).

    Not built itself: :meth:`class_for_config` returns the class of this one over the text
    config's decoder (or, for a tower not built here, the text-only class).
    """

    supported_modalities = frozenset({"image"})
    #: image embeddings taken as ``[rows, hidden]`` tensors (core/multimodal_embeds.py)
    image_embeds_form: str | None = "rows"
    #: the text-only class served when the checkpoint's tower is not one built here
    text_only_class: type[LlavaForConditionalGeneration] = LlavaForConditionalGeneration

    @classmethod
    def class_for_config(cls, hf_config: Any) -> type[CausalLM]:
        """This class over the text config's decoder, as the text-only class composes
        itself; that text-only class when the tower is not one built here."""
        if cls.__dict__.get("decoder") is not None:
            return cls  # already composed
        vision = getattr(hf_config, "vision_config", None)
        if vision is None or not cls.builds_tower(vision):
            cls.warn_text_only(hf_config, vision)
            return cls.text_only_class.class_for_config(hf_config)
        return super().class_for_config(hf_config)

    @classmethod
    def warn_text_only(cls, hf_config: Any, vision_config: Any) -> None:
        """Say (once per process) that a checkpoint whose tower is not built here is served
        as text only."""
        architecture = cls.__name__.removesuffix("WithImages")
        _warn_text_only(architecture, getattr(vision_config, "model_type", None))

    @classmethod
    def builds_tower(cls, vision_config: Any) -> bool:
        """Whether this class builds the tower ``vision_config`` describes (CLIP's or
        SigLIP's here; a subclass with another tower overrides it)."""
        return tower_kind(vision_config) is not None

    def __init__(self, hf_config: Any, build_ctx: ModelBuildContext) -> None:
        super().__init__(hf_config, build_ctx)
        self.check_decoder_takes_embeds("LLaVA images need")
        self.build_image_side(hf_config)

    def build_image_side(self, hf_config: Any) -> None:
        """Build ``vision_tower`` (which must have ``is_unused(name)``) and
        ``multi_modal_projector``, and what :meth:`image_features` needs: LLaVA's here, a
        subclass with another image side overrides it."""
        self.vision_spec = LlavaVisionSpec.from_config(hf_config)
        self.vision_tower = ClipVisionTower(
            self.vision_spec.vision_config, self.vision_spec.layers_needed
        )
        self.multi_modal_projector = LlavaProjector(self.vision_spec, int(hf_config.hidden_size))

    @classmethod
    def multimodal_processor(cls, model_dir: str, hf_config: Any) -> Any:
        """The front-end's image processor (:class:`~.llava_processing.LlavaImageInputs`)."""
        from chassis.builtin_plugins.models.llava_processing import LlavaImageInputs

        return LlavaImageInputs.from_pretrained(model_dir, hf_config)

    # -- inputs ---------------------------------------------------------------------------------

    def embed_multimodal(self, modality: str, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """One item's rows as the decoder reads them: :meth:`item_rows` (the projector's
        output, HF's image features) through the decoder's
        :meth:`~chassis.core.model_interface.CausalLM.prompt_embeds_to_inputs`, since
        transformers splices the features into ``inputs_embeds`` and the text model's forward
        scales every row it is given (Granite's ``embedding_multiplier``: granite-vision);
        for the other decoders the rows are kept as they are."""
        return self.prompt_embeds_to_inputs(self.item_rows(modality, inputs))

    def item_rows(self, modality: str, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """One image's rows: ``inputs["pixel_values"]`` ``[1, C, S, S]`` (or ``[C, S, S]``)
        -> ``[tokens_per_image, hidden_size]`` in the model's dtype. ``ValueError`` for
        another modality, a missing input or a wrong shape."""
        if modality != "image":
            raise ValueError(f"{type(self).__name__} takes images, not {modality!r} inputs")
        pixels = inputs.get("pixel_values")
        if pixels is None:
            raise ValueError(f"image inputs lack pixel_values (got {sorted(inputs)})")
        if pixels.dim() == 4 and pixels.shape[0] != 1:
            raise ValueError(f"a feature holds one image; pixel_values is {tuple(pixels.shape)}")
        features = self.image_features(pixels)
        return features.reshape(-1, features.shape[-1])

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[images, C, S, S]`` -> ``[images, tokens_per_image, hidden_size]`` (HF's
        ``get_image_features``, stacked)."""
        spec = self.vision_spec
        states = self.vision_tower(pixel_values, spec.feature_indices)
        return self.multi_modal_projector(spec.select(states))

    # -- weights (ImageSideWeights; its module docstring) --------------------------------------

    image_side_label = "LLaVA vision tower or projector"
    image_side_name = staticmethod(image_side_name)

    def image_tensor_unused(self, ours: str) -> bool:
        prefix = "vision_tower."
        return ours.startswith(prefix) and self.vision_tower.is_unused(ours[len(prefix) :])
