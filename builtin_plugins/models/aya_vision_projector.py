"""Aya Vision's image side after the tower: the pixel shuffle and the SwiGLU projector.

HF's ``AyaVisionModel.get_image_features`` takes the SigLIP tower's hidden state
``vision_feature_layer`` (``-1``: the last layer's output, without ``post_layernorm``),
keeps every row (``vision_feature_select_strategy`` ``"full"``; ``"default"`` would drop a
first row, which SigLIP does not have), lays a tile's ``side x side`` rows out as a square
(``side = image_size / patch_size``) and merges each ``k x k`` block (``k`` =
``downsample_factor``) into one row of ``k * k`` times the width, in the same order as
InternVL's shuffle (:func:`~.internvl_vision.pixel_shuffle`). The projector then applies
``layernorm`` (eps ``adapter_layer_norm_eps``), ``linear_1`` (to
``alignment_intermediate_size``, the text width by default), a SwiGLU (the first half of
``linear_1``'s output times SiLU of the second half) and ``linear_2`` (to the text width), all
with biases; HF's names (``multi_modal_projector.*``). A tile gives ``(side / k)**2`` rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from chassis.builtin_plugins.models.clip_vision import hidden_state_indices, tower_kind
from chassis.builtin_plugins.models.internvl_vision import pixel_shuffle


@dataclass(frozen=True)
class AyaVisionSpec:
    """The image-side settings of an Aya Vision config (module docstring), checked."""

    vision_config: Any
    #: the tower's hidden state read (non-negative)
    feature_index: int
    #: the tower's rows a side of a tile, and the shuffle's block side
    side: int
    shuffle: int
    norm_eps: float
    intermediate_size: int

    @classmethod
    def from_config(cls, hf_config: Any) -> AyaVisionSpec:
        """The settings of ``hf_config`` (the text config carrying the wrapper's fields);
        ``ValueError`` for a missing ``vision_config``, a tower other than SigLIP's, a list of
        feature layers, ``"default"`` selection, or a grid the shuffle does not divide."""
        vision = getattr(hf_config, "vision_config", None)
        if vision is None or tower_kind(vision) != "siglip_vision_model":
            kind = getattr(vision, "model_type", None)
            raise ValueError(f"Aya Vision images need a SigLIP vision tower; this one is {kind!r}")
        strategy = getattr(hf_config, "vision_feature_select_strategy", None) or "full"
        if strategy != "full":
            raise ValueError(
                f"vision_feature_select_strategy {strategy!r} is not supported for Aya Vision "
                "(SigLIP has no class row to drop): only 'full'"
            )
        layer = getattr(hf_config, "vision_feature_layer", None)
        layer = -1 if layer is None else layer
        if not isinstance(layer, int):
            raise ValueError(f"vision_feature_layer {layer!r} is not supported: one index only")
        (index,) = hidden_state_indices(layer, int(vision.num_hidden_layers))
        side = int(vision.image_size) // int(vision.patch_size)
        k = int(getattr(hf_config, "downsample_factor", None) or 2)
        if k < 1 or side % k:
            raise ValueError(
                f"downsample_factor {k} does not divide the tower's {side}x{side} grid of patches"
            )
        eps = getattr(hf_config, "adapter_layer_norm_eps", None)
        width = getattr(hf_config, "alignment_intermediate_size", None)
        return cls(
            vision_config=vision,
            feature_index=index,
            side=side,
            shuffle=k,
            norm_eps=1e-6 if eps is None else float(eps),
            intermediate_size=int(width or hf_config.hidden_size),
        )

    @property
    def tokens_per_tile(self) -> int:
        """Rows (``<|IMG_PATCH|>`` tokens) of one tile."""
        return (self.side // self.shuffle) ** 2


class AyaVisionProjector(nn.Module):
    """The pixel shuffle and ``layernorm``, ``linear_1``, SwiGLU, ``linear_2`` (module
    docstring): ``[tiles, side * side, dim]`` -> ``[tiles, tokens_per_tile, text width]``."""

    def __init__(self, spec: AyaVisionSpec, text_hidden_size: int) -> None:
        super().__init__()
        self.spec = spec
        width = int(spec.vision_config.hidden_size) * spec.shuffle**2
        self.layernorm = nn.LayerNorm(width, eps=spec.norm_eps)
        self.linear_1 = nn.Linear(width, spec.intermediate_size)
        self.linear_2 = nn.Linear(spec.intermediate_size // 2, text_hidden_size)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        grid = features.reshape(features.shape[0], spec.side, spec.side, features.shape[-1])
        shuffled = pixel_shuffle(grid, spec.shuffle)
        rows = shuffled.reshape(shuffled.shape[0], -1, shuffled.shape[-1])
        x, gate = self.linear_1(self.layernorm(rows)).chunk(2, dim=-1)
        return self.linear_2(F.silu(gate) * x)
