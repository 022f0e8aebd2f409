"""Running the selected stat loggers: resolve names, call them, keep a failing one out.

The front-end (``AsyncLLM``, or the offline ``LLM``) resolves the names before it starts the
engine (an unknown name fails fast), builds the loggers once the engine is ready, then
calls :meth:`StatLoggerManager.record` per step and :meth:`StatLoggerManager.shutdown` at the
end; a daemon timer thread calls :meth:`StatLoggerManager.log` every interval. A logger
never sees two calls at once (one lock per logger serialises them), and ``record`` on the
output path never waits for a logger's ``log``: a step's stats are queued per logger, and
whichever thread holds that logger's lock delivers the queue, in step order. So a slow
``log`` (a vendor's exporter on the network) delays only that logger's view of later steps,
never the outputs. A logger's queue holds at most :data:`MAX_PENDING_STEPS` steps: a ``log``
that stays busy longer makes that logger miss the oldest ones (a warning says how many), so
a hung exporter cannot grow the queue without bound.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from chassis.core.stat_logger import (
    IterationStats,
    SchedulerStats,
    StatLoggerBase,
    StatLoggerInfo,
)

logger = logging.getLogger(__name__)

#: what a front-end logs with when ``stat_loggers`` is left unset and it logs by default
DEFAULT_STAT_LOGGERS = ("logging",)

StatLoggerFactory = Callable[[StatLoggerInfo], StatLoggerBase]

#: steps queued at most for one logger while it is busy in ``log``; past it the oldest are
#: dropped (that logger misses them), so a ``log`` that hangs cannot exhaust memory
MAX_PENDING_STEPS = 10_000


@dataclass
class _Entry:
    name: str
    logger: StatLoggerBase
    disabled: bool = False
    #: held while one of the logger's methods runs
    calls: threading.Lock = field(default_factory=threading.Lock)
    #: steps not yet passed to ``record`` (deque: append and popleft are thread-safe)
    pending: deque[tuple[SchedulerStats, IterationStats]] = field(default_factory=deque)
    #: steps dropped from a full ``pending`` (by the recording thread), and how many of
    #: them a warning has reported (by the thread holding ``calls``)
    dropped: int = 0
    reported: int = 0


def default_stat_loggers() -> list[str]:
    """The names a front-end that logs by default runs when ``stat_loggers`` is unset:
    :data:`DEFAULT_STAT_LOGGERS` that are registered (``CHASSIS_PLUGINS`` may leave out the
    built-in ones; then there is nothing to log with, which is not an error)."""
    from chassis.plugins import get_registries

    registry = get_registries().stat_loggers
    return [name for name in DEFAULT_STAT_LOGGERS if name in registry]


def resolve_stat_loggers(names: Sequence[str]) -> list[tuple[str, StatLoggerFactory]]:
    """``(name, class)`` for each of ``names``: a name registered through
    ``chassis_register_stat_loggers``, or ``"package.module:Class"``.

    :raises ValueError: an unknown name (the message lists the registered ones), a
        ``"module:Class"`` that does not import, or a class that is not a
        :class:`~chassis.core.stat_logger.StatLoggerBase`; a name given twice.
    """
    from chassis.plugins import get_registries
    from chassis.plugins.registry import import_subclass

    resolved: list[tuple[str, StatLoggerFactory]] = []
    for name in names:
        if any(name == seen for seen, _ in resolved):
            raise ValueError(f"--stat-loggers names {name!r} twice")
        if ":" in name:
            cls = import_subclass(name, StatLoggerBase, "stat logger")
        else:
            cls = get_registries().stat_loggers.get(name)  # UnknownNameError lists the known
        resolved.append((name, cls))
    return resolved


class StatLoggerManager:
    """The running stat loggers of one front-end (possibly none)."""

    def __init__(
        self,
        factories: Sequence[tuple[str, StatLoggerFactory]],
        info: StatLoggerInfo,
        interval_s: float,
    ) -> None:
        """Build every logger and call its ``log_engine_initialized``, then start the timer
        (only when there is a logger).

        :raises ValueError: a logger's constructor raised (named in the message): a logger
            that cannot start is a start-up error, like a plugin that does not load.
        """
        self.interval_s = interval_s
        self._entries: list[_Entry] = []
        for name, factory in factories:
            try:
                built = factory(info)
            except Exception as exc:
                self._shutdown_entries()
                raise ValueError(
                    f"stat logger {name!r} failed to start: {type(exc).__name__}: {exc}"
                ) from exc
            self._entries.append(_Entry(name, built))
        for entry in self._entries:
            with entry.calls:
                self._call(entry, "log_engine_initialized")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self._entries:
            self._thread = threading.Thread(
                target=self._run_timer, daemon=True, name="chassis-stat-log"
            )
            self._thread.start()

    @property
    def loggers(self) -> list[StatLoggerBase]:
        """The loggers still enabled, in the order they were named."""
        return [e.logger for e in self._entries if not e.disabled]

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        """Pass one step's stats to every enabled logger, without waiting for one that is
        busy in another call (its ``log``): that logger gets them, in order, as soon as the
        call returns (all but the oldest if more than :data:`MAX_PENDING_STEPS` queued up)."""
        for entry in self._entries:
            if not entry.disabled:
                if len(entry.pending) >= MAX_PENDING_STEPS:
                    self._drop_oldest(entry)
                entry.pending.append((scheduler_stats, iteration_stats))
                self._deliver(entry, wait=False)

    def log(self) -> None:
        """Call every enabled logger's ``log`` (the timer does this every interval), after
        its ``record`` of every step recorded so far."""
        for entry in self._entries:
            with entry.calls:
                self._record_pending(entry)
                if not entry.disabled:
                    self._call(entry, "log")
            self._deliver(entry, wait=False)  # steps recorded while it logged

    def shutdown(self) -> None:
        """Stop the timer and call every enabled logger's ``shutdown`` (once; idempotent)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._shutdown_entries()

    def _shutdown_entries(self) -> None:
        for entry in self._entries:
            with entry.calls:
                self._record_pending(entry)
                if not entry.disabled:
                    self._call(entry, "shutdown")
                    entry.disabled = True
                entry.pending.clear()

    def _deliver(self, entry: _Entry, wait: bool) -> None:
        """Pass ``entry``'s queued steps to its ``record`` unless (``wait`` false) another
        thread is in one of its calls; that thread delivers them when its call returns."""
        while entry.pending:
            if not entry.calls.acquire(blocking=wait):
                # The holder checks the queue after releasing the lock; a step queued after
                # that check finds the lock free here.
                return
            try:
                self._record_pending(entry)
            finally:
                entry.calls.release()

    def _drop_oldest(self, entry: _Entry) -> None:
        """Drop ``entry``'s oldest queued step (its queue is full: its ``log`` is busy)."""
        try:
            entry.pending.popleft()
        except IndexError:  # the holder delivered them meanwhile
            return
        entry.dropped += 1
        if entry.dropped == entry.reported + 1:
            logger.warning(
                "stat logger %r: its log() has been busy for %d steps; dropping its oldest "
                "queued steps until it returns (it will miss them)",
                entry.name,
                MAX_PENDING_STEPS,
            )

    def _record_pending(self, entry: _Entry) -> None:
        # the caller holds entry.calls
        dropped = entry.dropped
        if dropped > entry.reported:
            logger.warning(
                "stat logger %r missed %d steps while its log() was busy",
                entry.name,
                dropped - entry.reported,
            )
            entry.reported = dropped
        while entry.pending:
            scheduler_stats, iteration_stats = entry.pending.popleft()
            if entry.disabled:
                entry.pending.clear()
                return
            self._call(entry, "record", scheduler_stats, iteration_stats)

    def _run_timer(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.log()

    def _call(self, entry: _Entry, method: str, *args: Any) -> None:
        # A broken logger must never take the engine down: logged once, then left out.
        try:
            getattr(entry.logger, method)(*args)
        except Exception:
            entry.disabled = True
            logger.exception(
                "stat logger %r (%s) raised in %s(); it is disabled from now on",
                entry.name,
                type(entry.logger).__qualname__,
                method,
            )
