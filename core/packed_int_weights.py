"""AWQ and GPTQ checkpoints (integer weights packed into int32), dequantized as they load.

Both store a linear layer ``X`` (``[out, in]`` unquantized) as unsigned ``bits``-bit codes
``q`` with, per group of ``group_size`` input rows and per output column, a zero point ``z``
and a float16 scale ``s``; the weight is ``(q - z) * s``. Their tensors differ:

- GPTQ (AutoGPTQ, GPTQModel; ``quant_method: "gptq"``): ``X.qweight`` int32
  ``[in * bits / 32, out]``, each int32 holding ``32 / bits`` consecutive *input* rows, the
  first in the lowest bits; ``X.qzeros`` int32 ``[groups, out * bits / 32]``, packed the same
  way along the output columns; ``X.scales`` ``[groups, out]``; ``X.g_idx`` int32 ``[in]``, the
  group of each input row. With ``desc_act`` (act-order) the groups are not runs of rows and
  ``g_idx`` is required. Without it row ``k`` is in group ``k // group_size`` unless a
  ``g_idx`` is stored: one is then honoured whatever it says, as AutoGPTQ's and GPTQModel's
  own dequantization do (it is what the codes were quantized with; vLLM's GPTQ kernels
  ignore it when ``desc_act`` is false, which computes other weights when it reorders). The
  ``"gptq"`` (v1) checkpoint format stores each zero point minus one (``z = stored + 1``),
  ``"gptq_v2"`` stores it as it is. ``group_size: -1`` is one group.
- AWQ (AutoAWQ's GEMM version; ``quant_method: "awq"``): ``X.qweight`` int32
  ``[in, out / 8]``, each int32 holding 8 consecutive *output* columns in the interleaved
  order ``0, 2, 4, 6, 1, 3, 5, 7`` (nibble ``i`` holds column :data:`AWQ_PACK_ORDER` ``[i]``);
  ``X.qzeros`` int32 ``[groups, out / 8]`` in the same order; ``X.scales`` ``[groups, out]``;
  row ``k`` is in group ``k // group_size``.

Each module's tensors are replaced by ``X.weight`` in float32, which holds ``(q - z) * s``
exactly (a small integer times a float16); the model copies it into its dtype and slices it
for tensor parallelism as it would the unquantized weight. Other tensors (biases, modules
left unquantized such as ``lm_head`` or ``modules_to_not_convert``) pass through, but for
the zero biases older GPTQ tools added to bias-free layers (:func:`without_phantom_biases`).
4-bit layers are then kept packed after loading where that is exact
(:mod:`chassis.core.int4_packing`); otherwise the checkpoint runs as its dequantized 16-bit
twin.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from chassis.core.int_quant_config import normalized_int_config

logger = logging.getLogger(__name__)

#: the ``quant_method`` values :func:`packed_int_weights` reads
PACKED_INT_METHODS = ("awq", "gptq")
#: GPTQ code widths read: ones that divide 32 (3-bit codes straddle int32s and are refused)
GPTQ_BITS = (2, 4, 8)
#: GPTQ checkpoint formats read -> what is added to a stored zero point
GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}
#: nibble ``i`` of an AWQ int32 holds column ``AWQ_PACK_ORDER[i]`` of its 8
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
#: input rows dequantized at a time (a multiple of every codes-per-int32 count)
ROWS_PER_STEP = 1024
_AWQ_VERSIONS = ("gemm",)
_AWQ_BACKENDS = (None, "autoawq")
_PARTS = ("qweight", "qzeros", "scales", "g_idx")


@dataclass(frozen=True)
class PackedIntFormat:
    """How a checkpoint's packed integer weights read (from :func:`packed_int_format`)."""

    method: str  #: "awq" or "gptq"
    bits: int
    group_size: int  #: input rows per group; -1: all of them
    zero_offset: int = 0  #: added to each stored zero point (1 for GPTQ's v1 format)
    act_order: bool = False  #: GPTQ ``desc_act``: groups come from ``g_idx``, required

    @property
    def parts(self) -> tuple[str, ...]:
        """The tensor suffixes a module needs (``g_idx`` only with act-order; GPTQ without
        it reads a ``g_idx`` stored before the others, :func:`packed_int_weights`)."""
        return _PARTS if self.act_order else _PARTS[:3]


def _int(config: dict[str, Any], key: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if value is None:
        raise ValueError(f"quantization_config.{key} is missing")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"quantization_config.{key} must be an integer; got {value!r}")
    return value


