"""Sentence-transformers modules after the pooling: the chain of ``Dense`` projections and
``LayerNorm`` modules.

A sentence-transformers checkpoint lists its pipeline in ``modules.json``: ``Transformer``,
``Pooling``, then optionally ``Dense`` modules (a linear layer and an activation each),
``LayerNorm`` modules (:mod:`chassis.core.pooling_layer_norm`) and ``Dropout`` modules (the
identity at inference), run one after the other on the pooled vector in the order listed,
and a final ``Normalize``. As vLLM does, chassis reads each ``Dense`` module from the folder
its ``path`` names: ``config.json`` (``in_features``, ``out_features``, ``bias``,
``activation_function``) and the weights in ``model.safetensors`` or ``pytorch_model.bin``
(``linear.weight``, ``linear.bias``).

Unlike vLLM, which skips a module it cannot load and logs it, everything chassis cannot
reproduce is refused when the engine starts (``ValueError``): another module type (the
message names it; ``WordWeights``, which reweighs each token before the pooling, says why),
modules out of this order, an unknown activation, a chain whose sizes do not meet, a
missing or mismatched weights file. The chain runs in float32 (vLLM's default head dtype),
on the float32 pooled vectors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from chassis.core.pooling_files import read_json, read_module_config, read_weights
from chassis.core.pooling_layer_norm import (
    LayerNormSpec,
    layer_norm,
    load_layer_norm_weights,
    read_layer_norm_spec,
)

__all__ = [
    "DEFAULT_ACTIVATION",
    "ST_PREFIX",
    "ChainSpec",
    "DenseChain",
    "DenseSpec",
    "activation_function",
    "load_dense_weights",
    "read_chain_specs",
    "read_json",
    "read_modules",
]

ST_PREFIX = "sentence_transformers.models."
#: the module types chassis runs, each with its rank: modules run in rank order (Transformer
#: first); those of the chain (rank 2) in the order listed, any number of each
_RANKS = {"Transformer": 0, "Pooling": 1, "Dense": 2, "LayerNorm": 2, "Dropout": 2, "Normalize": 3}
_CHAIN = tuple(k for k, rank in _RANKS.items() if rank == 2)
#: why a known module type is refused, by type
_REFUSALS = {
    "WordWeights": "WordWeights (a weight per vocabulary token, applied to each token's hidden "
    "state before the pooling) is not supported: chassis pools the unweighted hidden states",
}

#: activation class names (the last part of ``activation_function``) -> the function
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Identity": lambda x: x,
    "Tanh": torch.tanh,
    "Sigmoid": torch.sigmoid,
    "ReLU": torch.relu,
    "GELU": F.gelu,  # the exact (erf) form, torch.nn.GELU()'s default
    "SiLU": F.silu,
}
#: the module paths the activation classes are saved under (``torch.nn.Tanh`` is the same
#: class as ``torch.nn.modules.activation.Tanh``)
_ACTIVATION_PREFIXES = ("torch.nn.modules.linear.", "torch.nn.modules.activation.", "torch.nn.")
#: sentence-transformers' default when a Dense config names no activation
DEFAULT_ACTIVATION = "torch.nn.modules.activation.Tanh"
#: the weight keys read, in this order: sentence-transformers' own, then the two vLLM reads too
_WEIGHT_KEYS = ("linear.weight", "weight", "dense.weight")


@dataclass(frozen=True)
class DenseSpec:
    """One ``Dense`` module: its folder, sizes, whether it has a bias, its activation (the
    name as the checkpoint writes it)."""

    folder: str
    in_features: int
    out_features: int
    bias: bool
    activation: str


#: one module of the chain after the pooling (a ``Dropout`` has none: it is the identity)
ChainSpec = DenseSpec | LayerNormSpec


def activation_function(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The function a sentence-transformers ``activation_function`` names; ``ValueError``
    naming it when chassis does not know it."""
    for prefix in _ACTIVATION_PREFIXES:
        if name.startswith(prefix) and name.removeprefix(prefix) in _ACTIVATIONS:
            return _ACTIVATIONS[name.removeprefix(prefix)]
    known = ", ".join(f"torch.nn.{n}" for n in _ACTIVATIONS)
    raise ValueError(f"Dense activation_function {name!r} is not supported; known: {known}")


