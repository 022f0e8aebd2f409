"""Stat loggers: what a plugin implements to receive the engine's statistics step by step.

A stat logger lives in the front-end process (the API server's ``AsyncLLM``, or the offline
``LLM`` when ``stat_loggers`` names some). Selected by name with ``--stat-loggers a,b``
(registered through the ``chassis_register_stat_loggers`` hook) or as ``"module:Class"``.
The front-end calls, for each logger, never two calls at once (no locking needed inside):

1. ``cls(info)`` once, when the engine is ready (:class:`StatLoggerInfo`);
2. :meth:`StatLoggerBase.log_engine_initialized` once, right after;
3. :meth:`StatLoggerBase.record` for every engine step whose results reach the front-end;
4. :meth:`StatLoggerBase.log` every ``--stat-log-interval`` seconds (default 10);
5. :meth:`StatLoggerBase.shutdown` once, when the engine shuts down.

``record`` runs on the thread that reads the engine's outputs: keep it cheap (count, append)
and do slow work (network, formatting) in ``log``. A logger whose method raises is logged
once with its traceback and then disabled; the engine keeps serving.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

# The scheduler's snapshot, exactly what the engine core sends with every step's outputs (and
# what the Prometheus /metrics collector reads): re-exported as part of this contract.
from chassis.core.request import SchedulerStats

if TYPE_CHECKING:
    from chassis.core.config import EngineConfig
    from chassis.core.engine_core import EngineInfo

__all__ = [
    "FinishedRequestStats",
    "IterationStats",
    "SchedulerStats",
    "StatLoggerBase",
    "StatLoggerInfo",
]


@dataclass
class FinishedRequestStats:
    """One request (all its ``n`` completions) that finished in a step.

    Times are seconds on the wall clock of the front-end; a latency is ``None`` when the
    request never reached that point (no token generated, never scheduled).
    """

    request_id: str
    #: the first completion's finish reason (``"stop"``, ``"length"``, ``"abort"``)
    finish_reason: str
    num_prompt_tokens: int
    #: tokens generated over all completions (what ``usage.completion_tokens`` counts)
    num_generation_tokens: int
    #: prompt tokens served from the prefix cache
    num_cached_tokens: int = 0
    #: arrival at the front-end -> first generated token
    time_to_first_token: float | None = None
    #: arrival at the front-end -> last output
    e2e_latency: float | None = None
    #: arrival -> first scheduled by the engine core
    queue_time: float | None = None


@dataclass
class IterationStats:
    """What the front-end received from one engine step (vLLM's ``IterationStats``).

    Built by the output processor as it applies the step, so the counts are the ones
    clients see: prompt tokens are counted when a request's first token arrives (its prefill
    is then done), generated tokens as they arrive (a stop string's tail excluded).
    """

    #: when the front-end processed the step (``time.time()``)
    timestamp: float = 0.0
    #: the engine core whose step it was (``--data-parallel-size N``: 0 .. N-1; 0 with one
    #: engine), as vLLM's ``engine_idx``: a logger that splits by engine reads it here (the
    #: ``scheduler_stats`` passed beside it are summed over the engines)
    engine_index: int = 0
    #: prompt tokens of the requests whose first output arrived in this step
    num_prompt_tokens: int = 0
    #: tokens generated in this step, over every request and completion
    num_generation_tokens: int = 0
    #: arrival -> first token, one entry per request that got its first token now
    time_to_first_tokens: list[float] = field(default_factory=list)
    #: requests finished in this step (those the client aborted are not reported; those the
    #: engine refused are, with finish reason ``"abort"``)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)


@dataclass(frozen=True)
class StatLoggerInfo:
    """What a stat logger is built with."""

    #: the served model name (``--served-model-name``, else the model)
    model_name: str
    #: the engine's final configuration (read it; do not change it)
    config: EngineConfig
    #: what the engine core reported when ready (platform, backend, KV blocks, ...); ``None``
    #: when the engine does not report one
    engine_info: EngineInfo | None = None


class StatLoggerBase(ABC):
    """Receives the engine's statistics; subclass it and register the class by name.

    The constructor takes one :class:`StatLoggerInfo`. Only :meth:`record` is required.
    """

    def __init__(self, info: StatLoggerInfo) -> None:
        self.info = info

    @abstractmethod
    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        """One engine step: the scheduler's snapshot after it (queue lengths, KV usage,
        cumulative prefix-cache and preemption counters) and what the step produced. With
        several engines (data parallelism) every engine's steps come here, each with its
        ``iteration_stats.engine_index``; ``scheduler_stats`` is then the sum of the
        engines' latest snapshots.

        Called on the front-end's output thread, once per step, in step order. Do not keep
        references to the arguments beyond what you need: they are not copied for you.
        """

    def log(self) -> None:  # noqa: B027 (optional; no-op default)
        """Periodic: report what was recorded since the previous call (every
        ``--stat-log-interval`` seconds, on a timer thread). Default: nothing."""

    def log_engine_initialized(self) -> None:  # noqa: B027 (optional; no-op default)
        """Once, right after construction, with the engine ready. Default: nothing."""

    def shutdown(self) -> None:  # noqa: B027 (optional; no-op default)
        """Once, when the engine shuts down: flush and release resources. Default: nothing."""
