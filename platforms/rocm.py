"""The ROCm platform (AMD GPUs through torch.cuda on a HIP build of torch)."""

from __future__ import annotations

from chassis.platforms import torch_facts
from chassis.platforms.cuda import TorchCudaLikePlatform
from chassis.platforms.interface import Platform
from chassis.plugins.hookspecs import hookimpl


class RocmPlatform(TorchCudaLikePlatform):
    """AMD GPUs: usable when torch is a HIP build and sees at least one device."""

    name = "rocm"
    dist_backend = "nccl"  # RCCL, reached through torch's "nccl" backend name

    @classmethod
    def is_available(cls) -> bool:
        return torch_facts.hip_version() is not None and torch_facts.cuda_device_count() > 0

    @classmethod
    def detection_detail(cls) -> str:
        hip = torch_facts.hip_version()
        if hip is None:
            return "torch is not a HIP build"
        return f"torch HIP {hip}, {torch_facts.cuda_device_count()} device(s) visible"


@hookimpl
def chassis_platform() -> type[Platform] | None:
    return RocmPlatform if RocmPlatform.is_available() else None
