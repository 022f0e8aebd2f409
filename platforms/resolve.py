"""Choosing exactly one platform per process (the rules of ARCHITECTURE section 3)."""

from __future__ import annotations

import logging
import os

from chassis.platforms.interface import Platform
from chassis.plugins.manager import PLATFORM_GROUP, PluginManager

logger = logging.getLogger(__name__)

PLATFORM_ENV = "CHASSIS_PLATFORM"


class PlatformError(RuntimeError):
    """No platform, or more than one, could be chosen; the message says what to do."""


def _check_offer(plugin: str, offered: object) -> type[Platform] | None:
    if offered is None:
        return None
    if not (isinstance(offered, type) and issubclass(offered, Platform)):
        raise PlatformError(
            f"platform plugin {plugin!r} returned {offered!r} from chassis_platform; "
            "it must return a chassis.platforms.Platform subclass or None"
        )
    return offered


def resolve_platform(manager: PluginManager, forced: str | None = None) -> Platform:
    """Load the platform plugins of ``manager`` and return the one platform for this process.

    1. ``forced`` (default: ``$CHASSIS_PLATFORM``) picks a platform by name; it must be
       installed and usable.
    2. Exactly one usable out-of-tree platform (from a distribution other than chassis-llm)
       wins; two or more is an error.
    3. Else exactly one usable built-in accelerator; two or more is an error.
    4. Else the CPU.

    The chosen platform's ``selection_reason`` says which rule chose it.

    :raises PlatformError: no rule yields exactly one platform.
    :raises PluginLoadError: a platform plugin failed to load, or its hook raised.
    """
    if forced is None:
        forced = os.environ.get(PLATFORM_ENV) or None
    manager.load_platform_plugins()
    offers: list[tuple[str, type[Platform]]] = []
    declined: list[str] = []
    for plugin, offered in manager.call_each("chassis_platform"):
        cls = _check_offer(plugin, offered)
        if cls is None:
            declined.append(plugin)
        else:
            offers.append((plugin, cls))

    def describe(plugin: str, cls: type[Platform]) -> str:
        return f"{cls.name} (plugin {plugin!r}, distribution {manager.distribution_of(plugin)!r})"

    if forced:
        matches = [(p, c) for p, c in offers if c.name == forced]
        if not matches:
            usable = ", ".join(sorted({c.name for _, c in offers})) or "(none)"
            nothing = ", ".join(sorted(declined)) or "(none)"
            raise PlatformError(
                f"{PLATFORM_ENV}={forced!r}, but no installed platform plugin offers a usable "
                f"platform of that name. Usable here: {usable}. Platform plugins that found no "
                f"usable device here: {nothing}. Unset {PLATFORM_ENV} or install the plugin."
            )
        if len(matches) > 1:
            names = "; ".join(describe(p, c) for p, c in matches)
            raise PlatformError(
                f"{PLATFORM_ENV}={forced!r} is offered by more than one plugin: {names}; "
                "uninstall one or exclude it with CHASSIS_PLUGINS"
            )
        plugin, cls = matches[0]
        return _select(cls, f"forced by {PLATFORM_ENV}={forced} (plugin {plugin!r})")

    out_of_tree = [(p, c) for p, c in offers if not manager.is_builtin(p)]
    if len(out_of_tree) > 1:
        names = "; ".join(describe(p, c) for p, c in out_of_tree)
        raise PlatformError(
            f"more than one out-of-tree platform is usable: {names}. "
            f"Set {PLATFORM_ENV} to the one to use."
        )
    if out_of_tree:
        plugin, cls = out_of_tree[0]
        return _select(
            cls,
            f"out-of-tree platform from distribution {manager.distribution_of(plugin)!r} "
            f"(plugin {plugin!r}); out-of-tree platforms win over built-ins",
        )

    accelerators = [(p, c) for p, c in offers if manager.is_builtin(p) and c.name != "cpu"]
    if len(accelerators) > 1:
        names = "; ".join(f"{c.name}: {c.detection_detail()}" for _, c in accelerators)
        raise PlatformError(
            f"more than one built-in accelerator platform is usable ({names}). "
            f"Set {PLATFORM_ENV} to the one to use."
        )
    if accelerators:
        plugin, cls = accelerators[0]
        return _select(cls, f"the only usable accelerator: {cls.detection_detail()}")

    cpu = [(p, c) for p, c in offers if c.name == "cpu"]
    if not cpu:
        raise PlatformError(
            "no platform is usable: no accelerator was detected and the CPU platform plugin is "
            "not loaded (is 'cpu' missing from CHASSIS_PLUGINS?)"
        )
    reason = "no accelerator platform is usable; falling back to the CPU"
    excluded = sorted(
        record.name
        for (group, _), record in manager.records.items()
        if group == PLATFORM_GROUP and record.status == "skipped"
    )
    if excluded:
        # Not silent: the operator's CHASSIS_PLUGINS kept these detectors from looking.
        reason += f" (platform plugins not loaded, by CHASSIS_PLUGINS: {', '.join(excluded)})"
        logger.warning("%s", reason)
    return _select(cpu[0][1], reason)


def _select(cls: type[Platform], reason: str) -> Platform:
    platform = cls()
    platform.selection_reason = reason
    logger.info("platform: %s (%s)", cls.name, reason)
    return platform
