"""Executors run the model on one or more workers; the engine core talks only to this."""

from __future__ import annotations

import gc
from abc import ABC, abstractmethod

from chassis.core.config import EngineConfig
from chassis.core.in_flight import PendingRunnerOutput
from chassis.core.scheduler_interface import ModelRunnerOutput, SchedulerOutput


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

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> PendingRunnerOutput:
        """Launch one step and return before its results are on the host.

        Results are asked for in step order. Default: run :meth:`execute_model` to the end
        (correct, without overlap).
        """
        return PendingRunnerOutput.ready(self.execute_model(scheduler_output))

    def lora_target_shapes(self) -> dict[str, tuple[int, int]] | None:
        """The modules LoRA adapters may change, ``{HF module: (in_features, out_features)}``,
        or ``None`` without ``--enable-lora`` (default: ``None``)."""
        return None

    def check_health(self) -> None:  # noqa: B027 - optional hook
        """Raise ``RuntimeError`` when the workers cannot run steps any more (called while the
        engine is idle, so a dead worker is reported before the next request). Default:
        nothing can fail outside a step."""

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release workers (default: nothing to do)."""


class InProcessExecutor(Executor):
    """One device, driven from the engine-core process itself."""

    def __init__(self, config: EngineConfig) -> None:
        from chassis.core.worker import Worker

        self.worker = Worker(config)

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def initialize_cache(self, num_blocks: int) -> None:
        self.worker.initialize_cache(num_blocks)

    def lora_target_shapes(self) -> dict[str, tuple[int, int]] | None:
        lora = self.worker.lora
        return None if lora is None else dict(lora.target_shapes)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> PendingRunnerOutput:
        return self.worker.execute_model_async(scheduler_output)


def make_executor(config: EngineConfig) -> Executor:
    """The executor ``config`` asks for: in-process for one device, the tensor-parallel
    executor (``chassis.core.tp_executor``) for ``tensor_parallel_size`` above 1."""
    from chassis.core import parallel_state

    if parallel_state.tp_size() > 1:
        gc.collect()  # an engine nobody references any more leaves its group when collected
        if parallel_state.tp_size() > 1:
            raise ValueError(
                "a tensor-parallel engine is running in this process; call its shutdown() "
                "before building another engine"
            )
    if config.tensor_parallel_size > 1:
        from chassis.core.tp_executor import TensorParallelExecutor

        return TensorParallelExecutor(config)
    return InProcessExecutor(config)
