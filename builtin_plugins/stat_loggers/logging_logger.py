"""``logging``: vLLM's periodic throughput line, written with Python's ``logging``.

Every ``--stat-log-interval`` seconds, at INFO on the logger ``chassis.stats``::

    Avg prompt throughput: 512.0 tokens/s, Avg generation throughput: 96.3 tokens/s,
    Running: 4 reqs, Waiting: 0 reqs, KV cache usage: 12.5%, Prefix cache hit rate: 40.0%

(one line). Throughputs are the tokens the front-end received since the previous line over
the seconds since then; running, waiting and KV usage are the latest scheduler snapshot; the
prefix-cache hit rate is hits over lookups (tokens) since the previous line, or since start
when nothing was looked up in the interval. An idle engine logs one line, then stays quiet
until work arrives again.

With speculative decoding on (``--speculative-config``), an interval in which drafts were
verified adds vLLM's second line, its numbers since the previous line (from the cumulative
counters of :class:`~chassis.core.request.SchedulerStats`, those ``/metrics`` exports)::

    SpecDecoding metrics: Mean acceptance length: 2.50, Accepted throughput: 30.00 tokens/s,
    Drafted throughput: 80.00 tokens/s, Accepted: 300 tokens, Drafted: 800 tokens,
    Per-position acceptance rate: 0.700, 0.500, 0.200, 0.100, Avg Draft acceptance rate: 37.5%

(one line): mean acceptance length is 1 + accepted / drafts (a draft: one request's draft
tokens verified in one step; the 1 is the token the target makes itself), the throughputs
are tokens over the seconds since the previous line, per-position rates are the drafts
accepted up to that position over the drafts, and the average rate is accepted over drafted
tokens.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

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
        self._speculative = info.config.speculative is not None
        self._last_spec = _SpecCounters()

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
        if self._speculative:
            self._log_spec_decoding(stats, elapsed)
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

    def _log_spec_decoding(self, stats: SchedulerStats, elapsed: float) -> None:
        """vLLM's ``SpecDecoding metrics`` line for the drafts verified since the previous
        call (nothing when none were)."""
        now = _SpecCounters.of(stats)
        last, self._last_spec = self._last_spec, now
        drafts = now.drafts - last.drafts
        if drafts <= 0:
            return
        drafted = now.draft_tokens - last.draft_tokens
        accepted = now.accepted_tokens - last.accepted_tokens
        per_pos = [
            (count - (last.per_pos[i] if i < len(last.per_pos) else 0)) / drafts
            for i, count in enumerate(now.per_pos)
        ]
        stats_logger.info(
            "SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: %.2f "
            "tokens/s, Drafted throughput: %.2f tokens/s, Accepted: %d tokens, Drafted: %d "
            "tokens, Per-position acceptance rate: %s, Avg Draft acceptance rate: %.1f%%",
            1 + accepted / drafts,
            accepted / elapsed,
            drafted / elapsed,
            accepted,
            drafted,
            ", ".join(f"{rate:.3f}" for rate in per_pos),
            accepted / drafted * 100 if drafted else 0.0,
        )


@dataclass(frozen=True)
class _SpecCounters:
    """The scheduler's cumulative speculative-decoding counters at one log line."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    per_pos: tuple[int, ...] = ()

    @classmethod
    def of(cls, stats: SchedulerStats) -> _SpecCounters:
        return cls(
            stats.spec_num_drafts,
            stats.spec_num_draft_tokens,
            stats.spec_num_accepted_tokens,
            tuple(stats.spec_num_accepted_tokens_per_pos),
        )
