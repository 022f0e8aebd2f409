"""The XPU platform (Intel GPUs through torch.xpu)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from chassis.platforms import torch_facts
from chassis.platforms.interface import Platform
from chassis.plugins.hookspecs import hookimpl

if TYPE_CHECKING:
    from chassis.core.config import EngineConfig


class XpuPlatform(Platform):
    """Intel GPUs: usable when torch.xpu sees at least one device."""

    name = "xpu"
    device_type = "xpu"
    dist_backend = "xccl"
    supported_dtypes = (torch.bfloat16, torch.float16, torch.float32)
    # XPU queues kernels too, but --async-scheduling is unmeasured here: off by default
    device_runs_async = False

    @classmethod
    def is_available(cls) -> bool:
        return torch_facts.xpu_device_count() > 0

    @classmethod
    def detection_detail(cls) -> str:
        if not torch_facts.xpu_built():
            return "torch is built without XPU support"
        return f"torch.xpu sees {torch_facts.xpu_device_count()} device(s)"

    def device_count(self) -> int:
        return torch_facts.xpu_device_count()

    def set_device(self, index: int) -> None:
        torch.xpu.set_device(index)

    def synchronize(self) -> None:
        torch.xpu.synchronize()

    def record_event(self) -> torch.xpu.Event:
        """A ``torch.xpu.Event`` recorded on the current stream (waits for that work only)."""
        event = torch.xpu.Event()
        event.record()
        return event

    def device_name(self, index: int = 0) -> str:
        return torch.xpu.get_device_name(index)

    def empty_cache(self) -> None:
        """``torch.xpu.empty_cache()`` (sleep mode)."""
        torch.xpu.empty_cache()

    def memory_total(self, index: int = 0) -> int:
        return torch.xpu.get_device_properties(index).total_memory

    def memory_available(self, index: int = 0) -> int:
        return self.memory_total(index) - torch.xpu.memory_reserved(index)

    def default_attention_backend(self, config: EngineConfig) -> str:
        return "torch_paged"


@hookimpl
def chassis_platform() -> type[Platform] | None:
    return XpuPlatform if XpuPlatform.is_available() else None
