"""Gated activations for MLPs whose gate and up projections are one merged matmul."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from chassis.core.layers.kernels import kernels_for


class SiluAndMul(nn.Module):
    """``[..., 2 * d]`` -> ``[..., d]``: ``silu(x[..., :d]) * x[..., d:]`` (SwiGLU)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = kernels_for(x)
        if kernels is not None:
            return kernels.silu_and_mul(x)
        return self.forward_reference(x)

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        """The torch implementation (what platform kernels are tested against)."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
