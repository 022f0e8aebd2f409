"""RMSNorm, optionally fused with the residual add that precedes it in a decoder layer."""

from __future__ import annotations

from typing import overload

import torch
from torch import nn

from chassis.core.layers.kernels import kernels_for


class RMSNorm(nn.Module):
    """Root-mean-square layer norm over the last dimension, with a learned scale ``weight``.

    The statistics are computed in float32 and the normalized value is cast back to the input
    dtype before scaling (the same order as HF transformers, so float32 runs match it exactly).

    ``forward(x)`` returns the normalized ``x``. ``forward(x, residual)`` first adds
    ``residual`` to ``x`` and returns ``(norm(x + residual), x + residual)``: the second value
    is the residual stream the next layer continues from.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    @overload
    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...

    @overload
    def forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        kernels = kernels_for(x)
        if kernels is not None and self.weight.dtype == x.dtype:
            return kernels.rms_norm(x, self.weight, self.eps, residual)
        return self.forward_reference(x, residual)

    def forward_reference(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The torch implementation (what platform kernels are tested against)."""
        if residual is None:
            return self._normalize(x)
        x = x + residual
        return self._normalize(x), x

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: ``x * rsqrt(mean(x^2) + eps) * (1 + weight)`` over the last dimension.

    Unlike :class:`RMSNorm`, the learned ``weight`` is an offset from 1 (a checkpoint stores
    zeros for the identity) and the whole product is computed in float32 and cast to the
    input dtype once, at the end (HF transformers' ``GemmaRMSNorm``; 16-bit results differ
    from :class:`RMSNorm`'s rounding order, so the two are not interchangeable). The calls
    are :class:`RMSNorm`'s: ``forward(x)`` and ``forward(x, residual)``, the sum taken in the
    input dtype. Always the torch code: the platforms' ``rms_norm`` kernels compute
    :class:`RMSNorm`'s formula.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        nn.init.zeros_(self.weight)

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # never the platform kernel: it would compute RMSNorm's formula
        return self.forward_reference(x, residual)
