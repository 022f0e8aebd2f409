"""Keeping the garbage collector's full collections out of the serving loop.

A process that has loaded torch, transformers and a model tracks a few hundred thousand
objects. Every so often CPython's cyclic collector walks all of them (a generation-2
collection): about 100 ms on the development VM, which lands inside one engine step or one
streamed chunk as a latency spike, once per ~1,500 decode steps at 256 requests
(docs/performance.md). Objects created during start-up live as long as the process, so
they are moved out of the collector's sight once start-up is over, as vLLM does.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


def freeze_startup_heap() -> None:
    """Collect garbage, then move every object alive now into the permanent generation.

    Only for a process dedicated to one engine or one server (the engine-core process, the
    API server, a benchmark), called once start-up is done: frozen objects that become
    cyclic garbage later are never collected, so a process that builds and drops engines
    repeatedly (tests, notebooks) must not call it. Reference counting still frees frozen
    objects that are not in cycles.
    """
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """:func:`freeze_startup_heap` for the ``with`` block only (a timed benchmark run that
    may share its process with other work): on exit the frozen objects return to the
    collector's oldest generation, so whatever became garbage meanwhile is collected as
    usual."""
    freeze_startup_heap()
    try:
        yield
    finally:
        gc.unfreeze()
