"""Reading checkpoint tensors from ``*.safetensors`` files."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's ``*.safetensors`` files, sorted; ``ValueError`` when there are none."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"{model_dir} holds no *.safetensors files; chassis loads safetensors checkpoints "
            "only (convert .bin weights with transformers' save_pretrained)"
        )
    return files


def checkpoint_tensor_names(path: Path) -> set[str]:
    """The tensor names of the safetensors checkpoint in ``path``, without a ``model.``
    prefix (read from the files' headers, no tensor loaded). An EAGLE-1 head has
    ``fc.weight``; a whole model has not."""
    from safetensors import safe_open

    names: set[str] = set()
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            keys = f.keys()  # (a safe_open handle is not iterable)
            names.update(name.removeprefix("model.") for name in keys)
    return names


def iterate_safetensors(
    model_dir: Path,
    progress: bool | None = None,
    wanted: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of every file, as CPU tensors.

    :param progress: show a tqdm bar over tensors; ``None`` shows it when stderr is a tty
    :param wanted: when given, only the tensors whose name it accepts are read and yielded
        (the others are never read from the file)
    """
    from safetensors import safe_open
    from tqdm.auto import tqdm

    files = safetensors_files(model_dir)
    if progress is None:
        progress = sys.stderr.isatty()
    with tqdm(desc="Loading weights", unit="tensor", disable=not progress) as bar:
        for path in files:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                names = list(f.keys())
                bar.total = (bar.total or 0) + len(names)
                bar.refresh()
                for name in names:
                    if wanted is None or wanted(name):
                        yield name, f.get_tensor(name)
                    bar.update(1)
