"""The default of ``--async-scheduling``: on where the device runs ahead of the host.

``EngineConfig.async_scheduling`` is tri-state. An explicit ``True`` or ``False`` is kept (a
``True`` the config or the scheduler cannot honour is an error, raised elsewhere:
``EngineConfig.__post_init__`` and ``EngineCore``). ``None`` ("auto") is resolved here, in
the engine-core process where the platform is known, to on exactly when

- the platform's device runs asynchronously to the host (``Platform.device_runs_async``:
  CUDA and ROCm), so that planning step N+1 while step N runs overlaps host and device work
  (on the CPU the host *is* the device and nothing overlaps);
- the scheduler honours the async-scheduling contract
  (``Scheduler.supports_async_scheduling``); and
- no speculative decoding is configured (a step's accepted tokens must be known before the
  next one is planned); and
- the engine runs in one process on one device (``world_size`` 1, no Ray): the multi-rank
  executors run async scheduling without overlap (``chassis.core.tp_executor``), where it
  would only hand each step's outputs back one step later.

Auto never raises: a refusal turns it off. docs/scheduling.md has the measurements.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from chassis.core.config import EngineConfig
    from chassis.core.scheduler_interface import Scheduler
    from chassis.platforms.interface import Platform


def resolve_async_scheduling(
    config: EngineConfig, platform: type[Platform] | Platform, scheduler_cls: type[Scheduler]
) -> bool:
    """Whether the engine schedules asynchronously: ``config.async_scheduling`` where it is
    a bool, else the auto rule of this module. Reads only; the caller stores the result."""
    if config.async_scheduling is not None:
        return config.async_scheduling
    return (
        platform.device_runs_async
        and scheduler_cls.supports_async_scheduling
        and config.speculative_config is None
        and config.world_size == 1
        and config.distributed_executor_backend != "ray"
    )
