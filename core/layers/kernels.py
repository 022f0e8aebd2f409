"""How layers find a platform's fused implementations of their ops.

A platform may return a :class:`LayerKernels` from ``Platform.layer_kernels()``. The layers of
:mod:`chassis.core.layers` ask :func:`kernels_for` on each call and run the kernel when one
handles the tensor, else their torch code, which stays the reference the kernels are tested
against.
"""

from __future__ import annotations

import os
from typing import Protocol, overload

import torch

from chassis.platforms import get_current_platform


class LayerKernels(Protocol):
    """Fused decoder-layer ops. Each must give what the layer's torch code gives, rounding
    to the model dtype at the same points (HF transformers' order). Elementwise results are
    then bit-identical in 16-bit dtypes; where a float32 sum is taken in another order
    (RMSNorm's mean of squares) or ``exp`` is another approximation (SiLU), rare elements
    may be one rounding step apart, and float32 results may differ in the last bits.

    Optional, looked up with ``getattr`` (a class without it still satisfies this protocol):
    ``qk_norm_rotary_embedding_(positions, query, key, q_weight, k_weight, eps, cos_cache,
    sin_cache) -> (query, key)``, the per-head RMSNorm of ``query [T, Hq, D]`` and
    ``key [T, Hk, D]`` followed by the rotation of :meth:`rotary_embedding_` (Qwen3's
    attention; reference :func:`chassis.core.layers.fused_ops.qk_norm_rotary_embedding_ref`).
    It may work in place and returns the tensors to use. Without it the layers call
    :meth:`rms_norm` twice and then :meth:`rotary_embedding_`.

    Optional too: ``fused_moe(x, w13, w2, topk_weights, topk_ids) -> [T, H]``, the experts of
    a mixture-of-experts layer (reference :func:`chassis.core.layers.moe.fused_experts_ref`,
    same arguments); :class:`~chassis.core.layers.moe.FusedMoE` runs it when present, else
    its torch code. It should read nothing back to the host, so that decode steps with it can
    be captured in CUDA graphs. An expert id of ``-1`` (expert parallelism: the expert is on
    another rank) must leave its pair out of the sum; the same holds for the next kernel.

    Optional too: ``fused_moe_clamped_swiglu(x, w13, b13, w2, b2, topk_weights, topk_ids,
    alpha, limit) -> [T, H]``, gpt-oss's experts (a bias on each matmul, the clamped SwiGLU;
    reference :func:`chassis.builtin_plugins.models.gpt_oss.experts_reference`, same
    arguments); :class:`~chassis.builtin_plugins.models.gpt_oss.GptOssExperts` runs it when
    present, else its torch code. No host read either.

    Optional too: ``int4_linear(x, qweight, scales, zeros, g_idx, bias) -> [..., out]``, the
    matmul of a layer whose weight stays as packed 4-bit codes (layout and reference
    :func:`chassis.core.layers.int4_linear.int4_linear_ref`, same arguments);
    :class:`~chassis.core.layers.int4_linear.Int4Linear` runs it when present, else the
    reference, which dequantizes the weight on each call.
    """

    def handles(self, x: torch.Tensor) -> bool:
        """Whether these kernels accept ``x`` (device, dtype, layout)."""
        ...

    @overload
    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: None = None
    ) -> torch.Tensor: ...

    @overload
    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """:class:`~chassis.core.layers.norm.RMSNorm` of ``[tokens, hidden]`` (see there)."""
        ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``[tokens, 2d] -> [tokens, d]``, as :class:`~chassis.core.layers.activation.SiluAndMul`."""
        ...

    def rotary_embedding_(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        cos_cache: torch.Tensor,
        sin_cache: torch.Tensor,
    ) -> None:
        """Rotate-half RoPE of ``query [T, Hq, D]``/``key [T, Hk, D]`` in place, in their dtype,
        as :class:`~chassis.core.layers.rotary.RotaryEmbedding` does."""
        ...


#: the dtypes fused kernels are written for
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def is_inference_tensor_of_kernel_dtype(x: torch.Tensor) -> bool:
    """``x`` has a :data:`KERNEL_DTYPES` dtype and needs no autograd (kernels define no
    backward); the device check is each implementation's own."""
    return x.dtype in KERNEL_DTYPES and not (x.requires_grad and torch.is_grad_enabled())


#: ``CHASSIS_LAYER_KERNELS=0`` (read at import) makes every layer run its torch code
ENABLED = os.environ.get("CHASSIS_LAYER_KERNELS", "1").strip().lower() not in {"0", "false", "off"}


def kernels_for(x: torch.Tensor) -> LayerKernels | None:
    """The current platform's kernels if they handle ``x``, else ``None``.

    Always ``None`` while ``torch.compile`` traces (``--torch-compile``): the layers' torch
    code is what inductor fuses.
    """
    if not ENABLED or torch.compiler.is_compiling():
        return None
    kernels = get_current_platform().layer_kernels()
    if kernels is not None and kernels.handles(x):
        return kernels
    return None
