"""Linear layers that run few-row inputs through the Triton GEMV (``core/layers/triton_gemv``).

Needs Triton (imported with this module). Opt-in on CUDA/ROCm: with ``CHASSIS_TRITON_GEMV=1`` the platform's ``prepare_model`` calls
:func:`use_small_batch_gemv`, which swaps every plain ``nn.Linear`` of the model for a
:class:`SmallBatchLinear` holding the *same* ``weight`` and ``bias`` parameters (no copy:
``state_dict`` names, weight tying, ``load_weights``, in-place updates and sleep mode see the
parameters they saw before). A call with at most :data:`~chassis.core.layers.triton_gemv.MAX_ROWS`
rows (after flattening leading dimensions) on a GPU runs the GEMV; anything else, including
every CPU tensor and prefill, runs ``F.linear`` as before.

Only modules whose type *is* ``nn.Linear`` are swapped: subclasses (layers with a forward of
their own) and wrappers (LoRA's :class:`~chassis.core.lora.layers.LoRALinear`, which the
worker builds before ``prepare_model``: its ``base_layer``, a plain ``nn.Linear``, is swapped
inside it, and the adapter deltas are still added to its output) stay as they are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from chassis.core.layers import triton_gemv
from chassis.core.layers.activation import SiluAndMul
from chassis.core.layers.norm import RMSNorm

__all__ = ["SmallBatchLinear", "can_swap", "small_batch_layers", "use_small_batch_gemv"]

#: weight dtypes the GEMV takes
GEMV_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: device types whose layers are swapped (ROCm's tensors are ``cuda`` too); tests add ``cpu``,
#: whose tensors the kernel takes under Triton's interpreter
GEMV_DEVICE_TYPES = ("cuda",)


def can_swap(module: nn.Module) -> bool:
    """Whether ``module`` is a plain ``nn.Linear`` (not a subclass) whose weight the GEMV can
    read: 2-D, unit stride along the input, a supported dtype, on a CUDA/ROCm device."""
    if type(module) is not nn.Linear:
        return False
    weight = module.weight
    return (
        weight.device.type in GEMV_DEVICE_TYPES
        and weight.dtype in GEMV_DTYPES
        and weight.dim() == 2
        and weight.stride(1) == 1
    )


class SmallBatchLinear(nn.Module):
    """``y = x @ weight.T + bias``: the Triton GEMV for inputs of up to ``MAX_ROWS`` rows on
    a GPU, ``F.linear`` otherwise.

    Holds the *same* ``weight``/``bias`` parameters as the ``nn.Linear`` it replaces. ``x`` is
    ``[..., in_features]``; the result ``[..., out_features]``, in ``x``'s dtype.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias

    def _takes(self, x: torch.Tensor, features: int | None = None) -> bool:
        """Whether the GEMV runs ``x``: few rows, the weight's dtype and device, unit stride
        along the features (CPU tensors only under Triton's interpreter, for tests)."""
        if features is not None and (x.dim() == 0 or x.shape[-1] != features):
            return False
        rows = x.numel() // max(x.shape[-1], 1) if x.dim() else 0
        if not 0 < rows <= triton_gemv.MAX_ROWS:
            return False
        if x.dtype != self.weight.dtype or x.device != self.weight.device:
            return False
        if x.stride(-1) != 1:  # (the weight's unit stride was checked by can_swap)
            return False
        if self.bias is not None and self.bias.dtype != x.dtype:
            return False
        return x.device.type == "cuda" or triton_gemv.is_interpreted(triton_gemv._gemv_kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._takes(x):
            bias = None if self.bias is None else self.bias.detach()
            return triton_gemv.gemv(x, self.weight.detach(), bias)
        return F.linear(x, self.weight, self.bias)

    def forward_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``normed, stream = norm(x, residual)``, then ``(self(normed), stream)``: for few
        rows on a GPU, when ``norm`` is exactly an :class:`RMSNorm` (subclasses such as
        Gemma's compute other formulas) of ``x``'s dtype, one GEMV launch that adds, normalizes
        and multiplies (:func:`~chassis.core.layers.triton_gemv.add_rms_norm_gemv`); else the
        two steps. The optional capability that ``LlamaMLP`` asks its ``gate_up_proj`` for."""
        if (
            type(norm) is RMSNorm
            and norm.weight.dtype == x.dtype
            and norm.weight.device == x.device
            and residual.shape == x.shape
            and residual.dtype == x.dtype
            and residual.stride(-1) == 1
            and self._takes(x, features=self.in_features)
        ):
            bias = None if self.bias is None else self.bias.detach()
            return triton_gemv.add_rms_norm_gemv(
                x, residual, norm.weight.detach(), norm.eps, self.weight.detach(), bias
            )
        normed, stream = norm(x, residual)
        return self(normed), stream

    def forward_silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``self(SiluAndMul()(gate_up))`` for ``gate_up [..., 2 * in_features]`` (a SwiGLU
        MLP's down projection): few rows on a GPU in one GEMV launch that applies the
        activation as it loads its input, else the two steps. The optional capability that
        ``LlamaMLP`` asks its ``down_proj`` for."""
        if self._takes(gate_up, features=2 * self.in_features):
            bias = None if self.bias is None else self.bias.detach()
            return triton_gemv.gemv(gate_up, self.weight.detach(), bias, silu_and_mul=True)
        return self(SiluAndMul()(gate_up))

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, gemv_rows<={triton_gemv.MAX_ROWS}"
        )


def small_batch_layers(model: nn.Module) -> list[SmallBatchLinear]:
    """Every :class:`SmallBatchLinear` of ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, SmallBatchLinear)]


def use_small_batch_gemv(model: nn.Module) -> int:
    """Replace every plain ``nn.Linear`` of ``model`` that :func:`can_swap` accepts by a
    :class:`SmallBatchLinear` sharing its parameters; returns how many were swapped. A module
    reachable under several names (a shared head) becomes one ``SmallBatchLinear``."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        # (``_modules``, not ``named_children()``, which names a shared module only once)
        for name, child in parent._modules.items()
        if child is not None and can_swap(child)
    ]
    swapped: dict[int, SmallBatchLinear] = {}
    for parent, name, child in targets:
        layer = swapped.get(id(child))
        if layer is None:
            layer = swapped[id(child)] = SmallBatchLinear(child)
        setattr(parent, name, layer)
    return len(swapped)
