"""Pausing generation (vLLM's ``pause_generation`` / ``resume_generation``): the engine core
stops starting requests, for instance while a trainer updates the weights.

``pause(mode)`` says what happens to the requests the scheduler holds (:data:`PAUSE_MODES`):

- ``"abort"`` (the default, as vLLM's): they finish now with reason ``abort``;
- ``"wait"``: they run to their end; the pause is *drained* once none is left;
- ``"keep"``: they are frozen where they are (their KV blocks kept) and go on after
  ``resume()``.

Requests that arrive while the engine is paused are *held*: they reach the scheduler, in
their order, when the pause is lifted (``resume()``), and a client aborting one meanwhile
drops it. A ``sleep`` with ``mode="wait"`` pauses the engine too, until its requests have
drained and the sleep has run (:attr:`PauseState.sleep_after_drain`).

This module keeps the engine core's bookkeeping; the core applies it
(:mod:`chassis.core.engine_core`). docs/serving.md, "Pausing generation", is the user's
account.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from chassis.core.request import EngineCoreRequest

#: what a pause does to the requests the scheduler holds (vLLM's ``PauseMode``)
PauseMode = Literal["abort", "wait", "keep"]
PAUSE_MODES: tuple[PauseMode, ...] = ("abort", "wait", "keep")


def check_pause_mode(mode: object) -> PauseMode:
    """``mode`` if it is one of :data:`PAUSE_MODES`, else a ``ValueError`` naming them."""
    for known in PAUSE_MODES:
        if mode == known and isinstance(mode, str):
            return known
    raise ValueError(
        f"mode must be 'abort' (finish the unfinished requests now), 'wait' (let them "
        f"finish) or 'keep' (freeze them until resume); got {mode!r}"
    )


class PauseState:
    """Whether the engine core is paused, why, and the requests it holds meanwhile."""

    def __init__(self) -> None:
        #: paused by ``pause()`` (lifted by ``resume()`` only)
        self.explicit = False
        #: the mode of the last ``pause()`` (``None`` while not explicitly paused)
        self.mode: PauseMode | None = None
        #: a ``pause(mode="wait")`` whose requests have not all finished yet
        self.draining = False
        #: with :attr:`draining`: forget the prefix cache once drained (``clear_cache``)
        self.clear_cache_on_drain = False
        #: a ``sleep(level, mode="wait")`` waiting for the requests to finish: its level
        self.sleep_after_drain: int | None = None
        #: requests that arrived while paused, in arrival order
        self.held: list[EngineCoreRequest] = []

    @property
    def paused(self) -> bool:
        """Whether arriving requests are held (an explicit pause, or a sleep waiting)."""
        return self.explicit or self.sleep_after_drain is not None

    @property
    def frozen(self) -> bool:
        """Whether the scheduler's requests are frozen (``pause(mode="keep")``): no step
        runs them until ``resume()``."""
        return self.explicit and self.mode == "keep"

    @property
    def waiting_for_drain(self) -> bool:
        """Whether something waits for the scheduler's requests to finish."""
        return self.draining or self.sleep_after_drain is not None

    def hold(self, request: EngineCoreRequest) -> None:
        """Keep ``request`` until the pause is lifted."""
        self.held.append(request)

    def drop_held(self, request_ids: set[str]) -> None:
        """Forget held requests a client aborted."""
        self.held = [r for r in self.held if r.request_id not in request_ids]

    def take_held(self) -> list[EngineCoreRequest]:
        """The held requests, in arrival order, once the engine is no longer paused (none
        while it still is)."""
        if self.paused:
            return []
        held, self.held = self.held, []
        return held
