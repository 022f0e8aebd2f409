"""Entry-point discovery and loading: loud, idempotent, filtered by ``CHASSIS_PLUGINS``."""

from __future__ import annotations

import importlib.metadata
import logging
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pluggy

from chassis.plugins import hookspecs

logger = logging.getLogger(__name__)

PLATFORM_GROUP = "chassis.platform_plugins"
GENERAL_GROUP = "chassis.general_plugins"
GROUPS = (PLATFORM_GROUP, GENERAL_GROUP)
#: The distribution whose entry points are the built-ins.
BUILTIN_DISTRIBUTION = "chassis-llm"
ALLOW_LIST_ENV = "CHASSIS_PLUGINS"

EntryPointSource = Callable[[str], Iterable[importlib.metadata.EntryPoint]]


class PluginLoadError(RuntimeError):
    """A plugin could not be loaded; the message names distribution, entry point, hook, cause."""


@dataclass
class PluginRecord:
    """What ``chassis plugins`` shows for one discovered entry point."""

    group: str
    name: str
    value: str
    distribution: str
    #: ``"loaded"``, ``"skipped"`` (not in the allow-list) or ``"not loaded"`` (group not read yet)
    status: str = "not loaded"
    reason: str = ""
    hooks: list[str] = field(default_factory=list)

    @property
    def is_builtin(self) -> bool:
        return self.distribution == BUILTIN_DISTRIBUTION


def _installed_entry_points(group: str) -> Iterable[importlib.metadata.EntryPoint]:
    return importlib.metadata.entry_points(group=group)


