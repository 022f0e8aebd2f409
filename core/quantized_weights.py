"""Quantized checkpoints (FP8, MXFP4, AWQ, GPTQ), read by dequantizing their weights as they
load.

Five layouts are read (``quantization_config`` in ``config.json``, or for AWQ and GPTQ an
older export's ``quantize_config.json`` / ``quant_config.json``,
:mod:`chassis.core.int_quant_config`):

- ``quant_method: "fp8"`` (Qwen3-FP8, DeepSeek-V3 style): ``X.weight`` in ``float8_e4m3fn``
  with ``X.weight_scale_inv`` (float32), one scale per ``weight_block_size`` block
  (``[128, 128]``), or, without a block size, ``X.weight_scale`` per tensor or per row;
- ``quant_method: "compressed-tensors"`` with ``format: "float-quantized"`` (llm-compressor's
  FP8 models): ``X.weight`` in float8 with ``X.weight_scale`` per tensor or per row;
- ``quant_method: "mxfp4"`` (OpenAI's gpt-oss, whose experts are stored so): ``X_blocks``
  and ``X_scales``, both uint8 (:func:`dequantize_mxfp4`), replaced by the tensor ``X`` of
  the unquantized checkpoint;
- ``quant_method: "awq"`` (AutoAWQ's GEMM layout) and ``"gptq"`` (AutoGPTQ, GPTQModel):
  integer codes packed into int32 tensors with per-group zero points and scales, replaced by
  ``X.weight`` (:mod:`chassis.core.packed_int_weights`, which says how they are packed).

An FP8 weight is ``float8 value * scale`` (the scale broadcast over its block, row or tensor),
computed in float32; the model copies it into its dtype. Static activation scales
(``X.input_scale``) are dropped: activations stay in the model's dtype. So an FP8 checkpoint
runs as its dequantized 16-bit twin would: the same outputs, none of FP8's memory or speed
(there are no FP8 kernels yet). Likewise an MXFP4 checkpoint runs as its bfloat16 twin (no
MXFP4 kernels), and an AWQ or GPTQ checkpoint as its 16-bit twin (no int4 kernels). Other
quantization methods are refused by name (:func:`check_quantization`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Generator, Iterable, Iterator, Mapping
from typing import Any

import torch

from chassis.core.packed_int_weights import (
    PACKED_INT_METHODS,
    packed_int_format,
    packed_int_weights,
    without_phantom_biases,
)

#: the methods :func:`dequantized_weights` reads
SUPPORTED_METHODS = ("fp8", "compressed-tensors", "mxfp4", *PACKED_INT_METHODS)
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")
#: FP4 (e2m1) codes 0..15 -> values: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES += tuple(-v for v in E2M1_VALUES)
#: values per MXFP4 scale (one e8m0 byte per 32 values, 16 bytes of two codes each)
MXFP4_BLOCK = 32
_MXFP4_BLOCKS, _MXFP4_SCALES = "_blocks", "_scales"


def quantization_config(hf_config: Any) -> dict[str, Any] | None:
    """The checkpoint's ``quantization_config`` as a dict, or ``None``."""
    raw = getattr(hf_config, "quantization_config", None)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raw = raw.to_dict() if hasattr(raw, "to_dict") else vars(raw)
    return dict(raw)


#: vLLM's ``--quantization`` names of kernels for a method -> the checkpoint's method
QUANTIZATION_ALIASES = {
    "awq_marlin": "awq",
    "gptq_marlin": "gptq",
    "marlin": "gptq",
    "compressed_tensors": "compressed-tensors",
}


def check_quantization_flag(flag: str | None, hf_config: Any) -> None:
    """``--quantization`` (vLLM's flag) names how the checkpoint is quantized; chassis reads
    the method from the checkpoint, so the flag is a check: ``ValueError`` when it names
    another method, or any method for a checkpoint that is not quantized (vLLM would then
    quantize the weights at load, which chassis does not)."""
    if flag is None:
        return
    config = quantization_config(hf_config)
    wanted = QUANTIZATION_ALIASES.get(flag.lower(), flag.lower())
    if config is None:
        raise ValueError(
            f"--quantization {flag}: the checkpoint is not quantized, and chassis does not "
            "quantize weights at load; use a checkpoint quantized with one of "
            f"{', '.join(SUPPORTED_METHODS)}, or drop the flag"
        )
    method = str(config.get("quant_method"))
    if wanted != method:
        raise ValueError(
            f"--quantization {flag} does not match the checkpoint, which is quantized with "
            f"{method!r}; drop the flag (the checkpoint's method is read from its config)"
        )