def packed_int_format(config: dict[str, Any]) -> PackedIntFormat:
    """The format of an AWQ or GPTQ ``quantization_config`` (AutoAWQ's ``w_bit`` and
    ``q_group_size`` read as ``bits`` and ``group_size``, GPTQModel's ``format`` as
    ``checkpoint_format``); ``ValueError`` naming what is not read: contradicting spellings,
    other bit widths, AWQ versions other than GEMM (GEMV, Marlin, ExLlama, IPEX) or without
    zero points, GPTQ checkpoint formats other than ``gptq``/``gptq_v2`` (Marlin, BitBLAS,
    ...), a missing or bad group size."""
    config = normalized_int_config(config, "quantization_config")  # AutoAWQ's w_bit, ...
    method = config.get("quant_method")
    # no default: AutoGPTQ, GPTQModel and transformers default to 128 when quantizing, not to
    # one group, so a config without it is refused by name (as vLLM does) rather than guessed
    group_size = _int(config, "group_size")
    if group_size != -1 and group_size <= 0:
        raise ValueError(f"quantization_config.group_size must be positive or -1; got {group_size}")
    bits = _int(config, "bits")
    if method == "awq":
        version = str(config.get("version", "gemm")).lower()
        if version not in _AWQ_VERSIONS:
            raise ValueError(
                f"AWQ version {version!r} is not supported (only 'gemm', AutoAWQ's default "
                "layout, is read)"
            )
        backend = config.get("backend")
        if backend not in _AWQ_BACKENDS:
            raise ValueError(f"AWQ backend {backend!r} is not supported (only 'autoawq')")
        if bits != 4:
            raise ValueError(f"AWQ with {bits}-bit weights is not supported (only 4-bit)")
        if config.get("zero_point", True) is not True:
            raise ValueError("AWQ without zero points (zero_point: false) is not supported")
        return PackedIntFormat("awq", bits, group_size)
    if method == "gptq":
        if bits not in GPTQ_BITS:
            raise ValueError(
                f"GPTQ with {bits}-bit weights is not supported (only "
                f"{', '.join(map(str, GPTQ_BITS))}-bit)"
            )
        if config.get("is_marlin_format"):
            raise ValueError("GPTQ checkpoints in Marlin format are not supported")
        # some GPTQModel versions wrote the format as "format" (its in-code name) instead
        fmt = config.get("checkpoint_format") or config.get("format") or "gptq"
        if config.get("format") not in (None, fmt):
            raise ValueError(
                f"quantization_config states checkpoint_format={fmt!r} and "
                f"format={config['format']!r}; fix the checkpoint's config"
            )
        if fmt not in GPTQ_FORMATS:
            raise ValueError(
                f"GPTQ checkpoint format {fmt!r} is not supported (only "
                f"{', '.join(map(repr, GPTQ_FORMATS))})"
            )
        return PackedIntFormat(
            "gptq", bits, group_size, GPTQ_FORMATS[fmt], bool(config.get("desc_act", False))
        )
    raise ValueError(f"{method!r} is not a packed integer method ({PACKED_INT_METHODS})")


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The unsigned ``bits``-bit codes of an int32 tensor, ``32 / bits`` per element laid out
    along ``dim`` (the lowest bits first): ``[..., n, ...]`` -> ``[..., n * 32 / bits, ...]``,
    as int32 on ``packed``'s device."""
    if packed.dtype != torch.int32:
        raise ValueError(f"packed integer weights must be int32, got {packed.dtype}")
    per_int = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    dim = dim % packed.dim()
    view = [1] * (packed.dim() + 1)
    view[dim + 1] = per_int
    # an arithmetic shift of a negative int32 fills with ones: the mask keeps only the code
    codes = (packed.unsqueeze(dim + 1) >> shifts.reshape(view)) & ((1 << bits) - 1)
    return codes.flatten(dim, dim + 1)


