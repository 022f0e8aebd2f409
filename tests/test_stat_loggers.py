"""Stat loggers: the contract, the built-in ``logging`` line, fault isolation, and the totals a
logger receives from a real engine (tiny random Llama, ``AsyncLLM`` and the offline ``LLM``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import threading
import time
from typing import Any

import pytest
from fixtures_plugins import fake_manager, isolated_plugins  # noqa: F401

from chassis.builtin_plugins.stat_loggers.logging_logger import (
    STATS_LOGGER_NAME,
    LoggingStatLogger,
)
from chassis.core import stat_logger_manager
from chassis.core.async_llm import AsyncLLM
from chassis.core.config import EngineConfig
from chassis.core.sampling_params import SamplingParams
from chassis.core.stat_logger import (
    FinishedRequestStats,
    IterationStats,
    SchedulerStats,
    StatLoggerBase,
    StatLoggerInfo,
)
from chassis.core.stat_logger_manager import (
    StatLoggerManager,
    default_stat_loggers,
    resolve_stat_loggers,
)
from chassis.plugins import UnknownNameError, set_plugin_manager
from chassis.serve.args import add_engine_args, engine_config_from_args

INFO = StatLoggerInfo("tiny", EngineConfig())


class RecordingLogger(StatLoggerBase):
    """Keeps every call (importable as ``test_stat_loggers:RecordingLogger``)."""

    def __init__(self, info: StatLoggerInfo) -> None:
        super().__init__(info)
        self.steps: list[tuple[SchedulerStats, IterationStats]] = []
        self.calls: list[str] = []

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        self.steps.append((scheduler_stats, iteration_stats))

    def log(self) -> None:
        self.calls.append("log")

    def log_engine_initialized(self) -> None:
        self.calls.append("initialized")

    def shutdown(self) -> None:
        self.calls.append("shutdown")

    def totals(self) -> dict[str, Any]:
        its = [it for _, it in self.steps]
        finished = [f for it in its for f in it.finished_requests]
        return {
            "prompt": sum(it.num_prompt_tokens for it in its),
            "generation": sum(it.num_generation_tokens for it in its),
            "ttfts": sum(len(it.time_to_first_tokens) for it in its),
            "finished": sorted((f.request_id, f.finish_reason) for f in finished),
        }


class FailingLogger(StatLoggerBase):
    """Raises on its second ``record``."""

    def __init__(self, info: StatLoggerInfo) -> None:
        super().__init__(info)
        self.records = 0

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        self.records += 1
        if self.records == 2:
            raise RuntimeError("broken stat logger")


class UnbuildableLogger(StatLoggerBase):
    """Cannot start (importable as ``test_stat_loggers:UnbuildableLogger``)."""

    def __init__(self, info: StatLoggerInfo) -> None:
        raise OSError("no route to the metrics backend")

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        pass  # pragma: no cover


# -- the built-in logging line -----------------------------------------------------------------

LINE = re.compile(
    r"Avg prompt throughput: ([\d.]+) tokens/s, Avg generation throughput: ([\d.]+) tokens/s, "
    r"Running: (\d+) reqs, Waiting: (\d+) reqs, KV cache usage: ([\d.]+)%, "
    r"Prefix cache hit rate: ([\d.]+)%"
)


def _lines(caplog: pytest.LogCaptureFixture) -> list[tuple[float, ...]]:
    found = [LINE.search(r.getMessage()) for r in caplog.records if r.name == STATS_LOGGER_NAME]
    return [tuple(float(g) for g in m.groups()) for m in found if m]


def test_logging_line_has_the_interval_numbers(monkeypatch, caplog) -> None:
    caplog.set_level(logging.INFO, logger=STATS_LOGGER_NAME)
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    stat_logger = LoggingStatLogger(INFO)
    stats = SchedulerStats(
        num_running=3,
        num_waiting=2,
        kv_cache_usage=0.25,
        prefix_cache_queries=200,
        prefix_cache_hits=50,
    )
    stat_logger.record(stats, IterationStats(num_prompt_tokens=300, num_generation_tokens=20))
    stat_logger.record(stats, IterationStats(num_generation_tokens=30))
    clock[0] = 110.0  # 10 s later: 300 / 10 and 50 / 10 tokens/s
    stat_logger.log()
    # next interval: 100 more lookups, 80 of them hits; 5 s
    later = SchedulerStats(
        num_running=1, kv_cache_usage=0.5, prefix_cache_queries=300, prefix_cache_hits=130
    )
    stat_logger.record(later, IterationStats(num_generation_tokens=10))
    clock[0] = 115.0
    stat_logger.log()
    assert _lines(caplog) == [
        (30.0, 5.0, 3.0, 2.0, 25.0, 25.0),
        (0.0, 2.0, 1.0, 0.0, 50.0, 80.0),
    ]


def test_logging_line_goes_quiet_when_idle(monkeypatch, caplog) -> None:
    caplog.set_level(logging.INFO, logger=STATS_LOGGER_NAME)
    clock = [0.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    stat_logger = LoggingStatLogger(INFO)
    for _ in range(3):
        clock[0] += 10
        stat_logger.log()  # idle: one line, then nothing
    stat_logger.record(SchedulerStats(num_running=1), IterationStats(num_generation_tokens=5))
    clock[0] += 10
    stat_logger.log()
    assert [line[1] for line in _lines(caplog)] == [0.0, 0.5]


# -- selection and fault isolation -------------------------------------------------------------


def test_names_resolve_from_the_registry_or_module_path() -> None:
    resolved = resolve_stat_loggers(["logging", "test_stat_loggers:RecordingLogger"])
    assert [name for name, _ in resolved] == ["logging", "test_stat_loggers:RecordingLogger"]
    assert resolved[0][1] is LoggingStatLogger
    assert resolved[1][1].__name__ == "RecordingLogger"
    with pytest.raises(UnknownNameError, match="unknown stat logger 'nope'; known: logging"):
        resolve_stat_loggers(["nope"])
    with pytest.raises(ValueError, match=r"not a subclass of chassis\.core\.stat_logger"):
        resolve_stat_loggers(["test_stat_loggers:INFO"])
    with pytest.raises(ValueError, match="cannot be imported"):
        resolve_stat_loggers(["no_such_module:Logger"])
    with pytest.raises(ValueError, match="twice"):
        resolve_stat_loggers(["logging", "logging"])


def test_default_is_logging_unless_an_allow_list_left_it_out(isolated_plugins) -> None:  # noqa: F811
    assert default_stat_loggers() == ["logging"]
    set_plugin_manager(fake_manager())  # as CHASSIS_PLUGINS without builtin_stat_loggers
    assert default_stat_loggers() == []  # nothing to log with: not an error
    with pytest.raises(UnknownNameError, match=r"unknown stat logger 'logging'; known: \(none"):
        resolve_stat_loggers(["logging"])  # asked for by name: an error


def test_flags_and_config() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser, with_plugins=False)
    config = engine_config_from_args(
        parser.parse_args(["--stat-loggers", "logging, mine", "--stat-log-interval", "2.5"])
    )
    assert (config.stat_loggers, config.stat_log_interval) == (["logging", "mine"], 2.5)
    assert engine_config_from_args(parser.parse_args(["--disable-log-stats"])).stat_loggers == []
    assert engine_config_from_args(parser.parse_args(["--stat-loggers", ""])).stat_loggers == []
    assert engine_config_from_args(parser.parse_args([])).stat_loggers is None
    for bad in (0, float("nan"), float("inf")):  # NaN: a busy timer; inf: it would crash
        with pytest.raises(ValueError, match="--stat-log-interval must be"):
            EngineConfig(stat_log_interval=bad)


def test_a_failing_logger_is_logged_once_and_disabled(caplog) -> None:
    manager = StatLoggerManager(
        [("failing", FailingLogger), ("recording", RecordingLogger)], INFO, interval_s=3600
    )
    recording = manager.loggers[1]
    for _ in range(4):
        manager.record(SchedulerStats(), IterationStats(num_generation_tokens=1))
    manager.log()
    manager.shutdown()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "'failing'" in errors[0].getMessage()
    assert "broken stat logger" in errors[0].exc_text
    assert manager.loggers == []  # all shut down now
    assert len(recording.steps) == 4
    assert recording.calls == ["initialized", "log", "shutdown"]


class SlowLogLogger(RecordingLogger):
    """``log`` blocks until the test sets ``release``; ``record`` notes whether a ``log``
    was running (a logger must never see two calls at once)."""

    def __init__(self, info: StatLoggerInfo) -> None:
        super().__init__(info)
        self.logging = threading.Event()
        self.release = threading.Event()
        self.overlaps = 0

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        self.overlaps += self.logging.is_set()
        super().record(scheduler_stats, iteration_stats)

    def log(self) -> None:
        self.logging.set()
        assert self.release.wait(timeout=60)
        super().log()
        self.logging.clear()


@pytest.mark.timeout(60)
def test_record_does_not_wait_for_a_blocked_log() -> None:
    manager = StatLoggerManager(
        [("slow", SlowLogLogger), ("recording", RecordingLogger)], INFO, interval_s=3600
    )
    slow, other = manager.loggers
    manager.record(SchedulerStats(), IterationStats(num_generation_tokens=1))
    log_thread = threading.Thread(target=manager.log)
    log_thread.start()
    assert slow.logging.wait(timeout=30)  # slow.log() is running, and blocked
    # the output path: returns although slow.log() holds on; the other logger gets the steps
    for n in (2, 3):
        manager.record(SchedulerStats(), IterationStats(num_generation_tokens=n))
    assert [it.num_generation_tokens for _, it in other.steps] == [1, 2, 3]
    assert [it.num_generation_tokens for _, it in slow.steps] == [1]  # queued, not concurrent
    slow.release.set()
    log_thread.join(timeout=30)
    assert not log_thread.is_alive()
    # delivered in step order as soon as log() returned, never during it
    assert [it.num_generation_tokens for _, it in slow.steps] == [1, 2, 3]
    assert slow.overlaps == 0 and slow.calls == ["initialized", "log"]
    manager.shutdown()
    assert slow.calls[-1] == "shutdown" and other.calls == ["initialized", "log", "shutdown"]


@pytest.mark.timeout(60)
def test_a_blocked_log_keeps_only_the_newest_steps_queued(monkeypatch, caplog) -> None:
    """A logger stuck in log() must not grow its queue without bound: past the cap it misses
    the oldest steps (with a warning saying how many) and gets the newest, in order."""
    monkeypatch.setattr(stat_logger_manager, "MAX_PENDING_STEPS", 4)
    manager = StatLoggerManager(
        [("slow", SlowLogLogger), ("recording", RecordingLogger)], INFO, interval_s=3600
    )
    slow, other = manager.loggers
    log_thread = threading.Thread(target=manager.log)
    log_thread.start()
    assert slow.logging.wait(timeout=30)
    with caplog.at_level(logging.WARNING, logger="chassis.core.stat_logger_manager"):
        for n in range(1, 11):
            manager.record(SchedulerStats(), IterationStats(num_generation_tokens=n))
        assert len(manager._entries[0].pending) == 4
        assert [it.num_generation_tokens for _, it in other.steps] == list(range(1, 11))
        slow.release.set()
        log_thread.join(timeout=30)
        assert not log_thread.is_alive()
    assert [it.num_generation_tokens for _, it in slow.steps] == [7, 8, 9, 10]
    warnings = [r.getMessage() for r in caplog.records if "'slow'" in r.getMessage()]
    assert len(warnings) == 2 and "missed 6 steps" in warnings[1], warnings
    manager.shutdown()


def test_a_logger_that_cannot_start_is_a_startup_error() -> None:
    with pytest.raises(ValueError, match=r"'unbuildable' failed to start.*no route"):
        StatLoggerManager([("unbuildable", UnbuildableLogger)], INFO, interval_s=1)


def test_the_timer_calls_log_periodically() -> None:
    manager = StatLoggerManager([("recording", RecordingLogger)], INFO, interval_s=0.05)
    deadline = time.monotonic() + 5
    while manager.loggers[0].calls.count("log") < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    manager.shutdown()
    assert manager._thread is not None and not manager._thread.is_alive()
    assert manager.loggers == []


# -- a real engine ------------------------------------------------------------------------------

PROMPT = list(range(5, 45))  # 40 tokens: two full blocks of 16 for the prefix cache


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    llm = AsyncLLM(
        EngineConfig(
            model=str(tiny_llama_dir),
            dtype="float32",
            max_model_len=128,
            num_kv_blocks=64,
            stat_loggers=["logging", "test_stat_loggers:RecordingLogger"],
            stat_log_interval=0.2,
        ),
        stat_loggers=[FailingLogger],
    )
    yield llm
    llm.shutdown_sync()


async def _run(engine: AsyncLLM, prompt: list[int], request_id: str, n: int = 1) -> int:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, n=n)
    tokens = 0
    async for out in engine.generate(prompt, params, request_id):
        tokens += sum(len(c.token_ids) for c in out.outputs)
    return tokens


def test_engine_steps_add_up_to_what_was_generated(engine, caplog) -> None:
    caplog.set_level(logging.INFO, logger=STATS_LOGGER_NAME)
    recorder = next(lg for lg in engine.stat_loggers if isinstance(lg, RecordingLogger))
    assert recorder.calls[0] == "initialized"
    assert recorder.info.engine_info is not None and recorder.info.engine_info.num_kv_blocks == 64

    async def workload() -> list[int]:
        first = await _run(engine, PROMPT, "a")
        rest = await asyncio.gather(_run(engine, PROMPT, "b"), _run(engine, [7, 8, 9], "c", n=2))
        return [first, *rest]

    generated = asyncio.run(workload())
    assert generated == [8, 8, 16]
    totals = recorder.totals()
    assert totals == {
        "prompt": 40 + 40 + 3,
        "generation": 32,
        "ttfts": 3,
        "finished": [("a", "length"), ("b", "length"), ("c", "length")],
    }
    finished: dict[str, FinishedRequestStats] = {
        f.request_id: f for _, it in recorder.steps for f in it.finished_requests
    }
    assert finished["c"].num_generation_tokens == 16 and finished["c"].num_prompt_tokens == 3
    for f in finished.values():
        assert f.time_to_first_token is not None and f.e2e_latency is not None
        assert 0 < f.time_to_first_token <= f.e2e_latency
        assert f.queue_time is not None and f.queue_time >= 0
    assert finished["b"].num_cached_tokens == 32  # "b" reused "a"'s two full blocks
    last = recorder.steps[-1][0]
    assert (last.num_running, last.num_waiting) == (0, 0)
    assert last.prefix_cache_hits >= 32

    # The failing logger raised in its second record: disabled, the engine kept serving.
    assert not any(isinstance(lg, FailingLogger) for lg in engine.stat_loggers)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "'FailingLogger'" in errors[0].getMessage()
    assert asyncio.run(_run(engine, [1, 2, 3], "after")) == 8

    # The periodic line: generation throughput was reported, and the engine is now idle.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not any(
        line[1] > 0 for line in _lines(caplog)
    ):  # the timer runs every 0.2 s
        time.sleep(0.05)
    lines = _lines(caplog)
    assert any(line[1] > 0 for line in lines), lines
    assert recorder.calls.count("log") >= 1


def test_failing_logger_error_was_logged_once(engine, caplog) -> None:
    # (the failure happened in the previous test; a new request logs nothing more)
    asyncio.run(_run(engine, [4, 5, 6], "quiet"))
    assert not [r for r in caplog.records if "stat logger" in r.getMessage()]


def test_offline_llm_records_when_asked(tiny_llama_dir) -> None:
    from chassis import LLM

    llm = LLM(
        str(tiny_llama_dir),
        dtype="float32",
        max_model_len=64,
        num_kv_blocks=16,
        stat_loggers=["test_stat_loggers:RecordingLogger"],
    )
    outputs = llm.generate(
        [[1, 2, 3, 4], [5, 6]], SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.0)
    )
    [recorder] = llm.stat_loggers
    llm.shutdown()
    totals = recorder.totals()
    assert totals["prompt"] == 6 and totals["generation"] == 10
    assert [r for r, _ in totals["finished"]] == sorted(o.request_id for o in outputs)
    assert recorder.calls[-1] == "shutdown"


def test_offline_llm_stops_its_engine_when_a_logger_cannot_start(tiny_llama_dir, monkeypatch):
    """The constructor raises, so nobody could shut the engine down later: it does."""
    from chassis import LLM
    from chassis.core.engine_core import EngineCore

    stopped = []
    shutdown = EngineCore.shutdown
    monkeypatch.setattr(EngineCore, "shutdown", lambda self: stopped.append(shutdown(self)))
    with pytest.raises(ValueError, match=r"failed to start.*no route"):
        LLM(
            str(tiny_llama_dir),
            dtype="float32",
            max_model_len=64,
            num_kv_blocks=16,
            stat_loggers=["test_stat_loggers:UnbuildableLogger"],
        )
    assert len(stopped) == 1


SPEC_LINE = re.compile(
    r"SpecDecoding metrics: Mean acceptance length: ([\d.]+), Accepted throughput: ([\d.]+) "
    r"tokens/s, Drafted throughput: ([\d.]+) tokens/s, Accepted: (\d+) tokens, Drafted: "
    r"(\d+) tokens, Per-position acceptance rate: ([\d., ]+), Avg Draft acceptance rate: "
    r"([\d.]+)%"
)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


def _spec_lines(caplog: pytest.LogCaptureFixture) -> list[tuple[Any, ...]]:
    found = [
        SPEC_LINE.search(r.getMessage()) for r in caplog.records if r.name == STATS_LOGGER_NAME
    ]
    return [
        (
            float(m[1]),
            float(m[2]),
            float(m[3]),
            int(m[4]),
            int(m[5]),
            [float(x) for x in m[6].split(", ")],
            float(m[7]),
        )
        for m in found
        if m
    ]


def test_spec_decoding_line_has_the_interval_numbers(monkeypatch, caplog) -> None:
    caplog.set_level(logging.INFO, logger=STATS_LOGGER_NAME)
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    stat_logger = LoggingStatLogger(StatLoggerInfo("tiny", EngineConfig(speculative_config=NGRAM)))
    first = SchedulerStats(
        num_running=1,
        spec_num_drafts=4,
        spec_num_draft_tokens=12,
        spec_num_accepted_tokens=6,
        spec_num_accepted_tokens_per_pos=[3, 2, 1],
    )
    stat_logger.record(first, IterationStats(num_generation_tokens=10))
    clock[0] = 110.0
    stat_logger.log()
    # the next interval: 6 more drafts (18 tokens), 9 more accepted
    second = SchedulerStats(
        num_running=1,
        spec_num_drafts=10,
        spec_num_draft_tokens=30,
        spec_num_accepted_tokens=15,
        spec_num_accepted_tokens_per_pos=[9, 5, 2],
    )
    stat_logger.record(second, IterationStats(num_generation_tokens=15))
    clock[0] = 112.0
    stat_logger.log()
    stat_logger.record(second, IterationStats(num_generation_tokens=0))
    clock[0] = 120.0
    stat_logger.log()  # no drafts verified since: no SpecDecoding line
    assert _spec_lines(caplog) == [
        (2.5, 0.6, 1.2, 6, 12, [0.75, 0.5, 0.25], 50.0),
        (2.5, 4.5, 9.0, 9, 18, [1.0, 0.5, 0.167], 50.0),
    ]


def test_no_spec_decoding_line_without_speculation(caplog) -> None:
    caplog.set_level(logging.INFO, logger=STATS_LOGGER_NAME)
    stat_logger = LoggingStatLogger(INFO)
    stat_logger.record(SchedulerStats(spec_num_drafts=1), IterationStats(num_generation_tokens=1))
    stat_logger.log()
    assert _lines(caplog) and not _spec_lines(caplog)


def test_spec_decoding_line_matches_an_engines_counters(tiny_llama_dir, caplog) -> None:
    """A tiny engine with n-gram speculation: each line's Accepted / Drafted are the
    scheduler counters' (what /metrics exports) growth since the previous line, and its
    rates follow from the per-position counters."""
    from chassis import LLM

    caplog.set_level(logging.INFO, logger=STATS_LOGGER_NAME)
    llm = LLM(
        str(tiny_llama_dir),
        dtype="float32",
        max_model_len=128,
        num_kv_blocks=64,
        block_size=4,
        speculative_config=NGRAM,
        stat_loggers=["logging"],
        stat_log_interval=3600,  # the test calls log() itself
    )
    [logging_logger] = llm.stat_loggers
    prompts = ["a b c a b c a b c a b", "one two three one two three one two"]
    seen = [llm.engine.scheduler.stats()]
    for max_tokens in (24, 40):
        llm.generate(
            prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        )
        logging_logger.log()
        seen.append(llm.engine.scheduler.stats())
    llm.shutdown()
    lines = _spec_lines(caplog)
    assert len(lines) == 2
    for line, before, after in zip(lines, seen[:-1], seen[1:], strict=True):
        mean, _, _, accepted, drafted, per_pos, rate = line
        drafts = after.spec_num_drafts - before.spec_num_drafts
        assert drafted == after.spec_num_draft_tokens - before.spec_num_draft_tokens > 0
        assert accepted == after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
        assert drafts > 0 and mean == round(1 + accepted / drafts, 2)
        assert rate == round(accepted / drafted * 100, 1)
        assert len(per_pos) == NGRAM["num_speculative_tokens"]
        grown = [
            a - b
            for a, b in zip(
                after.spec_num_accepted_tokens_per_pos,
                before.spec_num_accepted_tokens_per_pos,
                strict=True,
            )
        ]
        assert sum(grown) == accepted
        assert per_pos == [round(g / drafts, 3) for g in grown]
