"""Llama 4's image side: the vision tower (``vision_model``, with its pixel-shuffle adapter)
and the projector (``multi_modal_projector``), as HF transformers' ``Llama4VisionModel`` and
``Llama4MultiModalProjector`` compute them.

One tile (``S x S`` pixels, ``S`` = ``image_size``; the tower's position table has exactly
one row per patch of such a tile) becomes ``(S / P)**2`` patch rows (``P`` = ``patch_size``)
through a bias-free linear map of each ``P x P`` patch's values (ordered channel, row,
column: ``torch.nn.functional.unfold``'s), in row-major patch order. Then:

1. a class row (``class_embedding``) appended *after* the patches, the learned
   ``positional_embedding_vlm`` added, ``layernorm_pre``;
2. ``num_hidden_layers`` pre-norm encoder layers: LayerNorm, bidirectional attention with
   biased q/k/v/o projections and a 2-D rotary embedding, residual; LayerNorm, GELU MLP
   (``fc1``, ``fc2``, biased), residual. The rotary embedding rotates pairs ``(2i, 2i + 1)``
   as complex numbers: the first quarter of a head's pairs by ``(column + 1) * f_j``, the
   second by ``(row + 1) * f_j`` with ``f_j = theta ** (-4j / head_dim)`` (``theta`` the
   vision config's ``rope_theta``); the class row is not rotated;
3. ``layernorm_post``, the class row dropped;
4. the adapter: a pixel shuffle of ratio ``r`` (``pixel_shuffle_ratio``, 0.5) folds each
   ``1/r x 1/r`` block of the patch grid into one row of ``hidden / r**2`` values (HF's
   ``pixel_shuffle`` order, :func:`pixel_shuffle`), then ``fc1`` (bias-free), GELU, ``fc2``
   (bias-free), GELU;
5. the projector: ``linear_1`` (bias-free) from ``vision_output_dim`` to the text width.

A tile therefore gives ``(S / P)**2 * r**2`` rows (144 for the released 336-pixel tiles of 14
pixels, ratio 0.5). Every LayerNorm has PyTorch's default epsilon (HF builds them so, whatever
``norm_eps`` says) and every activation is the exact GELU (HF's, whatever ``hidden_act``
says). The image side is whole on every tensor-parallel rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from chassis.builtin_plugins.models.pixtral_vision import config_value

#: the epsilon of every LayerNorm of HF's tower (``nn.LayerNorm``'s default)
_LAYER_NORM_EPS = 1e-5


@dataclass(frozen=True)
class Llama4VisionSpec:
    """The image-side settings of a Llama 4 config (the config the engine builds from: the
    text config carrying the wrapper's ``vision_config``)."""

    hidden_size: int
    num_heads: int
    num_layers: int
    intermediate_size: int
    image_size: int
    patch_size: int
    num_channels: int
    rope_theta: float
    shuffle_ratio: float
    projector_input_dim: int
    projector_output_dim: int
    vision_output_dim: int
    text_hidden_size: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def side(self) -> int:
        """Patches along a tile's side."""
        return self.image_size // self.patch_size

    @property
    def shuffled_side(self) -> int:
        """Rows along a tile's side after the pixel shuffle."""
        return round(self.side * self.shuffle_ratio)

    @property
    def tokens_per_tile(self) -> int:
        """The rows one tile gives."""
        return self.shuffled_side**2

    @classmethod
    def from_config(cls, hf_config: Any) -> Llama4VisionSpec:
        """The settings of ``hf_config``; ``ValueError`` naming what is missing or what HF's
        model could not run either (sizes that do not divide, widths that do not chain)."""
        vision = getattr(hf_config, "vision_config", None)
        if vision is None:
            raise ValueError("Llama 4 images need the config's vision_config")
        rope = config_value(vision, "rope_parameters") or {}
        theta = rope.get("rope_theta", config_value(vision, "rope_theta"))
        if theta is None:
            raise ValueError("the Llama 4 vision_config has no rope_theta")
        spec = cls(
            hidden_size=int(config_value(vision, "hidden_size", 768)),
            num_heads=int(config_value(vision, "num_attention_heads", 16)),
            num_layers=int(config_value(vision, "num_hidden_layers", 34)),
            intermediate_size=int(config_value(vision, "intermediate_size", 5632)),
            image_size=int(config_value(vision, "image_size", 448)),
            patch_size=int(config_value(vision, "patch_size", 14)),
            num_channels=int(config_value(vision, "num_channels", 3)),
            rope_theta=float(theta),
            shuffle_ratio=float(config_value(vision, "pixel_shuffle_ratio", 0.5)),
            projector_input_dim=int(config_value(vision, "projector_input_dim", 4096)),
            projector_output_dim=int(config_value(vision, "projector_output_dim", 4096)),
            vision_output_dim=int(config_value(vision, "vision_output_dim", 7680)),
            text_hidden_size=int(hf_config.hidden_size),
        )
        spec._check()
        return spec

    def _check(self) -> None:
        problems = []
        if self.hidden_size % self.num_heads or self.head_dim % 4:
            problems.append(
                f"hidden_size {self.hidden_size} over {self.num_heads} heads is not a head "
                "width divisible by 4 (the 2-D rotary embedding's quarters)"
            )
        if self.image_size % self.patch_size:
            problems.append(
                f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}"
            )
        shuffled = self.side * self.shuffle_ratio
        if shuffled != int(shuffled) or shuffled < 1:
            problems.append(
                f"pixel_shuffle_ratio {self.shuffle_ratio} does not divide the {self.side} "
                "patches along a tile's side"
            )
        elif self.hidden_size * (self.side / self.shuffled_side) ** 2 != self.intermediate_size:
            problems.append(
                f"the pixel shuffle gives rows of {self.hidden_size} / ratio**2 values, but the "
                f"adapter's fc1 takes intermediate_size {self.intermediate_size}"
            )
        if self.projector_input_dim != self.projector_output_dim:
            problems.append(
                f"projector_input_dim {self.projector_input_dim} differs from "
                f"projector_output_dim {self.projector_output_dim} (the adapter's fc2 takes one "
                "and gives the other)"
            )
        if self.vision_output_dim != self.projector_output_dim:
            problems.append(
                f"vision_output_dim {self.vision_output_dim} differs from the adapter's "
                f"projector_output_dim {self.projector_output_dim}"
            )
        if problems:
            raise ValueError("Llama 4 images are not supported: " + "; ".join(problems))


