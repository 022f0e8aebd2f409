"""Pixtral's vision encoder (Mistral Small 3.1/3.2, Ministral 3): an image of any size ->
one hidden state per patch, as ``Mistral3ForConditionalGeneration`` reads it.

An image ``[C, H, W]`` (``H`` and ``W`` multiples of the patch size ``P``) is cut into
``H/P x W/P`` patches, row-major, by a bias-free ``Conv2d`` with stride = kernel
(``patch_conv``), then normalized (``ln_pre``, RMSNorm, eps 1e-5). Pre-norm transformer
layers follow (``transformer.layers.i``): RMSNorm (``attention_norm``), attention over the
image's patches with bias-free ``q/k/v/o_proj`` and a 2-D rotary embedding, residual;
RMSNorm (``ffn_norm``), a gated MLP ``down(act(gate(x)) * up(x))`` of the config's
``hidden_act`` (``feed_forward``), residual.

The 2-D rotary (HF's ``PixtralVisionRotaryEmbedding``, "axial"): the head's ``head_dim / 2``
inverse frequencies ``theta ** (-2i / head_dim)`` are split by parity; the even ones turn by
the patch's row, the odd ones by its column, ``[row freqs, column freqs]`` repeated twice
over the head (rotate-half layout). The angles are computed in float32; cos and sin are cast
to the activations' dtype, as HF does.

HF runs several images as one sequence with a block-diagonal mask; here each image is its
own sequence (the same attention). HF's hidden states are the ``num_hidden_layers + 1``
states: index 0 the first layer's input (after ``ln_pre``), index ``i`` layer ``i``'s
output; :class:`PixtralVisionTower` builds only the layers up to the one selected.
Parameter names are the checkpoint's (``vision_tower.`` stripped).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from chassis.builtin_plugins.models.qwen2_vl_vision import activation
from chassis.core.layers.norm import RMSNorm
from chassis.core.layers.rotary import rope_parameters

#: Pixtral's fixed norm epsilon (HF hard-codes it; the config has none)
_NORM_EPS = 1e-5


def config_value(config: Any, name: str, default: Any = None) -> Any:
    """``config.name`` of a config object or a plain dict (a ``vision_config`` may be
    either)."""
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


class _Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"vision hidden_size {dim} is not a multiple of its {num_heads} heads")
        self.num_heads = num_heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x [n, dim] -> [1, heads, n, head_dim]
        n = x.shape[0]
        q, k, v = (
            proj(x).view(1, n, self.num_heads, -1).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(n, -1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``x [..., n, head_dim]`` by ``cos, sin [n, head_dim]``."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class _FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, hidden_act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)
        self.act = activation(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, dim: int, num_heads: int, hidden_dim: int, hidden_act: str) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(dim, _NORM_EPS)
        self.attention = _Attention(dim, num_heads)
        self.ffn_norm = RMSNorm(dim, _NORM_EPS)
        self.feed_forward = _FeedForward(dim, hidden_dim, hidden_act)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class _Transformer(nn.Module):
    def __init__(self, layers: list[_Layer]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)


class PixtralVisionTower(nn.Module):
    """Pixtral's encoder (module docstring) with its first ``num_layers`` layers: enough for
    HF's hidden state ``num_layers`` and the ones before it."""

    def __init__(self, vision_config: Any, num_layers: int) -> None:
        super().__init__()
        total = int(config_value(vision_config, "num_hidden_layers"))
        if not 0 <= num_layers <= total:
            raise ValueError(f"the Pixtral tower has {total} layers; {num_layers} requested")
        self.num_layers_in_checkpoint = total
        dim = int(config_value(vision_config, "hidden_size"))
        num_heads = int(config_value(vision_config, "num_attention_heads"))
        self.patch_size = int(config_value(vision_config, "patch_size"))
        channels = int(config_value(vision_config, "num_channels", 3))
        self.patch_conv = nn.Conv2d(
            channels, dim, kernel_size=self.patch_size, stride=self.patch_size, bias=False
        )
        self.ln_pre = RMSNorm(dim, _NORM_EPS)
        hidden_dim = int(config_value(vision_config, "intermediate_size"))
        hidden_act = str(config_value(vision_config, "hidden_act", "gelu"))
        self.transformer = _Transformer(
            [_Layer(dim, num_heads, hidden_dim, hidden_act) for _ in range(num_layers)]
        )
        head_dim = dim // num_heads
        if head_dim % 4:
            raise ValueError(
                f"Pixtral's 2-D rotary needs a head_dim divisible by 4; got {head_dim}"
            )
        params = rope_parameters(_Namespace(vision_config))
        if params["rope_type"] not in ("axial", "default"):
            raise ValueError(f"Pixtral's rotary is axial; the config names {params['rope_type']!r}")
        # computed on the host in float32 (as HF), kept on the default (model) device
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim
        inv_freq = 1.0 / (float(params["rope_theta"]) ** exponents)
        by_axis = torch.cat([inv_freq[0::2], inv_freq[1::2]])  # row freqs, then column freqs
        self.register_buffer("inv_freq", by_axis.to(torch.empty(0).device), persistent=False)

    def is_unused(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` (``vision_tower.`` stripped) belongs to a layer
        not built."""
        prefix = "transformer.layers."
        if not name.startswith(prefix):
            return False
        index = name[len(prefix) :].split(".", 1)[0]
        return index.isdigit() and int(index) >= len(self.transformer.layers)

    def rotary(self, rows: int, cols: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """``(cos, sin)`` ``[rows * cols, head_dim]`` of a grid's patches, row-major."""
        device = self.patch_conv.weight.device
        inv_freq = self.inv_freq.to(device, torch.float32)
        quarter = inv_freq.shape[0] // 2
        row = torch.arange(rows, device=device, dtype=torch.float32)
        col = torch.arange(cols, device=device, dtype=torch.float32)
        row_angles = (row[:, None] * inv_freq[:quarter]).repeat_interleave(cols, dim=0)
        col_angles = (col[:, None] * inv_freq[quarter:]).repeat(rows, 1)
        angles = torch.cat([row_angles, col_angles], dim=-1)
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(self, pixel_values: torch.Tensor, feature_index: int) -> torch.Tensor:
        """One image ``[C, H, W]`` -> HF's hidden state ``feature_index`` (at most the
        layers built) ``[H/P * W/P, hidden_size]``, patches row-major."""
        if feature_index > len(self.transformer.layers):
            raise ValueError(
                f"hidden state {feature_index} needs layers this tower did not build "
                f"({len(self.transformer.layers)})"
            )
        weight = self.patch_conv.weight
        patches = self.patch_conv(pixel_values.to(weight.dtype)[None])[0]  # [dim, rows, cols]
        _, rows, cols = patches.shape
        x = self.ln_pre(patches.flatten(1).t().contiguous())
        cos, sin = self.rotary(rows, cols, x.dtype)
        for layer in self.transformer.layers[:feature_index]:
            x = layer(x, cos, sin)
        return x


class _Namespace:
    """A dict config read as attributes (for :func:`rope_parameters`)."""

    def __init__(self, config: Any) -> None:
        self._config = config

    def __getattr__(self, name: str) -> Any:
        return config_value(self._config, name)
