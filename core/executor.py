"""Executors run the model on one or more workers; the engine core talks only to this."""

from __future__ import annotations

import gc
import logging
from abc import ABC, abstractmethod

import torch

from chassis.core.config import EngineConfig
from chassis.core.in_flight import PendingRunnerOutput
from chassis.core.lora.request import LoRARequest
from chassis.core.scheduler_interface import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


class Executor(ABC):
    """Owns the workers of one engine."""

    @abstractmethod
    def determine_num_blocks(self) -> int:
        """KV blocks that fit on every worker (the minimum across workers)."""

    @abstractmethod
    def initialize_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` KV blocks on every worker."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on all workers; return the driver worker's output."""

    @abstractmethod
    def model_dtype(self) -> torch.dtype:
        """The dtype the workers hold the model's weights in (``--dtype`` resolved)."""

    def local_device(self) -> torch.device | None:
        """The device of this process that holds the model (rank 0's with tensor
        parallelism), or ``None`` when every rank runs in another process and this one holds
        no device (default: ``None``)."""
        return None

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> PendingRunnerOutput:
        """Launch one step and return before its results are on the host.

        Results are asked for in step order. Default: run :meth:`execute_model` to the end
        (correct, without overlap).
        """
        return PendingRunnerOutput.ready(self.execute_model(scheduler_output))

    def kv_cache_window(self) -> int | None:
        """The sliding window that bounds what every attention layer reads, for the KV cache
        manager to release blocks behind it (``Worker.kv_cache_window``); ``None`` (the
        default): keep every position."""
        return None

    def kv_cache_group_windows(self) -> tuple[int | None, ...]:
        """The window of each KV cache group (``Worker.kv_cache_group_windows``; several for a
        model mixing sliding-window and full layers), for the KV cache manager. Default: one
        group, ``(kv_cache_window(),)``."""
        return (self.kv_cache_window(),)

    def kv_cache_group_chunks(self) -> tuple[int | None, ...]:
        """The attention chunk size of each KV cache group (``Worker.kv_cache_group_chunks``;
        ``None``: not a chunk group), as many as :meth:`kv_cache_group_windows`. Default: no
        chunk groups."""
        return (None,) * len(self.kv_cache_group_windows())

    def lora_target_shapes(self) -> dict[str, tuple[int, int]] | None:
        """The modules LoRA adapters may change, ``{HF module: (in_features, out_features)}``,
        or ``None`` without ``--enable-lora`` (default: ``None``)."""
        return None

    def pin_lora(self, lora_request: LoRARequest) -> None:  # noqa: B027 - optional hook
        """Hold the adapter in every worker's host memory until :meth:`unpin_lora`, reading
        its folder now unless a worker holds it already; a ``ValueError`` with the reason
        when it cannot be read (then no worker pins it). The engine core pins the adapter of
        every request it accepts, before the scheduler sees the request, so that no step
        reads a folder (docs/lora.md). Default: nothing (steps read folders when needed)."""

    def unpin_lora(self, lora_id: int) -> None:  # noqa: B027 - optional hook
        """Undo one :meth:`pin_lora` of adapter ``lora_id`` (default: nothing)."""

    def sleep(self, level: int) -> None:
        """Sleep mode: every worker releases its KV cache, and its weights as ``level`` says
        (``Worker.sleep``). Called by the engine core with no request unfinished. Default:
        ``NotImplementedError`` (this executor cannot sleep)."""
        raise NotImplementedError(f"{type(self).__name__} does not support sleep mode")

    def wake_up(self, tags: list[str]) -> None:
        """Sleep mode: every worker brings back the parts ``tags`` names (``"weights"``,
        ``"kv_cache"``; ``Worker.wake_up``). Default: ``NotImplementedError``."""
        raise NotImplementedError(f"{type(self).__name__} does not support sleep mode")

    def check_health(self) -> None:  # noqa: B027 - optional hook
        """Raise ``RuntimeError`` when the workers cannot run steps any more (called while the
        engine is idle, so a dead worker is reported before the next request). Default:
        nothing can fail outside a step."""

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release workers (default: nothing to do)."""


class InProcessExecutor(Executor):
    """One device, driven from the engine-core process itself."""

    def __init__(self, config: EngineConfig) -> None:
        from chassis.core.data_parallel import engine_rank_devices
        from chassis.core.worker import Worker

        # one engine of several (data parallelism) runs on its own device; one alone on 0
        device = engine_rank_devices(config)[0] if config.data_parallel_size > 1 else 0
        self.worker = Worker(config, device_index=device)

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def initialize_cache(self, num_blocks: int) -> None:
        self.worker.initialize_cache(num_blocks)

    def model_dtype(self) -> torch.dtype:
        return self.worker.dtype

    def local_device(self) -> torch.device | None:
        return self.worker.device

    def kv_cache_window(self) -> int | None:
        return self.worker.kv_cache_window()

    def kv_cache_group_windows(self) -> tuple[int | None, ...]:
        return self.worker.kv_cache_group_windows()

    def kv_cache_group_chunks(self) -> tuple[int | None, ...]:
        return self.worker.kv_cache_group_chunks()

    def lora_target_shapes(self) -> dict[str, tuple[int, int]] | None:
        lora = self.worker.lora
        return None if lora is None else dict(lora.target_shapes)

    def pin_lora(self, lora_request: LoRARequest) -> None:
        if self.worker.lora is not None:
            self.worker.lora.pin(lora_request)

    def unpin_lora(self, lora_id: int) -> None:
        if self.worker.lora is not None:
            self.worker.lora.unpin(lora_id)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> PendingRunnerOutput:
        return self.worker.execute_model_async(scheduler_output)

    def sleep(self, level: int) -> None:
        self.worker.sleep(level)

    def wake_up(self, tags: list[str]) -> None:
        self.worker.wake_up(tags)


def make_executor(config: EngineConfig) -> Executor:
    """The executor ``config`` asks for: Ray actors (``chassis.core.ray_executor``) with
    ``distributed_executor_backend="ray"``; else in-process for one device, the
    tensor-parallel executor (``chassis.core.tp_executor``) for ``tensor_parallel_size``
    above 1."""
    from chassis.core import parallel_state

    if config.distributed_executor_backend == "ray":
        from chassis.core.ray_executor import RayExecutor

        # the ranks are actors: this process joins no group, other engines may run beside it
        return RayExecutor(config)
    if parallel_state.world_size() > 1:
        gc.collect()  # an engine nobody references any more leaves its group when collected
        if parallel_state.world_size() > 1:
            raise ValueError(
                "a tensor-parallel engine is running in this process; call its shutdown() "
                "before building another engine"
            )
    if config.enable_expert_parallel and config.tensor_parallel_size == 1:
        # as vLLM: with one rank every expert is on it, so there is nothing to place
        logger.info("--enable-expert-parallel has no effect with --tensor-parallel-size 1")
    if config.world_size > 1:  # (tensor-parallel ranks, or pipeline stages)
        from chassis.core.tp_executor import TensorParallelExecutor

        return TensorParallelExecutor(config)
    return InProcessExecutor(config)
