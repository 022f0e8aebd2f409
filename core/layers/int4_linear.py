"""A linear layer whose weight stays as packed 4-bit codes (AWQ/GPTQ checkpoints, W4A16),
or 8-bit ones (GPTQ 8-bit checkpoints, W8A16) in the same layout.

The one layout (every AWQ and GPTQ module is converted to it at load,
:mod:`chassis.core.int4_packing`), for a weight ``W [out, in]`` of ``bits``-bit codes
(``p = 32 / bits`` codes per int32: 8 or 4):

- ``qweight`` int32 ``[in / p, out]``: int32 ``[i, n]`` holds the codes of input rows
  ``p i .. p i + p - 1`` of output column ``n``, row ``p i + j`` in bits
  ``bits j .. bits (j + 1) - 1``; the width follows from the shapes (:func:`code_bits`);
- ``scales`` ``[groups, out]`` (the checkpoint's float16) and ``zeros`` ``[groups, out]``
  (the zero points, GPTQ v1's ``+ 1`` already added: they may be ``2**bits``): uint8 for
  4-bit codes, int16 for 8-bit ones;
- ``g_idx`` int32 ``[in]``: the group of each input row. Act-order (GPTQ ``desc_act``)
  checkpoints keep their own; otherwise it is ``k // group_size``. Kernels read each row's
  group from it, so act-order needs no permutation of the input and no other path.

``W[n, k] = ((q[k, n] - zeros[g, n]) * scales[g, n])`` in float32 with ``g = g_idx[k]``,
rounded to the activation dtype: the same values as the dequantized weight the model would
otherwise hold, so the reference below gives exactly what ``nn.Linear`` on that weight gives.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from chassis.core.layers import kernels as layer_kernels
from chassis.core.layers.kernels import kernels_for
from chassis.core.packed_int_weights import unpack_int32
from chassis.platforms import get_current_platform

#: code widths a layer may hold (GPTQ 8-bit checkpoints keep theirs too)
BITS = (4, 8)


def unpack_codes(qweight: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """``qweight [in * bits / 32, out]`` int32 -> the codes ``[in, out]`` int32."""
    return unpack_int32(qweight, bits, 0)


def pack_codes(codes: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """Codes ``[in, out]`` (``0 .. 2**bits - 1``, ``in`` a multiple of ``32 / bits``) ->
    ``qweight [in * bits / 32, out]`` int32, the inverse of :func:`unpack_codes`."""
    per_int = 32 // bits
    rows, cols = codes.shape
    if rows % per_int:
        raise ValueError(
            f"{bits}-bit packing needs input rows in multiples of {per_int}; got {rows}"
        )
    rows_of = codes.view(rows // per_int, per_int, cols)
    packed = torch.zeros(rows // per_int, cols, dtype=torch.int32, device=codes.device)
    # one code row at a time into the int32s (the last lands in the sign bit: the int32 with
    # those bits), so the temporaries stay one row of codes, not int64 copies of them all
    for j in range(per_int):
        packed |= rows_of[:, j].to(torch.int32) << (bits * j)
    return packed


def code_bits(qweight: torch.Tensor, g_idx: torch.Tensor) -> int:
    """The code width of a packed weight: ``g_idx`` has one entry per input row, ``qweight``
    one row of int32s per ``32 / bits`` of them. ``ValueError`` for other widths."""
    rows = qweight.shape[0]
    per_int = g_idx.numel() // rows if rows else 0
    if not rows or per_int * rows != g_idx.numel() or per_int not in (32 // b for b in BITS):
        raise ValueError(
            f"qweight has {rows} rows for {g_idx.numel()} input rows: not 4- or 8-bit codes"
        )
    return 32 // per_int


def dequantize_int4(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    g_idx: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The ``[out, in]`` weight in ``dtype`` of the packed layout above."""
    groups = g_idx.long()
    codes = unpack_codes(qweight, code_bits(qweight, g_idx))  # [in, out]
    values = (codes - zeros[groups].to(torch.int32)).float() * scales[groups].float()
    # contiguous [out, in], as nn.Linear holds it: F.linear on a transposed view may take
    # another BLAS path, with other float32 sums than the dequantized model's
    return values.to(dtype).t().contiguous()


