"""Qwen3-VL's vision tower: image patches -> one row per merged 2x2 patch group, plus the
deepstack rows of some intermediate blocks.

Qwen2-VL's tower (:mod:`.qwen2_vl_vision`: the same patch order, 2-D rotary, segment
attention over each image frame, LayerNorm blocks) with four differences, as HF's
``Qwen3VLVisionModel``:

* the patch embedding has a bias;
* a learned ``num_position_embeddings`` table (a square grid of ``side x side`` positions) is
  added to the patch embeddings, bilinearly resampled to each image's ``h x w`` patch grid
  with the corners aligned (:func:`position_taps`);
* the MLP is ``linear_fc1``, the configured activation, ``linear_fc2``;
* the merger (:class:`Qwen3PatchMerger`: LayerNorm, 2x2 groups concatenated,
  Linear-GELU-Linear) runs on the last block's output, and one more merger per entry of
  ``deepstack_visual_indexes`` on the output of that block, its LayerNorm over the
  concatenated group (``use_postshuffle_norm``). The language model adds those deepstack
  rows to its first layers' outputs (:mod:`.qwen3_vl`).

Parameter names are the checkpoint's (``model.visual.`` stripped).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from chassis.builtin_plugins.models.qwen2_vl_vision import (
    Grid,
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


class Qwen3VisionMLP(nn.Module):
    """``linear_fc2(act(linear_fc1(x)))``, both with biases."""

    def __init__(self, dim: int, hidden_dim: int, hidden_act: str) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden_dim, bias=True)
        self.linear_fc2 = nn.Linear(hidden_dim, dim, bias=True)
        self.act = activation(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen3PatchMerger(nn.Module):
    """Every ``merge ** 2`` consecutive patches concatenated and projected by
    ``linear_fc1``, exact GELU, ``linear_fc2`` to ``out_dim``; the LayerNorm ``norm`` runs
    on each patch before the concatenation or, with ``postshuffle``, on the concatenation."""

    def __init__(self, dim: int, merge: int, out_dim: int, *, postshuffle: bool) -> None:
        super().__init__()
        self.merged_dim = dim * merge**2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.merged_dim if postshuffle else dim, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged_dim, self.merged_dim)
        self.act = nn.GELU()
        self.linear_fc2 = nn.Linear(self.merged_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.postshuffle:
            x = self.norm(x.reshape(-1, self.merged_dim))
        else:
            x = self.norm(x).reshape(-1, self.merged_dim)
        return self.linear_fc2(self.act(self.linear_fc1(x)))


def position_taps(
    grid: Grid, positions: torch.Tensor, side: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each patch reads the ``side x side`` learned position table: four rows of the
    flattened table and their bilinear weights (corners aligned: an image's first and last
    patch row read the table's first and last row; a 1-patch side reads row 0).

    :param positions: ``[patches, 2]`` (row, column) of each patch (:func:`patch_positions`)
    :return: ``indices [patches, 4]`` int64 and ``weights [patches, 4]`` float32, on
        ``positions``' device
    """
    device = positions.device
    sizes = torch.tensor([[h, w] for _, h, w in grid], device=device)
    counts = torch.tensor([t * h * w for t, h, w in grid], device=device)
    sizes = torch.repeat_interleave(sizes, counts, dim=0)  # [patches, 2]: its image's h, w
    # source coordinate on the table; a tap at floor and one at floor + 1 (clamped), each
    # weighted by one minus its distance (HF's formulation, in float32)
    src = positions.float() * (side - 1) / torch.clamp(sizes - 1, min=1)
    floor = torch.floor(src)
    offsets = torch.arange(2, device=device)
    taps = (floor.long()[..., None] + offsets).clamp(0, side - 1)  # [patches, 2 axes, 2]
    weights = (1 - (src[..., None] - floor[..., None] - offsets).abs()).clamp(min=0)
    indices = taps[:, 0, :, None] * side + taps[:, 1, None, :]  # rows x columns
    return indices.flatten(1), (weights[:, 0, :, None] * weights[:, 1, None, :]).flatten(1)


def deepstack_blocks(vision_config: Any) -> list[tuple[int, int]]:
    """``(block index, deepstack merger index)`` of each deepstack row set, in the order the
    tower returns them (block order), as HF picks them: a block listed in
    ``deepstack_visual_indexes`` runs the merger at its (first) place in that list; an index
    past the last block gives no rows. Its length is the number of deepstack sets."""
    indexes = [int(i) for i in vision_config.deepstack_visual_indexes]
    return [
        (block, indexes.index(block))
        for block in range(int(vision_config.depth))
        if block in indexes
    ]


class Qwen3VisionTower(nn.Module):
    """Qwen3-VL's tower (``vision_config``: ``hidden_size``, ``intermediate_size``,
    ``out_hidden_size`` = the language model's width, ``depth``, ``num_heads``,
    ``hidden_act``, ``num_position_embeddings``, ``deepstack_visual_indexes``, patch and
    merge sizes).

    ``forward(pixel_values [patches, C*T*P*P], grid_thw [images, 3])`` returns the merger's
    rows ``[patches / merge**2, out_hidden_size]`` and the deepstack rows, one tensor of
    that shape per deepstack block in the order the blocks run (HF's order); all in the
    tower's dtype.
    """

    def __init__(self, vision_config: Any) -> None:
        super().__init__()
        cfg = vision_config
        dim, heads = int(cfg.hidden_size), int(cfg.num_heads)
        merge = self.spatial_merge_size = int(cfg.spatial_merge_size)
        out_dim = int(cfg.out_hidden_size)
        num_positions = int(cfg.num_position_embeddings)
        self.grid_side = int(num_positions**0.5)
        if self.grid_side**2 != num_positions:
            raise ValueError(
                f"vision num_position_embeddings {num_positions} is not a square grid's size"
            )
        #: block index -> its deepstack merger's index
        self.deepstack_mergers_of = dict(deepstack_blocks(cfg))
        self.patch_embed = patch_embed(cfg, dim, bias=True)
        self.pos_embed = nn.Embedding(num_positions, dim)
        self.rotary = VisionRotary(dim // heads, vision_rope_theta(cfg))
        self.blocks = nn.ModuleList(
            VisionBlock(
                nn.LayerNorm(dim, eps=1e-6),
                nn.LayerNorm(dim, eps=1e-6),
                VisionAttention(dim, heads),
                Qwen3VisionMLP(dim, int(cfg.intermediate_size), str(cfg.hidden_act)),
            )
            for _ in range(int(cfg.depth))
        )
        self.merger = Qwen3PatchMerger(dim, merge, out_dim, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(
            Qwen3PatchMerger(dim, merge, out_dim, postshuffle=True)
            for _ in cfg.deepstack_visual_indexes
        )

    def forward(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        grid = grid_rows(grid_thw)
        check_patch_count(pixel_values, grid)
        x = self.patch_embed(pixel_values)
        positions = patch_positions(grid, self.spatial_merge_size).to(x.device)
        indices, weights = position_taps(grid, positions, self.grid_side)
        # float32 weights times the table's rows, summed, back in the tower's dtype (as HF)
        learned = (self.pos_embed(indices) * weights[..., None]).sum(1)
        x = x + learned.to(x.dtype)
        cos_sin = self.rotary(positions)
        cu_seqlens = frame_seqlens(grid)
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cu_seqlens, cos_sin)
            merger = self.deepstack_mergers_of.get(i)
            if merger is not None:
                deepstack.append(self.deepstack_merger_list[merger](x))
        return self.merger(x), deepstack
