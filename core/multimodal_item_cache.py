"""The front-end's cache of processed multimodal items (vLLM's ``--mm-processor-cache-gb``).

A model's processor (:meth:`~chassis.core.multimodal_processing.MultiModalProcessor.
process_item`) turns one raw item (an image, a video's frames, an audio clip) into its
placeholder count and tensors; for a large image that is most of a request's front-end time.
:class:`ProcessedItemCache` keeps those results, least recently used first out, so a request
that sends an item again (the same image in every turn of a conversation, a system image in
every request) skips the processor.

The key is a sha256 of the modality, the item's content and the processor kwargs the item is
processed with (after the server's ``--mm-processor-kwargs`` defaults are merged): for a PIL
image its mode, size, pixels, palette and transparency; for arrays and tensors their dtype,
shape and bytes; lists, tuples and dicts (a video's ``(frames, metadata)``, an audio's
``(waveform, rate)``) element by element. An item of any other type is not cached (processed
every time). The size counted is the bytes of the result's tensors; an item larger than the
whole cache is not kept. Thread-safe: the front-end processes requests from several threads;
two threads missing the same item at once both process it (the results are equal).
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

#: what a processor returns for one item: its placeholder count and tensors
ProcessedItem = tuple[int, dict[str, torch.Tensor]]

#: vLLM's default ``--mm-processor-cache-gb``
DEFAULT_CACHE_GB = 4.0


class _Unhashable(Exception):
    """An item part of a type the key does not cover."""


def item_key(modality: str, item: Any, kwargs: Mapping[str, Any]) -> str | None:
    """The cache key of ``item`` processed with ``kwargs`` (module docstring), or ``None``
    when the item holds a part of a type the key does not cover (not cached)."""
    digest = hashlib.sha256(modality.encode())
    try:
        _update(digest, item)
        text = json.dumps(dict(kwargs), sort_keys=True, default=repr)
    except _Unhashable:
        return None
    digest.update(b"|kwargs|" + text.encode())
    return digest.hexdigest()


def _update(digest: Any, value: Any) -> None:
    """Feed ``value``'s type and content into ``digest``; ``_Unhashable`` for other types."""
    from PIL import Image

    if isinstance(value, Image.Image):
        digest.update(f"|image|{value.mode}|{value.size}|".encode())
        digest.update(value.tobytes())
        palette = value.getpalette() if value.mode in ("P", "PA") else None
        # (the pixels of a palette image are indices; its transparency changes the RGB)
        digest.update(f"|{palette}|{value.info.get('transparency')!r}|".encode())
    elif isinstance(value, np.ndarray):
        array = np.ascontiguousarray(value)
        digest.update(f"|array|{array.dtype.str}|{array.shape}|".encode())
        digest.update(array.tobytes() if array.dtype != object else _refuse(value))
    elif isinstance(value, torch.Tensor):
        t = value.detach().to("cpu").contiguous()
        digest.update(f"|tensor|{t.dtype}|{tuple(t.shape)}|".encode())
        # the raw bytes, as uint8: numpy has no bfloat16, float8 or complex32 to convert to
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, list | tuple | range):
        digest.update(f"|{type(value).__name__}|{len(value)}|".encode())
        for element in value:
            _update(digest, element)
    elif isinstance(value, Mapping):
        digest.update(f"|dict|{len(value)}|".encode())
        for name in sorted(value, key=str):
            digest.update(f"|{name!s}|".encode())
            _update(digest, value[name])
    elif value is None or isinstance(value, bool | int | float | str | np.generic):
        digest.update(f"|{type(value).__name__}|{value!r}|".encode())
    else:
        _refuse(value)


def _refuse(value: Any) -> bytes:
    raise _Unhashable(type(value).__name__)


def result_bytes(result: ProcessedItem) -> int:
    """The bytes of a processed item's tensors (what the cache's size counts)."""
    return sum(t.numel() * t.element_size() for t in result[1].values())


@dataclass
class CacheStats:
    """A cache's cumulative counts (vLLM's ``mm_cache_queries`` / ``mm_cache_hits``)."""

    #: items looked up (each item that could be keyed)
    queries: int = 0
    #: items found
    hits: int = 0


class ProcessedItemCache:
    """An LRU cache of processed items holding at most ``capacity_bytes`` of tensors
    (module docstring). ``capacity_bytes`` must be > 0 (a disabled cache is no cache)."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"a processed-item cache needs capacity > 0; got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[str, tuple[ProcessedItem, int]] = OrderedDict()
        self._size = 0
        self._stats = CacheStats()
        self._lock = threading.Lock()

    @classmethod
    def from_gb(cls, gb: float) -> ProcessedItemCache | None:
        """The cache of ``--mm-processor-cache-gb`` (GiB, as vLLM counts them; at least one
        byte); ``None`` for 0 (disabled)."""
        return cls(max(1, int(gb * 2**30))) if gb > 0 else None

    def get_or_process(
        self,
        modality: str,
        item: Any,
        kwargs: Mapping[str, Any],
        process: Callable[[str, Any, Mapping[str, Any]], ProcessedItem],
    ) -> ProcessedItem:
        """The cached result of ``item`` with ``kwargs``, else ``process(modality, item,
        kwargs)``, kept (an error it raises is not). The result's tensors are shared by every
        hit: callers must not modify them (features copy them: ``MultiModalTensor``)."""
        key = item_key(modality, item, kwargs)
        if key is None:
            return process(modality, item, kwargs)
        with self._lock:
            self._stats.queries += 1
            entry = self._entries.get(key)
            if entry is not None:
                self._stats.hits += 1
                self._entries.move_to_end(key)
                return entry[0]
        result = process(modality, item, kwargs)
        self._put(key, result)
        return result

    def _put(self, key: str, result: ProcessedItem) -> None:
        size = result_bytes(result)
        if size > self.capacity_bytes:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._size -= old[1]
            self._entries[key] = (result, size)
            self._size += size
            while self._size > self.capacity_bytes:
                _, (_, evicted) = self._entries.popitem(last=False)
                self._size -= evicted

    def stats(self) -> CacheStats:
        """A copy of the cumulative counts."""
        with self._lock:
            return CacheStats(self._stats.queries, self._stats.hits)

    @property
    def size_bytes(self) -> int:
        """The bytes of tensors held now."""
        return self._size

    def __len__(self) -> int:
        return len(self._entries)
