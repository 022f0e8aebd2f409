"""``/metrics`` series of the front-end's processed-item cache (``--mm-processor-cache-gb``,
:mod:`chassis.core.multimodal_item_cache`): ``chassis:mm_cache_queries_total`` (items looked
up) and ``chassis:mm_cache_hits_total`` (items found, whose processing was skipped), vLLM's
``vllm:mm_cache_queries`` / ``vllm:mm_cache_hits`` under chassis' prefix.

The cache is the front-end's, one for all engines: its series carry ``engine="0"`` (as the
server's other counts that belong to no one engine). Read at scrape time; absent when the
engine has no cache (``--mm-processor-cache-gb 0``, or an engine without the input
processor).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from chassis.serve.metrics import LABELS, PREFIX


def engine_item_cache(engine: Any) -> Any:
    """``engine``'s processed-item cache (its input processor's), or ``None``."""
    multimodal = getattr(getattr(engine, "input_processor", None), "multimodal", None)
    return getattr(multimodal, "item_cache", None)


class _ItemCacheCollector(Collector):
    def __init__(self, model_name: str, cache: Any) -> None:
        self.model_name = model_name
        self.cache = cache

    def collect(self) -> Iterable[Metric]:
        stats = self.cache.stats()
        for name, doc, value in (
            ("mm_cache_queries", "Multimodal items looked up in the processed-item cache.",
             stats.queries),
            ("mm_cache_hits", "Multimodal items found in the processed-item cache.", stats.hits),
        ):  # fmt: skip
            metric = CounterMetricFamily(PREFIX + name, doc, labels=LABELS)
            metric.add_metric([self.model_name, "0"], float(value))
            yield metric


def register_item_cache_metrics(registry: CollectorRegistry, model_name: str, engine: Any) -> None:
    """Add the cache's series (module docstring) to ``registry`` when ``engine`` has one."""
    cache = engine_item_cache(engine)
    if cache is not None:
        registry.register(_ItemCacheCollector(model_name, cache))
