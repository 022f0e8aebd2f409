"""Prometheus metrics of the API server: ``chassis:`` prefix, labels ``model_name`` and
``engine`` (the engine core's index, ``"0"`` with one engine; as vLLM's series are labelled).

Two kinds, one registry per app (never the process-global default registry, so several apps
in one process, as in tests, do not collide):

* read from the engine at scrape time (``engine.stats()``, the scheduler's latest snapshot):
  ``chassis:num_requests_running``, ``chassis:num_requests_waiting``,
  ``chassis:kv_cache_usage_perc`` (gauges) and ``chassis:prefix_cache_queries_total``,
  ``chassis:prefix_cache_hits_total``, ``chassis:num_preemptions_total``,
  ``chassis:spec_decode_num_draft_tokens_total``, ``chassis:spec_decode_num_accepted_tokens_total``
  (counters: the engine's cumulative counts);
* observed by the server per request, from its own clock: ``chassis:prompt_tokens_total``,
  ``chassis:generation_tokens_total``, ``chassis:request_success_total{finished_reason}``
  (one per finished completion, so ``n=2`` counts two), and the histograms
  ``chassis:time_to_first_token_seconds``, ``chassis:inter_token_latency_seconds``,
  ``chassis:e2e_request_latency_seconds``, ``chassis:request_queue_time_seconds`` (arrival to
  the engine core's first scheduling, which the engine reports with the first output).
  Pooling requests (each input of ``/v1/embeddings``, ``/pooling``, ``/classify``, ``/score``,
  ``/rerank``) count too (:meth:`ServerMetrics.observe_pooled`): their prompt tokens, one
  ``request_success`` each (``stop``; ``abort`` when aborted), their end-to-end latency and
  queue time; they generate nothing, so they add no generation tokens, time to first token or
  inter-token latency, as in vLLM.

Every series is per engine (``--data-parallel-size N``: ``engine="0"`` .. ``"N-1"``, each
created at start so that a dashboard sees all N from the first scrape): the snapshot series
are each engine's own latest snapshot (the engine's ``engine_stats()``), the per-request series
count a request under the engine that ran it (``RequestMetrics.engine_index`` of its outputs).
Summing over ``engine`` gives the server's totals. A request the server counts without an
engine output to tell its engine (aborted before its first output, or a beam search, whose
step requests may run on several engines) counts under engine ``"0"``.

The front-end's processed-item cache adds ``chassis:mm_cache_queries_total`` and
``chassis:mm_cache_hits_total`` (:mod:`chassis.serve.mm_cache_metrics`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from chassis.core.outputs import RequestMetrics, RequestOutput
    from chassis.core.pooling_outputs import EmbeddingRequestOutput

logger = logging.getLogger(__name__)

PREFIX = "chassis:"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


#: the labels of every series (``request_success`` adds ``finished_reason``)
LABELS = ["model_name", "engine"]

#: (series, help, ``SchedulerStats`` field) read from each engine's snapshot at scrape time
_SNAPSHOT_GAUGES = (
    ("num_requests_running", "Requests in the running batch.", "num_running"),
    ("num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting"),
    ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).", "kv_cache_usage"),
)
_SNAPSHOT_COUNTERS = (
    (
        "prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache.",
        "prefix_cache_queries",
    ),
    ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
    ("num_preemptions", "Requests preempted for lack of KV blocks.", "num_preemptions"),
    (
        "spec_decode_num_draft_tokens",
        "Draft tokens verified by speculative decoding.",
        "spec_num_draft_tokens",
    ),
    (
        "spec_decode_num_accepted_tokens",
        "Draft tokens speculative decoding accepted.",
        "spec_num_accepted_tokens",
    ),
)


def _snapshots(value: Any) -> list[Any]:
    """What a ``stats`` callable returned as one snapshot per engine, in engine order: a
    list or tuple is already that; one snapshot is engine 0's; ``None`` is none."""
    if value is None:
        return []
    if isinstance(value, list | tuple):
        return list(value)
    return [value]


