"""Freeing a model's tensors in place and bringing them back (sleep mode's weights).

A module's parameters and buffers are views of *storages*. :class:`StorageStash` frees a
set of storages by resizing them to 0 bytes (``UntypedStorage.resize_``), which keeps every
tensor object, view and name as it is (the model, a ``torch.compile``'d forward, weights
tied between modules, the platform's kernels holding the same parameters), and resizes them
back later: with their bytes copied back from host memory (:meth:`StorageStash.offload`,
level 1) or as uninitialized memory to be filled again (:meth:`StorageStash.discard`,
level 2; :func:`copy_weights_into` fills them from a freshly loaded model). A storage comes
back at a new address, which is why captured device graphs are captured again.

A storage that cannot be resized (memory mapped from a file, or from a ``frombuffer``) is
left as it is: it stays readable and is not freed (counted in ``kept_bytes``).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

logger = logging.getLogger(__name__)


def storage_key(tensor: torch.Tensor) -> int:
    """What identifies ``tensor``'s storage, stable across resizes (its ``StorageImpl``)."""
    return int(tensor.untyped_storage()._cdata)


def module_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer of ``module`` (each once)."""
    return [*module.parameters(), *module.buffers()]


def checkpoint_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s parameters and persistent buffers by name, each once (a tied weight under
    its first name): what loading a checkpoint fills. Non-persistent buffers (rotary
    tables, ...) are computed when the model is built and are not among them."""
    tensors: dict[str, torch.Tensor] = dict(model.named_parameters())
    seen = {id(t) for t in tensors.values()}
    for module_name, module in model.named_modules():
        for name, buffer in module._buffers.items():
            if buffer is None or name in module._non_persistent_buffers_set:
                continue
            if id(buffer) not in seen:
                seen.add(id(buffer))
                tensors[f"{module_name}.{name}" if module_name else name] = buffer
    return tensors


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """``storage`` as a 1-D uint8 tensor (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


@dataclass
class _Stored:
    storage: torch.UntypedStorage
    nbytes: int
    #: the bytes in host memory while offloaded (level 1)
    host: torch.Tensor | None = None
    released: bool = False


class StorageStash:
    """The distinct storages of ``tensors`` (those in ``skip``, by :func:`storage_key`, left
    out), to release and bring back in place."""

    def __init__(self, tensors: Iterable[torch.Tensor], skip: Iterable[int] = ()) -> None:
        self._items: dict[int, _Stored] = {}
        #: bytes of storages that cannot be resized: never released
        self.kept_bytes = 0
        seen = set(skip)
        for tensor in tensors:
            if tensor.device.type == "meta" or tensor.layout != torch.strided:
                continue
            storage = tensor.untyped_storage()
            key = int(storage._cdata)
            if key in seen or storage.nbytes() == 0:
                continue
            seen.add(key)
            if not storage.resizable():
                self.kept_bytes += storage.nbytes()
                continue
            self._items[key] = _Stored(storage, storage.nbytes())

    @property
    def keys(self) -> set[int]:
        """The storages held (:func:`storage_key`)."""
        return set(self._items)

    @property
    def nbytes(self) -> int:
        """Bytes of the storages held."""
        return sum(item.nbytes for item in self._items.values())

    @torch.no_grad()
    def offload(self, pin_memory: bool = False) -> None:
        """Copy every storage to host memory (pinned with ``pin_memory``), then free it."""
        for item in self._items.values():
            if item.released:
                continue
            host = torch.empty(item.nbytes, dtype=torch.uint8, pin_memory=pin_memory)
            host.copy_(_bytes_view(item.storage))
            item.host = host
            item.storage.resize_(0)
            item.released = True

    def discard(self) -> None:
        """Free every storage; its contents are lost (:meth:`restore` gives it back with
        undefined contents, to be filled again)."""
        for item in self._items.values():
            item.storage.resize_(0)
            item.host = None
            item.released = True

    def restore_storage_of(self, tensor: torch.Tensor) -> None:
        """Bring back the storage of ``tensor`` if it is held and released."""
        item = self._items.get(storage_key(tensor))
        if item is not None:
            self._restore(item)

    def restore(self) -> None:
        """Bring back every released storage: its bytes from host memory when offloaded,
        else undefined."""
        for item in self._items.values():
            self._restore(item)

    @torch.no_grad()
    def _restore(self, item: _Stored) -> None:
        if not item.released:
            return
        item.storage.resize_(item.nbytes)
        if item.host is not None:
            _bytes_view(item.storage).copy_(item.host, non_blocking=False)
            item.host = None
        item.released = False


@torch.no_grad()
def copy_weights_into(
    targets: Mapping[str, torch.Tensor], fresh: Mapping[str, torch.Tensor], stash: StorageStash
) -> None:
    """Fill ``targets`` (the running model's :func:`checkpoint_tensors`, their storages held
    and discarded by ``stash``) from ``fresh`` (the same of a model just built and loaded
    the same way), bringing each target's storage back as it is filled and freeing each
    fresh storage once all its tensors are copied, so that at most about one model's
    weights plus one storage are in memory at a time. ``RuntimeError`` if the two models'
    tensors differ in names, shapes or dtypes (the running model then stays discarded)."""
    if targets.keys() != fresh.keys():
        missing = sorted(targets.keys() - fresh.keys())[:5]
        extra = sorted(fresh.keys() - targets.keys())[:5]
        raise RuntimeError(
            f"the reloaded model's tensors differ from the running one's (missing {missing}, "
            f"new {extra})"
        )
    for name, source in fresh.items():
        target = targets[name]
        if target.shape != source.shape or target.dtype != source.dtype:
            raise RuntimeError(
                f"reloaded {name} is {tuple(source.shape)} {source.dtype}, the running "
                f"model's {tuple(target.shape)} {target.dtype}"
            )
    uses = Counter(storage_key(t) for t in fresh.values())
    for name, source in fresh.items():
        target = targets[name]
        stash.restore_storage_of(target)
        target.copy_(source)
        key = storage_key(source)
        uses[key] -= 1
        storage = source.untyped_storage()
        if uses[key] == 0 and storage.resizable():
            storage.resize_(0)  # the fresh copy is no longer needed
    stash.restore()  # (nothing left, unless a target storage held no checkpoint tensor)
