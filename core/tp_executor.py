"""Tensor parallelism: one model sharded over N processes (``--tensor-parallel-size N``).

:class:`TensorParallelExecutor` is the executor of an engine whose config asks for more than
one rank. Rank 0 (the driver) runs in the engine-core process; ranks 1..N-1 are processes of
their own (``chassis.core.tp_worker_proc``), started here and joined with the driver in one
``torch.distributed`` group over the platform's ``dist_backend``, each on the device
``Platform.tensor_parallel_devices`` gives it. Every step the driver sends the plan (a
msgspec-encoded :class:`SchedulerOutput`) to every rank and runs it itself; all ranks run the
same forward (each with its shard of the weights and of the KV heads, summing partial results
with all-reduces), and rank 0's sampled ids are broadcast so every rank's batch continues from
the same tokens. The driver returns its own result, after checking that every rank appended
the same ids to the same rows and finished the same pooling requests (else the ranks'
batches differ; :func:`step_summary`). A pooling engine's ranks all compute the full hidden
states and pool them alike (keeping the same per-request state); only the driver's vectors
are returned. A step that has not completed on every rank within
``--execute-model-timeout-s`` fails with a ``StepTimeoutError`` naming the ranks that have
not answered, after logging where each one is (:mod:`chassis.core.tp_watchdog`).
docs/architecture.md has the failure handling.

Pipeline parallelism (``--pipeline-parallel-size M``, tensor parallelism 1) runs on the same
carrier: the M ranks are pipeline stages, each holding its run of the decoder layers, which
pass the hidden states stage to stage inside the forward; the last stage's logits are
broadcast, so every rank samples and is checked as above (``chassis.core.pipeline_parallel``).

Graph capture and ``torch.compile`` are not used with more than one rank (not validated with
collectives yet); async scheduling runs, without overlap.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from abc import abstractmethod
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
import torch
import zmq

from chassis.core import parallel_state
from chassis.core.config import EngineConfig
from chassis.core.data_parallel import engine_rank_devices, host_threads
from chassis.core.errors import RankExitedError
from chassis.core.executor import Executor
from chassis.core.kv_cache_groups import single_group_window
from chassis.core.lora.request import LoRARequest
from chassis.core.scheduler_interface import ModelRunnerOutput, SchedulerOutput
from chassis.core.tp_join import wait_for_every_rank
from chassis.core.tp_watchdog import (
    StepTimeout,
    StepWatchdog,
    driver_stack,
    file_size,
    read_new_text,
    stack_path,
)
from chassis.core.tp_worker_proc import (
    EXECUTE,
    INIT,
    INIT_CACHE,
    NUM_BLOCKS,
    PIN_LORA,
    SHUTDOWN,
    SLEEP,
    UNPIN_LORA,
    WAKE_UP,
    command_address,
    rendezvous,
    reply_address,
    try_pin_lora,
)
from chassis.core.worker import Worker

logger = logging.getLogger(__name__)

#: how long the driver waits for a rank's reply before checking that the rank still lives
_POLL_MS = 1000
_SHUTDOWN_WAIT_S = 10.0
#: how long a failed rank-0 step waits for the failing rank's own error
_FAILURE_WAIT_S = 3.0

T = TypeVar("T")

_encoder = msgspec.msgpack.Encoder()
_reply_decoder = msgspec.msgpack.Decoder(tuple[int, bool, Any])


def start_rank(config: EngineConfig, rank: int, ipc_dir: str, watch: Callable[[], None]) -> Worker:
    """In the process of ``rank``: join the group whose directory is ``ipc_dir``, then load
    this rank's share of the model on its device (the cores split evenly when ranks share a
    host). Every rank first waits for the others in Python, calling ``watch`` (which raises
    to stop waiting: :func:`chassis.core.tp_join.wait_for_every_rank`), so that a rank that
    fails before joining cannot leave another blocked in ``init_process_group``."""
    from chassis.platforms import get_current_platform

    platform = get_current_platform()
    size = config.world_size  # (tensor-parallel ranks, or pipeline stages)
    device = engine_rank_devices(config)[rank]  # (this engine's, with data parallelism)
    # every rank of every engine (data parallelism) gets an equal share of the host's cores
    torch.set_num_threads(host_threads(size * config.data_parallel_size))
    wait_for_every_rank(ipc_dir, rank, size, watch)
    parallel_state.init_tensor_parallel(
        rank,
        config.tensor_parallel_size,
        platform.dist_backend,
        rendezvous(ipc_dir),
        expert_parallel=config.enable_expert_parallel,
        pipeline_size=config.pipeline_parallel_size,
    )
    return Worker(config, device_index=device)


def run_command(worker: Worker, method: str, payload: Any, rank: int = 0) -> Any:
    """Run one command of the step protocol (``payload`` decoded) on rank ``rank``'s
    ``worker`` and return that rank's reply: the command's result, except that ranks other
    than 0 answer ``execute`` with the step's :func:`step_summary` instead of the whole
    :class:`ModelRunnerOutput`. ``ValueError`` for an unknown command. Every carrier runs
    commands through here: rank 0 in the driver, worker processes
    (``chassis.core.tp_worker_proc``), Ray actors (``chassis.core.ray_executor``)."""
    if method == NUM_BLOCKS:
        return worker.determine_num_blocks()
    if method == INIT_CACHE:
        worker.initialize_cache(payload)
        return None
    if method == EXECUTE:
        output = worker.execute_model(payload)
        return step_summary(output) if rank else output
    if method == PIN_LORA:
        return try_pin_lora(worker, payload)
    if method == UNPIN_LORA:
        if worker.lora is not None:
            worker.lora.unpin(payload)
        return None
    if method == SLEEP:
        worker.sleep(payload)
        return None
    if method == WAKE_UP:
        worker.wake_up(list(payload))
        return None
    raise ValueError(f"unknown command {method!r}")


class RankGroupExecutor(Executor):
    """What every executor of a group of ranks does the same way, whatever carries its
    commands (worker processes here, Ray actors in ``chassis.core.ray_executor``): the
    settings check before any rank starts, and the step protocol. A subclass sets
    :attr:`size`, :attr:`_broken` and :attr:`_lora_shapes` and implements
    :meth:`_run_on_all`."""

    #: the number of ranks
    size: int
    #: why the group cannot run any more (a rank failed or died), once it cannot
    _broken: str | None = None
    #: rank 0's LoRA target shapes (the same on every rank); None without ``--enable-lora``
    _lora_shapes: dict[str, tuple[int, int]] | None = None
    #: rank 0's ``Worker.kv_cache_group_windows`` (the same on every rank: windows are not
    #: sharded)
    _kv_group_windows: tuple[int | None, ...] = (None,)
    #: rank 0's ``Worker.kv_cache_group_chunks`` (likewise the same on every rank)
    _kv_group_chunks: tuple[int | None, ...] = (None,)

    @staticmethod
    def _group_config(config: EngineConfig) -> EngineConfig:
        """``config`` as a group runs it: ``ValueError`` for ``--torch-compile`` and for a
        model that cannot be sharded over ``tensor_parallel_size`` ranks (checked before any
        rank starts); device graphs off."""
        if config.torch_compile:
            raise ValueError("--torch-compile cannot be combined with --tensor-parallel-size > 1")
        if not config.enforce_eager:
            logger.info("tensor parallel: device graphs are off (not validated with collectives)")
            config = dataclasses.replace(config, enforce_eager=True)
        if config.pipeline_parallel_size > 1 and config.sliding_window_kv_release:
            # A stage plans KV cache groups and windows from its own layers, which may slide
            # where another stage's do not, while the scheduler follows rank 0's: keep every
            # block instead (one group; each layer masks its own window).
            logger.info("pipeline parallel: the sliding-window KV release is off")
            config = dataclasses.replace(config, sliding_window_kv_release=False)
        _check_model_splits(config)
        return config

    @abstractmethod
    def _run_on_all(self, method: str, payload: Any) -> list[Any]:
        """Run ``method`` on every rank; rank 0's whole result, then every other rank's reply
        by rank (``execute``: its :func:`step_summary`). A rank's failure raises and sets
        :attr:`_broken`; a broken group raises (:meth:`_refuse_if_broken`)."""

    def _refuse_if_broken(self) -> None:
        """``RuntimeError`` when the group cannot run any more."""
        if self._broken is not None:
            raise RuntimeError(
                f"the tensor-parallel group cannot run any more ({self._broken}); restart "
                "the engine"
            )

    # -- the Executor interface ---------------------------------------------------------------

    def kv_cache_window(self) -> int | None:
        return single_group_window(self._kv_group_windows)

    def kv_cache_group_windows(self) -> tuple[int | None, ...]:
        return self._kv_group_windows

    def kv_cache_group_chunks(self) -> tuple[int | None, ...]:
        return self._kv_group_chunks

    def lora_target_shapes(self) -> dict[str, tuple[int, int]] | None:
        # whole shapes, the same on every rank: the driver's answer
        return None if self._lora_shapes is None else dict(self._lora_shapes)

    def pin_lora(self, lora_request: LoRARequest) -> None:
        if self._lora_shapes is None:
            return
        failures = self._run_on_all(PIN_LORA, lora_request)
        reason = next((f for f in failures if f is not None), None)
        if reason is not None:  # every rank or none: unpin where it was pinned
            self.unpin_lora(lora_request.lora_int_id)
            raise ValueError(reason)

    def unpin_lora(self, lora_id: int) -> None:
        if self._lora_shapes is None:
            return
        self._run_on_all(UNPIN_LORA, lora_id)

    def determine_num_blocks(self) -> int:
        return min(self._run_on_all(NUM_BLOCKS, None))

    def initialize_cache(self, num_blocks: int) -> None:
        self._run_on_all(INIT_CACHE, num_blocks)

    def sleep(self, level: int) -> None:
        self._run_on_all(SLEEP, level)  # every rank, each its own shard

    def wake_up(self, tags: list[str]) -> None:
        self._run_on_all(WAKE_UP, list(tags))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        output, *summaries = self._run_on_all(EXECUTE, scheduler_output)
        own = step_summary(output)
        for rank, summary in enumerate(summaries, start=1):
            # Every rank continues from rank 0's sampled ids (broadcast), so a difference
            # means the ranks' batches are laid out differently: outputs would be wrong.
            if summary != own:
                self._broken = f"rank {rank}'s batch differs from rank 0's"
                raise RuntimeError(
                    f"tensor-parallel rank {rank} returned {summary} where rank 0 returned "
                    f"{own}: the ranks' batches differ"
                )
        return output


class TensorParallelExecutor(RankGroupExecutor):
    """The driver of N ranks (see the module docstring). Raises ``ValueError`` for settings the
    group cannot run (more ranks than devices, heads that do not split evenly, a model that
    cannot be sharded) after stopping every rank it started."""

    def __init__(self, config: EngineConfig) -> None:
        self.size = config.world_size
        engine_rank_devices(config)  # enough devices?
        config = self._group_config(config)  # before any process starts
        self._broken = None
        #: what the step watchdog found, once a step timed out (then raised for
        #: that step as :class:`StepTimeoutError`)
        self._timed_out: StepTimeout | None = None
        #: the ranks that have answered the command in flight (the watchdog reads it)
        self._answered: set[int] = set()
        self._ranks = _Ranks(self.size)
        self._watchdog = (
            StepWatchdog(config.execute_model_timeout_s, self._step_timed_out)
            if config.execute_model_timeout_s > 0
            else None
        )
        # Stop the ranks when the engine is dropped without shutdown() (an LLM going away).
        self._finalizer = weakref.finalize(self, _stop, self._ranks, self._watchdog)
        try:
            self._send(INIT, config.to_dict())
            self._collect(INIT)  # every rank started and joins the group now
            # (a rank that exits before joining ends rank 0's wait for the group)
            watch = functools.partial(self._raise_if_a_rank_exited, INIT)
            self.worker = self._on_driver(
                INIT, lambda: start_rank(config, 0, self._ranks.ipc_dir, watch)
            )
            self._collect(INIT)
        except BaseException:
            self.shutdown()
            raise
        lora = self.worker.lora
        self._lora_shapes = None if lora is None else dict(lora.target_shapes)
        self._kv_group_windows = self.worker.kv_cache_group_windows()
        self._kv_group_chunks = self.worker.kv_cache_group_chunks()
        logger.info("tensor parallel: %d ranks ready", self.size)

    def _run_on_all(self, method: str, payload: Any) -> list[Any]:
        self._send(method, payload)
        self._answered = set()
        if self._watchdog is not None:
            self._watchdog.arm(method)
        try:
            own = self._on_driver(method, lambda: run_command(self.worker, method, payload))
            self._answered.add(0)
            return [own, *self._collect(method)]
        finally:
            if self._watchdog is not None:
                self._watchdog.disarm()

    def _step_timed_out(self, method: str, driver_thread: int) -> None:
        """The watchdog's expiry (in its thread): collect the stack of every rank that has
        not answered ``method`` (rank 0's from this process, a worker's by ``SIGUSR1``), log
        the report, break the group and kill the workers, so that the driver's part of the
        step, blocked in a collective with them, fails (:meth:`_raise_if_timed_out`).
        Nothing when every rank has answered (the step completed as the time ran out)."""
        answered = set(self._answered)
        pending = [rank for rank in range(self.size) if rank not in answered]
        if not pending:  # every rank answered as the time ran out: the step completed
            return
        stacks: dict[int, str] = {}
        offsets: dict[int, int] = {}
        for rank in pending:  # signal every worker first: their dumps are written together
            proc = self._ranks.procs[rank - 1] if rank else None
            if proc is not None and proc.poll() is None:
                offsets[rank] = file_size(stack_path(self._ranks.ipc_dir, rank))
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGUSR1)
        if 0 in pending:
            stacks[0] = driver_stack(driver_thread)
        for rank, offset in offsets.items():
            stacks[rank] = read_new_text(stack_path(self._ranks.ipc_dir, rank), offset)
        assert self._watchdog is not None
        timeout = StepTimeout.of(method, self._watchdog.timeout_s, pending, stacks, self.size)
        logger.error("%s", timeout.report)
        self._timed_out, self._broken = timeout, timeout.broken
        self._ranks.kill_workers()

    def _raise_if_timed_out(self, cause: BaseException | None = None) -> None:
        """:class:`StepTimeoutError` once a step timed out (whatever failure the driver then
        saw: the killed workers' collectives, or their exit): its message is the watchdog's
        summary, without the stacks, which the log has."""
        if self._timed_out is not None:
            self._broken = self._broken or "a step timed out"
            raise self._timed_out.error() from cause

    def model_dtype(self) -> torch.dtype:
        return self.worker.dtype

    def local_device(self) -> torch.device | None:
        return self.worker.device  # rank 0 runs in this process

    def check_health(self) -> None:
        if self._broken is None:
            self._raise_if_a_rank_exited("idle")

    def shutdown(self) -> None:
        """Stop every rank (killing one that does not stop in 10 s) and leave the group."""
        self._broken = self._broken or "it was shut down"
        self._finalizer()

    # -- messaging ------------------------------------------------------------------------

    def _on_driver(self, method: str, run: Callable[[], T]) -> T:
        """Run rank 0's part of ``method``. When it fails, a failing rank is the likely cause
        (its exit broke the collective rank 0 was in): its own error is raised, if it sent one
        within a few seconds, with rank 0's as the cause. The group is then broken."""
        try:
            return run()
        except BaseException as exc:
            self._raise_if_timed_out(exc)
            self._broken = f"{method!r} failed"
            if isinstance(exc, Exception):
                reported = self._failure_reply(wait_s=_FAILURE_WAIT_S)
                reporter = reported[0] if reported else None
                # a rank that was killed left the others to fail: name it first
                self._raise_if_a_rank_exited(method, exc, wait_s=0.5, reporter=reporter)
                if reported is not None:
                    raise reported[1] from exc
            raise

    def _send(self, method: str, payload: Any) -> None:
        """Send a command to every other rank. A rank not connected yet (starting) is waited
        for; one that exited raises ``RuntimeError`` (zmq would block on it forever)."""
        self._refuse_if_broken()
        frame = _encoder.encode([method, payload])
        for rank, (sock, proc) in enumerate(
            zip(self._ranks.commands, self._ranks.procs, strict=True), start=1
        ):
            while True:
                try:
                    sock.send(frame, zmq.NOBLOCK)
                    break
                except zmq.Again:
                    if proc.poll() is not None:
                        self._broken = f"rank {rank} exited"
                        raise RankExitedError(
                            f"tensor-parallel rank {rank} exited with code {proc.returncode} "
                            f"before {method!r}"
                        ) from None
                    time.sleep(0.01)

    def _collect(self, method: str) -> list[Any]:
        """Every other rank's reply to ``method``, by rank; the first failure raises
        (``ValueError`` for a rank's ``ValueError``, as at start-up, else ``RuntimeError``)
        and breaks the group."""
        results: dict[int, Any] = {}
        replies = self._ranks.replies
        while len(results) < self.size - 1:
            if not replies.poll(_POLL_MS):
                self._raise_if_timed_out()
                for rank, proc in enumerate(self._ranks.procs, start=1):
                    if proc.poll() is not None and rank not in results:
                        self._broken = f"rank {rank} exited"
                        raise RankExitedError(
                            f"tensor-parallel rank {rank} exited with code {proc.returncode} "
                            f"during {method!r}"
                        )
                continue
            rank, ok, result = _reply_decoder.decode(replies.recv())
            if not ok:
                self._raise_if_timed_out()
                self._broken = f"rank {rank} failed"
                error = _rank_error(rank, result)
                # a killed rank makes the others fail their collectives: name it first
                self._raise_if_a_rank_exited(method, error, wait_s=0.5, reporter=rank)
                raise error
            results[rank] = result
            self._answered.add(rank)
        return [results[rank] for rank in range(1, self.size)]

    def _raise_if_a_rank_exited(
        self,
        method: str,
        cause: BaseException | None = None,
        wait_s: float = 0.0,
        reporter: int | None = None,
    ) -> None:
        """A ``RuntimeError`` naming the first rank whose process has exited (waiting up to
        ``wait_s`` for one that is exiting), which breaks the group; nothing if all live.
        ``reporter``, a rank that reported its own failure (and exits after it), is skipped:
        its report says more."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, proc in enumerate(self._ranks.procs, start=1):
                code = proc.poll()
                if code is not None and rank != reporter:
                    self._broken = f"rank {rank} exited"
                    raise RankExitedError(
                        f"tensor-parallel rank {rank} exited with code {code} during {method!r}"
                    ) from cause
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def _failure_reply(self, wait_s: float) -> tuple[int, Exception] | None:
        """The first failure a rank reported within ``wait_s`` seconds, as (rank, error)."""
        deadline = time.monotonic() + wait_s
        replies = self._ranks.replies
        while (left := deadline - time.monotonic()) > 0:
            if not replies.poll(int(left * 1000)):
                return None
            rank, ok, result = _reply_decoder.decode(replies.recv())
            if not ok:
                return rank, _rank_error(rank, result)
        return None


def step_summary(output: ModelRunnerOutput) -> list[Any]:
    """What every rank's step must agree on, as a rank sends it to the driver: the step's
    requests in batch-row order, the ids each sampled, and the pooling requests it finished
    (sorted). A pooling step samples nothing, so its rows and finished requests are what show
    a rank whose batch or pooler state went out of step."""
    return [list(output.request_ids), output.sampled_token_ids, sorted(output.pooled)]


def _check_model_splits(config: EngineConfig) -> None:
    """The model's class shards itself and accepts the group's size
    (``check_tensor_parallel``), its attention heads (if any) divide by the group's size, and
    its KV heads split over the group or replicate (``parallel_state.kv_head_split``)."""
    from chassis.core.model_loader import engine_hf_config, kv_head_count, model_class
    from chassis.core.parallel_state import kv_head_split

    assert config.model is not None
    hf_config = engine_hf_config(config)
    cls = model_class(hf_config)
    if config.pipeline_parallel_size > 1:  # (tensor parallelism 1: EngineConfig checked)
        from chassis.core.pipeline_parallel import check_pipeline_parallel

        check_pipeline_parallel(cls, hf_config, config.pipeline_parallel_size)
        return
    if not cls.supports_tensor_parallel:
        raise ValueError(
            f"{cls.__name__} cannot be sharded (its supports_tensor_parallel is False); use "
            "--tensor-parallel-size 1"
        )
    cls.check_tensor_parallel(hf_config, config.tensor_parallel_size)
    if getattr(hf_config, "num_attention_heads", None) is None:
        return  # no attention layers (Mamba2)
    heads = int(hf_config.num_attention_heads)
    if heads % config.tensor_parallel_size:
        raise ValueError(
            f"num_attention_heads ({heads}) is not divisible by --tensor-parallel-size "
            f"{config.tensor_parallel_size}"
        )
    kv_head_split(kv_head_count(hf_config), config.tensor_parallel_size, 0)


def _rank_error(rank: int, detail: Any) -> Exception:
    """A rank's reported failure as an exception of the same kind where it matters (a
    ``ValueError``: settings the group cannot run)."""
    error = ValueError if str(detail).startswith("ValueError") else RuntimeError
    return error(f"tensor-parallel rank {rank}: {detail}")


def _stop(ranks: _Ranks, watchdog: StepWatchdog | None) -> None:
    """What shutting the executor down (or dropping it) does: end the watchdog, stop the
    ranks."""
    if watchdog is not None:
        watchdog.close()
    ranks.stop()


class _Ranks:
    """The worker processes of ranks 1..N-1 and the driver's sockets to them."""

    def __init__(self, size: int) -> None:
        self.ipc_dir = tempfile.mkdtemp(prefix="chassis-tp-")
        os.chmod(self.ipc_dir, 0o700)
        #: rank 0 takes its share of the cores (start_rank); given back by stop()
        self.driver_threads = torch.get_num_threads()
        self.ctx = zmq.Context()
        self.replies = self.ctx.socket(zmq.PULL)
        self.commands: list[zmq.Socket[bytes]] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        try:
            self.replies.bind(reply_address(self.ipc_dir))
            for rank in range(1, size):
                sock = self.ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.bind(command_address(self.ipc_dir, rank))
                self.commands.append(sock)
            level = str(logging.getLogger().getEffectiveLevel())
            module = "chassis.core.tp_worker_proc"
            for rank in range(1, size):
                command = [sys.executable, "-m", module, self.ipc_dir, str(rank)]
                self.procs.append(subprocess.Popen([*command, str(os.getpid()), level]))
        except BaseException:
            self.stop()
            raise

    def kill_workers(self) -> None:
        """Kill every live rank process now (a rank stuck in a step reads no command); the
        driver reaps them (``poll``, :meth:`stop`)."""
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()

    def stop(self) -> None:
        """Ask every live rank to exit, kill those that do not within 10 s (together), leave
        the group, close the sockets. Idempotent (``weakref.finalize`` runs it once)."""
        try:
            live = [p for p in self.procs if p.poll() is None]
            for sock in self.commands:
                with contextlib.suppress(zmq.ZMQError):
                    sock.send(_encoder.encode([SHUTDOWN, None]), zmq.NOBLOCK)
            deadline = time.monotonic() + _SHUTDOWN_WAIT_S
            for proc in live:
                try:
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            with contextlib.suppress(Exception):  # the group may be broken already
                parallel_state.destroy_tensor_parallel()
            torch.set_num_threads(self.driver_threads)
            for sock in [self.replies, *self.commands]:
                sock.close(0)
            self.ctx.term()
        finally:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