class _EngineStatsCollector(Collector):
    """Reads each engine's latest scheduler snapshot when Prometheus scrapes."""

    def __init__(self, model_name: str, stats: Callable[[], Any]) -> None:
        self.model_name = model_name
        self.stats = stats

    def collect(self) -> Iterable[Metric]:
        try:
            snapshots = _snapshots(self.stats())
        except Exception as exc:  # a dead engine must not break /metrics
            logger.debug("engine stats unavailable: %s", exc)
            return
        if not snapshots:
            return

        def get(snapshot: Any, field: str) -> float:
            return float(getattr(snapshot, field, 0) or 0)

        def family(kind: type[Metric], name: str, doc: str, field: str) -> Metric:
            metric = kind(PREFIX + name, doc, labels=LABELS)
            for index, snapshot in enumerate(snapshots):
                metric.add_metric([self.model_name, str(index)], get(snapshot, field))
            return metric

        for name, doc, field in _SNAPSHOT_GAUGES:
            yield family(GaugeMetricFamily, name, doc, field)
        for name, doc, field in _SNAPSHOT_COUNTERS:
            yield family(CounterMetricFamily, name, doc, field)
        if get(snapshots[0], "max_loras"):
            # vLLM's lora_requests_info: the adapters in use as labels, the time as the value
            info = GaugeMetricFamily(
                PREFIX + "lora_requests_info",
                "LoRA adapters of the running and waiting requests.",
                labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters", "engine"],
            )
            now = time.time()
            for index, snapshot in enumerate(snapshots):
                info.add_metric(
                    [
                        str(int(get(snapshot, "max_loras"))),
                        ",".join(snapshot.waiting_lora_adapters),
                        ",".join(snapshot.running_lora_adapters),
                        str(index),
                    ],
                    now,
                )
            yield info


class EngineSeries:
    """The per-request series of one engine (its ``model_name`` and ``engine`` labels
    bound): what a :class:`RequestTracker` and the other counting code increment."""

    def __init__(self, metrics: ServerMetrics, index: int) -> None:
        values = (metrics.model_name, str(index))
        self._success = metrics._success
        self._values = values
        self.prompt_tokens = metrics._prompt_tokens.labels(*values)
        self.generation_tokens = metrics._generation_tokens.labels(*values)
        self.ttft = metrics._ttft.labels(*values)
        self.itl = metrics._itl.labels(*values)
        self.e2e = metrics._e2e.labels(*values)
        self.queue_time = metrics._queue_time.labels(*values)

    def success(self, finished_reason: str) -> None:
        """One finished completion (or pooled input) with ``finished_reason``."""
        self._success.labels(*self._values, finished_reason).inc()


