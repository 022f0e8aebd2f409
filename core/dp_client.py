"""Data parallelism, the front-end's side: N engine cores behind one ``AsyncLLM``.

``--data-parallel-size N`` (``EngineConfig.data_parallel_size``): :class:`DataParallelClient`
starts N engine-core child processes at once, each an :class:`EngineCoreClient` of its own
with the whole model (its own executor, ``--tensor-parallel-size`` ranks, KV cache and
scheduler; engine ``i`` gets ``data_parallel_rank = i``, which places it:
:mod:`chassis.core.data_parallel`). It offers ``AsyncLLM`` the same surface as one
:class:`EngineCoreClient`:

* **Routing.** The engine requests of one prompt (``n`` > 1: one per completion, kept
  together so that they share the prompt's cached blocks) go to the engine with the fewest
  unfinished engine requests this front-end has sent it: sent and not yet finished (an
  output with a finish reason came back) nor aborted by the front-end. Ties go to the lowest
  index, so a burst alternates 0, 1, 0, 1, ... Everything later about a request (aborts) goes
  to its engine, and its outputs come back from it. vLLM's balancer scores engines by
  ``4 * waiting + running`` from counts the engines publish every few steps, because
  several front-ends share its engines; here one front-end owns its engines and knows
  their unfinished requests exactly and at once, which is what waiting plus running adds up
  to, without the lag. (It does not weight waiting more: a request waits on an engine only
  while that engine has more unfinished requests than it runs at once, which this count
  already holds against it.)
* **Outputs and stats.** Each engine's outputs reach ``on_outputs`` one message at a time
  (the engines' output threads take turns), marked with the engine's index
  (``EngineCoreOutputs.engine_index``: the requests' ``RequestMetrics.engine_index`` and the
  stat loggers' ``IterationStats.engine_index`` come from it), with the scheduler snapshot
  replaced by the sum over the engines' latest ones
  (:func:`~chassis.core.dp_combine.combine_scheduler_stats`); :attr:`engine_stats` keeps
  each engine's own (``/metrics`` labels them ``engine="i"``).
* **Utility calls** go to every engine; the caller gets one result
  (:func:`~chassis.core.dp_combine.combine_utility_results`) or the first engine's error
  (in engine order). A ``sleep`` that some engines refused (mode ``keep`` with requests
  running there) wakes the engines that did sleep before the error is raised.
* **Death.** One engine dying is the server's death, as with one engine: ``on_dead`` is
  called once (the reason names the engine) and the other engines are shut down.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import Any

from chassis.core.config import EngineConfig
from chassis.core.dp_combine import combine_scheduler_stats, combine_utility_results
from chassis.core.engine_client import EngineCoreClient
from chassis.core.engine_core import EngineInfo
from chassis.core.errors import EngineDeadError
from chassis.core.request import EngineCoreOutputs, EngineCoreRequest, SchedulerStats

logger = logging.getLogger(__name__)


def engine_config(config: EngineConfig, index: int) -> EngineConfig:
    """The settings engine ``index`` of ``config.data_parallel_size`` runs with."""
    own = copy.copy(config)
    own.data_parallel_rank = index
    return own


class DataParallelClient:
    """Runs ``config.data_parallel_size`` engine cores and routes requests between them
    (see the module docstring)."""

    def __init__(
        self,
        config: EngineConfig,
        on_outputs: Callable[[EngineCoreOutputs], None],
        on_dead: Callable[[str], None],
        while_starting: Callable[[], None] | None = None,
        *,
        client_class: type[EngineCoreClient] = EngineCoreClient,
    ) -> None:
        """Start every engine core (all loading at once) and return once all are ready, as
        :class:`EngineCoreClient` does for one; ``while_starting`` runs meanwhile in this
        thread. If any engine fails to start (or ``while_starting`` raises), every engine
        is stopped and that error is raised (:class:`EngineCoreClient`'s: ``ValueError``
        for settings the engine refused). ``on_outputs`` and ``on_dead`` are called from the
        clients' threads, never two ``on_outputs`` at once. ``client_class`` (tests: a
        fake) is built like :class:`EngineCoreClient` once per engine."""
        self.size = config.data_parallel_size
        self._on_outputs = on_outputs
        self._on_dead = on_dead
        #: guards the routing tables below
        self._lock = threading.Lock()
        #: engine of each unfinished engine request sent
        self._engine_of: dict[str, int] = {}
        self._num_unfinished = [0] * self.size
        #: engine requests sent to each engine since start
        self.num_sent = [0] * self.size
        #: the engines' output threads take turns through on_outputs (one at a time)
        self._outputs_lock = threading.Lock()
        self._stats = [SchedulerStats() for _ in range(self.size)]
        self._dead_lock = threading.Lock()
        self._dead_reason: str | None = None
        self._started = False
        self._stop_lock = threading.Lock()
        self._stopped: set[int] = set()
        self._stopper: threading.Thread | None = None
        self._client_class = client_class
        self.clients: list[EngineCoreClient] = self._start(config, while_starting)
        self._num_kv_blocks = [client.info.num_kv_blocks for client in self.clients]
        self._started = True
        if self._dead_reason is not None:  # one died between its start and now
            self.shutdown()
            raise EngineDeadError(self._dead_reason)
        logger.info(
            "data parallel: %d engines ready, %d KV blocks in all",
            self.size,
            sum(self._num_kv_blocks),
        )

    def _start(
        self, config: EngineConfig, while_starting: Callable[[], None] | None
    ) -> list[EngineCoreClient]:
        """Every engine's client, in engine order. The processes are all started from this
        thread (a child's parent-death signal fires when the thread that started it ends)
        before any is waited for: engine ``i``'s client starts engine ``i + 1``'s while its
        own child loads, the last one runs ``while_starting``. A client that fails kills its
        child; those already ready are shut down here."""
        ready: list[EngineCoreClient] = []

        def start_from(index: int) -> None:
            if index == self.size:
                if while_starting is not None:
                    while_starting()
                return
            ready.append(
                self._client_class(
                    engine_config(config, index),
                    functools.partial(self._outputs_of, index),
                    functools.partial(self._dead_of, index),
                    while_starting=lambda: start_from(index + 1),
                )
            )

        try:
            start_from(0)
        except BaseException:
            _shutdown_all(ready)
            raise
        return ready[::-1]  # the last engine was ready first

    # -- state ----------------------------------------------------------------------------

    @property
    def info(self) -> EngineInfo:
        """Engine 0's start-up report (the engines are alike; :attr:`infos` has each)."""
        return self.clients[0].info

    @property
    def infos(self) -> list[EngineInfo]:
        """Every engine's start-up report, in engine order."""
        return [client.info for client in self.clients]

    @property
    def is_alive(self) -> bool:
        return self._dead_reason is None and all(client.is_alive for client in self.clients)

    @property
    def num_unfinished(self) -> list[int]:
        """Per engine: the engine requests sent to it and not finished or aborted yet (what
        routing compares)."""
        with self._lock:
            return list(self._num_unfinished)

    @property
    def engine_stats(self) -> list[SchedulerStats]:
        """Per engine: the latest scheduler snapshot it sent (before summing)."""
        with self._outputs_lock:
            return list(self._stats)

    # -- requests -------------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        self.add_requests([request])

    def add_requests(self, requests: Iterable[EngineCoreRequest]) -> None:
        """Send the engine requests of one prompt to the least busy engine (one for all)."""
        requests = list(requests)
        if not requests:
            return
        with self._lock:
            # min() keeps the first of equals: ties go to the lowest index
            index = min(range(self.size), key=self._num_unfinished.__getitem__)
            for request in requests:
                self._engine_of[request.request_id] = index
            self._num_unfinished[index] += len(requests)
            self.num_sent[index] += len(requests)
        try:
            self.clients[index].add_requests(requests)
        except BaseException:
            self._forget(request.request_id for request in requests)
            raise

    def abort(self, request_ids: Iterable[str]) -> None:
        """Abort each request on its engine (unknown and finished ids are ignored)."""
        for index, ids in self._forget(request_ids).items():
            self.clients[index].abort(ids)

    def _forget(self, request_ids: Iterable[str]) -> dict[int, list[str]]:
        """Stop counting ``request_ids`` as unfinished; those that were, by engine."""
        by_engine: dict[int, list[str]] = {}
        with self._lock:
            for request_id in request_ids:
                index = self._engine_of.pop(request_id, None)
                if index is not None:
                    self._num_unfinished[index] -= 1
                    by_engine.setdefault(index, []).append(request_id)
        return by_engine

    def _outputs_of(self, index: int, outputs: EngineCoreOutputs) -> None:
        """Engine ``index``'s output thread: count its finished requests, sum the stats,
        pass the message on."""
        with self._outputs_lock:
            finished = [o.request_id for o in outputs.outputs if o.finished]
            if finished:
                self._forget(finished)
            outputs.engine_index = index  # per-engine metrics (RequestMetrics, stat loggers)
            if outputs.stats is not None:
                self._stats[index] = outputs.stats
                outputs.stats = combine_scheduler_stats(self._stats, self._num_kv_blocks)
            self._on_outputs(outputs)

    # -- utility calls --------------------------------------------------------------------

    def call_utility(self, method: str, *args: Any) -> Future[Any]:
        """Run engine utility ``method(*args)`` on every engine; the future gets the one
        combined result, or the first engine's error (see the module docstring).
        :class:`EngineDeadError` at once when an engine is not running."""
        futures = [client.call_utility(method, *args) for client in self.clients]
        combined: Future[Any] = Future()
        remaining = [len(futures)]
        count_lock = threading.Lock()

        def one_done(_: Future[Any]) -> None:
            with count_lock:
                remaining[0] -= 1
                if remaining[0]:
                    return
            self._settle(method, futures, combined)

        for future in futures:
            future.add_done_callback(one_done)
        return combined

    def _settle(self, method: str, futures: Sequence[Future[Any]], combined: Future[Any]) -> None:
        errors = [future.exception() for future in futures]
        failed = next((e for e in errors if e is not None), None)
        if failed is None:
            try:
                combined.set_result(combine_utility_results(method, [f.result() for f in futures]))
            except Exception as exc:
                combined.set_exception(exc)
            return
        if method == "sleep":
            # The engines that slept wake up again (in their queue before any later
            # request), so that the server is awake as the error says.
            for client, future, error in zip(self.clients, futures, errors, strict=True):
                if error is None and future.result():
                    with contextlib.suppress(EngineDeadError):
                        client.call_utility("wake_up", None)
        combined.set_exception(failed)

    # -- death and shutdown ---------------------------------------------------------------

    def _dead_of(self, index: int, reason: str) -> None:
        """Engine ``index`` died: the server is dead; stop the other engines."""
        with self._dead_lock:
            if self._dead_reason is not None:
                return
            self._dead_reason = reason = f"data-parallel engine {index}: {reason}"
        if not self._started:  # __init__ raises it once every engine has started
            return
        self._on_dead(reason)
        others = [i for i in range(self.size) if i != index]
        self._stopper = threading.Thread(
            target=self._stop, args=(others,), daemon=True, name="chassis-dp-stop"
        )
        self._stopper.start()

    def _stop(self, indices: Sequence[int]) -> None:
        """Shut down engines ``indices`` (each once, whoever asks), concurrently."""
        with self._stop_lock:
            todo = [i for i in indices if i not in self._stopped]
            self._stopped.update(todo)
        _shutdown_all([self.clients[i] for i in todo])

    def shutdown(self) -> None:
        """Shut down every engine core (concurrently) and wait until all have exited."""
        self._stop(range(len(self.clients)))
        stopper = self._stopper
        if stopper is not None and stopper is not threading.current_thread():
            stopper.join()


def _shutdown_all(clients: Sequence[EngineCoreClient]) -> None:
    """``shutdown()`` each client, in threads of their own (each waits for its process)."""
    threads = [threading.Thread(target=client.shutdown, daemon=True) for client in clients]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