def check_quantization(hf_config: Any) -> None:
    """Refuse a quantized checkpoint chassis cannot read, naming the method (``ValueError``)."""
    config = quantization_config(hf_config)
    if config is None:
        return
    method = config.get("quant_method")
    if method not in SUPPORTED_METHODS:
        raise ValueError(
            f"the checkpoint is quantized with {method!r}, which chassis does not read; "
            f"supported: {', '.join(SUPPORTED_METHODS)} (FP8, MXFP4, AWQ and GPTQ weights, "
            "dequantized at load)"
        )
    if method in PACKED_INT_METHODS:
        packed_int_format(config)  # refuses the bit widths and layouts it does not read
        return
    if method == "compressed-tensors":
        fmt = config.get("format")
        groups = config.get("config_groups") or {}
        formats = {fmt} | {g.get("format") for g in groups.values() if isinstance(g, dict)}
        formats.discard(None)
        if formats != {"float-quantized"}:
            raise ValueError(
                f"compressed-tensors format(s) {sorted(formats) or '(none)'} are not supported "
                "(only 'float-quantized', FP8 weights)"
            )
    block = config.get("weight_block_size")
    if block is not None and (
        not isinstance(block, list | tuple)
        or len(block) != 2
        or not all(isinstance(b, int) and b > 0 for b in block)
    ):
        raise ValueError(f"quantization_config.weight_block_size must be [rows, cols]; got {block}")


def _dequantize(
    name: str, weight: torch.Tensor, scale: torch.Tensor, block: list[int] | None
) -> torch.Tensor:
    """``weight`` (float8, ``[out, in]``) times its scale, in float32."""
    values = weight.float()
    scale = scale.float()
    if scale.numel() == 1:
        return values * scale.reshape(())
    if block is not None and scale.dim() == 2 and weight.dim() == 2:
        rows, cols = block
        grid = (-(-weight.shape[0] // rows), -(-weight.shape[1] // cols))
        if tuple(scale.shape) != grid:
            raise ValueError(
                f"{name}: scale of shape {tuple(scale.shape)} for a {tuple(weight.shape)} "
                f"weight in {rows}x{cols} blocks (expected {grid})"
            )
        full = scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)
        return values * full[: weight.shape[0], : weight.shape[1]]
    if scale.numel() == weight.shape[0]:  # one scale per output row
        return values * scale.reshape(-1, *([1] * (weight.dim() - 1)))
    raise ValueError(
        f"{name}: cannot apply a scale of shape {tuple(scale.shape)} to a weight of shape "
        f"{tuple(weight.shape)}"
    )


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The bfloat16 tensor an MXFP4 pair stands for, in the unquantized checkpoint's layout.

    ``blocks`` (uint8 ``[..., N, G, 16]``) holds a ``[..., N, K]`` matrix (``K = 32 G``)
    quantized along ``K``: each byte two FP4 (e2m1, :data:`E2M1_VALUES`) codes, the low
    nibble element ``2j`` and the high nibble element ``2j + 1`` of its 32-element group.
    ``scales`` (uint8 ``[..., N, G]``) is one e8m0 exponent per group: the group's values
    are multiplied by ``2 ** (scale - 127)``. The result is that matrix transposed to
    ``[..., K, N]``, the layout of the bfloat16 tensor it replaces (gpt-oss's input-major
    experts; transformers' ``convert_moe_packed_tensors`` gives the same). Every value is
    exact in bfloat16 (a 2-bit significand times a power of two within its range).
    ``ValueError`` for dtypes or shapes that do not fit, or a scale of 255 (NaN in e8m0).
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}"
        )
    half = MXFP4_BLOCK // 2
    if blocks.dim() < 3 or blocks.shape[-1] != half or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} must be "
            f"[..., N, G, {half}] and [..., N, G]"
        )
    if bool((scales == 255).any()):
        raise ValueError("an MXFP4 scale is 255, which is NaN in e8m0: the checkpoint is corrupt")
    *prefix, rows, groups, _ = blocks.shape
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    flat_blocks = blocks.reshape(-1, rows, groups, half)
    flat_scales = scales.reshape(-1, rows, groups)
    out = torch.empty(flat_blocks.shape[0], groups * MXFP4_BLOCK, rows, dtype=torch.bfloat16)
    # one [N, K] matrix (an expert) at a time: the float32 temporaries stay that size
    for i in range(flat_blocks.shape[0]):
        codes = flat_blocks[i].long()
        values = torch.stack((lut[codes & 0x0F], lut[codes >> 4]), dim=-1)  # [N, G, 16, 2]
        exponents = flat_scales[i].to(torch.int32) - 127
        values = torch.ldexp(values.reshape(rows, groups, MXFP4_BLOCK), exponents[..., None])
        out[i] = values.reshape(rows, groups * MXFP4_BLOCK).t()
    return out.reshape(*prefix, groups * MXFP4_BLOCK, rows)


