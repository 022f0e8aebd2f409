"""Qwen2-VL's vision tower: image patches -> one embedding per merged 2x2 patch group.

The image processor cuts an image into ``grid_t x grid_h x grid_w`` patches of ``C x T x P x P``
pixels (``pixel_values [patches, C*T*P*P]``, patches ordered so that each
``spatial_merge_size``-square group of neighbours is consecutive). The tower embeds every
patch (HF's ``Conv3d`` with stride = kernel is one matmul over the flattened patch), runs
``depth`` pre-norm transformer blocks (LayerNorm, 2-D rotary attention over the patches of
the same image frame, ``quick_gelu`` MLP), and the :class:`PatchMerger` turns each group of
``spatial_merge_size ** 2`` consecutive patches into one row of the language model's width.

The 2-D rotary: a head's first half of frequencies turned by the patch's row, the second
half by its column (``head_dim / 4`` frequencies each, rotate-half layout, computed in
float32 as HF does). Attention is plain SDPA over each segment (segments of equal length
batched into one call). Parameter names are the checkpoint's (``visual.`` stripped).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

#: grid_thw rows as plain ints: (t, h, w) in patches, one per image
Grid = Sequence[tuple[int, int, int]]

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The vision MLP's ``hidden_act`` by its HF name; a ``ValueError`` for others."""
    if name not in _ACTIVATIONS:
        raise ValueError(
            f"vision hidden_act {name!r} is not supported; supported: {', '.join(_ACTIVATIONS)}"
        )
    return _ACTIVATIONS[name]


def grid_rows(grid_thw: torch.Tensor) -> list[tuple[int, int, int]]:
    """``grid_thw [n, 3]`` (any device) as host ints, checked: positive sizes."""
    rows = [(int(t), int(h), int(w)) for t, h, w in grid_thw.reshape(-1, 3).tolist()]
    if any(min(row) <= 0 for row in rows):
        raise ValueError(f"image_grid_thw {rows} has an empty dimension")
    return rows


def frame_seqlens(grid: Grid) -> list[int]:
    """Cumulative patch counts of the attention segments: one per image frame (``h * w``
    patches each, ``t`` frames an image), from 0."""
    bounds = [0]
    for t, h, w in grid:
        for _ in range(t):
            bounds.append(bounds[-1] + h * w)
    return bounds


