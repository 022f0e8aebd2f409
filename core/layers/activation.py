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


#: HF ``hidden_act`` / ``hidden_activation`` names -> ``F.gelu``'s ``approximate`` argument
GELU_APPROXIMATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


class GeluAndMul(nn.Module):
    """``[..., 2 * d]`` -> ``[..., d]``: ``gelu(x[..., :d]) * x[..., d:]`` (GeGLU, Gemma).

    ``approximate`` is ``F.gelu``'s: ``"tanh"`` (HF ``gelu_pytorch_tanh``, what Gemma uses)
    or ``"none"`` (the exact erf form, HF ``gelu``). Computed in the input dtype, as HF does.
    """

    def __init__(self, approximate: str = "tanh") -> None:
        super().__init__()
        if approximate not in ("tanh", "none"):
            raise ValueError(f"approximate must be 'tanh' or 'none', got {approximate!r}")
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"
