"""An out-of-tree platform: the host CPU under the name ``template_cpu``.

A real vendor plugin drives its own device here: override ``device_type``,
``dist_backend``, ``device_count``, ``memory_total``/``memory_available``,
``default_attention_backend`` and ``check_and_update_config``. This one reuses the CPU
platform so that it can be exercised on any machine, and is usable only when
``CHASSIS_TEMPLATE_PLATFORM=1`` -- the stand-in for "my device is present".

When it is usable it wins over every built-in platform: chassis prefers exactly one active
out-of-tree platform (see docs/plugins.md, "Platform selection").
"""

from __future__ import annotations

import os

from chassis.platforms.cpu import CpuPlatform
from chassis.platforms.interface import Platform
from chassis.plugins import hookimpl

#: Set to ``1`` to make :class:`TemplateCpuPlatform` usable.
ACTIVATE_ENV = "CHASSIS_TEMPLATE_PLATFORM"


class TemplateCpuPlatform(CpuPlatform):
    """The CPU platform under another name, usable only when ``CHASSIS_TEMPLATE_PLATFORM=1``."""

    name = "template_cpu"

    @classmethod
    def is_available(cls) -> bool:
        # Detection must be cheap and free of side effects: it runs in every process.
        return os.environ.get(ACTIVATE_ENV) == "1"

    @classmethod
    def detection_detail(cls) -> str:
        if cls.is_available():
            return f"{ACTIVATE_ENV}=1: the host CPU, as an out-of-tree platform"
        return f"{ACTIVATE_ENV} is not 1"


@hookimpl
def chassis_platform() -> type[Platform] | None:
    """Offer :class:`TemplateCpuPlatform` when it is usable, else ``None``."""
    return TemplateCpuPlatform if TemplateCpuPlatform.is_available() else None
