"""The CPU platform's :class:`~chassis.core.layers.kernels.LayerKernels`: the compiled ops."""

from __future__ import annotations

from typing import Any

import torch

from chassis.core.layers.kernels import is_inference_tensor_of_kernel_dtype


class CpuLayerKernels:
    """Runs RMSNorm, SiLU-and-mul and RoPE with the ``chassis_cpu`` ops of ``kernels.cpp``."""

    def __init__(self, ops: Any) -> None:
        self.ops = ops

    def handles(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and is_inference_tensor_of_kernel_dtype(x)

    # Decode steps call these ~100 times per step on a few rows, where Python around the op
    # costs as much as the op: 2-D inputs (what the models pass) go straight to it.

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> Any:
        if weight.dtype != x.dtype:
            weight = weight.to(x.dtype)
        if x.dim() == 2 and (residual is None or residual.dim() == 2):
            outs = self.ops.rms_norm(x, residual, weight, eps)
            return outs[0] if residual is None else (outs[0], outs[1])
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        r2 = None if residual is None else residual.reshape(-1, shape[-1])
        outs = self.ops.rms_norm(x2, r2, weight, eps)
        if residual is None:
            return outs[0].view(shape)
        return outs[0].view(shape), outs[1].view(shape)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return self.ops.silu_and_mul(x)
        shape = x.shape
        out = self.ops.silu_and_mul(x.reshape(-1, shape[-1]))
        return out.view(*shape[:-1], shape[-1] // 2)

    def rotary_embedding_(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        cos_cache: torch.Tensor,
        sin_cache: torch.Tensor,
    ) -> None:
        if positions.dtype != torch.int64:
            positions = positions.long()
        self.ops.rotary_embedding(positions, query, key, cos_cache, sin_cache)
