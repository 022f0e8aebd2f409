"""``logging``: vLLM's periodic throughput line, written with Python's ``logging``.

Every ``--stat-log-interval`` seconds, at INFO on the logger ``chassis.stats``::

    Avg prompt throughput: 512.0 tokens/s, Avg generation throughput: 96.3 tokens/s,
    Running: 4 reqs, Waiting: 0 reqs, KV cache usage: 12.5%, Prefix cache hit rate: 40.0%

(one line). Throughputs are the tokens the front-end received since the previous line over
the seconds since then; running, waiting and KV usage are the latest scheduler snapshot; the
prefix-cache hit rate is hits over lookups (tokens) since the previous line, or since start
when nothing was looked up in the interval. An idle engine logs one line, then stays quiet
until work arrives again.
"""

from __future__ import annotations

import logging
import time

from chassis.core.stat_logger import (
    IterationStats,
    SchedulerStats,
    StatLoggerBase,
    StatLoggerInfo,
)

#: the logger the line is written to (filter or silence it by this name)
STATS_LOGGER_NAME = "chassis.stats"

stats_logger = logging.getLogger(STATS_LOGGER_NAME)


class LoggingStatLogger(StatLoggerBase):
    """Logs throughput, queue lengths, KV usage and prefix-cache hit rate periodically."""

    def __init__(self, info: StatLoggerInfo) -> None:
        super().__init__(info)
        self._scheduler_stats = SchedulerStats()
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._last_log_time = time.monotonic()
        self._last_queries = 0
        self._last_hits = 0
        self._last_was_idle = False

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        self._scheduler_stats = scheduler_stats
        self._num_prompt_tokens += iteration_stats.num_prompt_tokens
        self._num_generation_tokens += iteration_stats.num_generation_tokens

    def log(self) -> None:
        now = time.monotonic()
        elapsed = max(now - self._last_log_time, 1e-9)
        stats = self._scheduler_stats
        idle = (
            self._num_prompt_tokens == 0
            and self._num_generation_tokens == 0
            and stats.num_running == 0
            and stats.num_waiting == 0
        )
        if not (idle and self._last_was_idle):
            stats_logger.info(
                "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f "
                "tokens/s, Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
                "Prefix cache hit rate: %.1f%%",
                self._num_prompt_tokens / elapsed,
                self._num_generation_tokens / elapsed,
                stats.num_running,
                stats.num_waiting,
                stats.kv_cache_usage * 100,
                self._prefix_cache_hit_rate(stats) * 100,
            )
        self._last_was_idle = idle
        self._last_log_time = now
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._last_queries = stats.prefix_cache_queries
        self._last_hits = stats.prefix_cache_hits

    def _prefix_cache_hit_rate(self, stats: SchedulerStats) -> float:
        queries = stats.prefix_cache_queries - self._last_queries
        hits = stats.prefix_cache_hits - self._last_hits
        if queries <= 0:  # nothing looked up in the interval: the rate since start
            queries, hits = stats.prefix_cache_queries, stats.prefix_cache_hits
        return hits / queries if queries > 0 else 0.0
