"""Keeping a 4-bit AWQ/GPTQ (or 8-bit GPTQ) checkpoint's linear layers packed
(:class:`Int4Linear`).

Each layer loads as the dequantized twin's would (``load_weights`` merges projections and
slices for tensor parallelism the way it does for any checkpoint), while :class:`Int4Sources`
keeps each checkpoint module's packed tensors, converted to the one layout of
:mod:`chassis.core.layers.int4_linear`. Then :func:`pack_int4_linear` replaces the
``nn.Linear`` if those tensors reproduce its weight *exactly* (dequantized to the model
dtype, bit for bit) by an :class:`Int4Linear` holding them: a layer that merges several
checkpoint projections (Q/K/V, gate/up) gets their tensors concatenated along the output
dimension, in the order that reproduces its weight. That equality is the proof the packed
layer computes what the dequantized one would; a layer it does not hold for (one the model
transformed at load, projections quantized with different act-order permutations) stays
dequantized. The dequantized weight is freed, so what stays is ~1/4 of the 16-bit bytes.
The loader does this one layer at a time as the checkpoint streams in
(:mod:`chassis.core.int4_streaming`), so the whole dequantized model never exists;
:func:`pack_int4_linears` does it for every layer of a loaded model.

Under tensor parallelism a rank's layer holds its even share of the checkpoint modules'
output columns (column-parallel layers) or input rows (row-parallel ones: whole int32 words
of codes and those rows' ``g_idx``, with every group's scales and zero points, so shares need
not fall on group boundaries), found by the same exact comparison; a layer sharded some other
way (KV heads replicated across more ranks than there are) stays dequantized.

8-bit GPTQ modules are kept packed the same way (:func:`keeps_bits_packed`; the layout
holds 4 codes per int32 then). Not packed (the dequantized path): 2-bit GPTQ (with a log
line), fused MoE
experts (one tensor for all experts; no log line: they are not ``nn.Linear``),
``--int4-weights dequantized``, and ``--int4-weights auto`` (the default) on a platform
without an int4 matmul kernel (:func:`keeps_int4_packed`).
"""

from __future__ import annotations

import itertools
import logging

import torch
from torch import nn

from chassis.core.layers import int4_linear
from chassis.core.layers.int4_linear import Int4Linear, pack_codes, reproduces
from chassis.core.packed_int_weights import (
    ROWS_PER_STEP,
    PackedIntFormat,
    awq_columns,
    row_groups,
    unpack_int32,
)

logger = logging.getLogger(__name__)

#: one module's (or layer's) ``(qweight, scales, zeros, g_idx)`` in the layout of
#: :mod:`chassis.core.layers.int4_linear`
Packed = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def keeps_int4_packed(mode: str, torch_compile: bool = False) -> bool:
    """Whether ``--int4-weights mode`` keeps 4-bit layers packed on this platform: always for
    "packed", never for "dequantized"; for "auto" (the default) where the platform's layer
    kernels have ``int4_linear`` (:func:`~chassis.core.layers.int4_linear.
    platform_int4_kernel`) and the model is not compiled (``--torch-compile``: layers trace
    their torch references, so the kernel would not run). Without the kernel the reference
    dequantizes every layer's whole weight on every call: slower than the dequantized path,
    and it holds a full-size weight (and its float32 and int32 temporaries) while each layer
    runs."""
    if mode == "auto":
        return not torch_compile and int4_linear.platform_int4_kernel() is not None
    return mode == "packed"


def keeps_bits_packed(fmt: PackedIntFormat) -> bool:
    """Whether the layers of a checkpoint in ``fmt`` can stay packed: 4-bit AWQ and GPTQ,
    and 8-bit GPTQ (its codes are packed along the input rows as the layout wants; 2-bit
    ones are not kept packed)."""
    return fmt.bits == 4 or (fmt.method == "gptq" and fmt.bits == 8)


