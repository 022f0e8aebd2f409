"""Reading LoRA adapters saved by PEFT, and checking them against the served model.

A PEFT adapter folder holds ``adapter_config.json`` (``r``, ``lora_alpha``,
``use_rslora``, ...) and ``adapter_model.safetensors`` (older PEFT versions:
``adapter_model.bin``, read as tensors only, :mod:`chassis.core.bin_weights`) with, per
adapted linear layer,
``base_model.model.<module>.lora_A.weight`` (``[r, in_features]``) and
``...lora_B.weight`` (``[out_features, r]``). The layer computes
``W x + scaling * B (A x)`` with ``scaling = lora_alpha / r`` (``lora_alpha / sqrt(r)``
with rsLoRA).

The engine tells the front-end which modules it can adapt and their shapes
(:attr:`LoRAModel.target_shapes <chassis.core.lora.model.LoRAModel.target_shapes>`,
``{module: (in_features, out_features)}``); :func:`check_adapter` refuses a bad adapter
before a request reaches the engine (from the safetensors header, then the values: one
adapter's NaN or infinity would reach every token of the steps it runs in, as the slots are
computed densely), and :func:`load_adapter` reads the tensors when the engine first needs
them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from chassis.core.bin_weights import load_bin_state_dict

#: the name prefix PEFT gives every tensor of a causal LM adapter
_PEFT_PREFIX = "base_model.model."
_CONFIG_FILE = "adapter_config.json"
#: PEFT's ``LoraConfig.lora_alpha`` when ``adapter_config.json`` leaves it out
_PEFT_DEFAULT_ALPHA = 8
_WEIGHTS_FILE = "adapter_model.safetensors"
#: what older PEFT versions save (``safe_serialization=False``); read when there is no
#: safetensors file
_BIN_WEIGHTS_FILE = "adapter_model.bin"


@dataclass(frozen=True)
class AdapterConfig:
    """The parts of ``adapter_config.json`` that decide the computation."""

    rank: int
    alpha: float
    use_rslora: bool

    def scaling(self, rank: int) -> float:
        """The factor of ``B (A x)`` for a module of ``rank`` (PEFT's rule)."""
        return self.alpha / math.sqrt(rank) if self.use_rslora else self.alpha / rank


@dataclass(frozen=True)
class AdapterWeights:
    """One adapter's tensors (float32, on the CPU), per adapted module (HF names):
    ``(A [r, in], B * scaling [out, r])``."""

    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def max_rank(self) -> int:
        return max(a.shape[0] for a, _ in self.modules.values())


def read_adapter_config(folder: str | Path) -> AdapterConfig:
    """Parse ``adapter_config.json``; a ``ValueError`` for what chassis cannot apply."""
    folder = Path(folder)
    path = folder / _CONFIG_FILE
    if not folder.is_dir():
        raise ValueError(f"LoRA adapter folder {str(folder)!r} does not exist")
    if not path.is_file():
        raise ValueError(
            f"LoRA adapter folder {str(folder)!r} has no {_CONFIG_FILE} (is it a PEFT adapter?)"
        )
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object")
    peft_type = raw.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"{path}: peft_type {peft_type!r} is not supported (only 'LORA')")
    refusals = {
        "use_dora": "DoRA adapters are not supported",
        "modules_to_save": "adapters that replace whole modules (modules_to_save: "
        f"{raw.get('modules_to_save')!r}) are not supported, such as a PEFT SEQ_CLS "
        "adapter's trained classifier head ('score'): only LoRA pairs (lora_A, lora_B) on the "
        "model's linear layers are applied, the head is always the base model's",
        "alpha_pattern": "per-module lora_alpha (alpha_pattern) is not supported",
        "fan_in_fan_out": "fan_in_fan_out adapters (GPT-2-style Conv1D layers) are not supported",
        "lora_bias": "adapters with a bias on lora_B (lora_bias) are not supported",
    }
    for key, why in refusals.items():
        if raw.get(key):
            raise ValueError(f"{path}: {why}")
    bias = raw.get("bias", "none")
    if bias != "none":
        raise ValueError(f"{path}: bias {bias!r} is not supported (only 'none')")
    rank = raw.get("r")
    alpha = raw.get("lora_alpha", _PEFT_DEFAULT_ALPHA)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{path}: 'r' must be an integer >= 1; got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise ValueError(f"{path}: 'lora_alpha' must be a number; got {alpha!r}")
    return AdapterConfig(rank=rank, alpha=float(alpha), use_rslora=bool(raw.get("use_rslora")))


def _module_of(key: str, path: Path) -> tuple[str, str]:
    """``base_model.model.<module>.lora_A[.<adapter name>].weight`` -> (module, "A" or "B")."""
    name = key.removeprefix(_PEFT_PREFIX)
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in ("lora_A", "lora_B"):
            tail = parts[i + 1 :]
            if tail and tail[-1] == "weight" and len(tail) <= 2:
                return ".".join(parts[:i]), part[-1]
        if part in ("lora_embedding_A", "lora_embedding_B"):
            raise ValueError(
                f"{path}: LoRA on embeddings ({name}) is not supported; adapt linear layers only"
            )
    raise ValueError(f"{path}: tensor {key!r} is not a LoRA A or B matrix")


def _weights_path(folder: Path) -> Path:
    """The adapter's weights file: ``adapter_model.safetensors``, else ``adapter_model.bin``."""
    for name in (_WEIGHTS_FILE, _BIN_WEIGHTS_FILE):
        if (folder / name).is_file():
            return folder / name
    raise ValueError(
        f"LoRA adapter folder {str(folder)!r} has no {_WEIGHTS_FILE} (nor {_BIN_WEIGHTS_FILE})"
    )


