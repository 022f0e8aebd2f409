"""Linear layers whose bfloat16 weights are packed once, at load time, for a fast CPU kernel.

``F.linear`` on a plain row-major bf16 weight goes through oneDNN without a weight in its
preferred layout, paying the layout conversion (or a slower kernel) on every call; for the
one-token-per-request matmuls of decode (GEMV-like) that costs as much as the product itself.
So every eligible weight is packed once:

- for ``chassis_cpu::linear`` (``platforms/cpu_kernels/bf16_linear.cpp``, AVX512-BF16 dot
  products) when the CPU has AVX512-BF16, the compiled kernels are available, out_features is
  a multiple of 64 and in_features even and at most 4,096. ``chassis bench kernels`` on the 2-vCPU
  development machine (SmolLM2's MLP weights of 30 layers, from memory), against oneDNN's
  packed linear: 1 row 20 -> 30 GFLOP/s, 8 rows 164 -> 236, 32 rows 309 -> 352, equal from
  512 rows. Outputs are float32 sums rounded once, like oneDNN's; summation order differs, so
  ~1e-4 of the outputs differ from ``F.linear``'s by one bf16 rounding step;
- otherwise in oneDNN's blocked layout, calling oneDNN's linear on it: same values as
  ``F.linear`` (bit-identical in the tests), 1.3-4x faster at small batch (a 49152x576 LM
  head at 1 token 7.2 -> 1.6-2.5 ms) and no slower at 2,048 tokens.

:func:`pack_linear_weights` swaps every eligible ``nn.Linear`` of a loaded model for a
:class:`PackedLinear` that shares its parameters; platforms call it from
``Platform.prepare_model``. The packed copy is refreshed automatically when the weight is
modified in place afterwards (e.g. a later ``load_weights``), so it never goes stale.
Sleep mode drops the packed copies (:meth:`PackedLinear.release`) before it frees the
weights, and packs them again when the weights are back (:meth:`PackedLinear.repack`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import torch
from torch import nn

__all__ = ["PackedLinear", "can_pack", "pack_linear_weights", "packed_linear_layers"]

#: weight dtypes packing is used for (where the speedup was measured; float32 goes via MKL
#: and float16 packing needs AVX512-FP16 / AVX-NE-CONVERT, which few CPUs have)
PACKED_DTYPES = (torch.bfloat16,)


@cache
def _packing_works(dtype: torch.dtype) -> bool:
    """Whether this torch build and CPU pack and run a ``dtype`` linear (probed once)."""
    mkldnn = torch.ops.mkldnn
    if not (
        torch.backends.mkldnn.is_available()
        and hasattr(mkldnn, "_reorder_linear_weight")
        and hasattr(mkldnn, "_linear_pointwise")
    ):
        return False
    try:  # oneDNN refuses 16-bit paths the CPU lacks instructions for, with a RuntimeError
        weight = torch.ones(4, 4, dtype=dtype)
        packed = mkldnn._reorder_linear_weight(weight, 1)
        out = mkldnn._linear_pointwise(torch.ones(1, 4, dtype=dtype), packed, None, "none", [], "")
    except RuntimeError:
        return False
    return bool((out == 4).all())


#: the chassis kernel keeps a 64-column panel of K weights in L2 while it walks K
_CHASSIS_MAX_IN_FEATURES = 4096


def _onednn_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


@cache
def _chassis_linear_ops() -> Any | None:
    """``torch.ops.chassis_cpu`` when its bf16 linear runs on this CPU (AVX512-BF16)."""
    from chassis.platforms import cpu_kernels

    ops = cpu_kernels.load()
    return ops if ops is not None and ops.bf16_linear_available() else None


def _chassis_linear_fits(weight: torch.Tensor) -> bool:
    out_features, in_features = weight.shape
    return (
        weight.dtype == torch.bfloat16
        and out_features % 64 == 0
        and in_features % 2 == 0
        and in_features <= _CHASSIS_MAX_IN_FEATURES
    )


def can_pack(weight: torch.Tensor) -> bool:
    """Whether ``weight`` (a 2-D linear weight) can be packed on this build and device."""
    return (
        weight.dim() == 2
        and weight.device.type == "cpu"
        and weight.dtype in PACKED_DTYPES
        and _packing_works(weight.dtype)
    )


class PackedLinear(nn.Module):
    """``y = x @ weight.T + bias`` with ``weight`` also held in oneDNN's packed layout.

    Holds the *same* ``weight``/``bias`` parameters as the ``nn.Linear`` it replaces (names,
    ``state_dict`` and weight tying unchanged) plus a non-persistent packed copy, which is
    rebuilt on the next call whenever ``weight``'s version counter shows an in-place change.
    ``x`` is ``[..., in_features]`` in the weight's dtype; the result is ``[..., out_features]``.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        if not can_pack(linear.weight):
            raise ValueError(
                f"cannot pack a {linear.weight.dtype} weight on {linear.weight.device}; "
                "check can_pack() first"
            )
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self._packed: torch.Tensor | None = None
        self._linear: Callable[..., torch.Tensor] = _onednn_linear
        self._packed_version = -1
        self.repack()

    def release(self) -> None:
        """Drop the packed copy (its memory is freed once nothing else holds it); the layer
        must not run until :meth:`repack`."""
        self._packed = None
        self._packed_version = -1

    @property
    def is_released(self) -> bool:
        """Whether the packed copy was dropped (:meth:`release`) and not rebuilt since."""
        return self._packed is None

    @torch.no_grad()
    def repack(self) -> None:
        """Pack ``weight`` as it is now (after :meth:`release`, or to pick up new values)."""
        weight = self.weight.detach()
        ops = _chassis_linear_ops()
        if ops is not None and _chassis_linear_fits(weight):
            self._packed = ops.pack_linear(weight)
            self._linear = ops.linear
        else:
            # The batch-size hint only tunes the packed layout; at 1 it measured as fast as
            # any other hint from 1 to 2,048 tokens.
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
            self._linear = _onednn_linear
        self._packed_version = self.weight._version

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight._version != self._packed_version:
            self.repack()
        bias = None if self.bias is None else self.bias.detach()
        return self._linear(x, self._packed, bias)

    @property
    def packed_weight(self) -> torch.Tensor:
        """The packed copy of ``weight`` the kernel reads (rebuilt after in-place updates)."""
        assert self._packed is not None
        return self._packed

    @property
    def kernel(self) -> str:
        """Which kernel runs this layer: ``"chassis"`` (``chassis_cpu::linear``) or ``"oneDNN"``."""
        return "oneDNN" if self._linear is _onednn_linear else "chassis"

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, packed={self.kernel}"
        )


def packed_linear_layers(model: nn.Module) -> list[PackedLinear]:
    """Every :class:`PackedLinear` of ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, PackedLinear)]


def pack_linear_weights(model: nn.Module) -> int:
    """Replace every packable ``nn.Linear`` in ``model`` by a :class:`PackedLinear`.

    Call after the weights are loaded (later in-place updates are picked up anyway). Layers
    whose weight :func:`can_pack` rejects are left as they are. Returns how many were packed.
    """
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and can_pack(child.weight)
    ]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return len(targets)
