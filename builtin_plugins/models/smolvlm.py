"""SmolVLM / SmolVLM2 (``SmolVLMForConditionalGeneration``) with images and videos.

Idefics3's model (:mod:`.idefics3_images`: the text config's decoder, the SigLIP-like tower,
the pixel-shuffle connector) with SmolVLM2's videos: a video is a run of frames, each one
``max_image_size`` tile through the same tower and connector
(:mod:`.smolvlm_media` writes the run), its rows at the run's ``<image>`` tokens in frame
order and the token embeddings at its intro, timestamps and delimiters, as HF's
``inputs_merger`` places them. Positions are the decoder's own (1D).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from chassis.builtin_plugins.models.idefics3_images import (
    Idefics3ForConditionalGenerationWithImages,
)
from chassis.builtin_plugins.models.image_item_inputs import image_tiles
from chassis.core.placeholder_runs import splice_item_rows


class SmolVLMForConditionalGenerationWithImages(Idefics3ForConditionalGenerationWithImages):
    """``SmolVLMForConditionalGeneration`` checkpoints with images and videos (module
    docstring). Not built itself: :meth:`class_for_config` composes it over the text
    config's decoder (or gives the text-only class for a tower not built here)."""

    supported_modalities = frozenset({"image", "video"})

    @classmethod
    def multimodal_processor(cls, model_dir: str, hf_config: Any) -> Any:
        """The front-end's image and video processor (:mod:`.smolvlm_media`)."""
        from chassis.builtin_plugins.models.smolvlm_media import SmolVLMMediaInputs

        return SmolVLMMediaInputs.from_pretrained(model_dir, hf_config)

    def embed_multimodal(self, modality: str, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """An image's rows as Idefics3's; a video's, one per token of its run:
        ``inputs["pixel_values"]`` ``[frames, C, M, M]`` (one tile a frame) and
        ``inputs["placeholder_ids"]`` -> ``[length, hidden_size]``. ``ValueError`` for a
        missing input, a wrong shape, or a run whose ``<image>`` count is not the frames'
        rows."""
        if modality != "video":
            return super().embed_multimodal(modality, inputs)
        pixels, run = inputs.get("pixel_values"), inputs.get("placeholder_ids")
        if pixels is None or run is None:
            raise ValueError(
                f"video inputs need pixel_values and placeholder_ids (got {sorted(inputs)})"
            )
        features = self.image_features(image_tiles(pixels))
        rows = features.reshape(-1, features.shape[-1])
        return splice_item_rows(self.model.embed(run), run, self.image_token_id, rows, "video")