def rotary_angles(spec: Llama4VisionSpec) -> torch.Tensor:
    """``[patches + 1, head_dim / 2]`` float32 angles of each row's pairs (module docstring);
    the last row, the class row's, all zero."""
    side, quarter = spec.side, spec.head_dim // 4
    freqs = 1.0 / spec.rope_theta ** (
        torch.arange(quarter, dtype=torch.float32) * 4 / spec.head_dim
    )
    index = torch.arange(side * side)
    cols = (index % side + 1).float()[:, None] * freqs
    rows = (index // side + 1).float()[:, None] * freqs
    patches = torch.cat([cols, rows], dim=-1)
    return torch.cat([patches, torch.zeros(1, 2 * quarter)])


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[tiles, rows, heads, head_dim]`` with pairs ``(2i, 2i + 1)`` rotated by the
    angles whose ``cos`` / ``sin`` are ``[rows, head_dim / 2]``, in float32, cast back."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    real, imag = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[:, None], sin[:, None]
    out = torch.stack([real * cos - imag * sin, real * sin + imag * cos], dim=-1)
    return out.flatten(-2).to(x.dtype)


def pixel_shuffle(rows: torch.Tensor, ratio: float) -> torch.Tensor:
    """HF's ``pixel_shuffle``: ``[tiles, side * side, C]`` (a square grid, row-major) ->
    ``[tiles, (side * ratio)**2, C / ratio**2]``. Each output row gathers a block of the
    grid; the order of its values is HF's (two transposed folds)."""
    tiles, count, channels = rows.shape
    side = round(count**0.5)
    small = round(side * ratio)
    grid = rows.reshape(tiles, side, small, round(channels / ratio))
    grid = grid.permute(0, 2, 1, 3).reshape(tiles, small, small, round(channels / ratio**2))
    return grid.permute(0, 2, 1, 3).reshape(tiles, small * small, -1)


class Llama4VisionAttention(nn.Module):
    """Bidirectional multi-head attention with the 2-D rotary embedding."""

    def __init__(self, spec: Llama4VisionSpec) -> None:
        super().__init__()
        width = spec.hidden_size
        self.num_heads, self.head_dim = spec.num_heads, spec.head_dim
        self.q_proj = nn.Linear(width, width)
        self.k_proj = nn.Linear(width, width)
        self.v_proj = nn.Linear(width, width)
        self.o_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape = (*x.shape[:-1], self.num_heads, self.head_dim)
        q = rotate_pairs(self.q_proj(x).view(shape), cos, sin)
        k = rotate_pairs(self.k_proj(x).view(shape), cos, sin)
        v = self.v_proj(x).view(shape)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        )
        return self.o_proj(out.transpose(1, 2).reshape(x.shape))