class ServerMetrics:
    """The server's Prometheus registry for one served model.

    ``stats`` is called at scrape time and returns each engine's latest ``SchedulerStats``,
    a list in engine order (or one snapshot: engine 0's; it may raise when the engine is
    gone, which leaves the engine metrics out of that scrape). ``num_engines`` engines'
    per-request series exist from the start (zero until counted); a later index still
    counts, its series created then.
    """

    def __init__(self, model_name: str, stats: Callable[[], Any], num_engines: int = 1) -> None:
        self.model_name = model_name
        # No *_created series: they double the output and no chassis dashboard uses them.
        disable_created_metrics()
        self.registry = CollectorRegistry()
        reg = self.registry
        self._prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens processed.", LABELS, registry=reg
        )
        self._generation_tokens = Counter(
            PREFIX + "generation_tokens", "Tokens generated.", LABELS, registry=reg
        )
        self._success = Counter(
            PREFIX + "request_success",
            "Finished completions, by finish reason.",
            [*LABELS, "finished_reason"],
            registry=reg,
        )
        self._ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Seconds from the request's arrival at the server to its first generated token.",
            LABELS,
            buckets=_TTFT_BUCKETS,
            registry=reg,
        )
        self._itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Seconds between successive outputs of a request, per generated token.",
            LABELS,
            buckets=_ITL_BUCKETS,
            registry=reg,
        )
        self._e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Seconds from the request's arrival at the server to its last output.",
            LABELS,
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self._queue_time = Histogram(
            PREFIX + "request_queue_time_seconds",
            "Seconds a request waited in the engine before it was first scheduled.",
            LABELS,
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self._engines_lock = threading.Lock()
        self._engines: dict[int, EngineSeries] = {}
        for index in range(max(1, num_engines)):
            self.engine(index)
        reg.register(_EngineStatsCollector(model_name, stats))

    @classmethod
    def of_engine(cls, engine: Any) -> ServerMetrics:
        """The metrics of the server of ``engine`` (the ``AsyncLLM`` contract of
        serve/state.py): per-engine snapshots from its ``engine_stats()`` when it has one,
        else its ``stats()``; one engine per entry of its ``engine_infos`` when it has them."""
        stats = getattr(engine, "engine_stats", None) or engine.stats
        infos = getattr(engine, "engine_infos", None)
        num_engines = len(infos) if isinstance(infos, list | tuple) and infos else 1
        metrics = cls(engine.model_name, stats, num_engines)
        from chassis.serve.mm_cache_metrics import register_item_cache_metrics

        register_item_cache_metrics(metrics.registry, engine.model_name, engine)
        return metrics

    def engine(self, index: int) -> EngineSeries:
        """Engine ``index``'s per-request series."""
        series = self._engines.get(index)
        if series is None:
            with self._engines_lock:
                series = self._engines.setdefault(index, EngineSeries(self, index))
        return series

    # Engine 0's series, for counts that belong to no one engine output (a beam search).

    @property
    def prompt_tokens(self) -> Any:
        return self.engine(0).prompt_tokens

    @property
    def generation_tokens(self) -> Any:
        return self.engine(0).generation_tokens

    @property
    def e2e(self) -> Any:
        return self.engine(0).e2e

    def success(self, finished_reason: str, engine_index: int = 0) -> None:
        """One finished completion of engine ``engine_index`` with ``finished_reason``."""
        self.engine(engine_index).success(finished_reason)

    def observe_pooled(self, output: EmbeddingRequestOutput, seconds: float) -> None:
        """Count one finished pooling request (one input of a pooling route) under the engine
        that ran it: its prompt tokens, its ``request_success`` (its finish reason,
        ``stop``), ``seconds`` (the server's time from sending it to the engine to its
        vector) as its end-to-end latency, and its queue time when the engine reported it."""
        m = getattr(output, "metrics", None)
        series = self.engine(engine_index_of(m))
        series.prompt_tokens.inc(len(output.prompt_token_ids))
        series.success(output.finish_reason)
        series.e2e.observe(seconds)
        observe_queue_time(series, m)

    def tracker(self, n: int = 1) -> RequestTracker:
        """A tracker for one engine request of ``n`` completions, started now."""
        return RequestTracker(self, n)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestTracker:
    """Observes the outputs of one engine request (all ``n`` completions) as they stream,
    counted under the engine its first output names."""

    def __init__(self, metrics: ServerMetrics, n: int = 1) -> None:
        self.metrics = metrics
        self.start = time.monotonic()
        self.last: float | None = None
        #: the series of the request's engine, known from its first output
        self.series: EngineSeries | None = None
        self.finished = False
        self.n = n
        #: completion indices whose finish reason was counted
        self.counted: set[int] = set()

    def observe(self, output: RequestOutput) -> None:
        """Record one delta-mode output of the request."""
        now = time.monotonic()
        series = self.series
        if series is None:
            series = self.series = self.metrics.engine(engine_index_of(output.metrics))
            series.prompt_tokens.inc(len(output.prompt_token_ids))
            observe_queue_time(series, output.metrics)
        num_new = sum(len(c.token_ids) for c in output.outputs)
        if num_new:
            series.generation_tokens.inc(num_new)
            if self.last is None:
                series.ttft.observe(now - self.start)
            else:
                # A delta may carry several tokens (several completions, or a burst): spread it.
                per_token = (now - self.last) / num_new
                for _ in range(num_new):
                    series.itl.observe(per_token)
            self.last = now
        for completion in output.outputs:
            if completion.finish_reason is not None and completion.index not in self.counted:
                self.counted.add(completion.index)
                series.success(completion.finish_reason)
        if output.finished and not self.finished:
            self.finished = True
            series.e2e.observe(now - self.start)

    def close(self) -> None:
        """The request's stream ended: completions that never finished were aborted (the
        client went away, or the server shut down), and count as ``finished_reason="abort"``,
        as vLLM counts them (under engine 0 when no output ever named the engine)."""
        series = self.series or self.metrics.engine(0)
        for _ in range(self.n - len(self.counted)):
            series.success("abort")
        self.counted = set(range(self.n))


def engine_index_of(m: RequestMetrics | None) -> int:
    """The engine a request's metrics name (0 when they name none)."""
    return 0 if m is None else int(getattr(m, "engine_index", 0) or 0)


def observe_queue_time(series: EngineSeries, m: RequestMetrics | None) -> None:
    """Observe a request's queue time (arrival to first scheduling) in ``series`` when the
    engine reported when it was first scheduled."""
    queue_time = m.queue_time if m is not None and m.arrival_time else None
    if queue_time is not None:
        series.queue_time.observe(queue_time)