def canonical_int4(parts: dict[str, torch.Tensor], fmt: PackedIntFormat) -> Packed:
    """``(qweight [in * bits / 32, out] int32, scales [groups, out], zeros [groups, out]
    (uint8 for 4-bit codes, int16 for 8-bit), g_idx [in] int32)`` of one checkpoint module's
    checked parts; ``ValueError`` for a format not kept packed (:func:`keeps_bits_packed`)."""
    if not keeps_bits_packed(fmt):
        raise ValueError(f"{fmt.bits}-bit {fmt.method.upper()} weights are not kept packed")
    scales = parts["scales"]
    zeros_dtype = torch.uint8
    if fmt.method == "gptq":  # codes packed along the input already, as the layout wants
        qweight = parts["qweight"]
        in_features = qweight.shape[0] * 32 // fmt.bits
        zeros = unpack_int32(parts["qzeros"], fmt.bits, 1) + fmt.zero_offset
        if fmt.bits == 8:  # a v1 zero point of 255 + 1 does not fit a byte
            zeros_dtype = torch.int16
        g_idx = parts.get("g_idx")
    else:  # AWQ: codes packed along the output columns, interleaved; repack along the input
        columns = awq_columns(scales.shape[1], 8)
        in_features = parts["qweight"].shape[0]
        # a slice of rows at a time keeps the int32 codes to that slice (the loader packs
        # while it loads: these temporaries add to its peak)
        qweight = torch.cat(
            [
                pack_codes(
                    unpack_int32(parts["qweight"][start : start + ROWS_PER_STEP], 4, 1)[:, columns]
                )
                for start in range(0, in_features, ROWS_PER_STEP)
            ]
        )
        zeros = unpack_int32(parts["qzeros"], 4, 1)[:, columns]
        g_idx = None
    if g_idx is None:
        g_idx = row_groups(in_features, fmt.group_size)
    return qweight.contiguous(), scales.contiguous(), zeros.to(zeros_dtype), g_idx.to(torch.int32)


class Int4Sources:
    """The packed tensors of a checkpoint's modules, by module name (``model.layers.0.
    self_attn.q_proj``), recorded while the checkpoint loads dequantized."""

    def __init__(self, fmt: PackedIntFormat) -> None:
        self.fmt = fmt
        self.modules: dict[str, Packed] = {}

    def record(self, name: str, parts: dict[str, torch.Tensor]) -> None:
        """Keep module ``name``'s parts (already checked by the dequantization)."""
        self.modules[name] = canonical_int4(parts, self.fmt)


def _concat(parts: list[Packed]) -> Packed | None:
    """Parts concatenated along the output dimension; ``None`` when their input grouping
    (``g_idx``) or group count differs."""
    first = parts[0]
    for other in parts[1:]:
        if other[2].shape[0] != first[2].shape[0] or not torch.equal(other[3], first[3]):
            return None
    return (
        torch.cat([p[0] for p in parts], dim=1),
        torch.cat([p[1] for p in parts], dim=1),
        torch.cat([p[2] for p in parts], dim=1),
        first[3],
    )


