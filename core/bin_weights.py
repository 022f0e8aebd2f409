"""Reading PyTorch ``.bin`` checkpoints: which files hold the weights, and their tensors.

transformers writes a model's weights as ``pytorch_model.bin`` or, sharded,
``pytorch_model-0000i-of-0000n.bin`` files listed by ``pytorch_model.bin.index.json``
(``save_pretrained(..., safe_serialization=False)``; older hub repos ship only these). Only
these names are weights: a checkpoint folder may also hold ``training_args.bin``,
``optimizer.bin`` or an adapter's ``adapter_model.bin``, which are never read as the model.

Each file is read with ``torch.load(weights_only=True)``: tensors and plain containers only,
no pickled code runs; memory-mapped when the file is in torch's zip format (older files are
read whole). Every failure is a ``ValueError`` naming the file.

A file's tensor names are read by loading it too (the int4 scan of a packed checkpoint, a
LoRA adapter's header check), with no cache of them, on purpose: a zip-format file is
memory-mapped, so such a read unpickles its index and no tensor data (about 0.1 s for a
400 MiB file of 400 tensors, measured); the model's names are needed once per load (the
loader then reads the tensors, which needs the load anyway); a cached state dict would keep
every tensor alive that the loader frees one by one; and an adapter is read again on purpose
(it may have changed on disk since the front-end's check). Only a legacy (pre-zip) file is
read whole each time; transformers has written the zip format since torch 1.6.
"""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import torch

#: transformers' names for a ``.bin`` checkpoint: the single file and the shards' index
BIN_WEIGHTS_FILE = "pytorch_model.bin"
BIN_INDEX_FILE = "pytorch_model.bin.index.json"
#: the glob of every ``.bin`` weights file transformers writes (single or sharded); also
#: what the hub download fetches for a ``.bin`` checkpoint
BIN_WEIGHTS_GLOB = "pytorch_model*.bin"


def bin_weight_files(model_dir: Path) -> list[Path]:
    """The ``.bin`` files holding the weights of the checkpoint in ``model_dir``, sorted
    (empty when there are none): the shards ``pytorch_model.bin.index.json`` lists when it
    exists (only those: a stale shard left beside them is not read), else
    ``pytorch_model.bin``, else the ``pytorch_model*.bin`` files. ``ValueError`` when the
    index cannot be read or lists a shard that is missing."""
    model_dir = Path(model_dir)
    index = model_dir / BIN_INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{index} is not a readable shard index: {exc!r}") from None
        files = [model_dir / name for name in shards]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index} lists shards that are missing: {', '.join(missing)}")
        return files
    single = model_dir / BIN_WEIGHTS_FILE
    if single.is_file():
        return [single]
    return sorted(model_dir.glob(BIN_WEIGHTS_GLOB))


def load_bin_state_dict(file: Path) -> dict[str, torch.Tensor]:
    """The state dict in the ``.bin`` ``file`` (CPU tensors, memory-mapped where the format
    allows). ``ValueError`` naming the file when ``torch.load(weights_only=True)`` refuses
    it (it pickles more than tensors), it cannot be read, or it is not a mapping of names to
    tensors."""
    try:
        try:
            state = torch.load(str(file), map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # not torch's zip format (legacy or not a torch file): no mmap
            state = torch.load(str(file), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise ValueError(
            f"{file} is not a plain state dict of tensors: torch.load(weights_only=True) "
            f"refused it ({_refusal_reason(exc)}); it is not read, as that would run the "
            "code it pickles"
        ) from None
    except (OSError, RuntimeError, EOFError, ValueError) as exc:
        raise ValueError(f"cannot read {file}: {exc}") from None
    if not isinstance(state, dict):
        raise ValueError(
            f"{file} holds a {type(state).__name__}, not a state dict (a mapping of tensor names)"
        )
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"{file}: entry {name!r} is a {type(value).__name__}, not a tensor (a "
                "training checkpoint rather than a model's state dict?)"
            )
    return state


def _refusal_reason(exc: Exception) -> str:
    """The useful line of torch's weights-only refusal (what it would not unpickle)."""
    text = str(exc)
    found = re.search(r"WeightsUnpickler error:\s*(.+?)(?:\. |\n\n|$)", text, re.DOTALL)
    return " ".join((found.group(1) if found else text.splitlines()[0]).split())[:200]