def read_modules(model_dir: str | Path) -> list[dict[str, Any]] | None:
    """``model_dir``'s ``modules.json`` (``None`` without one), checked: only
    ``Transformer``, ``Pooling``, the chain's ``Dense``, ``LayerNorm`` and ``Dropout`` and
    ``Normalize`` modules, in that order, at most one of each outside the chain, and the
    chain only after a ``Pooling``. ``ValueError`` otherwise, naming the modules."""
    modules_file = Path(model_dir) / "modules.json"
    if not modules_file.is_file():
        return None
    modules = read_json(modules_file)
    if isinstance(modules, dict):  # some exports wrap the list
        modules = modules.get("modules")
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ValueError(f"{modules_file}: expected a list of modules")
    kinds = [_kind(m) for m in modules]
    refused = [_REFUSALS[k] for k in dict.fromkeys(kinds) if k in _REFUSALS]
    if refused:
        raise ValueError(f"{modules_file}: {'; '.join(refused)}")
    others = [
        str(m.get("type", "")) for m, k in zip(modules, kinds, strict=True) if k not in _RANKS
    ]
    if others:
        raise ValueError(
            f"{modules_file} lists modules chassis cannot run: {', '.join(others)} (supported: "
            "Transformer, Pooling, Dense projections, LayerNorm, Dropout, Normalize)"
        )
    ranks = [_RANKS[k] for k in kinds]
    repeated = sorted({k for k in kinds if k not in _CHAIN and kinds.count(k) > 1})
    chain_without_pooling = any(k in _CHAIN for k in kinds) and "Pooling" not in kinds
    if ranks != sorted(ranks) or repeated or chain_without_pooling:
        raise ValueError(
            f"{modules_file}: modules in the order {' -> '.join(kinds)} are not supported; "
            "chassis runs Transformer -> Pooling -> (Dense | LayerNorm | Dropout)... -> "
            "Normalize (each outside the parentheses at most once)"
        )
    return modules


def _kind(module: dict[str, Any]) -> str:
    """A module's type without sentence-transformers' package prefix."""
    return str(module.get("type", "")).removeprefix(ST_PREFIX)


def read_chain_specs(
    model_dir: str | Path,
    modules: Sequence[dict[str, Any]],
    input_size: int | None,
    *,
    check_weights: bool = True,
) -> tuple[ChainSpec, ...]:
    """The ``Dense`` and ``LayerNorm`` modules of ``modules`` (as :func:`read_modules`
    returns them), in order (``Dropout`` modules, the identity at inference, are left out),
    each config and weights file checked: a known activation, sizes that chain from
    ``input_size`` (the pooled vector's length, when known), a weights file with tensors of
    the configured shapes (a Dense weight ``[out_features, in_features]``, its bias
    ``[out_features]`` when the config says ``bias``; a LayerNorm weight and bias
    ``[dimension]``). ``ValueError`` naming the folder otherwise. ``check_weights=False``
    leaves the weights files to whoever loads them next (:class:`DenseChain` checks them the
    same way) rather than reading them twice."""
    specs: list[ChainSpec] = []
    expected = input_size
    for module in modules:
        kind = _kind(module)
        if kind not in ("Dense", "LayerNorm"):
            continue
        folder = Path(model_dir) / str(module.get("path", ""))
        spec = _dense_spec(folder) if kind == "Dense" else read_layer_norm_spec(folder)
        if expected is not None and spec.in_features != expected:
            size = "in_features" if kind == "Dense" else "dimension"
            previous = type(specs[-1]).__name__.removesuffix("Spec") if specs else None
            previous_size = "dimension" if previous == "LayerNorm" else "out_features"
            what = (
                f"the previous {previous}'s {previous_size}"
                if previous
                else "the pooled vector's size"
            )
            raise ValueError(
                f"{folder / 'config.json'}: {size} {spec.in_features} does not match "
                f"{what} {expected}"
            )
        if check_weights:
            _load_weights(spec)  # present and of the configured shapes
        specs.append(spec)
        expected = spec.out_features
    return tuple(specs)