def _stored_shapes(path: Path) -> list[tuple[str, list[int]]]:
    """``(name, shape)`` of every tensor of the weights file ``path`` (safetensors: from the
    header, no tensor data; ``.bin``: the memory-mapped state dict)."""
    if path.suffix == ".bin":
        return [(key, list(tensor.shape)) for key, tensor in load_bin_state_dict(path).items()]
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            keys = handle.keys()  # (a safe_open handle is not a dict)
            return [(key, list(handle.get_slice(key).get_shape())) for key in keys]
    except SafetensorError as exc:
        raise ValueError(f"{path} is not a readable safetensors file: {exc}") from None


def _stored_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor of the weights file ``path``, one at a time."""
    if path.suffix == ".bin":
        yield from load_bin_state_dict(path).items()
        return
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - a safe_open handle is not a dict
                yield key, handle.get_tensor(key)
    except SafetensorError as exc:
        raise ValueError(f"{path} is not a readable safetensors file: {exc}") from None


def _tensor_shapes(folder: Path) -> dict[str, dict[str, list[int]]]:
    """``{module: {"A": shape, "B": shape}}`` from the weights file (no tensor data read
    from a safetensors file)."""
    path = _weights_path(folder)
    shapes: dict[str, dict[str, list[int]]] = {}
    for key, shape in _stored_shapes(path):
        module, which = _module_of(key, path)
        shapes.setdefault(module, {})[which] = shape
    if not shapes:
        raise ValueError(f"{path} holds no LoRA tensors")
    return shapes


def check_adapter(
    folder: str | Path, target_shapes: dict[str, tuple[int, int]], max_rank: int
) -> AdapterConfig:
    """Refuse an adapter the engine could not apply (the front-end's check).

    Every module it adapts must be one of ``target_shapes`` (the model's adaptable linear
    layers, ``{module: (in_features, out_features)}``), with ``A`` of shape ``[r, in]`` and
    ``B`` of ``[out, r]``, ``1 <= r <= max_rank`` (``--max-lora-rank``), all read from the
    headers; then every value must be finite (the tensors are read, one at a time).
    """
    folder = Path(folder)
    config = _check_headers(folder, target_shapes, max_rank)
    path = _weights_path(folder)
    for key, tensor in _stored_tensors(path):
        _check_finite(path, key, tensor)
    return config


def _check_headers(
    folder: Path, target_shapes: dict[str, tuple[int, int]], max_rank: int
) -> AdapterConfig:
    """:func:`check_adapter` up to the values: the config and the tensors' names and shapes."""
    config = read_adapter_config(folder)
    for module, pair in sorted(_tensor_shapes(folder).items()):
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{folder}: module {module!r} has lora_{''.join(pair)} only")
        expected = target_shapes.get(module)
        if expected is None:
            raise ValueError(
                f"{folder}: the adapter changes {module!r}, which this model cannot apply LoRA "
                f"to (adaptable here: {_adaptable_kinds(target_shapes)})"
            )
        in_features, out_features = expected
        a_shape, b_shape = pair["A"], pair["B"]
        rank = a_shape[0] if len(a_shape) == 2 else -1
        if a_shape != [rank, in_features] or b_shape != [out_features, rank]:
            raise ValueError(
                f"{folder}: {module!r} has lora_A {a_shape} and lora_B {b_shape}; this model "
                f"needs [r, {in_features}] and [{out_features}, r] (an adapter for another "
                f"base model?)"
            )
        if rank < 1:
            raise ValueError(f"{folder}: {module!r} has rank 0 (empty lora_A and lora_B)")
        if rank > max_rank:
            raise ValueError(
                f"{folder}: {module!r} has rank {rank}, above --max-lora-rank {max_rank}; "
                f"restart with --max-lora-rank {rank} or more"
            )
    return config


def _adaptable_kinds(target_shapes: dict[str, tuple[int, int]]) -> str:
    """The last name parts of the adaptable modules (``q_proj, k_proj, ...``), each once."""
    kinds = dict.fromkeys(name.rpartition(".")[2] for name in target_shapes)
    return ", ".join(kinds) or "nothing"


def _check_finite(path: Path, key: str, tensor: torch.Tensor) -> None:
    """Refuse NaN and infinity: the layer computes every slot for every token and masks
    afterwards, and ``0 * NaN`` is NaN, so they would reach the other requests of a step."""
    if not bool(torch.isfinite(tensor.float()).all()):  # float(): no isfinite for float8
        raise ValueError(
            f"{path}: tensor {key!r} holds NaN or infinite values (a diverged training run?)"
        )


def load_adapter(
    folder: str | Path, target_shapes: dict[str, tuple[int, int]], max_rank: int
) -> AdapterWeights:
    """Read the adapter's tensors, ``B`` pre-scaled, checked as :func:`check_adapter` does
    (again: the folder may have changed since the front-end's check). Every failure to read
    it (a folder deleted, made unreadable or truncated since) is a ``ValueError``."""
    folder = Path(folder)
    try:
        config = _check_headers(folder, target_shapes, max_rank)
        path = _weights_path(folder)
        tensors = list(_stored_tensors(path))
    except OSError as exc:
        raise ValueError(f"LoRA adapter {str(folder)!r} cannot be read: {exc}") from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors:
        module, which = _module_of(key, folder)
        tensor = tensor.float()
        _check_finite(path, key, tensor)
        pairs.setdefault(module, {})[which] = tensor
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, pair in pairs.items():
        a, b = pair["A"], pair["B"]
        modules[module] = (a, b * config.scaling(a.shape[0]))
    return AdapterWeights(modules)