def _output_slice(packed: Packed, size: int, rank: int) -> Packed | None:
    """Rank ``rank``'s even share of the output columns (a column-parallel layer)."""
    out_features = packed[0].shape[1]
    if out_features % size:
        return None
    cols = slice(rank * out_features // size, (rank + 1) * out_features // size)
    return packed[0][:, cols], packed[1][:, cols], packed[2][:, cols], packed[3]


def _input_slice(packed: Packed, size: int, rank: int) -> Packed | None:
    """Rank ``rank``'s even share of the input rows (a row-parallel layer): whole int32
    words of codes and their rows' ``g_idx``; every group's scales and zero points stay, as
    ``g_idx`` indexes them, so a share need not start or end on a group boundary."""
    in_features = packed[3].numel()
    per_int = in_features // packed[0].shape[0]
    if in_features % (per_int * size):
        return None
    start, end = rank * in_features // size, (rank + 1) * in_features // size
    return packed[0][start // per_int : end // per_int], packed[1], packed[2], packed[3][start:end]


def _rank_variants(candidates: list[Packed], tp_size: int, tp_rank: int) -> list[list[Packed]]:
    """The ways a layer of this rank may hold ``candidates``: whole (no tensor parallelism,
    or a replicated layer), each cut to this rank's output columns, or to its input rows."""
    variants = [candidates]
    if tp_size > 1:
        for cut in (_output_slice, _input_slice):
            parts = [cut(c, tp_size, tp_rank) for c in candidates]
            if all(p is not None for p in parts):
                variants.append(parts)  # type: ignore[arg-type]
    return variants


def _matching(
    weight: torch.Tensor, candidates: list[Packed], tp_size: int = 1, tp_rank: int = 0
) -> Packed | None:
    """The concatenation of ``candidates`` (in some order, whole or cut to this rank's
    share, :func:`_rank_variants`) whose dequantized weight equals ``weight``, moved to its
    device and made contiguous; ``None`` if there is none."""
    if len(candidates) > 4:  # 24 orders at most; no built-in layer merges more
        return None
    for variant in _rank_variants(candidates, tp_size, tp_rank):
        packed = _matching_order(weight, variant)
        if packed is not None:
            return packed
    return None


def _matching_order(weight: torch.Tensor, candidates: list[Packed]) -> Packed | None:
    for order in itertools.permutations(candidates):
        packed = _concat(list(order))
        if packed is None or packed[0].shape[1] != weight.shape[0]:
            continue
        if packed[3].numel() != weight.shape[1]:
            continue
        packed = tuple(t.to(weight.device).contiguous() for t in packed)
        if reproduces(*packed, weight):
            return packed  # type: ignore[return-value]
    return None


def _rank_of(name: str, declared: list[str]) -> int:
    leaf = name.rpartition(".")[2]
    return declared.index(leaf) if leaf in declared else len(declared)


def layer_of(module_name: str, merged_projections: dict[str, str] | None) -> str:
    """The model layer a checkpoint module loads into (``...q_proj`` -> ``...qkv_proj`` for a
    model that merges Q/K/V; its own name otherwise)."""
    prefix, _, leaf = module_name.rpartition(".")
    target = (merged_projections or {}).get(leaf, leaf)
    return f"{prefix}.{target}" if prefix else target


def pack_int4_linear(
    model: nn.Module,
    layer_name: str,
    candidates: dict[str, Packed],
    merged_projections: dict[str, str] | None,
    tp_size: int = 1,
    tp_rank: int = 0,
) -> bool:
    """Replace ``model``'s ``nn.Linear`` ``layer_name`` by an :class:`Int4Linear` holding
    ``candidates`` (its checkpoint modules' packed tensors, by module name) when some order
    and rank share of them reproduces its loaded weight exactly (module docstring); return
    whether it did. The replaced layer's weight is freed (its storage emptied, also for
    anyone still holding the parameter); its bias is shared with the packed layer."""
    module = model.get_submodule(layer_name)
    if type(module) is not nn.Linear:
        return False
    # the order merged_projections declares first (the models' own: q, k, v), so that the
    # first comparison usually matches
    declared = list(merged_projections or {})
    names = sorted(candidates, key=lambda n: (_rank_of(n, declared), n))
    packed = _matching(module.weight.data, [candidates[n] for n in names], tp_size, tp_rank)
    if packed is None:
        return False
    bias = module.bias.data if module.bias is not None else None
    parent_name, _, child = layer_name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, Int4Linear(*packed, bias))
    # a loader may still hold the parameter (a dict of the model's parameters): empty it
    module.weight.data = module.weight.data.new_empty(0)
    return True


def warn_kept_dequantized(kept: list[str]) -> None:
    """Log the layers whose packed tensors did not reproduce their weight (a warning: real
    checkpoints reproduce their layers, so the memory asked for is not what the model holds
    for a reason worth seeing, such as a model transforming weights at load)."""
    if kept:
        logger.warning(
            "int4: %d linear layers kept dequantized (no order or tensor-parallel share of "
            "their checkpoint modules' packed tensors reproduces the loaded weight, e.g. "
            "projections with different act-order g_idx), e.g. %s",
            len(kept),
            kept[0],
        )


@torch.no_grad()
def pack_int4_linears(
    model: nn.Module,
    sources: Int4Sources,
    merged_projections: dict[str, str] | None,
    tp_size: int = 1,
    tp_rank: int = 0,
) -> int:
    """Replace each ``nn.Linear`` of a loaded ``model`` that ``sources`` reproduce exactly
    by an :class:`Int4Linear` (:func:`pack_int4_linear`); return how many were replaced.
    Under tensor parallelism (``tp_size`` ranks, this one ``tp_rank``) a layer may hold this
    rank's even share of the checkpoint modules' output columns or input rows. The loader
    packs each layer as soon as it has loaded instead (:mod:`chassis.core.int4_streaming`)."""
    by_layer: dict[str, dict[str, Packed]] = {}
    for name, packed in sources.modules.items():
        by_layer.setdefault(layer_of(name, merged_projections), {})[name] = packed
    modules = dict(model.named_modules())
    replaced, kept = 0, []
    for layer_name, candidates in by_layer.items():
        if type(modules.get(layer_name)) is not nn.Linear:
            continue
        if pack_int4_linear(model, layer_name, candidates, merged_projections, tp_size, tp_rank):
            replaced += 1
        else:
            kept.append(layer_name)
    warn_kept_dequantized(kept)
    return replaced
