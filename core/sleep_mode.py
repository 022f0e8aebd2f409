"""Sleep mode (vLLM's ``--enable-sleep-mode``): free an idle engine's memory, bring it back.

``sleep(level)`` frees the KV cache (its contents are forgotten, so the prefix cache is
reset) and, at level 1, moves the weights to host memory (where the device memory is host
memory, the CPU, they stay where they are) or, at level 2, discards them.
``wake_up(tags)`` brings back the parts named (:data:`SLEEP_TAGS`; all by default), in any
order and in several calls: ``wake_up(["weights"])``, update them, then
``wake_up(["kv_cache"])`` is the RLHF flow. Weights discarded at level 2 are read again from
the checkpoint (vLLM leaves them uninitialized for a trainer to overwrite).

This module holds what every layer checks the same way (the settings, the level, the tags)
and the engine core's bookkeeping, :class:`SleepState`; the worker's part is
:mod:`chassis.core.sleep_worker`. docs/serving.md, "Sleep mode", is the user's account.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from chassis.core.config import EngineConfig

logger = logging.getLogger(__name__)

#: what ``wake_up`` may bring back, each on its own (vLLM's tags)
SLEEP_TAGS = ("weights", "kv_cache")
#: the sleep levels: 1 = weights to host memory, 2 = weights discarded (KV cache freed at both)
SLEEP_LEVELS = (1, 2)


def check_sleep_mode_enabled(config: EngineConfig) -> None:
    """``ValueError`` naming the flag unless the engine was started with sleep mode on."""
    if not config.enable_sleep_mode:
        raise ValueError(
            "sleep mode is off: start the engine with --enable-sleep-mode "
            "(LLM(..., enable_sleep_mode=True)) to use sleep and wake_up"
        )


def check_sleep_level(level: object) -> int:
    """``level`` if it is 1 or 2, else a ``ValueError`` naming the valid levels."""
    if isinstance(level, bool) or level not in SLEEP_LEVELS:
        raise ValueError(
            f"sleep level must be 1 (weights to host memory, KV cache freed) or 2 (weights "
            f"and KV cache freed); got {level!r}"
        )
    assert isinstance(level, int)
    return level


def check_wake_tags(tags: Iterable[str] | None) -> tuple[str, ...]:
    """The parts ``wake_up(tags)`` brings back, in :data:`SLEEP_TAGS`' order: all of them
    for ``None`` (or an empty list, as vLLM's route reads no ``tags``), else ``tags``; a
    ``ValueError`` naming the valid tags for any other value (a bare string included)."""
    if tags is None:
        return SLEEP_TAGS
    if isinstance(tags, str | bytes):
        raise ValueError(
            f"wake_up tags must be a list of {', '.join(SLEEP_TAGS)} (or None for all); "
            f"got the string {tags!r}"
        )
    given = list(tags)
    unknown = [tag for tag in given if tag not in SLEEP_TAGS]
    if unknown:
        raise ValueError(
            f"unknown wake_up tag(s) {', '.join(map(repr, unknown))}: the valid tags are "
            f"{', '.join(map(repr, SLEEP_TAGS))} (None wakes up both)"
        )
    if not given:
        return SLEEP_TAGS
    return tuple(tag for tag in SLEEP_TAGS if tag in given)


def sleeping_message(asleep: Iterable[str]) -> str:
    """Why a request is refused while the parts ``asleep`` sleep."""
    names = {"weights": "weights", "kv_cache": "KV cache"}
    parts = " and ".join(names[tag] for tag in SLEEP_TAGS if tag in set(asleep))
    return (
        f"the engine is sleeping (sleep mode: its {parts} are released) and cannot generate; "
        "call wake_up() (POST /wake_up) first"
    )


class SleepState:
    """Which parts of one engine sleep, as its engine core keeps track of them.

    ``sleep`` and ``wake_up`` return the parts the caller must act on (nothing when the
    engine already sleeps, or the parts named are awake: a warning in the log, as vLLM's),
    and record the change once the caller has done it (:meth:`slept`, :meth:`woke`).
    """

    def __init__(self) -> None:
        #: the parts released now (a subset of :data:`SLEEP_TAGS`)
        self.asleep: set[str] = set()
        #: the level of the last sleep (while any part sleeps)
        self.level: int | None = None

    @property
    def is_sleeping(self) -> bool:
        """Whether any part is released (also with only the KV cache left to wake)."""
        return bool(self.asleep)

    def to_sleep(self, level: int) -> bool:
        """Whether a ``sleep(level)`` should run: not while any part still sleeps."""
        if self.asleep:
            logger.warning(
                "sleep(%d) ignored: the engine is sleeping already (level %s; %s released); "
                "wake it up first",
                level,
                self.level,
                ", ".join(sorted(self.asleep)),
            )
            return False
        return True

    def slept(self, level: int) -> None:
        """Record a done ``sleep(level)``: every part is released."""
        self.asleep = set(SLEEP_TAGS)
        self.level = level

    def to_wake(self, tags: tuple[str, ...]) -> tuple[str, ...]:
        """The parts of ``tags`` that sleep (in :data:`SLEEP_TAGS`' order); the others are
        awake already (logged)."""
        awake = [tag for tag in tags if tag not in self.asleep]
        if awake:
            logger.warning("wake_up: %s not sleeping; nothing to do for it", ", ".join(awake))
        return tuple(tag for tag in tags if tag in self.asleep)

    def woke(self, tags: tuple[str, ...]) -> None:
        """Record a done ``wake_up`` of ``tags``."""
        self.asleep -= set(tags)
        if not self.asleep:
            self.level = None
