"""Sentence-transformers' ``LayerNorm`` module, run on the pooled vector.

``sentence_transformers.models.LayerNorm`` wraps ``torch.nn.LayerNorm(dimension)`` and
applies it to the sentence embedding (the pooled vector, after any ``Dense`` before it).
It saves ``config.json`` (``{"dimension": N}``) and its state dict (``norm.weight`` and
``norm.bias``, each ``[N]``) as ``model.safetensors`` or ``pytorch_model.bin``. The epsilon
is not saved: it is ``torch.nn.LayerNorm``'s default, 1e-5, which the module never changes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from chassis.core.pooling_files import read_module_config, read_weights

#: ``torch.nn.LayerNorm``'s default epsilon (sentence-transformers' module keeps it)
LAYER_NORM_EPS = 1e-5
_KEYS = ("norm.weight", "norm.bias")


@dataclass(frozen=True)
class LayerNormSpec:
    """One ``LayerNorm`` module: its folder and ``dimension`` (the vector's length, in and
    out: the chain reads ``in_features`` and ``out_features`` of every module)."""

    folder: str
    dimension: int

    @property
    def in_features(self) -> int:
        return self.dimension

    @property
    def out_features(self) -> int:
        return self.dimension


def read_layer_norm_spec(folder: Path) -> LayerNormSpec:
    """The ``LayerNorm`` module in ``folder`` from its ``config.json``; ``ValueError`` naming
    the file unless ``dimension`` is a positive integer."""
    config = read_module_config(folder, "LayerNorm")
    dimension = config.get("dimension")
    if not isinstance(dimension, int) or isinstance(dimension, bool) or dimension <= 0:
        raise ValueError(
            f"{folder / 'config.json'}: dimension must be a positive integer; got {dimension!r}"
        )
    return LayerNormSpec(str(folder), dimension)


def load_layer_norm_weights(spec: LayerNormSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """``spec``'s weight and bias (each ``[dimension]``) in float32 on the CPU;
    ``ValueError`` naming the file for a missing file or tensor or a wrong shape."""
    path, state = read_weights(Path(spec.folder), "LayerNorm")
    tensors = []
    for key in _KEYS:
        if key not in state:
            raise ValueError(f"{path}: no {key} tensor (a LayerNorm module saves {_KEYS})")
        tensor = state[key].float()
        if tuple(tensor.shape) != (spec.dimension,):
            raise ValueError(
                f"{path}: {key} has shape {list(tensor.shape)}, config says "
                f"dimension {spec.dimension}"
            )
        tensors.append(tensor)
    return tensors[0], tensors[1]


def layer_norm(weight: torch.Tensor, bias: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The module's function on float32 ``[n, dimension]`` vectors (each row normalized
    over its values, then scaled by ``weight`` and shifted by ``bias``)."""
    shape = (weight.shape[0],)
    return lambda x: F.layer_norm(x.float(), shape, weight, bias, LAYER_NORM_EPS)
