"""GLM-4.1V's vision tower (GLM-4.5V has the same): image patches -> one row per merged
``spatial_merge_size``-square group of patches, in the language model's width.

Built from Qwen2-VL's and Qwen2.5-VL's pieces (:mod:`.qwen2_vl_vision`,
:mod:`.qwen2_5_vl_vision`): the patch embedding (HF's ``Conv3d``, with a bias here), the 2-D
rotary (the same frequencies: a head's first half turned by the patch's row, the second by
its column), the blocks (RMSNorm, fused ``qkv`` with a bias only by ``attention_bias`` and
no ``proj`` bias, a bias-free SwiGLU MLP of width ``out_hidden_size``) and per-frame segment
attention. What GLM adds, after transformers' ``Glm4vVisionModel``:

- ``post_conv_layernorm`` (RMSNorm) after the patch embedding;
- learned absolute position embeddings (:class:`GlmVisionEmbeddings`): the
  ``(image_size / patch_size)``-square table resampled to each image's patch grid by
  bicubic ``grid_sample`` at the patch centres (float32, borders clamped), added to each
  patch;
- after the blocks, ``post_layernorm`` (RMSNorm) and ``downsample``, a ``Conv2d`` whose
  kernel and stride are the merge size: each group's ``merge ** 2`` consecutive patches
  (row-major within the group, the processor's order) become one ``out_hidden_size`` row;
- the merger (:class:`GlmPatchMerger`): a bias-free ``proj``, LayerNorm, exact GELU, then a
  bias-free SwiGLU of width ``intermediate_size``.

Parameter names are the checkpoint's (``model.visual.`` / ``visual.`` stripped).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from chassis.builtin_plugins.models.qwen2_5_vl_vision import VisionSwiGLU
from chassis.builtin_plugins.models.qwen2_vl_vision import (
    Grid,
    VisionAttention,
    VisionBlock,
    VisionRotary,
    check_patch_count,
    frame_seqlens,
    grid_rows,
    patch_embed,
    patch_positions,
    vision_rope_theta,
)
from chassis.core.layers.norm import RMSNorm


class GlmVisionEmbeddings(nn.Module):
    """``position_embedding`` (``[side * side, dim]``, ``side = image_size / patch_size``)
    resampled to each patch: ``forward(x [patches, dim], positions [patches, 2], grid)``
    adds, to the patch at (row, column) of an ``h x w`` grid, the table's bicubic sample at
    ``((column + 0.5) / w, (row + 0.5) / h)`` of its extent (HF's ``grid_sample`` with
    ``align_corners=False``, ``padding_mode="border"``, in float32)."""

    def __init__(self, dim: int, image_size: int, patch_size: int) -> None:
        super().__init__()
        self.side = image_size // patch_size
        self.position_embedding = nn.Embedding(self.side * self.side, dim)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, grid: Grid) -> torch.Tensor:
        table = self.position_embedding.weight
        # [1, dim, side, side] in float32, as HF samples it
        image = table.view(self.side, self.side, -1).permute(2, 0, 1)[None].float()
        # each patch's grid height and width (every frame of a grid row has that row's sizes)
        sizes = torch.tensor(
            [(h, w) for t, h, w in grid for _ in range(t * h * w)],
            dtype=torch.float32,
            device=x.device,
        )
        where = positions.to(x.device, torch.float32)
        rows = (where[:, 0] + 0.5) / sizes[:, 0] * 2 - 1
        cols = (where[:, 1] + 0.5) / sizes[:, 1] * 2 - 1
        sample_at = torch.stack((cols, rows), dim=-1)[None, :, None]  # [1, patches, 1, 2]
        sampled = F.grid_sample(
            image, sample_at, mode="bicubic", align_corners=False, padding_mode="border"
        )
        return x + sampled[0, :, :, 0].t().to(table.dtype)


class GlmPatchMerger(VisionSwiGLU):
    """``proj`` (bias-free), ``post_projection_norm`` (LayerNorm, eps 1e-5), exact GELU,
    then the bias-free SwiGLU ``gate_proj`` / ``up_proj`` / ``down_proj`` of width
    ``hidden_dim``; ``[rows, dim]`` -> ``[rows, dim]``."""

    def __init__(self, dim: int, hidden_dim: int, hidden_act: str) -> None:
        super().__init__(dim, hidden_dim, hidden_act, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.post_projection_norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.gelu(self.post_projection_norm(self.proj(x))))


class Glm4vVisionTower(nn.Module):
    """GLM-4.1V / GLM-4.5V's tower (``vision_config``: ``hidden_size``, ``depth``,
    ``num_heads``, ``attention_bias``, ``hidden_act``, ``rms_norm_eps``, ``image_size``,
    ``out_hidden_size`` = the language model's width, ``intermediate_size`` = the merger's,
    patch and merge sizes).

    ``forward(pixel_values [patches, C*T*P*P], grid_thw [images, 3])`` returns
    ``[patches / merge**2, out_hidden_size]``: the images' rows in order (each image
    ``t * h * w / merge**2`` rows), in the tower's dtype.
    """

    def __init__(self, vision_config: Any) -> None:
        super().__init__()
        cfg = vision_config
        dim, heads = int(cfg.hidden_size), int(cfg.num_heads)
        out_dim, eps = int(cfg.out_hidden_size), float(cfg.rms_norm_eps)
        self.spatial_merge_size = merge = int(cfg.spatial_merge_size)
        self.patch_embed = patch_embed(cfg, dim, bias=True)
        self.post_conv_layernorm = RMSNorm(dim, eps=eps)
        self.embeddings = GlmVisionEmbeddings(dim, int(cfg.image_size), int(cfg.patch_size))
        self.rotary = VisionRotary(dim // heads, vision_rope_theta(cfg))
        qkv_bias = bool(getattr(cfg, "attention_bias", False))
        self.blocks = nn.ModuleList(
            VisionBlock(
                RMSNorm(dim, eps=eps),
                RMSNorm(dim, eps=eps),
                VisionAttention(dim, heads, qkv_bias=qkv_bias, proj_bias=False),
                VisionSwiGLU(dim, out_dim, str(cfg.hidden_act), bias=False),
            )
            for _ in range(int(cfg.depth))
        )
        self.post_layernorm = RMSNorm(dim, eps=eps)
        self.downsample = nn.Conv2d(dim, out_dim, kernel_size=merge, stride=merge)
        self.merger = GlmPatchMerger(out_dim, int(cfg.intermediate_size), str(cfg.hidden_act))

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        grid = grid_rows(grid_thw)
        check_patch_count(pixel_values, grid)
        merge = self.spatial_merge_size
        x = self.post_conv_layernorm(self.patch_embed(pixel_values))
        positions = patch_positions(grid, merge).to(x.device)
        x = self.embeddings(x, positions, grid)
        cos_sin = self.rotary(positions)
        cu_seqlens = frame_seqlens(grid)
        for block in self.blocks:
            x = block(x, cu_seqlens, cos_sin)
        x = self.post_layernorm(x)
        # each group of merge**2 consecutive patches is a merge x merge image for the conv
        groups = x.view(-1, merge, merge, x.shape[-1]).permute(0, 3, 1, 2)
        return self.merger(self.downsample(groups).flatten(1))
