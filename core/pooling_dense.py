"""Sentence-transformers modules after the pooling: the ``Dense`` projection chain.

A sentence-transformers checkpoint lists its pipeline in ``modules.json``: ``Transformer``,
``Pooling``, then optionally ``Dense`` modules (a linear layer and an activation each, run
one after the other on the pooled vector) and a final ``Normalize``. As vLLM does, chassis
reads each ``Dense`` module from the folder its ``path`` names: ``config.json``
(``in_features``, ``out_features``, ``bias``, ``activation_function``) and the weights in
``model.safetensors`` or ``pytorch_model.bin`` (``linear.weight``, ``linear.bias``).

Unlike vLLM, which skips a module it cannot load and logs it, everything chassis cannot
reproduce is refused when the engine starts (``ValueError``): a module type other than these
four, modules out of this order, an unknown activation, a chain whose sizes do not meet, a
missing or mismatched weights file. The chain runs in float32 (vLLM's default head dtype),
on the float32 pooled vectors.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ST_PREFIX = "sentence_transformers.models."
#: the module types chassis runs, in the only order it runs them (Transformer first)
_ORDER = ("Transformer", "Pooling", "Dense", "Normalize")

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
_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


@dataclass(frozen=True)
class DenseSpec:
    """One ``Dense`` module: its folder, sizes, whether it has a bias, its activation (the
    name as the checkpoint writes it)."""

    folder: str
    in_features: int
    out_features: int
    bias: bool
    activation: str


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
    ``Transformer``, ``Pooling``, ``Dense`` and ``Normalize`` modules, in that order, at most
    one of each but ``Dense``, and ``Dense`` only after a ``Pooling``. ``ValueError``
    otherwise, naming the modules."""
    modules_file = Path(model_dir) / "modules.json"
    if not modules_file.is_file():
        return None
    modules = read_json(modules_file)
    if isinstance(modules, dict):  # some exports wrap the list
        modules = modules.get("modules")
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ValueError(f"{modules_file}: expected a list of modules")
    kinds = [str(m.get("type", "")).removeprefix(ST_PREFIX) for m in modules]
    others = [
        str(m.get("type", "")) for m, k in zip(modules, kinds, strict=True) if k not in _ORDER
    ]
    if others:
        raise ValueError(
            f"{modules_file} lists modules chassis cannot run: {', '.join(others)} (supported: "
            "Transformer, Pooling, Dense projections, Normalize)"
        )
    ranks = [_ORDER.index(k) for k in kinds]
    repeated = sorted({k for k in kinds if k != "Dense" and kinds.count(k) > 1})
    if ranks != sorted(ranks) or repeated or ("Dense" in kinds and "Pooling" not in kinds):
        raise ValueError(
            f"{modules_file}: modules in the order {' -> '.join(kinds)} are not supported; "
            "chassis runs Transformer -> Pooling -> Dense... -> Normalize (each but Dense "
            "at most once)"
        )
    return modules


def read_dense_specs(
    model_dir: str | Path,
    modules: Sequence[dict[str, Any]],
    input_size: int | None,
    *,
    check_weights: bool = True,
) -> tuple[DenseSpec, ...]:
    """The ``Dense`` modules of ``modules`` (as :func:`read_modules` returns them), in
    order, each config and weights file checked: a known activation, sizes that chain from
    ``input_size`` (the pooled vector's length, when known), a weights file with a weight of
    shape ``[out_features, in_features]`` (and a bias of ``[out_features]`` when the config
    says ``bias``). ``ValueError`` naming the folder otherwise. ``check_weights=False`` leaves
    the weights files to whoever loads them next (:class:`DenseChain` checks them the same
    way, with :func:`load_dense_weights`) rather than reading them twice."""
    specs: list[DenseSpec] = []
    expected = input_size
    for module in modules:
        if str(module.get("type", "")).removeprefix(ST_PREFIX) != "Dense":
            continue
        folder = Path(model_dir) / str(module.get("path", ""))
        config_file = folder / "config.json"
        if not config_file.is_file():
            raise ValueError(f"Dense module {folder}: no config.json")
        config = read_json(config_file)
        if not isinstance(config, dict):
            raise ValueError(f"{config_file}: expected a JSON object")
        sizes = [config.get("in_features"), config.get("out_features")]
        if not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in sizes):
            raise ValueError(
                f"{config_file}: in_features and out_features must be positive integers; "
                f"got {sizes}"
            )
        activation = config.get("activation_function") or DEFAULT_ACTIVATION
        activation_function(str(activation))  # refuses an unknown one, by name
        spec = DenseSpec(
            str(folder), sizes[0], sizes[1], bool(config.get("bias", True)), activation
        )
        if expected is not None and spec.in_features != expected:
            what = "the pooled vector's size" if not specs else "the previous Dense's out_features"
            raise ValueError(
                f"{config_file}: in_features {spec.in_features} does not match {what} {expected}"
            )
        if check_weights:
            load_dense_weights(spec)  # present and of the configured shapes
        specs.append(spec)
        expected = spec.out_features
    return tuple(specs)


def load_dense_weights(spec: DenseSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``spec``'s weight ``[out_features, in_features]`` and bias (``None`` without one) in
    float32 on the CPU, from its folder's ``model.safetensors`` or else
    ``pytorch_model.bin``. ``ValueError`` for a missing file, key or a wrong shape."""
    folder = Path(spec.folder)
    path = next((folder / f for f in _WEIGHT_FILES if (folder / f).is_file()), None)
    if path is None:
        raise ValueError(f"Dense module {folder}: no weights file ({' or '.join(_WEIGHT_FILES)})")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a corrupt or foreign file: say which
        raise ValueError(f"cannot read {path}: {exc}") from None
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
    """The ``Dense`` modules of one engine, loaded on ``device``: float32 ``[n, in]`` ->
    ``[n, out]`` vectors, each layer ``activation(x @ W.T + b)`` in order."""

    def __init__(self, specs: Sequence[DenseSpec], device: torch.device) -> None:
        if not specs:
            raise ValueError("a Dense chain needs at least one Dense module")
        self.in_features = specs[0].in_features
        self.out_features = specs[-1].out_features
        self._layers = []
        for spec in specs:
            weight, bias = load_dense_weights(spec)
            self._layers.append(
                (
                    weight.to(device),
                    None if bias is None else bias.to(device),
                    activation_function(spec.activation),
                )
            )

    def __call__(self, vectors: torch.Tensor) -> torch.Tensor:
        if vectors.shape[-1] != self.in_features:
            raise RuntimeError(
                f"the pooled vectors have {vectors.shape[-1]} values but the first Dense "
                f"module takes {self.in_features} (in_features)"
            )
        for weight, bias, activation in self._layers:
            vectors = activation(F.linear(vectors.float(), weight, bias))
        return vectors


def read_json(path: Path) -> Any:
    """``path``'s JSON; ``ValueError`` naming the file when it cannot be read or parsed."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
