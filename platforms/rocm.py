"""The ROCm platform (AMD GPUs through torch.cuda on a HIP build of torch)."""

from __future__ import annotations

import torch

from chassis.platforms import torch_facts
from chassis.platforms.cuda import TorchCudaLikePlatform
from chassis.platforms.interface import Platform
from chassis.plugins.hookspecs import hookimpl

#: the architectures Triton's HIP backend gives the OCP e4m3 type (``fp8e4nv``): CDNA3
#: (gfx940-942, converted in software: the hardware's own e4m3 is the FNUZ variant) and CDNA4
#: (gfx950, native; Triton releases before gfx950 support do not know it)
_E4M3_ARCHS = frozenset({"gfx940", "gfx941", "gfx942", "gfx950"})


class RocmPlatform(TorchCudaLikePlatform):
    """AMD GPUs: usable when torch is a HIP build and sees at least one device."""

    name = "rocm"
    dist_backend = "nccl"  # RCCL, reached through torch's "nccl" backend name

    def fp8_kv_cache_dtypes(self) -> tuple[torch.dtype, ...]:
        """e5m2 on every GPU (Triton's HIP backend offers ``fp8e5`` on every architecture);
        e4m3 (``torch.float8_e4m3fn``, OCP) only when every visible device is gfx940-942 or
        gfx950, the architectures for which Triton offers ``fp8e4nv``. The FNUZ formats
        (``float8_e4m3fnuz``) are not ``--kv-cache-dtype`` choices."""
        return self._fp8_kv_formats(lambda i: torch_facts.rocm_arch(i) in _E4M3_ARCHS)

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
