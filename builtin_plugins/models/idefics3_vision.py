"""Idefics3's and SmolVLM's image side: the SigLIP-like tower with bucketed patch positions,
the pixel shuffle and the connector's linear projection.

HF's ``Idefics3VisionTransformer`` (``SmolVLMVisionTransformer`` is the same) is SigLIP's
encoder (:class:`~.clip_vision.ClipVisionTower`'s SigLIP layers: a biased patch ``Conv2d``,
no class row, no pre-norm) with two changes: patch positions are bucketed, so a tile of any
size reuses the position table learned for ``image_size`` (:func:`bucket_positions`), and
every layer runs, then ``post_layernorm``. The tiles here are always square and whole (the
front-end never pads one), so no patch is masked. HF's ``Idefics3Connector`` lays a tile's
``side x side`` rows out as a square, merges each ``k x k`` block into one row of ``k * k``
times the width (``k`` = ``scale_factor``; the same order as InternVL's shuffle,
:func:`~.internvl_vision.pixel_shuffle`) and projects it with ``modality_projection.proj``
(no bias) to the language model's width. A tile of ``T`` pixels gives ``(T / (P * k))**2``
rows (``P`` the patch size): 64 for SmolVLM (512 px, patch 16, k 4), 169 for Idefics3-8B
(364 px, patch 14, k 2).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from chassis.builtin_plugins.models.clip_vision import ClipVisionTower
from chassis.builtin_plugins.models.internvl_vision import pixel_shuffle

#: the ``vision_config.model_type`` of the towers built here
TOWER_TYPES = ("idefics3_vision", "smolvlm_vision")


def _get(config: Any, name: str, default: Any = None) -> Any:
    """A field of a sub-config that may be a config object or a plain dict."""
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


def builds_tower(vision_config: Any) -> bool:
    """Whether ``vision_config`` is an Idefics3 / SmolVLM vision config."""
    return _get(vision_config, "model_type") in TOWER_TYPES


@dataclass(frozen=True)
class Idefics3VisionSpec:
    """The image-side settings of an Idefics3 / SmolVLM config, checked."""

    vision_config: Any
    patch_size: int
    #: the tower's patches a side of ``image_size`` (the position table's grid)
    positions_per_side: int
    #: the pixel shuffle's block side (``scale_factor``)
    shuffle: int

    @classmethod
    def from_config(cls, hf_config: Any) -> Idefics3VisionSpec:
        """The settings of ``hf_config`` (the text config carrying the wrapper's fields);
        ``ValueError`` for another tower or a shuffle that does not divide the grid."""
        vision = getattr(hf_config, "vision_config", None)
        if vision is None or not builds_tower(vision):
            kind = _get(vision, "model_type") if vision is not None else None
            raise ValueError(f"Idefics3 images need an Idefics3 vision tower; this one is {kind!r}")
        patch, size = int(_get(vision, "patch_size")), int(_get(vision, "image_size"))
        k = int(getattr(hf_config, "scale_factor", None) or 2)
        side = size // patch
        if k < 1 or side % k:
            raise ValueError(
                f"scale_factor {k} does not divide the tower's {side}x{side} grid of patches"
            )
        return cls(vision_config=vision, patch_size=patch, positions_per_side=side, shuffle=k)

    def rows_per_tile(self, tile: int) -> int:
        """Rows (``<image>`` tokens) of a square tile of ``tile`` pixels a side."""
        return (tile // (self.patch_size * self.shuffle)) ** 2


def bucket_positions(rows: int, cols: int, per_side: int, device: Any = None) -> torch.Tensor:
    """The position-table index of each patch of a whole ``rows x cols`` grid, row-major, as
    HF's ``Idefics3VisionEmbeddings`` computes it: each patch's fractional coordinate (float32
    ``i * (1 / n)``, capped below 1) bucketized against the table's ``1 / per_side`` steps.
    Float rounding makes this differ from ``arange`` for some grid sides even when the grid is
    the table's own, so it is always computed HF's way."""
    boundaries = torch.arange(1 / per_side, 1.0, 1 / per_side, device=device)

    def buckets(n: int) -> torch.Tensor:
        step = 1.0 / torch.tensor(n, device=device)  # float32, as HF's 1.0 / count
        coords = torch.arange(n, device=device, dtype=torch.float32) * step
        return torch.bucketize(coords.clamp(max=1.0 - 1e-6), boundaries, right=True)

    return (buckets(rows)[:, None] * per_side + buckets(cols)[None, :]).reshape(-1)


class Idefics3VisionTower(ClipVisionTower):
    """The tower (module docstring): ``forward(pixel_values [n, C, T, T])`` -> ``[n,
    (T / P)**2, hidden_size]`` after ``post_layernorm``; ``T`` a multiple of the patch size.
    Parameter names are the checkpoint's (``model.vision_model.`` stripped)."""

    def __init__(self, spec: Idefics3VisionSpec) -> None:
        vision = spec.vision_config
        fields = (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "image_size",
            "patch_size",
            "layer_norm_eps",
            "hidden_act",
        )
        # SigLIP's layers and embeddings are ClipVisionTower's (its "siglip_vision_model")
        siglip = SimpleNamespace(
            model_type="siglip_vision_model",
            num_channels=int(_get(vision, "num_channels", 3)),
            **{name: _get(vision, name) for name in fields},
        )
        siglip.layer_norm_eps = float(siglip.layer_norm_eps or 1e-6)
        siglip.hidden_act = siglip.hidden_act or "gelu_pytorch_tanh"
        super().__init__(siglip, int(siglip.num_hidden_layers))
        self.spec = spec
        self.post_layernorm = nn.LayerNorm(int(siglip.hidden_size), eps=siglip.layer_norm_eps)

    def is_unused(self, name: str) -> bool:
        """Every tensor is used (``post_layernorm`` included)."""
        return False

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        patch = self.patch_size
        if (
            pixel_values.dim() != 4
            or pixel_values.shape[-1] % patch
            or pixel_values.shape[-2] % patch
        ):
            raise ValueError(
                f"pixel_values must be [tiles, channels, height, width] with sides multiples of "
                f"the patch size {patch}; got {tuple(pixel_values.shape)}"
            )
        embeddings = self.embeddings
        weight = embeddings.patch_embedding.weight
        patches = embeddings.patch_embedding(pixel_values.to(weight.dtype))  # [n, dim, h, w]
        rows, cols = patches.shape[-2:]
        x = patches.flatten(2).transpose(1, 2)
        ids = bucket_positions(rows, cols, self.spec.positions_per_side, device=x.device)
        x = x + embeddings.position_embedding(ids)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class Idefics3Connector(nn.Module):
    """The pixel shuffle and ``modality_projection.proj`` (module docstring): ``[tiles,
    side * side, dim]`` -> ``[tiles, (side / k)**2, text width]``."""

    def __init__(self, spec: Idefics3VisionSpec, text_hidden_size: int) -> None:
        super().__init__()
        self.shuffle = spec.shuffle
        width = int(_get(spec.vision_config, "hidden_size")) * spec.shuffle**2
        self.modality_projection = nn.Module()
        self.modality_projection.proj = nn.Linear(width, text_hidden_size, bias=False)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        n, count, dim = features.shape
        side = round(count**0.5)
        if side * side != count or side % self.shuffle:
            raise ValueError(
                f"a tile's {count} rows are not a square grid the shuffle {self.shuffle} divides"
            )
        shuffled = pixel_shuffle(features.reshape(n, side, side, dim), self.shuffle)
        return self.modality_projection.proj(shuffled.reshape(n, -1, shuffled.shape[-1]))
