"""LLaVA's image side: which vision-tower states it reads, and the projector that maps them
into the language model's embedding space.

HF's ``LlavaForConditionalGeneration`` runs the tower (:mod:`.clip_vision`), takes the
hidden state(s) ``vision_feature_layer`` names (one index, or a list whose states are
concatenated feature-wise; negative from the end), drops each state's first row when
``vision_feature_select_strategy`` is ``"default"`` (CLIP's class row; ``"full"`` keeps
it), and projects every remaining row with ``linear_1``, ``projector_hidden_act``,
``linear_2`` (biases by ``multimodal_projector_bias``). One image gives
``rows - 1`` (``"default"``) or ``rows`` (``"full"``) embeddings, ``rows`` = the tower's
patches (+ CLIP's class row): 576 for LLaVA-1.5 (CLIP ViT-L/14 at 336 px, ``-2``,
``"default"``).

:class:`LlavaVisionSpec` reads these settings from the config the engine builds from (the
text config, which carries them: :func:`~chassis.core.model_loader.language_model_config`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from chassis.builtin_plugins.models.clip_vision import hidden_state_indices, tower_kind
from chassis.builtin_plugins.models.qwen2_vl_vision import activation

#: ``vision_feature_select_strategy`` values and how many leading rows each drops
STRATEGIES = {"default": 1, "full": 0}


@dataclass(frozen=True)
class LlavaVisionSpec:
    """The image-side settings of a LLaVA config (module docstring)."""

    vision_config: Any
    #: the tower's hidden states read, non-negative, in concatenation order
    feature_indices: tuple[int, ...]
    strategy: str
    projector_act: str
    projector_bias: bool
    #: the tower's rows per image (its patches, and CLIP's class row)
    tower_rows: int

    @classmethod
    def from_config(cls, hf_config: Any) -> LlavaVisionSpec:
        """The settings of ``hf_config``; ``ValueError`` naming what is missing or not
        supported (no ``vision_config``, a tower other than CLIP's or SigLIP's, a strategy
        other than ``"default"`` / ``"full"``, a layer index outside the tower)."""
        vision = getattr(hf_config, "vision_config", None)
        if vision is None:
            raise ValueError(
                "the LLaVA config has no vision_config (is this the checkpoint's config.json, "
                "loaded with chassis.core.model_loader.load_hf_config?)"
            )
        if tower_kind(vision) is None:
            raise ValueError(
                f"LLaVA images need a CLIP or SigLIP vision tower; this checkpoint's is "
                f"{getattr(vision, 'model_type', None)!r}"
            )
        strategy = getattr(hf_config, "vision_feature_select_strategy", None) or "default"
        if strategy not in STRATEGIES:
            raise ValueError(
                f"vision_feature_select_strategy {strategy!r} is not supported; supported: "
                f"{', '.join(STRATEGIES)}"
            )
        layer = getattr(hf_config, "vision_feature_layer", None)
        indices = hidden_state_indices(-2 if layer is None else layer, vision.num_hidden_layers)
        patches = (int(vision.image_size) // int(vision.patch_size)) ** 2
        class_row = tower_kind(vision) == "clip_vision_model"
        bias = getattr(hf_config, "multimodal_projector_bias", None)
        return cls(
            vision_config=vision,
            feature_indices=tuple(indices),
            strategy=strategy,
            projector_act=str(getattr(hf_config, "projector_hidden_act", None) or "gelu"),
            projector_bias=True if bias is None else bool(bias),
            tower_rows=patches + int(class_row),
        )

    @property
    def tokens_per_image(self) -> int:
        """Placeholder tokens (projected rows) of one image."""
        return self.tower_rows - STRATEGIES[self.strategy]

    @property
    def layers_needed(self) -> int:
        """How many of the tower's layers the selected states need."""
        return max(self.feature_indices)

    def select(self, states: list[torch.Tensor]) -> torch.Tensor:
        """The tower's selected states ``[images, rows, dim]`` each -> the projector's input
        ``[images, tokens_per_image, dim * len(states)]``."""
        drop = STRATEGIES[self.strategy]
        return torch.cat([state[:, drop:] for state in states], dim=-1)


class LlavaProjector(nn.Module):
    """``linear_1`` (tower width x number of selected states -> text width), the
    activation, ``linear_2`` (text width -> text width); HF's names."""

    def __init__(self, spec: LlavaVisionSpec, text_hidden_size: int) -> None:
        super().__init__()
        width = int(spec.vision_config.hidden_size) * len(spec.feature_indices)
        self.linear_1 = nn.Linear(width, text_hidden_size, bias=spec.projector_bias)
        self.act = activation(spec.projector_act)
        self.linear_2 = nn.Linear(text_hidden_size, text_hidden_size, bias=spec.projector_bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))
