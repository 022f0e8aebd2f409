"""CLIP's and SigLIP's vision encoders (ViT), as LLaVA-style models read them: the hidden
states entering and leaving each encoder layer, not the pooled output.

An image ``[C, S, S]`` (``S`` the config's ``image_size``) is cut into ``(S / P)**2``
patches of ``P x P`` pixels (HF's ``Conv2d`` with stride = kernel), row-major; CLIP puts a
learned class row before them (``class_embedding``; SigLIP has none and a patch bias
instead), adds one learned position row per row, and normalizes (CLIP's ``pre_layrnorm``;
SigLIP has none). Then pre-norm transformer layers: LayerNorm, full attention over the
image's rows (q/k/v/out projections with biases, SDPA), residual; LayerNorm, an MLP of
``hidden_act`` (CLIP: ``quick_gelu``, SigLIP: ``gelu_pytorch_tanh``), residual.

HF's ``hidden_states`` of such a tower are the ``num_hidden_layers + 1`` states: index 0 is
what the first layer reads, index ``i`` what layer ``i`` returns (before any
``post_layernorm``). :class:`ClipVisionTower` builds only the layers the selected states
need (:func:`hidden_state_indices`); the later layers, ``post_layernorm`` and SigLIP's
pooling ``head`` are not built, and their checkpoint tensors are not read
(:meth:`ClipVisionTower.is_unused`). Positions are the config's own: images must be
``image_size`` a side (no position interpolation). Parameter names are the checkpoint's
(``vision_model.`` stripped).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from chassis.builtin_plugins.models.qwen2_vl_vision import activation

#: the ``vision_config.model_type`` of the towers built here, and whether each has CLIP's
#: class row and ``pre_layrnorm`` (SigLIP: neither, a patch-embedding bias instead)
TOWER_TYPES = {"clip_vision_model": True, "siglip_vision_model": False}


def tower_kind(vision_config: Any) -> str | None:
    """``vision_config``'s ``model_type`` when :class:`ClipVisionTower` builds it, else
    ``None``."""
    model_type = _get(vision_config, "model_type")
    return model_type if model_type in TOWER_TYPES else None


def hidden_state_indices(feature_layer: int | Sequence[int], num_layers: int) -> list[int]:
    """HF's ``vision_feature_layer`` (one index or a list, negative from the end, into the
    ``num_layers + 1`` hidden states) as non-negative indices, in order; ``ValueError`` for
    one out of range or an empty list."""
    layers = [feature_layer] if isinstance(feature_layer, int) else list(feature_layer)
    if not layers or any(isinstance(x, bool) or not isinstance(x, int) for x in layers):
        raise ValueError(
            f"vision_feature_layer must be an integer or a list of integers; got {feature_layer!r}"
        )
    count = num_layers + 1
    resolved = []
    for layer in layers:
        if not -count <= layer < count:
            raise ValueError(
                f"vision_feature_layer {layer} is outside the tower's {count} hidden states "
                f"({num_layers} layers)"
            )
        resolved.append(layer % count)
    return resolved


class _Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"vision hidden_size {dim} is not a multiple of its {num_heads} heads")
        self.num_heads = num_heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [images, rows, dim]; heads: [images, heads, rows, head_dim]
        n, rows, dim = x.shape
        q, k, v = (
            proj(x).view(n, rows, self.num_heads, -1).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        attended = F.scaled_dot_product_attention(q, k, v)  # scale head_dim ** -0.5, as HF
        return self.out_proj(attended.transpose(1, 2).reshape(n, rows, dim))


class _MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = activation(act)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class _EncoderLayer(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        dim, eps = int(cfg.hidden_size), float(cfg.layer_norm_eps)
        self.layer_norm1 = nn.LayerNorm(dim, eps=eps)
        self.self_attn = _Attention(dim, int(cfg.num_attention_heads))
        self.layer_norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = _MLP(dim, int(cfg.intermediate_size), str(cfg.hidden_act))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class _Embeddings(nn.Module):
    def __init__(self, cfg: Any, class_row: bool) -> None:
        super().__init__()
        dim, patch = int(cfg.hidden_size), int(cfg.patch_size)
        self.image_size = int(cfg.image_size)
        num_patches = (self.image_size // patch) ** 2
        if class_row:
            self.class_embedding = nn.Parameter(torch.empty(dim))
        else:
            self.class_embedding = None
        self.patch_embedding = nn.Conv2d(
            int(getattr(cfg, "num_channels", 3)),
            dim,
            kernel_size=patch,
            stride=patch,
            bias=not class_row,
        )
        self.position_embedding = nn.Embedding(num_patches + int(class_row), dim)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.patch_embedding.weight
        # [images, C, S, S] -> [images, patches, dim], patches row-major
        patches = self.patch_embedding(pixel_values.to(weight.dtype)).flatten(2).transpose(1, 2)
        if self.class_embedding is not None:
            cls = self.class_embedding.to(patches.dtype).expand(patches.shape[0], 1, -1)
            patches = torch.cat([cls, patches], dim=1)
        return patches + self.position_embedding.weight


class ClipVisionTower(nn.Module):
    """CLIP's (``clip_vision_model``) or SigLIP's (``siglip_vision_model``) vision encoder
    with its first ``num_layers`` layers (the module docstring).

    ``forward(pixel_values [n, C, S, S], indices)`` returns the hidden states ``indices``
    select (each ``[n, rows, hidden_size]``; rows: CLIP's class row, then the patches
    row-major); every index must be at most ``num_layers``.
    """

    def __init__(self, vision_config: Any, num_layers: int) -> None:
        super().__init__()
        kind = tower_kind(vision_config)
        if kind is None:
            raise ValueError(
                f"vision tower {_get(vision_config, 'model_type')!r} is not supported; "
                f"supported: {', '.join(TOWER_TYPES)}"
            )
        total = int(vision_config.num_hidden_layers)
        if not 0 <= num_layers <= total:
            raise ValueError(f"cannot build {num_layers} of the tower's {total} layers")
        class_row = TOWER_TYPES[kind]
        self.kind = kind
        self.image_size = int(vision_config.image_size)
        self.patch_size = int(vision_config.patch_size)
        self.embeddings = _Embeddings(vision_config, class_row)
        dim, eps = int(vision_config.hidden_size), float(vision_config.layer_norm_eps)
        # (HF's spelling, "layrnorm", is the checkpoint's tensor name)
        self.pre_layrnorm = nn.LayerNorm(dim, eps=eps) if class_row else None
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(_EncoderLayer(vision_config) for _ in range(num_layers))

    @property
    def num_rows(self) -> int:
        """Rows of each hidden state: the patches, and CLIP's class row."""
        return self.embeddings.position_embedding.num_embeddings

    def is_unused(self, name: str) -> bool:
        """Whether a tower tensor ``name`` (``vision_model.`` stripped) belongs to what is not
        built: a later layer, ``post_layernorm``, SigLIP's pooling ``head``."""
        if name.startswith(("post_layernorm.", "head.")):
            return True
        prefix = "encoder.layers."
        if name.startswith(prefix):
            index = name[len(prefix) :].split(".", 1)[0]
            return index.isdigit() and int(index) >= len(self.encoder.layers)
        return False

    def forward(self, pixel_values: torch.Tensor, indices: Sequence[int]) -> list[torch.Tensor]:
        if pixel_values.dim() == 3:
            pixel_values = pixel_values[None]
        size = self.image_size
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[-2:]) != (size, size):
            raise ValueError(
                f"pixel_values must be [images, channels, {size}, {size}] (the tower's "
                f"image_size); got {tuple(pixel_values.shape)}"
            )
        last = max(indices)
        if last > len(self.encoder.layers):
            raise ValueError(
                f"hidden state {last} needs {last} layers; the tower has {len(self.encoder.layers)}"
            )
        x = self.embeddings(pixel_values)
        if self.pre_layrnorm is not None:
            x = self.pre_layrnorm(x)
        states = [x]
        for layer in self.encoder.layers[:last]:
            x = layer(x)
            states.append(x)
        return [states[i] for i in indices]


def _get(config: Any, name: str) -> Any:
    """A field of a sub-config that may be a config object or a plain dict."""
    if isinstance(config, dict):
        return config.get(name)
    return getattr(config, name, None)
