"""InternVL's image side (transformers' ``InternVLForConditionalGeneration``, the ``-hf``
checkpoints): the InternViT encoder, the pixel shuffle and the projector.

A tile ``[C, S, S]`` (``S`` the vision config's square ``image_size``) is cut into
``(S / P)**2`` patches (a ``Conv2d`` with stride = kernel, with bias), row-major; a learned
``cls_token`` row goes first and, with ``use_absolute_position_embeddings``, one learned
position row per row is added (no interpolation: tiles are always ``S`` a side). Then
pre-norm layers with layer scale: ``x + lambda_1 * attn(norm_before(x))``, then
``x + lambda_2 * mlp(norm_after(x))``; the norms are LayerNorms or RMSNorms
(``norm_type``, ``layer_norm_eps``); attention is full over the tile's rows, q/k/v with
biases by ``attention_bias``, optional RMSNorms of the whole q and k (``use_qk_norm``, eps
1e-6, before the heads split), an output ``projection_layer`` with bias; the MLP is ``fc1``,
``hidden_act``, ``fc2``.

``vision_feature_layer`` (an integer, as HF's ``get_image_features`` takes) picks the state:
``-1`` is the last layer's output after the tower's final ``layernorm`` (which exists only
without ``use_mean_pooling``: the released configs have none); any other index, negative from
the end, is into the ``num_hidden_layers + 1`` states entering and leaving each layer (no
final norm). ``vision_feature_select_strategy`` ``"default"`` drops the class row (``"full"``
would keep a row that does not fit the square grid, and HF cannot run it either). The
``side x side`` grid of rows (``side = S / P``) is pixel-shuffled by ``downsample_ratio``
``r`` (``k = 1 / r`` an integer): each ``k x k`` block of rows becomes one row of ``k * k``
times the width, in HF's channel order; then the projector (LayerNorm, ``linear_1``,
``projector_hidden_act``, ``linear_2``, all with biases) maps each to the language model's
width. A tile gives ``(side / k)**2`` rows: 256 for InternVL3 (448 px, patch 14, 0.5).

Only the layers the selected state needs are built; the others (and the final norm when
unused, and ``mask_token``, a training input) are not read (:meth:`InternVLVisionTower.
is_unused`). Parameter names are the checkpoint's (``vision_tower.`` stripped).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from chassis.builtin_plugins.models.qwen2_vl_vision import activation

#: the ``vision_config.model_type`` built here
TOWER_TYPE = "internvl_vision"
_NORMS = ("layer_norm", "rms_norm")


def _get(config: Any, name: str, default: Any = None) -> Any:
    """A field of a sub-config that may be a config object or a plain dict."""
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


def _square(value: Any, name: str) -> int:
    """An ``image_size`` / ``patch_size`` (an integer or a pair) as one side; ``ValueError``
    for a pair of unequal sides."""
    if isinstance(value, list | tuple):
        if len(value) != 2 or int(value[0]) != int(value[1]):
            raise ValueError(f"vision {name} {list(value)} is not square (not supported)")
        value = value[0]
    return int(value)


@dataclass(frozen=True)
class InternVLVisionSpec:
    """The image-side settings of an InternVL config (module docstring), checked."""

    vision_config: Any
    #: the tile's side in pixels, the patch's
    image_size: int
    patch_size: int
    #: ``1 / downsample_ratio``: the side of the blocks of rows the pixel shuffle merges
    shuffle: int
    #: ``vision_feature_layer`` as given (``-1``: the final state after the final norm)
    feature_layer: int
    #: how many of the tower's layers the selected state needs
    layers_needed: int
    projector_act: str

    @classmethod
    def from_config(cls, hf_config: Any) -> InternVLVisionSpec:
        """The settings of ``hf_config`` (the engine's text config, which carries the
        wrapper's image-side fields); ``ValueError`` naming what is missing or not
        supported."""
        vision = getattr(hf_config, "vision_config", None)
        if vision is None:
            raise ValueError("the InternVL config has no vision_config: it cannot take images")
        if _get(vision, "model_type") != TOWER_TYPE:
            raise ValueError(
                f"InternVL images need an {TOWER_TYPE!r} tower; this checkpoint's is "
                f"{_get(vision, 'model_type')!r}"
            )
        image_size = _square(_get(vision, "image_size", 448), "image_size")
        patch_size = _square(_get(vision, "patch_size", 14), "patch_size")
        if image_size % patch_size:
            raise ValueError(f"vision image_size {image_size} is not a multiple of {patch_size}")
        ratio = float(getattr(hf_config, "downsample_ratio", None) or 0.5)
        shuffle = round(1 / ratio)
        side = image_size // patch_size
        if abs(shuffle * ratio - 1) > 1e-9 or side % shuffle:
            raise ValueError(
                f"downsample_ratio {ratio} does not divide the tower's {side} x {side} grid "
                "into whole blocks (1 / downsample_ratio must be an integer dividing it)"
            )
        strategy = getattr(hf_config, "vision_feature_select_strategy", None) or "default"
        if strategy != "default":
            raise ValueError(
                f"vision_feature_select_strategy {strategy!r} is not supported for InternVL "
                "(only 'default': the class row dropped)"
            )
        layer = getattr(hf_config, "vision_feature_layer", None)
        layer = -1 if layer is None else layer
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise ValueError(f"vision_feature_layer must be an integer for InternVL; got {layer!r}")
        num_layers = int(_get(vision, "num_hidden_layers"))
        if not -(num_layers + 1) <= layer <= num_layers:
            raise ValueError(
                f"vision_feature_layer {layer} is outside the tower's {num_layers + 1} hidden "
                f"states ({num_layers} layers)"
            )
        norm = _get(vision, "norm_type", "layer_norm")
        if norm not in _NORMS:
            raise ValueError(f"vision norm_type {norm!r} is not supported; supported: {_NORMS}")
        return cls(
            vision_config=vision,
            image_size=image_size,
            patch_size=patch_size,
            shuffle=shuffle,
            feature_layer=layer,
            layers_needed=num_layers if layer == -1 else layer % (num_layers + 1),
            projector_act=str(getattr(hf_config, "projector_hidden_act", None) or "gelu"),
        )

    @property
    def side(self) -> int:
        """Rows (and columns) of a tile's patch grid."""
        return self.image_size // self.patch_size

    @property
    def tokens_per_tile(self) -> int:
        """Projected rows (placeholder tokens) of one tile."""
        return (self.side // self.shuffle) ** 2


class _RMSNorm(nn.Module):
    """HF's ``InternVLVisionRMSNorm``: in float32, the weight applied in the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def _norm(kind: str, dim: int, eps: float) -> nn.Module:
    return nn.LayerNorm(dim, eps=eps) if kind == "layer_norm" else _RMSNorm(dim, eps)


class _Attention(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        dim, heads = int(_get(cfg, "hidden_size")), int(_get(cfg, "num_attention_heads"))
        if dim % heads:
            raise ValueError(f"vision hidden_size {dim} is not a multiple of its {heads} heads")
        self.num_heads = heads
        bias = bool(_get(cfg, "attention_bias", False))
        self.q_proj = nn.Linear(dim, dim, bias=bias)
        self.k_proj = nn.Linear(dim, dim, bias=bias)
        self.v_proj = nn.Linear(dim, dim, bias=bias)
        self.projection_layer = nn.Linear(dim, dim)
        qk_norm = bool(_get(cfg, "use_qk_norm", False))
        # (HF builds these RMSNorms with their default eps, not the config's)
        self.q_norm = _RMSNorm(dim, 1e-6) if qk_norm else None
        self.k_norm = _RMSNorm(dim, 1e-6) if qk_norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [tiles, rows, dim]; heads: [tiles, heads, rows, head_dim]
        n, rows, dim = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.view(n, rows, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v)  # scale head_dim ** -0.5, as HF
        return self.projection_layer(attended.transpose(1, 2).reshape(n, rows, dim))


class _MLP(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        dim, hidden = int(_get(cfg, "hidden_size")), int(_get(cfg, "intermediate_size"))
        self.fc1 = nn.Linear(dim, hidden)
        self.act = activation(str(_get(cfg, "hidden_act", "gelu")))
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class _Layer(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        dim = int(_get(cfg, "hidden_size"))
        kind, eps = _get(cfg, "norm_type", "layer_norm"), float(_get(cfg, "layer_norm_eps", 1e-6))
        self.attention = _Attention(cfg)
        self.mlp = _MLP(cfg)
        self.layernorm_before = _norm(kind, dim, eps)
        self.layernorm_after = _norm(kind, dim, eps)
        self.lambda_1 = nn.Parameter(torch.ones(dim))
        self.lambda_2 = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.lambda_1 * self.attention(self.layernorm_before(x))
        return x + self.lambda_2 * self.mlp(self.layernorm_after(x))


class _Embeddings(nn.Module):
    def __init__(self, spec: InternVLVisionSpec) -> None:
        super().__init__()
        cfg = spec.vision_config
        dim = int(_get(cfg, "hidden_size"))
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.patch_embeddings = nn.Module()
        self.patch_embeddings.projection = nn.Conv2d(
            int(_get(cfg, "num_channels", 3)),
            dim,
            kernel_size=spec.patch_size,
            stride=spec.patch_size,
        )
        if _get(cfg, "use_absolute_position_embeddings", True):
            self.position_embeddings = nn.Parameter(torch.zeros(1, spec.side**2 + 1, dim))
        else:
            self.position_embeddings = None

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        projection = self.patch_embeddings.projection
        # [tiles, C, S, S] -> [tiles, patches, dim], patches row-major
        patches = projection(pixel_values.to(projection.weight.dtype)).flatten(2).transpose(1, 2)
        rows = torch.cat([self.cls_token.expand(patches.shape[0], -1, -1), patches], dim=1)
        if self.position_embeddings is not None:
            rows = rows + self.position_embeddings
        return rows


class InternVLVisionTower(nn.Module):
    """The InternViT encoder with the layers (and final norm) the selected state needs
    (module docstring). ``forward(pixel_values [tiles, C, S, S])`` returns the selected state
    ``[tiles, 1 + side * side, hidden]`` (the class row first)."""

    def __init__(self, spec: InternVLVisionSpec) -> None:
        super().__init__()
        cfg = spec.vision_config
        self.image_size = spec.image_size
        self.embeddings = _Embeddings(spec)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(_Layer(cfg) for _ in range(spec.layers_needed))
        final_norm = spec.feature_layer == -1 and not _get(cfg, "use_mean_pooling", True)
        dim, eps = int(_get(cfg, "hidden_size")), float(_get(cfg, "layer_norm_eps", 1e-6))
        # (always a LayerNorm in HF, whatever norm_type says)
        self.layernorm = nn.LayerNorm(dim, eps=eps) if final_norm else None

    def is_unused(self, name: str) -> bool:
        """Whether a tower tensor ``name`` (``vision_tower.`` stripped) belongs to what is not
        built: a later layer, an unused final ``layernorm``, ``embeddings.mask_token``."""
        if name.startswith("layernorm."):
            return self.layernorm is None
        if name == "embeddings.mask_token":
            return True
        prefix = "encoder.layer."
        if name.startswith(prefix):
            index = name[len(prefix) :].split(".", 1)[0]
            return index.isdigit() and int(index) >= len(self.encoder.layer)
        return False

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        size = self.image_size
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[-2:]) != (size, size):
            raise ValueError(
                f"pixel_values must be [tiles, channels, {size}, {size}] (the tower's "
                f"image_size); got {tuple(pixel_values.shape)}"
            )
        x = self.embeddings(pixel_values)
        for layer in self.encoder.layer:
            x = layer(x)
        return x if self.layernorm is None else self.layernorm(x)


def pixel_shuffle(features: torch.Tensor, k: int) -> torch.Tensor:
    """HF's ``pixel_shuffle`` with ``scale_factor = 1 / k``: ``[n, side, side, dim]`` ->
    ``[n, side / k, side / k, dim * k * k]``, each ``k x k`` block of rows merged (first
    ``k`` neighbours along the second axis into the channels, then ``k`` along the first;
    the result's axes in HF's order)."""
    n, rows, cols, dim = features.shape
    x = features.reshape(n, rows, cols // k, dim * k).permute(0, 2, 1, 3)
    x = x.reshape(n, cols // k, rows // k, dim * k * k)
    return x.permute(0, 2, 1, 3).contiguous()


class InternVLProjector(nn.Module):
    """``layer_norm``, ``linear_1`` (shuffled tower width -> text width), the activation,
    ``linear_2``; HF's names (``multi_modal_projector.*``)."""

    def __init__(self, spec: InternVLVisionSpec, text_hidden_size: int) -> None:
        super().__init__()
        width = int(_get(spec.vision_config, "hidden_size")) * spec.shuffle**2
        self.layer_norm = nn.LayerNorm(width)
        self.linear_1 = nn.Linear(width, text_hidden_size)
        self.act = activation(spec.projector_act)
        self.linear_2 = nn.Linear(text_hidden_size, text_hidden_size)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(self.layer_norm(features))))
