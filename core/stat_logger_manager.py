"""Running the selected stat loggers: resolve names, call them, keep a failing one out.

The front-end (``AsyncLLM``, or the offline ``LLM``) resolves the names before it starts the
engine (an unknown name fails fast), builds the loggers once the engine is ready, then
calls :meth:`StatLoggerManager.record` per step and :meth:`StatLoggerManager.shutdown` at the
end; a daemon timer thread calls :meth:`StatLoggerManager.log` every interval. One lock
serialises every call, so a logger never sees two calls at once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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


@dataclass
class _Entry:
    name: str
    logger: StatLoggerBase
    disabled: bool = False


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
        self._lock = threading.Lock()
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
        with self._lock:
            for entry in self._entries:
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
        """Pass one step's stats to every enabled logger."""
        if not self._entries:
            return
        with self._lock:
            for entry in self._entries:
                if not entry.disabled:
                    self._call(entry, "record", scheduler_stats, iteration_stats)

    def log(self) -> None:
        """Call every enabled logger's ``log`` (the timer does this every interval)."""
        with self._lock:
            for entry in self._entries:
                if not entry.disabled:
                    self._call(entry, "log")

    def shutdown(self) -> None:
        """Stop the timer and call every enabled logger's ``shutdown`` (once; idempotent)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._shutdown_entries()

    def _shutdown_entries(self) -> None:
        with self._lock:
            for entry in self._entries:
                if not entry.disabled:
                    self._call(entry, "shutdown")
                    entry.disabled = True

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