def reproduces(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    g_idx: torch.Tensor,
    weight: torch.Tensor,
    rows_per_step: int = 256,
) -> bool:
    """Whether the packed tensors dequantize to ``weight [out, in]`` (in its dtype) bit for
    bit: :func:`dequantize_int4`'s values, compared ``rows_per_step`` input rows at a time
    (a multiple of 8) so that the temporaries stay a slice of the layer, not several
    full-size int32/float32 copies of it (the loader checks each layer as it loads)."""
    in_features = g_idx.numel()
    if weight.shape != (qweight.shape[1], in_features):
        return False
    bits = code_bits(qweight, g_idx)
    per_int = 32 // bits
    for start in range(0, in_features, rows_per_step):
        end = min(start + rows_per_step, in_features)
        groups = g_idx[start:end].long()
        codes = unpack_codes(qweight[start // per_int : -(-end // per_int)], bits)
        values = (codes - zeros[groups].to(torch.int32)).float() * scales[groups].float()
        if not torch.equal(values.to(weight.dtype), weight[:, start:end].t()):
            return False
    return True


def platform_int4_kernel() -> Callable[..., torch.Tensor] | None:
    """The current platform's ``int4_linear`` layer kernel (optional in
    :class:`~chassis.core.layers.kernels.LayerKernels`), or ``None`` when its kernels lack
    it or layer kernels are off (``CHASSIS_LAYER_KERNELS=0``): then :class:`Int4Linear` runs
    the reference, which dequantizes the whole weight on every call."""
    if not layer_kernels.ENABLED:
        return None
    kernels = get_current_platform().layer_kernels()
    return getattr(kernels, "int4_linear", None) if kernels is not None else None


def int4_linear_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    g_idx: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """The reference W4A16 matmul: the layer's weight dequantized to ``x``'s dtype on this
    call, then ``F.linear`` (``x [..., in] -> [..., out]``)."""
    weight = dequantize_int4(qweight, scales, zeros, g_idx, x.dtype)
    return nn.functional.linear(x, weight, bias)


class Int4Linear(nn.Module):
    """``y = x @ W.T + bias`` with ``W`` held as packed 4-bit (or 8-bit, :attr:`bits`)
    codes (layout above).

    ``forward`` runs the platform's ``int4_linear`` kernel
    (:class:`~chassis.core.layers.kernels.LayerKernels`, optional there) when the platform's
    kernels handle ``x``, else :func:`int4_linear_ref`. The packed tensors are contiguous
    buffers (a view of a wider tensor is copied: kernels index them with unit column
    strides): they move with ``.to()`` and count in the module's memory, and no optimizer
    touches them.
    """

    def __init__(
        self,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        g_idx: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> None:
        super().__init__()
        in_features, out_features = g_idx.numel(), qweight.shape[1]
        groups = scales.shape[0]
        if g_idx.dim() != 1:
            raise ValueError(f"g_idx has shape {tuple(g_idx.shape)}, expected one dimension")
        if qweight.dtype != torch.int32 or zeros.dtype not in (torch.uint8, torch.int16):
            raise ValueError("qweight must be int32 and zeros uint8 (or int16: 8-bit codes)")
        self.bits = code_bits(qweight, g_idx)
        if scales.shape != (groups, out_features) or zeros.shape != scales.shape:
            raise ValueError(
                f"scales {tuple(scales.shape)} and zeros {tuple(zeros.shape)} must be "
                f"[groups, {out_features}]"
            )
        self.in_features = in_features
        self.out_features = out_features
        # contiguous: the kernels index the packed tensors with unit column strides
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scales", scales.contiguous())
        self.register_buffer("zeros", zeros.contiguous())
        self.register_buffer("g_idx", g_idx.to(torch.int32).contiguous())
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """``W [out, in]`` in ``dtype`` (what the reference multiplies by)."""
        return dequantize_int4(self.qweight, self.scales, self.zeros, self.g_idx, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = kernels_for(x)
        kernel = getattr(kernels, "int4_linear", None) if kernels is not None else None
        if kernel is not None:
            return kernel(x, self.qweight, self.scales, self.zeros, self.g_idx, self.bias)
        return int4_linear_ref(x, self.qweight, self.scales, self.zeros, self.g_idx, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bits={self.bits}, groups={self.scales.shape[0]}, bias={self.bias is not None}"
        )