def patch_positions(grid: Grid, merge: int) -> torch.Tensor:
    """``[patches, 2]`` (row, column) of every patch, in the processor's order: the
    ``merge x merge`` groups row-major, each group's patches row-major (host, int64)."""
    rows = []
    for t, h, w in grid:
        if h % merge or w % merge:
            raise ValueError(f"image grid {h}x{w} is not a multiple of spatial_merge_size {merge}")
        hpos = torch.arange(h, device="cpu").view(-1, 1).expand(h, w)
        wpos = torch.arange(w, device="cpu").view(1, -1).expand(h, w)
        blocks = (h // merge, merge, w // merge, merge)
        hpos = hpos.reshape(blocks).transpose(1, 2).flatten()
        wpos = wpos.reshape(blocks).transpose(1, 2).flatten()
        rows.append(torch.stack([hpos, wpos], dim=-1).repeat(t, 1))
    return torch.cat(rows)


class VisionRotary(nn.Module):
    """The tower's 2-D rotary: ``(cos, sin)`` ``[patches, head_dim]`` (float32) for patch
    positions ``[patches, 2]``."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        spatial_dim = head_dim // 2
        # computed on the host in float32 (as HF), kept on the default (model) device
        exponents = torch.arange(0, spatial_dim, 2, dtype=torch.float32, device="cpu")
        inv_freq = 1.0 / (theta ** (exponents / spatial_dim))
        self.register_buffer("inv_freq", inv_freq.to(torch.empty(0).device), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # float32 whatever the model's dtype (a cast of the whole model casts buffers too)
        inv_freq = self.inv_freq.to(positions.device, torch.float32)
        freqs = positions[..., None].float() * inv_freq  # [patches, 2, head_dim / 4]
        freqs = freqs.flatten(1)  # rows' frequencies, then columns'
        freqs = torch.cat([freqs, freqs], dim=-1)
        return freqs.cos(), freqs.sin()


def rotate_vision(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [patches, heads, head_dim]`` rotated (rotate-half) in float32, back in its dtype."""
    x32 = x.float()
    x1, x2 = x32.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x32 * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


def attend_segments(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: Sequence[int]
) -> torch.Tensor:
    """Full (non-causal) attention within each segment ``cu_seqlens[i] .. cu_seqlens[i+1]``
    of ``q, k, v [patches, heads, head_dim]``; ``[patches, heads, head_dim]``. Segments of
    one length go through one batched SDPA call."""
    by_length: dict[int, list[int]] = {}
    for start, end in itertools.pairwise(cu_seqlens):
        if end > start:
            by_length.setdefault(end - start, []).append(start)
    out = torch.empty_like(q)
    for length, starts in by_length.items():
        if len(by_length) == 1 and len(starts) == 1:
            rows: torch.Tensor | slice = slice(starts[0], starts[0] + length)
            shape = (1, length)
        else:
            first = torch.tensor(starts, device=q.device).view(-1, 1)
            rows = (first + torch.arange(length, device=q.device)).flatten()
            shape = (len(starts), length)
        # [segments, heads, length, head_dim]
        qs, ks, vs = (x[rows].reshape(*shape, *x.shape[1:]).transpose(1, 2) for x in (q, k, v))
        attended = F.scaled_dot_product_attention(qs, ks, vs)
        out[rows] = attended.transpose(1, 2).reshape(-1, *q.shape[1:])
    return out


class VisionAttention(nn.Module):
    """Fused ``qkv`` projection (rows: q, k, v, each head-major), 2-D rotary, segment
    attention, output ``proj``; both with biases unless ``qkv_bias`` / ``proj_bias`` say
    otherwise (GLM-4.1V's tower)."""

    def __init__(
        self, dim: int, num_heads: int, *, qkv_bias: bool = True, proj_bias: bool = True
    ) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"vision width {dim} is not a multiple of num_heads {num_heads}")
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim, bias=proj_bias)

    def forward(
        self,
        x: torch.Tensor,
        cu_seqlens: Sequence[int],
        cos_sin: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, -1).unbind(1)
        cos, sin = cos_sin
        q, k = rotate_vision(q, cos, sin), rotate_vision(k, cos, sin)
        return self.proj(attend_segments(q, k, v, cu_seqlens).flatten(1))


