"""Back long-lived CPU tensors (a model's packed weights) with 2 MB pages on Linux.

A decode step streams every weight once. With 4 KB pages that is a TLB miss every 4 KB
(~66,000 per step for SmolLM2-135M's 270 MB of bf16 weights), and the hardware prefetchers
stop at every 4 KB boundary. Collapsing the packed weights into transparent huge pages
(``madvise(MADV_HUGEPAGE)`` + ``MADV_COLLAPSE``, Linux 6.1+) measured, on the 2-vCPU
development machine, for SmolLM2's 121 linear layers at 1 row 9.6-10.2 -> 8.1 ms and at 8 rows
10.1 -> 8.5-8.9 ms (three alternating runs; docs/performance.md); collapsing 270 MB took
0.07-0.7 s. Larger batches are compute-bound and gain nothing.

Where the kernel or libc refuse, pages stay 4 KB and nothing else changes. Transparent huge
pages set to ``never`` by the administrator, or ``CHASSIS_CPU_HUGE_PAGES=0``, turn it off.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections.abc import Iterable

import torch

__all__ = ["HUGE_PAGE_BYTES", "collapse_into_huge_pages", "enabled", "huge_page_spans"]

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
_SMALL_PAGE_BYTES = 4096
_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"
#: linux/mman.h
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25
ENV_SWITCH = "CHASSIS_CPU_HUGE_PAGES"


def enabled() -> bool:
    """Whether huge pages are wanted: on Linux, unless ``CHASSIS_CPU_HUGE_PAGES=0`` or the
    administrator set transparent huge pages to ``never`` (``MADV_COLLAPSE`` would ignore
    that setting, so it is read here)."""
    off = os.environ.get(ENV_SWITCH, "1").strip().lower() in {"0", "false", "no", "off"}
    if off or not sys.platform.startswith("linux"):
        return False
    try:
        with open(_THP_SETTING) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def huge_page_spans(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The whole 2 MB pages inside the given ``[start, end)`` address ranges.

    Ranges less than a 4 KB page apart are merged first: tensors allocated one after another
    on the heap are separated by a few bytes of allocator bookkeeping, and a gap that short
    lies in pages its neighbours occupy, so it is mapped (a wider gap might not be, and
    ``madvise`` refuses a span with unmapped holes). Returns ``[start, end)`` spans aligned to
    :data:`HUGE_PAGE_BYTES`, without the partial pages at the ends of each merged range.
    """
    merged: list[list[int]] = []
    for start, end in sorted(r for r in ranges if r[1] > r[0]):
        if merged and start - merged[-1][1] < _SMALL_PAGE_BYTES:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    spans = []
    for start, end in merged:
        first = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
        last = end // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
        if last > first:
            spans.append((first, last))
    return spans


def collapse_into_huge_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Back the memory of ``tensors`` (kept alive by the caller) with huge pages now.

    Advises the whole 2 MB pages of their storage (see :func:`huge_page_spans`) as huge pages
    and collapses them synchronously; values are unchanged. Tensors that are not strided CPU
    tensors (e.g. oneDNN's opaque packed weights, whose memory Python cannot see) are
    skipped. Returns how many bytes were collapsed: 0 when disabled (see :func:`enabled`),
    or refused (pages then stay 4 KB).
    """
    if not enabled():
        return 0
    ranges = []
    for t in tensors:
        if t.device.type == "cpu" and t.layout == torch.strided and not t.is_mkldnn and t.numel():
            storage = t.untyped_storage()
            ranges.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    collapsed = 0
    for start, end in huge_page_spans(ranges):
        if madvise(start, end - start, _MADV_HUGEPAGE) != 0:
            logger.debug("MADV_HUGEPAGE refused (errno %d)", ctypes.get_errno())
            continue
        if madvise(start, end - start, _MADV_COLLAPSE) != 0:
            # EINVAL: kernel before 6.1; EAGAIN/ENOMEM: no huge page free now
            logger.debug("MADV_COLLAPSE refused (errno %d)", ctypes.get_errno())
            continue
        collapsed += end - start
    return collapsed
