"""The TPU platform (Google TPUs through torch_xla and libtpu)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from chassis.platforms import torch_facts
from chassis.platforms.interface import Platform
from chassis.plugins.hookspecs import hookimpl

if TYPE_CHECKING:
    from chassis.core.config import EngineConfig


class TpuPlatform(Platform):
    """Google TPUs: usable when torch_xla and libtpu are installed and see a TPU device."""

    name = "tpu"
    device_type = "xla"
    dist_backend = "xla"
    supported_dtypes = (torch.bfloat16, torch.float32)

    @classmethod
    def is_available(cls) -> bool:
        return torch_facts.tpu_device_count() > 0

    @classmethod
    def detection_detail(cls) -> str:
        if not torch_facts.module_present("torch_xla"):
            return "torch_xla is not installed"
        if not torch_facts.libtpu_present():
            return "torch_xla is installed but libtpu is not"
        return f"torch_xla sees {torch_facts.tpu_device_count()} TPU device(s)"

    def device_count(self) -> int:
        return torch_facts.tpu_device_count()

    def ray_resources(self) -> dict[str, float]:
        """One TPU chip per rank (Ray's ``TPU`` resource)."""
        return {"TPU": 1.0}

    def device(self, index: int = 0) -> torch.device:
        import torch_xla.core.xla_model as xm  # type: ignore[import-not-found]

        return xm.xla_device()

    def memory_total(self, index: int = 0) -> int:
        import torch_xla.core.xla_model as xm  # type: ignore[import-not-found]

        return int(xm.get_memory_info(self.device(index))["bytes_limit"])

    def memory_available(self, index: int = 0) -> int:
        import torch_xla.core.xla_model as xm  # type: ignore[import-not-found]

        info = xm.get_memory_info(self.device(index))
        return int(info["bytes_limit"]) - int(info["bytes_used"])

    def default_attention_backend(self, config: EngineConfig) -> str:
        return "torch_paged"


@hookimpl
def chassis_platform() -> type[Platform] | None:
    return TpuPlatform if TpuPlatform.is_available() else None
