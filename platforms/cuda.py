"""The CUDA platform (NVIDIA GPUs through torch.cuda on a non-HIP build)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from chassis.platforms import torch_facts
from chassis.platforms.interface import Platform
from chassis.plugins.hookspecs import hookimpl

if TYPE_CHECKING:
    from chassis.core.config import EngineConfig


class TorchCudaLikePlatform(Platform):
    """Shared by CUDA and ROCm: both drive devices through the ``torch.cuda`` API."""

    device_type = "cuda"
    supported_dtypes = (torch.bfloat16, torch.float16, torch.float32)

    def device_count(self) -> int:
        return torch_facts.cuda_device_count()

    def set_device(self, index: int) -> None:
        torch.cuda.set_device(index)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def device_name(self, index: int = 0) -> str:
        return torch.cuda.get_device_name(index)

    def memory_total(self, index: int = 0) -> int:
        return torch.cuda.mem_get_info(index)[1]

    def memory_available(self, index: int = 0) -> int:
        return torch.cuda.mem_get_info(index)[0]

    def determine_kv_cache_memory(self, config: EngineConfig, profile: Callable[[], None]) -> int:
        """Profile a forward at the max token budget, then grant
        ``gpu_memory_utilization * total`` minus the torch peak and non-torch usage."""
        if config.kv_cache_memory is not None:
            return config.kv_cache_memory
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        profile()
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        peak = torch.cuda.max_memory_allocated()
        non_torch = total - free - torch.cuda.memory_reserved()
        return int(total * config.gpu_memory_utilization) - peak - max(non_torch, 0)

    def default_attention_backend(self, config: EngineConfig) -> str:
        return "triton_paged"

    def supports_graph_capture(self) -> bool:
        return True

    def pin_memory_available(self) -> bool:
        return True


class CudaPlatform(TorchCudaLikePlatform):
    """NVIDIA GPUs: usable when torch is a CUDA build (not HIP) and sees at least one device."""

    name = "cuda"
    dist_backend = "nccl"

    @classmethod
    def is_available(cls) -> bool:
        return torch_facts.hip_version() is None and torch_facts.cuda_device_count() > 0

    @classmethod
    def detection_detail(cls) -> str:
        if torch_facts.hip_version() is not None:
            return "torch is a HIP (ROCm) build: see the rocm platform"
        version = torch_facts.cuda_version()
        if version is None:
            return "torch is built without CUDA"
        return f"torch CUDA {version}, {torch_facts.cuda_device_count()} device(s) visible"


@hookimpl
def chassis_platform() -> type[Platform] | None:
    return CudaPlatform if CudaPlatform.is_available() else None
