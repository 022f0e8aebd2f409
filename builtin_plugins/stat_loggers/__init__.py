"""Built-in stat loggers, registered through ``chassis.general_plugins``."""

from __future__ import annotations

from typing import Any

from chassis.plugins.hookspecs import hookimpl

_PKG = "chassis.builtin_plugins.stat_loggers"


@hookimpl
def chassis_register_stat_loggers(registry: Any) -> None:
    registry.register("logging", f"{_PKG}.logging_logger:LoggingStatLogger")
