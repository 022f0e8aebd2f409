"""core/heap.py: the start-up heap is frozen for a timed block and released after it."""

from __future__ import annotations

import gc
import weakref

from chassis.core.heap import frozen_heap


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_frozen_heap_hides_the_heap_then_gives_it_back() -> None:
    before = gc.get_freeze_count()
    kept = _Cycle()
    alive = weakref.ref(kept)
    with frozen_heap():
        assert gc.get_freeze_count() > before  # `kept` and the rest of the heap
        del kept  # cyclic garbage now, but frozen: no collection frees it
        gc.collect()
        assert alive() is not None
    assert gc.get_freeze_count() == 0
    gc.collect()  # after the block the cycle is collectable again
    assert alive() is None
