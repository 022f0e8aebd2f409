"""Built-in samplers, registered through ``chassis.general_plugins``."""

from __future__ import annotations

from typing import Any

from chassis.plugins.hookspecs import hookimpl


@hookimpl
def chassis_register_samplers(registry: Any) -> None:
    registry.register("default", "chassis.builtin_plugins.samplers.default:DefaultSampler")
