"""Built-in attention backends, registered through ``chassis.general_plugins``."""

from __future__ import annotations

from typing import Any

from chassis.plugins.hookspecs import hookimpl

_PKG = "chassis.builtin_plugins.attention"


@hookimpl
def chassis_register_attention_backends(registry: Any) -> None:
    registry.register("torch_paged", f"{_PKG}.torch_paged:TorchPagedAttention")
    registry.register("cpu_paged", f"{_PKG}.cpu_paged:CpuPagedAttention")
    registry.register("triton_paged", f"{_PKG}.triton_paged:TritonPagedAttention")
