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
# Re-entrant so that a plugin reading current_platform during detection gets an error, not
# a deadlock.
_lock = threading.RLock()
_resolving = False


def get_current_platform() -> Platform:
    """The one platform of this process, resolved on first call.

    A failed resolution is not cached: the next call tries again (and fails the same way).

    :raises PlatformError: see :func:`chassis.platforms.resolve.resolve_platform`.
    :raises PluginLoadError: a platform plugin failed to load.
    """
    global _current, _resolving
    current = _current
    if current is not None:  # the hot path (layers ask per call): no lock once resolved
        return current
    with _lock:
        if _current is None:
            if _resolving:
                raise PlatformError(
                    "current_platform was read while the platform is being resolved (from a "
                    "chassis_platform hook?); detection must not depend on the platform"
                )
            from chassis.plugins.manager import get_plugin_manager

            _resolving = True
            try:
                _current = resolve_platform(get_plugin_manager())
            finally:
                _resolving = False
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
