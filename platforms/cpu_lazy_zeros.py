"""Zero-filled host tensors whose pages are zeroed by the kernel when first touched.

``torch.zeros`` on the CPU allocates and then writes every byte: for the default 4 GiB KV
cache (``DEFAULT_CPU_KV_CACHE_BYTES``) that is a million page faults plus a 4 GiB memset at
engine start-up, 2-18 s on the 2-vCPU development machine depending on its load
(docs/development.md, "Engine start-up"), although a short session writes a few blocks. An
anonymous private mapping reads as zeros from the start (the kernel maps the shared zero
page) and gets a real page only where it is written, so start-up costs nothing and the
memory is committed as requests use it.
The values are the same zeros ``torch.zeros`` gives.
"""

from __future__ import annotations

import math
import mmap

import torch

__all__ = ["LAZY_MIN_BYTES", "lazy_zeros"]

#: Below this size ``torch.zeros`` is used: a mapping costs a system call and whole pages.
LAZY_MIN_BYTES = 1 << 20


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous CPU tensor of ``shape`` and ``dtype``, all zeros, backed by an anonymous
    private mapping (page-aligned) when it is at least :data:`LAZY_MIN_BYTES`.

    The tensor keeps the mapping alive; it is unmapped when the last view of it is freed.
    Falls back to ``torch.zeros`` where the platform has no anonymous mappings, or the
    kernel refuses this one (``ENOMEM`` under strict overcommit accounting or at
    ``vm.max_map_count``): its allocator then fails with the number of bytes it could not
    get, or succeeds where only the mapping was refused.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    flags = getattr(mmap, "MAP_PRIVATE", None), getattr(mmap, "MAP_ANONYMOUS", None)
    if nbytes < LAZY_MIN_BYTES or None in flags:
        return torch.zeros(shape, dtype=dtype)
    try:
        buffer = mmap.mmap(-1, nbytes, flags=flags[0] | flags[1])  # type: ignore[operator]
    except OSError:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)