def _distribution_name(ep: importlib.metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    name = getattr(dist, "name", None) or (dist.metadata["Name"] if dist is not None else None)
    return name or "<unknown distribution>"


def allow_list_from_env() -> frozenset[str] | None:
    """Entry-point names from ``CHASSIS_PLUGINS=a,b`` or ``None`` when unset (load all)."""
    raw = os.environ.get(ALLOW_LIST_ENV)
    if raw is None:
        return None
    return frozenset(n.strip() for n in raw.split(",") if n.strip())


class PluginManager:
    """Owns the pluggy manager of one process and the records of what was discovered.

    ``entry_points`` and ``allow_list`` are injectable so tests can use fake entry points
    without installing anything.
    """

    def __init__(
        self,
        entry_points: EntryPointSource | None = None,
        allow_list: frozenset[str] | None = None,
        *,
        read_env: bool = True,
    ) -> None:
        self._entry_points = entry_points or _installed_entry_points
        self.allow_list = allow_list if allow_list is not None or not read_env else allow_list_from_env()
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.records: dict[tuple[str, str], PluginRecord] = {}
        self._distributions: dict[str, str] = {}
        self._loaded_groups: set[str] = set()
        self._lock = threading.RLock()
        self.cache: dict[str, Any] = {}

    # -- loading ------------------------------------------------------------------------------

    def discover(self, group: str) -> list[PluginRecord]:
        """Records of every entry point in ``group`` (without loading them)."""
        out = []
        for ep in self._entry_points(group):
            key = (group, ep.name)
            if key not in self.records:
                self.records[key] = PluginRecord(group, ep.name, ep.value, _distribution_name(ep))
            out.append(self.records[key])
        return out

    def load_group(self, group: str) -> None:
        """Import and register every allowed entry point of ``group``; a no-op the second time."""
        with self._lock:
            if group in self._loaded_groups:
                return
            for ep in self._entry_points(group):
                record = self.discover_one(group, ep)
                if self.allow_list is not None and ep.name not in self.allow_list:
                    record.status = "skipped"
                    record.reason = f"not in {ALLOW_LIST_ENV}"
                    continue
                try:
                    obj = ep.load()
                except Exception as exc:
                    record.status = "failed"
                    record.reason = f"{type(exc).__name__}: {exc}"
                    raise PluginLoadError(
                        f"cannot import plugin {ep.name!r} ({ep.value}) from distribution "
                        f"{record.distribution!r}, group {group!r}: {type(exc).__name__}: {exc}"
                    ) from exc
                self.register(obj, ep.name, distribution=record.distribution, group=group)
                record.status = "loaded"
                record.hooks = self.hooks_of(ep.name)
            self._loaded_groups.add(group)
            logger.debug("loaded plugin group %s", group)

    def discover_one(self, group: str, ep: importlib.metadata.EntryPoint) -> PluginRecord:
        key = (group, ep.name)
        if key not in self.records:
            self.records[key] = PluginRecord(group, ep.name, ep.value, _distribution_name(ep))
        return self.records[key]

    def load_general_plugins(self) -> None:
        """Load ``chassis.general_plugins`` (once per process)."""
        self.load_group(GENERAL_GROUP)

    def load_platform_plugins(self) -> None:
        """Load ``chassis.platform_plugins`` (once per process)."""
        self.load_group(PLATFORM_GROUP)

    def register(
        self,
        plugin: object,
        name: str,
        *,
        distribution: str = "<direct>",
        group: str = GENERAL_GROUP,
    ) -> None:
        """Register ``plugin`` (a module or object with hookimpls) under ``name``.

        Registering the same name again is a no-op (loading is idempotent). A hookimpl whose
        name matches no hookspec, or whose arguments the hookspec lacks, raises
        :class:`PluginLoadError`.
        """
        with self._lock:
            if self.pm.has_plugin(name):
                return
            where = f"plugin {name!r} from distribution {distribution!r}, group {group!r}"
            try:
                self.pm.register(plugin, name=name)
            except pluggy.PluginValidationError as exc:
                raise PluginLoadError(f"{where}: {exc}") from exc
            except ValueError as exc:  # the same object registered under another name
                raise PluginLoadError(f"{where}: {exc}") from exc
            for caller in self.pm.get_hookcallers(plugin) or []:
                if not caller.has_spec():
                    self.pm.unregister(name=name)
                    known = ", ".join(sorted(h for h in dir(hookspecs) if h.startswith("chassis_")))
                    raise PluginLoadError(
                        f"{where}: hook {caller.name!r} matches no hookspec (known hooks: {known})"
                    )
            self._distributions[name] = distribution
            self.cache.clear()

    # -- queries ------------------------------------------------------------------------------

    def hooks_of(self, name: str) -> list[str]:
        plugin = self.pm.get_plugin(name)
        return sorted(c.name for c in self.pm.get_hookcallers(plugin) or []) if plugin else []

    def distribution_of(self, plugin_name: str) -> str:
        return self._distributions.get(plugin_name, "<direct>")

    def hookimpls(self, hook_name: str) -> list[tuple[str, Callable[..., Any], list[str]]]:
        """``(plugin name, function, argument names)`` of every implementation of a hook,
        in registration order."""
        caller = getattr(self.pm.hook, hook_name)
        impls = caller.get_hookimpls()
        return [(impl.plugin_name, impl.function, list(impl.argnames)) for impl in impls][::-1]

    def call_each(self, hook_name: str, **kwargs: Any) -> list[tuple[str, Any]]:
        """Call every implementation of ``hook_name`` one by one; ``(plugin, result)`` pairs.

        An exception from a hookimpl becomes a :class:`PluginLoadError` naming the plugin.
        """
        results = []
        for plugin_name, fn, argnames in self.hookimpls(hook_name):
            try:
                result = fn(**{a: kwargs[a] for a in argnames})
            except PluginLoadError:
                raise
            except Exception as exc:
                raise PluginLoadError(
                    f"plugin {plugin_name!r} from distribution "
                    f"{self.distribution_of(plugin_name)!r}: hook {hook_name!r} failed: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            results.append((plugin_name, result))
        return results


_manager: PluginManager | None = None
_manager_lock = threading.Lock()


def get_plugin_manager() -> PluginManager:
    """The process-wide :class:`PluginManager` (created on first use)."""
    global _manager
    with _manager_lock:
        if _manager is None:
            _manager = PluginManager()
        return _manager


def set_plugin_manager(manager: PluginManager | None) -> None:
    """Replace the process-wide manager (tests; ``None`` makes a fresh one on next use)."""
    global _manager
    with _manager_lock:
        _manager = manager


def load_general_plugins() -> None:
    """Load ``chassis.general_plugins`` in this process (idempotent)."""
    get_plugin_manager().load_general_plugins()


def register_plugin(plugin: object, name: str) -> None:
    """Register a plugin object directly, without an entry point (scripts, notebooks, tests).

    Only takes effect in the calling process: an engine-core child process loads plugins
    from entry points, so ship an entry point for anything that must reach it.
    """
    get_plugin_manager().register(plugin, name)
