"""Reading a sentence-transformers module's files: its ``config.json`` and its weights.

Each module of a sentence-transformers checkpoint lives in the folder ``modules.json`` names
for it; a module with weights saves them as ``model.safetensors`` (newer versions) or
``pytorch_model.bin`` (older ones). Every failure is a ``ValueError`` naming the file, so
the engine refuses the checkpoint at start with a message a user can act on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

#: the weights files read, in this order
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def read_json(path: Path) -> Any:
    """``path``'s JSON; ``ValueError`` naming the file when it cannot be read or parsed."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None


def read_module_config(folder: Path, module: str) -> dict[str, Any]:
    """``folder/config.json`` as a dict; ``ValueError`` naming the ``module`` type and the
    folder when it is missing, and the file when it is not a JSON object."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{module} module {folder}: no config.json")
    config = read_json(config_file)
    if not isinstance(config, dict):
        raise ValueError(f"{config_file}: expected a JSON object")
    return config


def read_weights(folder: Path, module: str) -> tuple[Path, dict[str, torch.Tensor]]:
    """The weights file of the ``module`` in ``folder`` (``model.safetensors``, else
    ``pytorch_model.bin``, read on the CPU without unpickling code:
    :func:`~chassis.core.bin_weights.load_bin_state_dict`) and its tensors. ``ValueError``
    when there is none or it cannot be read."""
    from chassis.core.bin_weights import load_bin_state_dict

    path = next((folder / f for f in WEIGHT_FILES if (folder / f).is_file()), None)
    if path is None:
        raise ValueError(f"{module} module {folder}: no weights file ({' or '.join(WEIGHT_FILES)})")
    if path.suffix == ".bin":
        return path, load_bin_state_dict(path)
    try:
        from safetensors.torch import load_file

        return path, load_file(str(path))
    except Exception as exc:  # a corrupt or foreign file: say which
        raise ValueError(f"cannot read {path}: {exc}") from None
