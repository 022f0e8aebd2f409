"""Tensor parallelism: one model sharded over N processes (``--tensor-parallel-size N``).

:class:`TensorParallelExecutor` is the executor of an engine whose config asks for more than
one rank. Rank 0 (the driver) runs in the engine-core process; ranks 1..N-1 are processes of
their own (``chassis.core.tp_worker_proc``), started here and joined with the driver in one
``torch.distributed`` group over the platform's ``dist_backend``, each on the device
``Platform.tensor_parallel_devices`` gives it. Every step the driver sends the plan (a
msgspec-encoded :class:`SchedulerOutput`) to every rank and runs it itself; all ranks run the
same forward (each with its shard of the weights and of the KV heads, summing partial results
with all-reduces) and the same sampling, so every rank's persistent batch stays the same. The
driver returns its own result, after checking that every rank sampled the same tokens.

Graph capture and ``torch.compile`` are not used with more than one rank (not validated with
collectives yet); async scheduling runs, without overlap.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import weakref
from typing import Any

import msgspec
import torch
import zmq

from chassis.core import parallel_state
from chassis.core.config import EngineConfig
from chassis.core.executor import Executor
from chassis.core.scheduler_interface import ModelRunnerOutput, SchedulerOutput
from chassis.core.tp_worker_proc import (
    EXECUTE,
    INIT,
    INIT_CACHE,
    NUM_BLOCKS,
    SHUTDOWN,
    command_address,
    rendezvous,
    reply_address,
)
from chassis.core.worker import Worker

logger = logging.getLogger(__name__)

#: how long the driver waits for a rank's reply before checking that the rank still lives
_POLL_MS = 1000
_SHUTDOWN_WAIT_S = 10.0

_encoder = msgspec.msgpack.Encoder()
_reply_decoder = msgspec.msgpack.Decoder(tuple[int, bool, Any])


def start_rank(config: EngineConfig, rank: int, init_method: str) -> Worker:
    """In the process of ``rank``: join the group, then load this rank's share of the model on
    its device (the cores split evenly when ranks share a host)."""
    from chassis.platforms import get_current_platform

    platform = get_current_platform()
    size = config.tensor_parallel_size
    device = platform.tensor_parallel_devices(size)[rank]
    torch.set_num_threads(max(1, torch.get_num_threads() // size))
    parallel_state.init_tensor_parallel(rank, size, platform.dist_backend, init_method)
    return Worker(config, device_index=device)


class TensorParallelExecutor(Executor):
    """The driver of N ranks (see the module docstring). Raises ``ValueError`` for settings the
    group cannot run (more ranks than devices, heads that do not split evenly, a model that
    cannot be sharded) after stopping every rank it started."""

    def __init__(self, config: EngineConfig) -> None:
        from chassis.platforms import get_current_platform

        if config.torch_compile:
            raise ValueError("--torch-compile cannot be combined with --tensor-parallel-size > 1")
        if parallel_state.tp_size() > 1:
            gc.collect()  # an engine nobody references any more leaves its group when collected
            if parallel_state.tp_size() > 1:
                raise ValueError(
                    "another tensor-parallel engine is running in this process; call its "
                    "shutdown() first"
                )
        if not config.enforce_eager:
            logger.info("tensor parallel: device graphs are off (not validated with collectives)")
            config = dataclasses.replace(config, enforce_eager=True)
        self.size = config.tensor_parallel_size
        get_current_platform().tensor_parallel_devices(self.size)  # enough devices?
        self._ranks = _Ranks(self.size)
        # Stop the ranks when the engine is dropped without shutdown() (an LLM going away).
        self._finalizer = weakref.finalize(self, self._ranks.stop)
        try:
            self._send(INIT, config.to_dict())
            self.worker = start_rank(config, 0, rendezvous(self._ranks.ipc_dir))
            self._collect(INIT)
        except BaseException:
            self.shutdown()
            raise
        logger.info("tensor parallel: %d ranks ready", self.size)

    # -- the Executor interface ---------------------------------------------------------------

    def determine_num_blocks(self) -> int:
        self._send(NUM_BLOCKS, None)
        own = self.worker.determine_num_blocks()
        return min([own, *self._collect(NUM_BLOCKS)])

    def initialize_cache(self, num_blocks: int) -> None:
        self._send(INIT_CACHE, num_blocks)
        self.worker.initialize_cache(num_blocks)
        self._collect(INIT_CACHE)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._send(EXECUTE, scheduler_output)
        output = self.worker.execute_model(scheduler_output)
        for rank, sampled in enumerate(self._collect(EXECUTE), start=1):
            if sampled != output.sampled_token_ids:
                raise RuntimeError(
                    f"tensor-parallel rank {rank} sampled {sampled}, rank 0 "
                    f"{output.sampled_token_ids}: the ranks' sampling is not deterministic"
                )
        return output

    def shutdown(self) -> None:
        """Stop every rank (killing one that does not stop in 10 s) and leave the group."""
        self._finalizer()

    # -- messaging ------------------------------------------------------------------------

    def _send(self, method: str, payload: Any) -> None:
        """Send a command to every other rank. A rank not connected yet (starting) is waited
        for; one that exited raises ``RuntimeError`` (zmq would block on it forever)."""
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
                        raise RuntimeError(
                            f"tensor-parallel rank {rank} exited with code {proc.returncode} "
                            f"before {method!r}"
                        ) from None
                    time.sleep(0.01)

    def _collect(self, method: str) -> list[Any]:
        """Every other rank's reply to ``method``, by rank; the first failure raises
        (``ValueError`` for a rank's ``ValueError``, as at start-up, else ``RuntimeError``)."""
        results: dict[int, Any] = {}
        replies = self._ranks.replies
        while len(results) < self.size - 1:
            if not replies.poll(_POLL_MS):
                for rank, proc in enumerate(self._ranks.procs, start=1):
                    if proc.poll() is not None and rank not in results:
                        raise RuntimeError(
                            f"tensor-parallel rank {rank} exited with code {proc.returncode} "
                            f"during {method!r}"
                        )
                continue
            rank, ok, result = _reply_decoder.decode(replies.recv())
            if not ok:
                error = ValueError if str(result).startswith("ValueError") else RuntimeError
                raise error(f"tensor-parallel rank {rank}: {result}")
            results[rank] = result
        return [results[rank] for rank in range(1, self.size)]


class _Ranks:
    """The worker processes of ranks 1..N-1 and the driver's sockets to them."""

    def __init__(self, size: int) -> None:
        self.ipc_dir = tempfile.mkdtemp(prefix="chassis-tp-")
        os.chmod(self.ipc_dir, 0o700)
        self.ctx = zmq.Context()
        self.replies = self.ctx.socket(zmq.PULL)
        self.replies.bind(reply_address(self.ipc_dir))
        self.commands = []
        for rank in range(1, size):
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(command_address(self.ipc_dir, rank))
            self.commands.append(sock)
        level = str(logging.getLogger().getEffectiveLevel())
        module = "chassis.core.tp_worker_proc"
        self.procs = [
            subprocess.Popen([sys.executable, "-m", module, self.ipc_dir, str(r), level])
            for r in range(1, size)
        ]

    def stop(self) -> None:
        """Ask every live rank to exit, kill those that do not within 10 s, leave the group,
        close the sockets. Idempotent (``weakref.finalize`` runs it once)."""
        live = [p for p in self.procs if p.poll() is None]
        for sock in self.commands:
            with contextlib.suppress(zmq.ZMQError):
                sock.send(_encoder.encode([SHUTDOWN, None]), zmq.NOBLOCK)
        for proc in live:
            try:
                proc.wait(timeout=_SHUTDOWN_WAIT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        parallel_state.destroy_tensor_parallel()
        for sock in [self.replies, *self.commands]:
            sock.close(0)
        self.ctx.term()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
