"""Qwen2.5-VL's vision tower: Qwen2-VL's (:mod:`.qwen2_vl_vision`) with RMSNorm, a SwiGLU
MLP with biases, and window attention.

Window attention: the merged-patch grid of each image frame is cut into windows of
``window_size / patch_size / spatial_merge_size`` merged patches a side (the last row and
column of windows may be smaller). The patches are reordered window by window
(:func:`window_order`; each merged group's ``merge ** 2`` patches stay together), every
block attends within each window except the ``fullatt_block_indexes`` ones, which attend
over the whole frame (the frame's patches stay contiguous under the reordering), and the
merger's rows are put back in the original order at the end. This is HF's
``get_window_index`` / ``cu_window_seqlens``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from chassis.builtin_plugins.models.qwen2_vl_vision import (
    Grid,
    PatchMerger,
    VisionAttention,
    VisionBlock,
    VisionRotary,
    activation,
    check_patch_count,
    frame_seqlens,
    grid_rows,
    patch_embed,
    patch_positions,
    vision_rope_theta,
)
from chassis.core.layers.norm import RMSNorm


class VisionSwiGLU(nn.Module):
    """``down_proj(act(gate_proj(x)) * up_proj(x))``, every projection with a bias unless
    ``bias`` is false (GLM-4.1V's tower)."""

    def __init__(self, dim: int, hidden_dim: int, hidden_act: str, *, bias: bool = True) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=bias)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=bias)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=bias)
        self.act = activation(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def window_order(grid: Grid, merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """The merged groups' order window by window, and the windows' cumulative patch counts.

    :param window: a window's side in merged groups
    :return: ``order [groups]`` (host int64: position ``i`` of the reordered sequence holds
        group ``order[i]``) and ``cu_seqlens`` (from 0; in patches, ``merge ** 2`` a group)
    """
    order: list[torch.Tensor] = []
    bounds = [0]
    first_group = 0
    for t, h, w in grid:
        gh, gw = h // merge, w // merge
        groups = torch.arange(t * gh * gw, device="cpu").view(t, gh, gw)
        for frame in groups:
            for top in range(0, gh, window):
                for left in range(0, gw, window):
                    ids = frame[top : top + window, left : left + window].flatten()
                    order.append(ids + first_group)
                    bounds.append(bounds[-1] + ids.numel() * merge**2)
        first_group += t * gh * gw
    return torch.cat(order), bounds


class Qwen2_5VisionTower(nn.Module):
    """Qwen2.5-VL's tower (``vision_config``: ``hidden_size``, ``intermediate_size``,
    ``out_hidden_size`` = the language model's width, ``depth``, ``num_heads``,
    ``hidden_act``, ``window_size`` in pixels, ``fullatt_block_indexes``, patch and merge
    sizes).

    ``forward(pixel_values [patches, C*T*P*P], grid_thw [images, 3])`` returns
    ``[patches / merge**2, out_hidden_size]``: the images' rows in order, in the tower's
    dtype.
    """

    def __init__(self, vision_config: Any) -> None:
        super().__init__()
        cfg = vision_config
        dim, heads = int(cfg.hidden_size), int(cfg.num_heads)
        self.spatial_merge_size = int(cfg.spatial_merge_size)
        self.window_groups = int(cfg.window_size) // self.spatial_merge_size // int(cfg.patch_size)
        if self.window_groups <= 0:
            raise ValueError(
                f"vision window_size {cfg.window_size} is smaller than one merged patch group "
                f"({self.spatial_merge_size} x {cfg.patch_size} pixels)"
            )
        self.full_attention_blocks = frozenset(int(i) for i in cfg.fullatt_block_indexes)
        self.patch_embed = patch_embed(cfg, dim)
        self.rotary = VisionRotary(dim // heads, vision_rope_theta(cfg))
        self.blocks = nn.ModuleList(
            VisionBlock(
                RMSNorm(dim, eps=1e-6),
                RMSNorm(dim, eps=1e-6),
                VisionAttention(dim, heads),
                VisionSwiGLU(dim, int(cfg.intermediate_size), str(cfg.hidden_act)),
            )
            for _ in range(int(cfg.depth))
        )
        self.merger = PatchMerger(
            RMSNorm(dim, eps=1e-6), dim, self.spatial_merge_size, int(cfg.out_hidden_size)
        )

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        grid = grid_rows(grid_thw)
        check_patch_count(pixel_values, grid)
        unit = self.spatial_merge_size**2
        order, window_seqlens = window_order(grid, self.spatial_merge_size, self.window_groups)
        order = order.to(pixel_values.device)

        def by_window(x: torch.Tensor) -> torch.Tensor:
            # rows regrouped window by window, each merged group's `unit` rows together
            return x.view(-1, unit, x.shape[-1])[order].flatten(0, 1)

        x = by_window(self.patch_embed(pixel_values))
        positions = patch_positions(grid, self.spatial_merge_size).to(x.device)
        cos, sin = self.rotary(positions)
        cos_sin = (by_window(cos), by_window(sin))
        frame_bounds = frame_seqlens(grid)
        for i, block in enumerate(self.blocks):
            bounds = frame_bounds if i in self.full_attention_blocks else window_seqlens
            x = block(x, bounds, cos_sin)
        merged = self.merger(x)
        return merged[torch.argsort(order)]