class VisionMLP(nn.Module):
    """``fc1``, the activation, ``fc2``."""

    def __init__(self, dim: int, hidden_dim: int, hidden_act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = activation(hidden_act)
        self.fc2 = nn.Linear(hidden_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    """Pre-norm attention and MLP with residual adds (``norm1``/``norm2``: the tower's
    norm class)."""

    def __init__(self, norm1: nn.Module, norm2: nn.Module, attn: nn.Module, mlp: nn.Module):
        super().__init__()
        self.norm1, self.norm2, self.attn, self.mlp = norm1, norm2, attn, mlp

    def forward(
        self,
        x: torch.Tensor,
        cu_seqlens: Sequence[int],
        cos_sin: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens, cos_sin)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    """``[patches, C*T*P*P]`` -> ``[patches, dim]``: HF's ``Conv3d`` with stride = kernel =
    one patch, i.e. a matmul with the flattened kernel (``proj.weight`` keeps the
    checkpoint's ``[dim, C, T, P, P]``); bias-free (Qwen2-VL, Qwen2.5-VL) unless ``bias``
    (Qwen3-VL: ``proj.bias [dim]``)."""

    def __init__(
        self, in_channels: int, temporal: int, patch: int, dim: int, *, bias: bool = False
    ) -> None:
        super().__init__()
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.empty(dim, in_channels, temporal, patch, patch))
        self.proj.bias = nn.Parameter(torch.empty(dim)) if bias else None

    @property
    def patch_numel(self) -> int:
        return int(self.proj.weight[0].numel())

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        if pixels.dim() != 2 or pixels.shape[1] != self.patch_numel:
            raise ValueError(
                f"pixel_values must be [patches, {self.patch_numel}]; got {tuple(pixels.shape)}"
            )
        return F.linear(pixels.to(weight.dtype), weight.flatten(1), self.proj.bias)


class PatchMerger(nn.Module):
    """``ln_q`` over each patch, then every ``merge ** 2`` consecutive patches concatenated
    and projected by ``mlp`` (Linear, exact GELU, Linear) to ``out_dim``."""

    def __init__(self, ln_q: nn.Module, dim: int, merge: int, out_dim: int) -> None:
        super().__init__()
        self.ln_q = ln_q
        self.merged_dim = dim * merge**2
        self.mlp = nn.Sequential(
            nn.Linear(self.merged_dim, self.merged_dim),
            nn.GELU(),
            nn.Linear(self.merged_dim, out_dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged_dim))


class Qwen2VisionTower(nn.Module):
    """Qwen2-VL's tower (``vision_config``: ``embed_dim``, ``depth``, ``num_heads``,
    ``mlp_ratio``, ``hidden_act``, ``hidden_size`` = the language model's width, patch and
    merge sizes).

    ``forward(pixel_values [patches, C*T*P*P], grid_thw [images, 3])`` returns
    ``[patches / merge**2, hidden_size]``: the images' rows in order (each image
    ``t * h * w / merge**2`` rows), in the tower's dtype.
    """

    def __init__(self, vision_config: Any) -> None:
        super().__init__()
        cfg = vision_config
        dim, heads = int(cfg.embed_dim), int(cfg.num_heads)
        self.spatial_merge_size = int(cfg.spatial_merge_size)
        self.patch_embed = patch_embed(cfg, dim)
        self.rotary = VisionRotary(dim // heads, vision_rope_theta(cfg))
        mlp_dim = int(dim * float(cfg.mlp_ratio))
        self.blocks = nn.ModuleList(
            VisionBlock(
                nn.LayerNorm(dim, eps=1e-6),
                nn.LayerNorm(dim, eps=1e-6),
                VisionAttention(dim, heads),
                VisionMLP(dim, mlp_dim, str(cfg.hidden_act)),
            )
            for _ in range(int(cfg.depth))
        )
        self.merger = PatchMerger(
            nn.LayerNorm(dim, eps=1e-6), dim, self.spatial_merge_size, int(cfg.hidden_size)
        )

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        grid = grid_rows(grid_thw)
        check_patch_count(pixel_values, grid)
        x = self.patch_embed(pixel_values)
        positions = patch_positions(grid, self.spatial_merge_size).to(x.device)
        cos_sin = self.rotary(positions)
        cu_seqlens = frame_seqlens(grid)
        for block in self.blocks:
            x = block(x, cu_seqlens, cos_sin)
        return self.merger(x)


def patch_embed(cfg: Any, dim: int, *, bias: bool = False) -> PatchEmbed:
    """The :class:`PatchEmbed` of a Qwen2-VL / Qwen2.5-VL / Qwen3-VL ``vision_config``."""
    return PatchEmbed(
        int(getattr(cfg, "in_channels", 3)),
        int(cfg.temporal_patch_size),
        int(cfg.patch_size),
        dim,
        bias=bias,
    )


def vision_rope_theta(cfg: Any) -> float:
    """The tower's rotary base: ``rope_parameters["rope_theta"]`` (transformers 5), else
    10000 (what older configs imply)."""
    params = getattr(cfg, "rope_parameters", None) or {}
    return float(params.get("rope_theta", 10000.0))


def check_patch_count(pixel_values: torch.Tensor, grid: Grid) -> None:
    """``ValueError`` unless ``pixel_values`` has one row per patch of ``grid``."""
    expected = sum(t * h * w for t, h, w in grid)
    if pixel_values.shape[0] != expected:
        raise ValueError(
            f"pixel_values has {pixel_values.shape[0]} patches; image_grid_thw {list(grid)} "
            f"needs {expected}"
        )
