"""One answer from several engines' (data parallelism): scheduler stats and utility results.

:class:`~chassis.core.dp_client.DataParallelClient` sends every utility call to every engine
and hands the front-end one result (:func:`combine_utility_results`), and replaces each
engine's scheduler snapshot by the sum over engines (:func:`combine_scheduler_stats`), so
that ``AsyncLLM``, ``/metrics`` and the stat loggers read the server as one engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from chassis.core.request import SchedulerStats


def combine_scheduler_stats(
    stats: Sequence[SchedulerStats], num_kv_blocks: Sequence[int]
) -> SchedulerStats:
    """The engines' latest snapshots as one: queue lengths and the cumulative counters
    (prefix-cache lookups and hits, preemptions, speculative decoding, per draft position)
    summed; KV cache usage the used blocks of all engines over all their blocks
    (``num_kv_blocks[i]`` is engine ``i``'s; the plain mean when the engines are alike);
    the LoRA adapters in use the sorted union of the engines'."""
    total_blocks = sum(num_kv_blocks)
    used = sum(s.kv_cache_usage * n for s, n in zip(stats, num_kv_blocks, strict=True))
    per_pos: list[int] = []
    for s in stats:
        for pos, count in enumerate(s.spec_num_accepted_tokens_per_pos):
            if pos == len(per_pos):
                per_pos.append(0)
            per_pos[pos] += count
    return SchedulerStats(
        num_running=sum(s.num_running for s in stats),
        num_waiting=sum(s.num_waiting for s in stats),
        kv_cache_usage=used / total_blocks if total_blocks else 0.0,
        prefix_cache_queries=sum(s.prefix_cache_queries for s in stats),
        prefix_cache_hits=sum(s.prefix_cache_hits for s in stats),
        num_preemptions=sum(s.num_preemptions for s in stats),
        spec_num_draft_tokens=sum(s.spec_num_draft_tokens for s in stats),
        spec_num_accepted_tokens=sum(s.spec_num_accepted_tokens for s in stats),
        spec_num_drafts=sum(s.spec_num_drafts for s in stats),
        spec_num_accepted_tokens_per_pos=per_pos,
        max_loras=max(s.max_loras for s in stats),
        running_lora_adapters=sorted({a for s in stats for a in s.running_lora_adapters}),
        waiting_lora_adapters=sorted({a for s in stats for a in s.waiting_lora_adapters}),
    )


def _union(results: Sequence[Any]) -> list[str]:
    return sorted({tag for tags in results for tag in tags})


def _sleep(results: Sequence[Any]) -> list[str]:
    # [] while any engine still waits for its requests to finish (mode "wait"): the caller
    # then polls sleep_progress until every engine sleeps
    return [] if any(not tags for tags in results) else _union(results)


def _sleep_progress(results: Sequence[Any]) -> list[Any]:
    waiting = any(bool(r[0]) for r in results)
    error = next((r[2] for r in results if r[2] is not None), None)
    # the parts asleep once every engine is done waiting; none when one failed to sleep
    tags = [] if waiting or error is not None else _union([r[1] for r in results])
    return [waiting, tags, error]


#: engine utility -> how its per-engine results (in engine order) make one
_COMBINERS: dict[str, Callable[[Sequence[Any]], Any]] = {
    "reset_prefix_cache": lambda results: all(bool(r) for r in results),
    "sleep": _sleep,
    "sleep_progress": _sleep_progress,
    "wake_up": _union,  # the parts still asleep on any engine
    "is_sleeping": lambda results: any(bool(r) for r in results),
    "pause": lambda results: all(bool(r) for r in results),  # every engine drained
    "pause_drained": lambda results: all(bool(r) for r in results),
    "resume": lambda results: None,
    "is_paused": lambda results: any(bool(r) for r in results),
}


def combine_utility_results(method: str, results: Sequence[Any]) -> Any:
    """The one result of utility ``method`` that ran on every engine and returned
    ``results`` (engine order): a bool that must hold everywhere (``reset_prefix_cache``,
    ``pause``, ``pause_drained``) is the ``all`` of them; a state any engine being in puts
    the server in (``is_sleeping``, ``is_paused``) is the ``any``; parts asleep (``sleep``,
    ``wake_up``, ``sleep_progress``) are the union, ``sleep`` answering ``[]`` while an
    engine still waits to sleep. A method without a rule gets the list of results."""
    combine = _COMBINERS.get(method)
    return list(results) if combine is None else combine(results)
