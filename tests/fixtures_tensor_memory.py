"""The peak of tensor memory a piece of code holds at once, measured on any device (the
CPU has no allocator statistics): :class:`PeakTensorBytes`."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class PeakTensorBytes(TorchDispatchMode):
    """Inside ``with PeakTensorBytes() as m:``, counts the bytes of every storage an op
    creates until the last tensor on it dies; ``m.peak`` is the most held at once.

    Storages that existed before (an op's inputs, views and in-place results on them) are
    not counted: the figure is what the block allocates on top of what was there.
    """

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._refs: dict[int, int] = {}  # storage address -> live tensors on it
        self._sizes: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in self._refs:
                self._refs[key] += 1  # another tensor on a storage made in the block
            elif key in inputs or storage.nbytes() == 0:
                continue  # a view or in-place result of something older
            else:
                self._refs[key] = 1
                self._sizes[key] = storage.nbytes()
                self.current += storage.nbytes()
                self.peak = max(self.peak, self.current)
            weakref.finalize(t, self._release, key)
        return out

    def _release(self, key: int) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            self.current -= self._sizes.pop(key)