class _Mlp(nn.Module):
    """``fc1``, exact GELU, ``fc2``; with ``gelu_after``, GELU on the output too."""

    def __init__(self, width: int, inner: int, out: int, bias: bool, gelu_after: bool) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, inner, bias=bias)
        self.fc2 = nn.Linear(inner, out, bias=bias)
        self.gelu_after = gelu_after

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc2(F.gelu(self.fc1(x)))
        return F.gelu(x) if self.gelu_after else x


class Llama4VisionLayer(nn.Module):
    def __init__(self, spec: Llama4VisionSpec) -> None:
        super().__init__()
        width = spec.hidden_size
        self.input_layernorm = nn.LayerNorm(width, eps=_LAYER_NORM_EPS)
        self.self_attn = Llama4VisionAttention(spec)
        self.post_attention_layernorm = nn.LayerNorm(width, eps=_LAYER_NORM_EPS)
        self.mlp = _Mlp(width, spec.intermediate_size, width, bias=True, gelu_after=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Encoder(nn.Module):
    def __init__(self, spec: Llama4VisionSpec) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Llama4VisionLayer(spec) for _ in range(spec.num_layers))


class _Adapter(nn.Module):
    """The pixel shuffle and its MLP (HF's ``Llama4VisionPixelShuffleMLP``)."""

    def __init__(self, spec: Llama4VisionSpec) -> None:
        super().__init__()
        self.ratio = spec.shuffle_ratio
        self.mlp = _Mlp(
            spec.intermediate_size,
            spec.projector_input_dim,
            spec.projector_output_dim,
            bias=False,
            gelu_after=True,
        )

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return self.mlp(pixel_shuffle(rows, self.ratio))


class _PatchEmbedding(nn.Module):
    def __init__(self, spec: Llama4VisionSpec) -> None:
        super().__init__()
        self.patch_size = spec.patch_size
        self.linear = nn.Linear(
            spec.num_channels * spec.patch_size**2, spec.hidden_size, bias=False
        )

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = F.unfold(pixels, kernel_size=self.patch_size, stride=self.patch_size)
        return self.linear(patches.transpose(1, 2))


class Llama4VisionTower(nn.Module):
    """HF's ``Llama4VisionModel``: ``forward(tiles [T, C, S, S]) -> [T, tokens_per_tile,
    vision_output_dim]`` (the module docstring's steps 1-4), in the parameters' dtype."""

    def __init__(self, spec: Llama4VisionSpec) -> None:
        super().__init__()
        self.spec = spec
        width, patches = spec.hidden_size, spec.side**2
        self.patch_embedding = _PatchEmbedding(spec)
        self.class_embedding = nn.Parameter(torch.zeros(width))
        self.positional_embedding_vlm = nn.Parameter(torch.zeros(patches + 1, width))
        self.layernorm_pre = nn.LayerNorm(width, eps=_LAYER_NORM_EPS)
        self.layernorm_post = nn.LayerNorm(width, eps=_LAYER_NORM_EPS)
        self.model = _Encoder(spec)
        self.vision_adapter = _Adapter(spec)
        angles = rotary_angles(spec)
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        if pixels.dim() != 4 or tuple(pixels.shape[1:]) != (
            spec.num_channels,
            spec.image_size,
            spec.image_size,
        ):
            raise ValueError(
                f"Llama 4 tiles are [tiles, {spec.num_channels}, {spec.image_size}, "
                f"{spec.image_size}]; got {tuple(pixels.shape)}"
            )
        dtype = self.positional_embedding_vlm.dtype
        x = self.patch_embedding(pixels.to(dtype))
        cls_row = self.class_embedding.expand(x.shape[0], 1, -1)
        x = torch.cat([x, cls_row], dim=1) + self.positional_embedding_vlm
        x = self.layernorm_pre(x)
        cos, sin = self.rope_cos.to(x.device), self.rope_sin.to(x.device)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        x = self.layernorm_post(x)[:, :-1]
        return self.vision_adapter(x)


class Llama4Projector(nn.Module):
    """HF's ``Llama4MultiModalProjector``: ``linear_1``, bias-free."""

    def __init__(self, spec: Llama4VisionSpec) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(spec.vision_output_dim, spec.text_hidden_size, bias=False)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return self.linear_1(rows)
