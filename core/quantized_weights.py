"""FP8 checkpoints, read by dequantizing their weights as they load.

Two layouts are read (``quantization_config`` in ``config.json``):

- ``quant_method: "fp8"`` (Qwen3-FP8, DeepSeek-V3 style): ``X.weight`` in ``float8_e4m3fn``
  with ``X.weight_scale_inv`` (float32), one scale per ``weight_block_size`` block
  (``[128, 128]``), or, without a block size, ``X.weight_scale`` per tensor or per row;
- ``quant_method: "compressed-tensors"`` with ``format: "float-quantized"`` (llm-compressor's
  FP8 models): ``X.weight`` in float8 with ``X.weight_scale`` per tensor or per row.

The weight is ``float8 value * scale`` (the scale broadcast over its block, row or tensor),
computed in float32; the model copies it into its dtype. Static activation scales
(``X.input_scale``) are dropped: activations stay in the model's dtype. So an FP8 checkpoint
runs as its dequantized 16-bit twin would: the same outputs, none of FP8's memory or speed
(there are no FP8 kernels yet). Other quantization methods are refused by name
(:func:`check_quantization`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

#: the methods :func:`dequantized_weights` reads
SUPPORTED_METHODS = ("fp8", "compressed-tensors")
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")


def quantization_config(hf_config: Any) -> dict[str, Any] | None:
    """The checkpoint's ``quantization_config`` as a dict, or ``None``."""
    raw = getattr(hf_config, "quantization_config", None)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raw = raw.to_dict() if hasattr(raw, "to_dict") else vars(raw)
    return dict(raw)


def check_quantization(hf_config: Any) -> None:
    """Refuse a quantized checkpoint chassis cannot read, naming the method (``ValueError``)."""
    config = quantization_config(hf_config)
    if config is None:
        return
    method = config.get("quant_method")
    if method not in SUPPORTED_METHODS:
        raise ValueError(
            f"the checkpoint is quantized with {method!r}, which chassis does not read; "
            f"supported: FP8 checkpoints ({', '.join(SUPPORTED_METHODS)}), dequantized at load"
        )
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


def dequantized_weights(
    weights: Iterable[tuple[str, torch.Tensor]], hf_config: Any
) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` with every float8 weight replaced by its dequantized float32 value and the
    scales consumed; unquantized tensors pass through. ``ValueError`` for a float8 weight
    without a scale, a scale without its weight, or shapes that do not fit."""
    config = quantization_config(hf_config)
    if config is None:
        yield from weights
        return
    block = config.get("weight_block_size")
    # A weight waits for its scale (or a scale for its weight): files list them in any order.
    waiting_weights: dict[str, torch.Tensor] = {}
    waiting_scales: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name.endswith(".input_scale"):
            continue  # static activation scale: activations are not quantized here
        scale_suffix = next((s for s in _SCALE_SUFFIXES if name.endswith(s)), None)
        if scale_suffix is not None:
            weight_name = name[: -len(scale_suffix)] + ".weight"
            weight = waiting_weights.pop(weight_name, None)
            if weight is None:
                waiting_scales[weight_name] = tensor
            else:
                yield weight_name, _dequantize(weight_name, weight, tensor, block)
            continue
        if tensor.dtype in _FP8_DTYPES:
            scale = waiting_scales.pop(name, None)
            if scale is None:
                waiting_weights[name] = tensor
            else:
                yield name, _dequantize(name, tensor, scale, block)
            continue
        yield name, tensor
    if waiting_weights:
        raise ValueError(
            f"float8 weights without a scale in the checkpoint: {sorted(waiting_weights)[:4]}"
        )
    if waiting_scales:
        raise ValueError(f"scales without a float8 weight: {sorted(waiting_scales)[:4]}")