def _dense_spec(folder: Path) -> DenseSpec:
    config = read_module_config(folder, "Dense")
    sizes = [config.get("in_features"), config.get("out_features")]
    if not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in sizes):
        raise ValueError(
            f"{folder / 'config.json'}: in_features and out_features must be positive "
            f"integers; got {sizes}"
        )
    activation = config.get("activation_function") or DEFAULT_ACTIVATION
    activation_function(str(activation))  # refuses an unknown one, by name
    return DenseSpec(str(folder), sizes[0], sizes[1], bool(config.get("bias", True)), activation)


def _load_weights(spec: ChainSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(spec, LayerNormSpec):
        return load_layer_norm_weights(spec)
    return load_dense_weights(spec)


def load_dense_weights(spec: DenseSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``spec``'s weight ``[out_features, in_features]`` and bias (``None`` without one) in
    float32 on the CPU, from its folder's ``model.safetensors`` or else
    ``pytorch_model.bin``. ``ValueError`` for a missing file, key or a wrong shape."""
    path, state = read_weights(Path(spec.folder), "Dense")
    key = next((k for k in _WEIGHT_KEYS if k in state), None)
    if key is None:
        raise ValueError(f"{path}: no {' or '.join(_WEIGHT_KEYS)} tensor")
    weight = state[key].float()
    want = (spec.out_features, spec.in_features)
    if tuple(weight.shape) != want:
        raise ValueError(f"{path}: {key} has shape {list(weight.shape)}, config says {list(want)}")
    bias = None
    if spec.bias:
        bias_key = key.replace("weight", "bias")
        if bias_key not in state:
            raise ValueError(f"{path}: the config says bias but there is no {bias_key} tensor")
        bias = state[bias_key].float()
        if tuple(bias.shape) != (spec.out_features,):
            raise ValueError(
                f"{path}: {bias_key} has shape {list(bias.shape)}, expected [{spec.out_features}]"
            )
    return weight, bias


class DenseChain:
    """The chain after the pooling of one engine (its ``Dense`` and ``LayerNorm`` modules),
    loaded on ``device``: float32 ``[n, in]`` -> ``[n, out]`` vectors, each module in order
    (a Dense ``activation(x @ W.T + b)``, a LayerNorm ``F.layer_norm``)."""

    def __init__(self, specs: Sequence[ChainSpec], device: torch.device) -> None:
        if not specs:
            raise ValueError("a chain after the pooling needs at least one module")
        self.in_features = specs[0].in_features
        self.out_features = specs[-1].out_features
        self._layers: list[Callable[[torch.Tensor], torch.Tensor]] = []
        for spec in specs:
            weight, bias = (t if t is None else t.to(device) for t in _load_weights(spec))
            if isinstance(spec, LayerNormSpec):
                assert bias is not None  # (a LayerNorm always has one: load checks it)
                self._layers.append(layer_norm(weight, bias))
            else:
                self._layers.append(_dense(weight, bias, activation_function(spec.activation)))

    def __call__(self, vectors: torch.Tensor) -> torch.Tensor:
        if vectors.shape[-1] != self.in_features:
            raise RuntimeError(
                f"the pooled vectors have {vectors.shape[-1]} values but the first module "
                f"after the pooling takes {self.in_features}"
            )
        for layer in self._layers:
            vectors = layer(vectors.float())
        return vectors


def _dense(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: Callable[[torch.Tensor], torch.Tensor],
) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: activation(F.linear(x, weight, bias))