def _joined_pairs(
    weights: Iterable[tuple[str, torch.Tensor]],
    half_of: Callable[[str, torch.Tensor], tuple[str, str] | None],
    join: Callable[[str, dict[str, torch.Tensor]], torch.Tensor],
) -> Generator[tuple[str, torch.Tensor], None, dict[str, dict[str, torch.Tensor]]]:
    """``weights`` with each pair of halves (a float8 weight and its scale, MXFP4 blocks and
    scales) replaced by ``(pair name, join(pair name, {half: tensor}))`` when its second half
    comes: files list the halves in any order. ``half_of(name, tensor)`` is ``(pair name,
    half)``, or ``None`` for a tensor that passes through. Returns the halves whose partner
    never came, ``{pair name: {half: tensor}}``."""
    waiting: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        half = half_of(name, tensor)
        if half is None:
            yield name, tensor
            continue
        pair_name, which = half
        pair = waiting.setdefault(pair_name, {})
        pair[which] = tensor
        if len(pair) == 2:
            del waiting[pair_name]
            yield pair_name, join(pair_name, pair)
    return waiting


def _mxfp4_weights(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """``X_blocks`` and ``X_scales`` pairs replaced by ``X`` (:func:`dequantize_mxfp4`);
    other tensors pass through."""

    def half_of(name: str, tensor: torch.Tensor) -> tuple[str, str] | None:
        suffix = next((s for s in (_MXFP4_BLOCKS, _MXFP4_SCALES) if name.endswith(s)), None)
        return None if suffix is None else (name[: -len(suffix)], suffix)

    waiting = yield from _joined_pairs(
        weights,
        half_of,
        lambda _name, pair: dequantize_mxfp4(pair[_MXFP4_BLOCKS], pair[_MXFP4_SCALES]),
    )
    if waiting:
        halves = sorted(base + next(iter(pair)) for base, pair in waiting.items())
        raise ValueError(f"MXFP4 tensors without their blocks or scales: {halves[:4]}")


def _fp8_weights(
    weights: Iterable[tuple[str, torch.Tensor]], block: list[int] | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each float8 ``X.weight`` with its ``X.weight_scale_inv`` or ``X.weight_scale``
    replaced by ``X.weight`` dequantized (:func:`_dequantize`, in ``block`` blocks); static
    activation scales (``X.input_scale``) dropped; other tensors pass through."""

    def half_of(name: str, tensor: torch.Tensor) -> tuple[str, str] | None:
        scale_suffix = next((s for s in _SCALE_SUFFIXES if name.endswith(s)), None)
        if scale_suffix is not None:
            return name[: -len(scale_suffix)] + ".weight", "scale"
        return (name, "weight") if tensor.dtype in _FP8_DTYPES else None

    # activations are not quantized here: their static scales have no use
    kept = ((name, t) for name, t in weights if not name.endswith(".input_scale"))
    waiting = yield from _joined_pairs(
        kept, half_of, lambda name, pair: _dequantize(name, pair["weight"], pair["scale"], block)
    )
    lone_weights = sorted(name for name, pair in waiting.items() if "weight" in pair)
    if lone_weights:
        raise ValueError(f"float8 weights without a scale in the checkpoint: {lone_weights[:4]}")
    if waiting:
        raise ValueError(f"scales without a float8 weight: {sorted(waiting)[:4]}")


def dequantized_weights(
    weights: Iterable[tuple[str, torch.Tensor]],
    hf_config: Any,
    parameter_names: Collection[str] | None = None,
    merged_projections: Mapping[str, str] | None = None,
    on_int_module: Callable[[str, dict[str, torch.Tensor]], None] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` with every float8 weight replaced by its dequantized float32 value and the
    scales consumed (MXFP4 checkpoints: every blocks/scales pair by its bfloat16 value,
    :func:`dequantize_mxfp4`; AWQ and GPTQ checkpoints: every module's packed tensors by its
    float32 weight, :func:`~chassis.core.packed_int_weights.packed_int_weights`); unquantized
    tensors pass through. Given the model's ``parameter_names`` (and its
    ``merged_projections``, :attr:`~chassis.core.model_interface.CausalLM.merged_projections`),
    the zero biases older GPTQ tools add to bias-free layers are left out
    (:func:`~chassis.core.packed_int_weights.without_phantom_biases`); ``on_int_module``
    is passed to :func:`~chassis.core.packed_int_weights.packed_int_weights`. ``ValueError`` for a
    quantized weight without a scale, a scale without its weight, or shapes that do not
    fit."""
    config = quantization_config(hf_config)
    if config is None:
        yield from weights
    elif config.get("quant_method") == "mxfp4":
        yield from _mxfp4_weights(weights)
    elif config.get("quant_method") in PACKED_INT_METHODS:
        if parameter_names is not None:
            weights = without_phantom_biases(weights, parameter_names, merged_projections)
        yield from packed_int_weights(weights, packed_int_format(config), on_int_module)
    else:
        yield from _fp8_weights(weights, config.get("weight_block_size"))
