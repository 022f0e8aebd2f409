"""Built-in schedulers, registered through ``chassis.general_plugins``."""

from __future__ import annotations

from typing import Any

from chassis.plugins.hookspecs import hookimpl

_PKG = "chassis.builtin_plugins.schedulers"


@hookimpl
def chassis_register_schedulers(registry: Any) -> None:
    registry.register("fcfs", f"{_PKG}.fcfs:FcfsScheduler")
    registry.register("priority", f"{_PKG}.priority:PriorityScheduler")
