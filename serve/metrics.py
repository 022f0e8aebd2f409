"""Prometheus metrics of the API server: ``chassis:`` prefix, label ``model_name``.

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
"""

from __future__ import annotations

import logging
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


class _EngineStatsCollector(Collector):
    """Reads the engine's latest scheduler snapshot when Prometheus scrapes."""

    def __init__(self, model_name: str, stats: Callable[[], Any]) -> None:
        self.model_name = model_name
        self.stats = stats

    def collect(self) -> Iterable[Metric]:
        try:
            snapshot = self.stats()
        except Exception as exc:  # a dead engine must not break /metrics
            logger.debug("engine stats unavailable: %s", exc)
            snapshot = None
        labels = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        if snapshot is None:
            return

        def get(field: str) -> float:
            return float(getattr(snapshot, field, 0) or 0)

        yield gauge("num_requests_running", "Requests in the running batch.", get("num_running"))
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", get("num_waiting"))
        yield gauge(
            "kv_cache_usage_perc",
            "Fraction of KV-cache blocks in use (0 to 1).",
            get("kv_cache_usage"),
        )
        yield counter(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            get("prefix_cache_queries"),
        )
        yield counter(
            "prefix_cache_hits",
            "Prompt tokens found in the prefix cache.",
            get("prefix_cache_hits"),
        )
        yield counter(
            "num_preemptions", "Requests preempted for lack of KV blocks.", get("num_preemptions")
        )
        yield counter(
            "spec_decode_num_draft_tokens",
            "Draft tokens verified by speculative decoding.",
            get("spec_num_draft_tokens"),
        )
        yield counter(
            "spec_decode_num_accepted_tokens",
            "Draft tokens speculative decoding accepted.",
            get("spec_num_accepted_tokens"),
        )
        if get("max_loras"):
            # vLLM's lora_requests_info: the adapters in use as labels, the time as the value
            info = GaugeMetricFamily(
                PREFIX + "lora_requests_info",
                "LoRA adapters of the running and waiting requests.",
                labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            )
            info.add_metric(
                [
                    str(int(get("max_loras"))),
                    ",".join(snapshot.waiting_lora_adapters),
                    ",".join(snapshot.running_lora_adapters),
                ],
                time.time(),
            )
            yield info


class ServerMetrics:
    """The server's Prometheus registry for one served model.

    ``stats`` is called at scrape time and returns the engine's ``SchedulerStats`` (or raises
    when the engine is gone, which leaves the engine metrics out of that scrape).
    """

    def __init__(self, model_name: str, stats: Callable[[], Any]) -> None:
        self.model_name = model_name
        # No *_created series: they double the output and no chassis dashboard uses them.
        disable_created_metrics()
        self.registry = CollectorRegistry()
        reg = self.registry
        names = ["model_name"]
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens processed.", names, registry=reg
        ).labels(model_name)
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Tokens generated.", names, registry=reg
        ).labels(model_name)
        self._success = Counter(
            PREFIX + "request_success",
            "Finished completions, by finish reason.",
            [*names, "finished_reason"],
            registry=reg,
        )
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Seconds from the request's arrival at the server to its first generated token.",
            names,
            buckets=_TTFT_BUCKETS,
            registry=reg,
        ).labels(model_name)
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Seconds between successive outputs of a request, per generated token.",
            names,
            buckets=_ITL_BUCKETS,
            registry=reg,
        ).labels(model_name)
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Seconds from the request's arrival at the server to its last output.",
            names,
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        ).labels(model_name)
        self.queue_time = Histogram(
            PREFIX + "request_queue_time_seconds",
            "Seconds a request waited in the engine before it was first scheduled.",
            names,
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        ).labels(model_name)
        reg.register(_EngineStatsCollector(model_name, stats))

    def success(self, finished_reason: str) -> None:
        self._success.labels(self.model_name, finished_reason).inc()

    def observe_pooled(self, output: EmbeddingRequestOutput, seconds: float) -> None:
        """Count one finished pooling request (one input of a pooling route): its prompt
        tokens, its ``request_success`` (its finish reason, ``stop``), ``seconds`` (the
        server's time from sending it to the engine to its vector) as its end-to-end latency,
        and its queue time when the engine reported it."""
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.success(output.finish_reason)
        self.e2e.observe(seconds)
        observe_queue_time(self, getattr(output, "metrics", None))

    def tracker(self, n: int = 1) -> RequestTracker:
        """A tracker for one engine request of ``n`` completions, started now."""
        return RequestTracker(self, n)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestTracker:
    """Observes the outputs of one engine request (all ``n`` completions) as they stream."""

    def __init__(self, metrics: ServerMetrics, n: int = 1) -> None:
        self.metrics = metrics
        self.start = time.monotonic()
        self.last: float | None = None
        self.prompt_counted = False
        self.finished = False
        self.n = n
        #: completion indices whose finish reason was counted
        self.counted: set[int] = set()

    def observe(self, output: RequestOutput) -> None:
        """Record one delta-mode output of the request."""
        now = time.monotonic()
        if not self.prompt_counted:
            self.prompt_counted = True
            self.metrics.prompt_tokens.inc(len(output.prompt_token_ids))
            self._observe_queue_time(output)
        num_new = sum(len(c.token_ids) for c in output.outputs)
        if num_new:
            self.metrics.generation_tokens.inc(num_new)
            if self.last is None:
                self.metrics.ttft.observe(now - self.start)
            else:
                # A delta may carry several tokens (several completions, or a burst): spread it.
                per_token = (now - self.last) / num_new
                for _ in range(num_new):
                    self.metrics.itl.observe(per_token)
            self.last = now
        for completion in output.outputs:
            if completion.finish_reason is not None and completion.index not in self.counted:
                self.counted.add(completion.index)
                self.metrics.success(completion.finish_reason)
        if output.finished and not self.finished:
            self.finished = True
            self.metrics.e2e.observe(now - self.start)

    def close(self) -> None:
        """The request's stream ended: completions that never finished were aborted (the
        client went away, or the server shut down), and count as ``finished_reason="abort"``,
        as vLLM counts them."""
        for _ in range(self.n - len(self.counted)):
            self.metrics.success("abort")
        self.counted = set(range(self.n))

    def _observe_queue_time(self, output: RequestOutput) -> None:
        observe_queue_time(self.metrics, output.metrics)


def observe_queue_time(metrics: ServerMetrics, m: RequestMetrics | None) -> None:
    """Observe a request's queue time (arrival to first scheduling) when the engine reported
    when it was first scheduled."""
    queue_time = m.queue_time if m is not None and m.arrival_time else None
    if queue_time is not None:
        metrics.queue_time.observe(queue_time)