def awq_columns(out_features: int, per_int: int) -> torch.Tensor:
    """The index that puts AWQ's interleaved codes in column order: in
    ``unpack_int32(qweight, bits, 1)[:, awq_columns(out_features, 32 // bits)]`` column ``n``
    holds output column ``n``'s codes (for AWQ's ``qzeros`` alike)."""
    # column j of each run of per_int sits in the nibble i with AWQ_PACK_ORDER[i] == j
    nibble_of_column = torch.tensor([AWQ_PACK_ORDER.index(j) for j in range(per_int)])
    columns = (torch.arange(out_features) // per_int) * per_int
    return columns + nibble_of_column.repeat(out_features // per_int)


def _check_shape(name: str, part: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != expected:
        raise ValueError(
            f"{name}: {part} has shape {tuple(tensor.shape)}, expected {expected} (does "
            "quantization_config match the weights?)"
        )


def _groups(in_features: int, group_size: int) -> int:
    return 1 if group_size == -1 else -(-in_features // group_size)


def row_groups(in_features: int, group_size: int) -> torch.Tensor:
    """The group of each input row when groups are consecutive runs of rows."""
    rows = torch.arange(in_features)
    return torch.zeros_like(rows) if group_size == -1 else rows // group_size


def _assemble(
    codes_of: Callable[[int, int], torch.Tensor],
    zeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
) -> torch.Tensor:
    """The ``[out, in]`` float32 weight ``(q - z) * s``, from ``codes_of(start, end)`` (the
    codes of input rows ``start..end - 1``, ``[end - start, out]``), zero points and scales
    ``[groups, out]`` and the group of each input row (``g_idx``)."""
    in_features, out_features = g_idx.numel(), scales.shape[1]
    weight = torch.empty(out_features, in_features, dtype=torch.float32)
    scales = scales.float()
    # a slice of rows at a time keeps the int32/float32 temporaries to that slice
    for start in range(0, in_features, ROWS_PER_STEP):
        end = min(start + ROWS_PER_STEP, in_features)
        groups = g_idx[start:end]
        values = (codes_of(start, end) - zeros[groups]).float() * scales[groups]
        weight[:, start:end] = values.t()
    return weight


def dequantize_gptq(
    name: str,
    parts: dict[str, torch.Tensor],
    fmt: PackedIntFormat,
) -> torch.Tensor:
    """The ``[out, in]`` float32 weight of a GPTQ module's ``qweight``, ``qzeros``,
    ``scales`` and ``g_idx`` (required with act-order; without it, the consecutive grouping
    when absent); ``ValueError`` for shapes or a ``g_idx`` that do not fit ``fmt``."""
    per_int = 32 // fmt.bits
    qweight, scales = parts["qweight"], parts["scales"]
    in_features, out_features = qweight.shape[0] * per_int, qweight.shape[1]
    groups = _groups(in_features, fmt.group_size)
    _check_shape(name, "scales", scales, (groups, out_features))
    _check_shape(name, "qzeros", parts["qzeros"], (groups, out_features // per_int))
    zeros = unpack_int32(parts["qzeros"], fmt.bits, 1) + fmt.zero_offset  # [groups, out]
    if "g_idx" in parts:
        g_idx = parts["g_idx"].long()
        _check_shape(name, "g_idx", g_idx, (in_features,))
        if bool(((g_idx < 0) | (g_idx >= groups)).any()):
            raise ValueError(f"{name}: g_idx names groups outside 0..{groups - 1}")
    else:
        g_idx = row_groups(in_features, fmt.group_size)
    return _assemble(
        lambda start, end: unpack_int32(qweight[start // per_int : end // per_int], fmt.bits, 0),
        zeros,
        scales,
        g_idx,
    )


def dequantize_awq(
    name: str,
    parts: dict[str, torch.Tensor],
    fmt: PackedIntFormat,
) -> torch.Tensor:
    """The ``[out, in]`` float32 weight of an AWQ (GEMM) module's ``qweight``, ``qzeros`` and
    ``scales``; ``ValueError`` for shapes that do not fit ``fmt``."""
    per_int = 32 // fmt.bits
    qweight, scales = parts["qweight"], parts["scales"]
    in_features, out_features = qweight.shape[0], qweight.shape[1] * per_int
    groups = _groups(in_features, fmt.group_size)
    _check_shape(name, "scales", scales, (groups, out_features))
    _check_shape(name, "qzeros", parts["qzeros"], (groups, qweight.shape[1]))
    columns = awq_columns(out_features, per_int)
    zeros = unpack_int32(parts["qzeros"], fmt.bits, 1)[:, columns]  # [groups, out]
    return _assemble(
        lambda start, end: unpack_int32(qweight[start:end], fmt.bits, 1)[:, columns],
        zeros,
        scales,
        row_groups(in_features, fmt.group_size),
    )


def _is_row_groups(g_idx: torch.Tensor, fmt: PackedIntFormat) -> bool:
    """Whether ``g_idx`` is the consecutive grouping (row ``k`` in group ``k // size``)."""
    return torch.equal(g_idx.long(), row_groups(g_idx.numel(), fmt.group_size))


def _check_late_g_idx(name: str, g_idx: torch.Tensor, fmt: PackedIntFormat) -> None:
    """A ``g_idx`` that comes after its GPTQ module was dequantized (without act-order), or
    an AWQ module's (AWQ reads none), must be the consecutive grouping the module is
    dequantized with."""
    if _is_row_groups(g_idx, fmt):
        return
    if fmt.method == "awq":
        raise ValueError(f"{name} reorders the input rows, which AWQ checkpoints never do")
    raise ValueError(
        f"{name} reorders the input rows (quantization_config.desc_act is false) but "
        "comes after the module's other packed tensors, which were dequantized with "
        "consecutive groups; set desc_act: true in the checkpoint's config, or keep each "
        "module's tensors in one file"
    )


def packed_int_weights(
    weights: Iterable[tuple[str, torch.Tensor]],
    fmt: PackedIntFormat,
    on_module: Callable[[str, dict[str, torch.Tensor]], None] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` with each module's packed tensors (``X.qweight``, ``X.qzeros``,
    ``X.scales``, and with act-order ``X.g_idx``, in any order) replaced by ``X.weight``
    dequantized, once its last part comes; other tensors pass through.

    GPTQ without act-order: a module's ``X.g_idx`` is honoured when it comes before the
    module's last other part (safetensors files list names sorted, so ``g_idx`` comes first
    within a file), with a warning when it reorders rows; one coming later must be the
    consecutive grouping. AWQ has no ``g_idx``: a stored one must be consecutive and is
    dropped. ``on_module(base, parts)``, when given, is called with each module's parts once
    they are checked (dequantized), before its weight is yielded (what
    :class:`~chassis.core.int4_packing.Int4Sources` keeps packed). ``ValueError`` for a module missing a part (when the weights end), whose shapes
    do not fit ``fmt``, or for a late or AWQ ``g_idx`` that reorders rows."""
    dequantize = dequantize_gptq if fmt.method == "gptq" else dequantize_awq
    needed = set(fmt.parts)
    # GPTQ without act-order takes a g_idx that comes early; AWQ checks and drops one
    optional_g_idx = fmt.method == "gptq" and not fmt.act_order
    waiting: dict[str, dict[str, torch.Tensor]] = {}
    done: set[str] = set()  # modules dequantized, for a g_idx coming after them
    warned = False
    for name, tensor in weights:
        base, _, suffix = name.rpartition(".")
        if suffix == "g_idx" and not fmt.act_order and (not optional_g_idx or base in done):
            _check_late_g_idx(name, tensor, fmt)
            continue
        if (suffix not in needed and not (optional_g_idx and suffix == "g_idx")) or not base:
            yield name, tensor
            continue
        parts = waiting.setdefault(base, {})
        parts[suffix] = tensor
        if needed <= set(parts):
            del waiting[base]
            if optional_g_idx:
                done.add(base)
                if not warned and "g_idx" in parts and not _is_row_groups(parts["g_idx"], fmt):
                    warned = True
                    logger.warning(
                        "%s.g_idx reorders the input rows although desc_act is false: "
                        "honouring it (the weights were quantized in that order)",
                        base,
                    )
            weight = dequantize(base, parts, fmt)
            if on_module is not None:
                on_module(base, parts)
            yield base + ".weight", weight
    if waiting:
        lacking = sorted(
            f"{base} (no {', '.join(sorted(needed - set(p)))})" for base, p in waiting.items()
        )
        raise ValueError(f"{fmt.method.upper()} modules missing packed tensors: {lacking[:4]}")


def without_phantom_biases(
    weights: Iterable[tuple[str, torch.Tensor]],
    parameter_names: Collection[str],
    merged_projections: Mapping[str, str] | None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` less the all-zero biases the model has no parameter for.

    Older GPTQ tools (GPTQ-for-LLaMa, early AutoGPTQ) gave every quantized layer a bias,
    zeros where the architecture has none (Llama's projections, Qwen2's ``o_proj`` and MLP),
    and many Hub checkpoints carry them. A zero ``P.X.bias`` is left out when the model has
    neither ``P.X.bias`` nor ``P.M.bias``, ``M`` the module its ``merged_projections`` (the
    model's :attr:`~chassis.core.model_interface.CausalLM.merged_projections`) loads ``X``
    into: it adds nothing, and the model has no place for it. Any other bias passes through.
    ``ValueError`` for a zero bias without a parameter of its own name when the model
    declares no ``merged_projections`` (``None``): it may belong to a merged module whose
    name only the model knows.
    """
    names = set(parameter_names)
    for name, tensor in weights:
        if (
            name.endswith(".bias")
            and name.count(".") >= 2
            and name not in names
            and not bool(tensor.any())
        ):
            prefix, module, _ = name.rsplit(".", 2)
            if merged_projections is None:
                raise ValueError(
                    f"the checkpoint has a zero bias {name!r} the model has no parameter of "
                    "that name for, and the model does not declare which of its modules the "
                    "checkpoint's projections load into (CausalLM.merged_projections); "
                    "declare them in the model plugin"
                )
            if f"{prefix}.{merged_projections.get(module, module)}.bias" not in names:
                continue
        yield name, tensor
