"""Gemma 3 (``Gemma3ForConditionalGeneration``, gemma-3-4b/12b/27b) with images: the Gemma 3
text decoder, a SigLIP vision tower and Gemma 3's projector; image tokens attend to their
whole image.

An image ``[3, S, S]`` goes through the whole SigLIP tower (:mod:`.clip_vision`, every layer,
then SigLIP's ``post_layernorm``: HF's ``last_hidden_state``), ``(S / P)**2`` rows. The
projector (:class:`Gemma3Projector`, HF's ``Gemma3MultiModalProjector``) lays the rows out as
their patch grid, averages ``k x k`` squares (``k`` = patches a side / tokens a side) down to
``mm_tokens_per_image`` rows, normalizes them with a Gemma RMSNorm (``mm_soft_emb_norm``) and
multiplies by ``mm_input_projection_weight`` ``[vision hidden, text hidden]``. These rows
replace the image's ``<image_soft_token>`` placeholders; they are not multiplied by Gemma's
embedding scale ``sqrt(hidden_size)``, which text embeddings get (HF scales in the embedding
layer, before the image rows are scattered in).

Within one image's placeholder tokens attention is bidirectional, elsewhere causal, and on
the sliding layers within the window as well (HF's masks with ``token_type_ids``): the class
declares ``bidirectional_image_blocks``, so the runner gives such steps an
``AttentionMetadata.attend_limit`` and the scheduler never splits an image's tokens across
prefill chunks (docs/multimodal.md). The attention backend must support that
(``supports_attend_limit``); building refuses one that does not.

Tensor names: the language model's as the text-only class reads them (:mod:`.gemma3`); the
tower's ``vision_tower.vision_model.*`` (hub files), ``vision_tower.*`` (what transformers 5
saves) or ``model.vision_tower.*`` (its in-memory layout); the projector's
``multi_modal_projector.*`` or ``model.multi_modal_projector.*``. SigLIP's pooling ``head``
(unused by Gemma 3) is never read. Tower and projector are whole on every tensor-parallel
rank; LoRA adapters never reach them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from chassis.builtin_plugins.models.clip_vision import ClipVisionTower, tower_kind
from chassis.builtin_plugins.models.embeds_forward import DecoderOverEmbeds
from chassis.builtin_plugins.models.gemma3 import Gemma3ForConditionalGeneration
from chassis.builtin_plugins.models.image_side_weights import ImageSideWeights
from chassis.core.layers.attention import check_attend_limit_support
from chassis.core.layers.norm import GemmaRMSNorm
from chassis.core.model_interface import ModelBuildContext

#: checkpoint prefixes of the tower (the first that matches applies)
_TOWER_PREFIXES = (
    "model.vision_tower.vision_model.",
    "model.vision_tower.",
    "vision_tower.vision_model.",
    "vision_tower.",
)
_PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")


def image_side_name(name: str) -> str | None:
    """Checkpoint name -> our name of an image-side tensor (``""`` for one never read:
    SigLIP's pooling head), ``None`` for the language model's."""
    for prefix in _TOWER_PREFIXES:
        if name.startswith(prefix):
            rest = name[len(prefix) :]
            if rest.startswith("head."):
                return ""
            if rest.startswith("post_layernorm."):
                return "vision_tower." + rest
            return "vision_tower.encoder." + rest
    for prefix in _PROJECTOR_PREFIXES:
        if name.startswith(prefix):
            return "multi_modal_projector." + name[len(prefix) :]
    return None


class Gemma3VisionTower(nn.Module):
    """SigLIP's whole encoder then its ``post_layernorm``: ``[n, 3, S, S]`` ->
    ``[n, patches, vision hidden]`` (HF's ``SiglipVisionModel(...).last_hidden_state``)."""

    def __init__(self, vision_config: Any) -> None:
        super().__init__()
        if tower_kind(vision_config) != "siglip_vision_model":
            raise ValueError(
                "Gemma 3 images need a SigLIP vision tower (siglip_vision_model); this "
                f"checkpoint's is {getattr(vision_config, 'model_type', None)!r}"
            )
        self.num_layers = int(vision_config.num_hidden_layers)
        self.encoder = ClipVisionTower(vision_config, self.num_layers)
        self.post_layernorm = nn.LayerNorm(
            int(vision_config.hidden_size), eps=float(vision_config.layer_norm_eps)
        )

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        (last,) = self.encoder(pixel_values, [self.num_layers])
        return self.post_layernorm(last)


class Gemma3Projector(nn.Module):
    """HF's ``Gemma3MultiModalProjector``: ``[n, patches, vision hidden]`` ->
    ``[n, mm_tokens_per_image, text hidden]`` (the module docstring)."""

    def __init__(self, vision_config: Any, text_hidden: int, tokens_per_image: int) -> None:
        super().__init__()
        vision_hidden = int(vision_config.hidden_size)
        self.patches_per_side = int(vision_config.image_size) // int(vision_config.patch_size)
        self.tokens_per_side = round(tokens_per_image**0.5)
        if (
            self.tokens_per_side**2 != tokens_per_image
            or self.patches_per_side % self.tokens_per_side
        ):
            raise ValueError(
                f"mm_tokens_per_image {tokens_per_image} must be a square whose side divides "
                f"the tower's {self.patches_per_side} patches a side"
            )
        self.kernel = self.patches_per_side // self.tokens_per_side
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(vision_hidden, text_hidden))
        self.mm_soft_emb_norm = GemmaRMSNorm(vision_hidden, float(vision_config.layer_norm_eps))

    def forward(self, vision_rows: torch.Tensor) -> torch.Tensor:
        n, _, hidden = vision_rows.shape
        side = self.patches_per_side
        grid = vision_rows.transpose(1, 2).reshape(n, hidden, side, side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        normed = self.mm_soft_emb_norm(pooled)
        return torch.matmul(normed, self.mm_input_projection_weight).type_as(vision_rows)


class Gemma3ForConditionalGenerationWithImages(
    ImageSideWeights, DecoderOverEmbeds, Gemma3ForConditionalGeneration
):
    """``Gemma3ForConditionalGeneration`` checkpoints with images (the module docstring)."""

    supported_modalities = frozenset({"image"})
    bidirectional_image_blocks = True
    #: image embeddings as ``[mm_tokens_per_image, hidden]`` tensors, the projector's rows
    #: (core/multimodal_embeds.py; the processor checks the count)
    image_embeds_form = "rows"

    def __init__(self, hf_config: Any, build_ctx: ModelBuildContext) -> None:
        check_attend_limit_support(build_ctx.attention_backend, type(self).__name__)
        super().__init__(hf_config, build_ctx)
        vision_config = getattr(hf_config, "vision_config", None)
        tokens = getattr(hf_config, "mm_tokens_per_image", None)
        if vision_config is None or tokens is None:
            raise ValueError(
                "a Gemma 3 checkpoint for images needs vision_config and mm_tokens_per_image "
                "in its config.json"
            )
        self.tokens_per_image = int(tokens)
        self.image_token_id = int(hf_config.image_token_id)
        self.vocab_size = int(hf_config.vocab_size)
        self.vision_tower = Gemma3VisionTower(vision_config)
        self.multi_modal_projector = Gemma3Projector(
            vision_config, int(hf_config.hidden_size), self.tokens_per_image
        )

    @classmethod
    def multimodal_processor(cls, model_dir: str, hf_config: Any) -> Any:
        """The front-end's image processor (:class:`~.gemma3_processing.Gemma3ImageInputs`)."""
        from chassis.builtin_plugins.models.gemma3_processing import Gemma3ImageInputs

        return Gemma3ImageInputs.from_pretrained(model_dir, hf_config)

    # -- inputs ---------------------------------------------------------------------------------

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Text embeddings (scaled by ``sqrt(hidden_size)``); an id past the vocabulary (an
        image token outside it) embeds as id 0, as HF does (its row is replaced anyway)."""
        return self.model.embed(torch.where(input_ids < self.vocab_size, input_ids, 0))

    def embed_multimodal(self, modality: str, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """One image's rows: ``inputs["pixel_values"]`` ``[1, 3, S, S]`` (or ``[3, S, S]``)
        -> ``[mm_tokens_per_image, hidden_size]`` in the model's dtype; ``ValueError`` for
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
        """``[images, 3, S, S]`` -> ``[images, mm_tokens_per_image, hidden_size]`` (HF's
        ``get_image_features(...).pooler_output``)."""
        return self.multi_modal_projector(self.vision_tower(pixel_values))

    # -- weights (ImageSideWeights; module docstring) -------------------------------------------

    image_side_label = "Gemma 3 vision tower or projector"
    image_side_name = staticmethod(image_side_name)
