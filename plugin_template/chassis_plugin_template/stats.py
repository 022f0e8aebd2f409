"""``template_counter``: a stat logger that counts what the engine served.

Select it with ``chassis serve --stat-loggers logging,template_counter`` (keep ``logging``
for the built-in throughput line). Its counts are served by the template's route
``GET /template/stats`` (``routes.py``) and logged every ``--stat-log-interval`` seconds.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Any

from chassis.core.stat_logger import (
    IterationStats,
    SchedulerStats,
    StatLoggerBase,
    StatLoggerInfo,
)

logger = logging.getLogger(__name__)


class TemplateCounterStatLogger(StatLoggerBase):
    """Totals since start: engine steps, prompt and generated tokens, finished requests by
    finish reason, and the largest number of requests seen running at once."""

    def __init__(self, info: StatLoggerInfo) -> None:
        super().__init__(info)
        # chassis never calls two methods of one logger at once, but the route reads the
        # counts from the server's event loop: guard them for a consistent snapshot.
        self._lock = threading.Lock()
        self._num_steps = 0
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._finish_reasons: Counter[str] = Counter()
        self._max_running = 0

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        # Cheap on purpose: this runs on the thread that reads every engine step.
        with self._lock:
            self._num_steps += 1
            self._num_prompt_tokens += iteration_stats.num_prompt_tokens
            self._num_generation_tokens += iteration_stats.num_generation_tokens
            for finished in iteration_stats.finished_requests:
                self._finish_reasons[finished.finish_reason] += 1
            self._max_running = max(self._max_running, scheduler_stats.num_running)

    def log(self) -> None:
        snapshot = self.snapshot()
        logger.info(
            "template_counter: %d requests finished, %d tokens generated (model %s)",
            snapshot["num_finished_requests"],
            snapshot["num_generation_tokens"],
            self.info.model_name,
        )

    def snapshot(self) -> dict[str, Any]:
        """The counts so far, as JSON-ready values."""
        with self._lock:
            return {
                "num_steps": self._num_steps,
                "num_prompt_tokens": self._num_prompt_tokens,
                "num_generation_tokens": self._num_generation_tokens,
                "num_finished_requests": sum(self._finish_reasons.values()),
                "finish_reasons": dict(self._finish_reasons),
                "max_running": self._max_running,
            }
