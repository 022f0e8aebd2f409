"""Mistral 3's image side besides the tower: which Pixtral hidden state it reads, and the
projector that maps it into the language model's embedding space.

HF's ``Mistral3ForConditionalGeneration`` takes the tower's hidden state
``vision_feature_layer`` (-1 in the released checkpoints: the last layer's output) and runs
``Mistral3MultiModalProjector`` over an image's ``h x w`` patch rows:

1. ``norm``: RMSNorm over the tower's width, with the *text* config's ``rms_norm_eps``;
2. ``patch_merger``: each ``m x m`` square of patches (``m`` = ``spatial_merge_size``, 2),
   taken row-major over the ``h/m x w/m`` merged grid, becomes one row of ``m * m * width``
   values ordered channel-major (channel ``c``, then the square's row, then its column: what
   ``torch.nn.functional.unfold`` gives), through ``merging_layer`` (bias-free);
3. ``linear_1``, ``projector_hidden_act`` (GELU), ``linear_2`` (biases by
   ``multimodal_projector_bias``, false in the released checkpoints).

An image of ``H x W`` pixels therefore gives ``(H / (P*m)) * (W / (P*m))`` rows (``P`` the
patch size). :class:`Mistral3VisionSpec` reads these settings from the config the engine
builds from (the text config, which carries the wrapper's image fields:
:func:`~chassis.core.model_loader.language_model_config`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from chassis.builtin_plugins.models.pixtral_vision import config_value
from chassis.builtin_plugins.models.qwen2_vl_vision import activation
from chassis.core.layers.norm import RMSNorm


def unsupported_reason(hf_config: Any) -> str | None:
    """Why the image side of ``hf_config`` cannot be built here (no ``vision_config``, a
    tower other than Pixtral's, a list of feature layers), or ``None`` when it can."""
    vision = getattr(hf_config, "vision_config", None)
    if vision is None:
        return "the config has no vision_config"
    model_type = config_value(vision, "model_type")
    if model_type != "pixtral":
        return f"its vision tower is {model_type!r}, not Pixtral's"
    layer = getattr(hf_config, "vision_feature_layer", None)
    if layer is not None and (isinstance(layer, bool) or not isinstance(layer, int)):
        # (HF's projector cannot run a list either: its norm and merger take one state's width)
        return f"vision_feature_layer {layer!r} is not one layer index"
    return None


@dataclass(frozen=True)
class Mistral3VisionSpec:
    """The image-side settings of a Mistral 3 config (module docstring)."""

    vision_config: Any
    #: HF's hidden state read (non-negative): that many tower layers are run
    feature_index: int
    patch_size: int
    merge: int
    projector_act: str
    projector_bias: bool
    #: the projector norm's epsilon (the text config's ``rms_norm_eps``)
    norm_eps: float
    vision_width: int

    @classmethod
    def from_config(cls, hf_config: Any) -> Mistral3VisionSpec:
        """The settings of ``hf_config``; ``ValueError`` naming what is missing or not
        supported (:func:`unsupported_reason`, a layer index outside the tower)."""
        reason = unsupported_reason(hf_config)
        if reason is not None:
            raise ValueError(f"Mistral 3 images are not supported: {reason}")
        vision = hf_config.vision_config
        num_layers = int(config_value(vision, "num_hidden_layers"))
        layer = getattr(hf_config, "vision_feature_layer", None)
        layer = -1 if layer is None else int(layer)
        if not -(num_layers + 1) <= layer <= num_layers:
            raise ValueError(
                f"vision_feature_layer {layer} is outside the tower's {num_layers + 1} hidden "
                f"states ({num_layers} layers)"
            )
        merge = int(getattr(hf_config, "spatial_merge_size", None) or 2)
        bias = getattr(hf_config, "multimodal_projector_bias", None)
        return cls(
            vision_config=vision,
            feature_index=layer % (num_layers + 1),
            patch_size=int(config_value(vision, "patch_size")),
            merge=merge,
            projector_act=str(getattr(hf_config, "projector_hidden_act", None) or "gelu"),
            projector_bias=bool(bias) if bias is not None else False,
            norm_eps=float(getattr(hf_config, "rms_norm_eps", None) or 1e-5),
            vision_width=int(config_value(vision, "hidden_size")),
        )

    @property
    def pixels_per_token(self) -> int:
        """The side in pixels of the square one image token covers (``P * m``)."""
        return self.patch_size * self.merge


class _PatchMerger(nn.Module):
    def __init__(self, width: int, merge: int) -> None:
        super().__init__()
        self.merge = merge
        self.merging_layer = nn.Linear(width * merge * merge, width, bias=False)

    def forward(self, x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """``[rows * cols, width]`` patches (row-major) -> ``[rows/m * cols/m, width]``."""
        m, width = self.merge, x.shape[-1]
        # (merged row, square row, merged col, square col, channel) -> one row per square,
        # its values channel-major (what unfold gives)
        grid = x.view(rows // m, m, cols // m, m, width).permute(0, 2, 4, 1, 3)
        return self.merging_layer(grid.reshape((rows // m) * (cols // m), width * m * m))


class Mistral3Projector(nn.Module):
    """``norm``, ``patch_merger``, ``linear_1``, the activation, ``linear_2``; HF's names."""

    def __init__(self, spec: Mistral3VisionSpec, text_hidden_size: int) -> None:
        super().__init__()
        width = spec.vision_width
        self.norm = RMSNorm(width, spec.norm_eps)
        self.patch_merger = _PatchMerger(width, spec.merge)
        self.linear_1 = nn.Linear(width, text_hidden_size, bias=spec.projector_bias)
        self.act = activation(spec.projector_act)
        self.linear_2 = nn.Linear(text_hidden_size, text_hidden_size, bias=spec.projector_bias)

    def forward(self, features: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """One image's ``[rows * cols, width]`` tower rows (a grid of patches whose sides
        are multiples of the merge size) -> ``[rows * cols / m**2, text_hidden_size]``."""
        merged = self.patch_merger(self.norm(features), rows, cols)
        return self.linear_2(self.act(self.linear_1(merged)))
