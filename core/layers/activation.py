"""Gated activations for MLPs whose gate and up projections are one merged matmul."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """``[..., 2 * d]`` -> ``[..., d]``: ``silu(x[..., :d]) * x[..., d:]`` (SwiGLU)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
