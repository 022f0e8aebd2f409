"""Reading checkpoint tensors: ``*.safetensors`` files, or PyTorch ``.bin`` files.

The files read follow ``--load-format`` (vLLM's rule): ``safetensors`` reads the
``*.safetensors`` files, ``pt`` the ``.bin`` ones (:mod:`chassis.core.bin_weights`), and
``auto`` the safetensors files when the checkpoint has any, else the ``.bin`` ones. Every
reader of a model's weights goes through here.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from chassis.core.bin_weights import BIN_WEIGHTS_GLOB, bin_weight_files, load_bin_state_dict

#: what each load format reads, for the error messages
_LOOKED_FOR = {
    "safetensors": "*.safetensors",
    "pt": f"{BIN_WEIGHTS_GLOB} (or the shards pytorch_model.bin.index.json lists)",
}


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's ``*.safetensors`` files, sorted; ``ValueError`` when there are none."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"{model_dir} holds no *.safetensors files (--load-format safetensors reads only "
            "those; --load-format auto or pt read a pytorch_model*.bin checkpoint)"
        )
    return files


def weight_format(model_dir: Path, load_format: str = "auto") -> str:
    """``"safetensors"`` or ``"pt"``: the kind of file the weights of the checkpoint in
    ``model_dir`` are read from under ``load_format`` (``auto``: safetensors when there are
    any such files, else ``.bin``). ``ValueError`` saying what was looked for when the
    folder has no file of that kind."""
    model_dir = Path(model_dir)
    if load_format not in ("auto", "safetensors", "pt"):
        raise ValueError(f"load format {load_format!r} reads no checkpoint files")
    has_safetensors = any(model_dir.glob("*.safetensors"))
    if load_format == "safetensors" or (load_format == "auto" and has_safetensors):
        if not has_safetensors:
            safetensors_files(model_dir)  # raises, saying what to do
        return "safetensors"
    if bin_weight_files(model_dir):
        return "pt"
    if load_format == "pt":
        other = " (it has *.safetensors files: use --load-format auto)" if has_safetensors else ""
        raise ValueError(
            f"{model_dir} holds no PyTorch .bin weights: --load-format pt reads "
            f"{_LOOKED_FOR['pt']}{other}"
        )
    raise ValueError(
        f"{model_dir} holds no model weights: looked for {_LOOKED_FOR['safetensors']} and "
        f"{_LOOKED_FOR['pt']}"
    )


def has_weight_files(model_dir: Path) -> bool:
    """Whether ``model_dir`` holds weights ``--load-format auto`` would read."""
    try:
        weight_format(model_dir)
    except ValueError:
        return False
    return True


def checkpoint_keys(model_dir: Path, load_format: str = "auto") -> list[str]:
    """Every tensor name of the checkpoint in ``model_dir`` as stored, file by file
    (safetensors: from the headers, no tensor read; ``.bin``: the keys of the memory-mapped
    state dicts)."""
    from safetensors import safe_open

    names: list[str] = []
    if weight_format(model_dir, load_format) == "pt":
        for file in bin_weight_files(model_dir):
            names.extend(load_bin_state_dict(file))
        return names
    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            names.extend(f.keys())  # (a safe_open handle is not iterable)
    return names


def checkpoint_tensor_names(path: Path, load_format: str = "auto") -> set[str]:
    """The tensor names of the checkpoint in ``path`` (:func:`checkpoint_keys`), without a
    ``model.`` prefix. An EAGLE-1 head has ``fc.weight``; a whole model has not."""
    return {name.removeprefix("model.") for name in checkpoint_keys(path, load_format)}


def iterate_checkpoint(
    model_dir: Path,
    load_format: str = "auto",
    progress: bool | None = None,
    wanted: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of the checkpoint in ``model_dir``, as CPU
    tensors, from the files ``load_format`` picks (:func:`weight_format`).

    :param progress: show a tqdm bar over tensors; ``None`` shows it when stderr is a tty
    :param wanted: when given, only the tensors whose name it accepts are yielded (a
        safetensors file's others are never read; a ``.bin`` file is mapped whole)
    """
    if weight_format(model_dir, load_format) == "safetensors":
        yield from iterate_safetensors(model_dir, progress, wanted)
    else:
        yield from iterate_bin(model_dir, progress, wanted)


def iterate_bin(
    model_dir: Path,
    progress: bool | None = None,
    wanted: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of the checkpoint's ``.bin`` weight files
    (:func:`~chassis.core.bin_weights.bin_weight_files`), file by file, as CPU tensors; each
    file is loaded whole (memory-mapped where its format allows), and the reader keeps no
    tensor once it is yielded. ``progress`` and ``wanted`` as for
    :func:`iterate_safetensors`. ``ValueError`` when there is no such file."""
    from tqdm.auto import tqdm

    files = bin_weight_files(model_dir)
    if not files:
        weight_format(model_dir, "pt")  # raises, saying what was looked for
    if progress is None:
        progress = sys.stderr.isatty()
    with tqdm(desc="Loading weights", unit="tensor", disable=not progress) as bar:
        for file in files:
            state = load_bin_state_dict(file)
            bar.total = (bar.total or 0) + len(state)
            bar.refresh()
            for name in list(state):  # (in the file's order)
                # popped: the state dict keeps no tensor the consumer has let go of
                tensor = state.pop(name)
                if wanted is None or wanted(name):
                    yield name, tensor
                del tensor
                bar.update(1)


def iterate_safetensors(
    model_dir: Path,
    progress: bool | None = None,
    wanted: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of every ``*.safetensors`` file, as CPU
    tensors (:func:`iterate_checkpoint` with ``load_format="safetensors"``).

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
