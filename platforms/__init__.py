"""Platforms: the ``Platform`` interface, the built-ins, and ``current_platform``.

``current_platform`` resolves lazily (module ``__getattr__``) the first time it is read, so an
out-of-tree plugin can import :class:`Platform` from here without triggering detection.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from chassis.platforms.interface import Platform
from chassis.platforms.resolve import PLATFORM_ENV, PlatformError, resolve_platform

if TYPE_CHECKING:
    current_platform: Platform

__all__ = [
    "PLATFORM_ENV",
    "Platform",
    "PlatformError",
    "current_platform",
    "get_current_platform",
    "reset_current_platform",
]

_current: Platform | None = None
_lock = threading.Lock()


def get_current_platform() -> Platform:
    """The one platform of this process, resolved on first call."""
    global _current
    with _lock:
        if _current is None:
            from chassis.plugins.manager import get_plugin_manager

            _current = resolve_platform(get_plugin_manager())
        return _current


def reset_current_platform() -> None:
    """Forget the resolved platform (tests only)."""
    global _current
    with _lock:
        _current = None


def __getattr__(name: str) -> Any:
    if name == "current_platform":
        return get_current_platform()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
