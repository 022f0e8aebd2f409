"""Entry-point discovery and loading: loud, idempotent, filtered by ``CHASSIS_PLUGINS``."""

from __future__ import annotations

import importlib.metadata
import inspect
import logging
import os
import re
import threading
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import pluggy

from chassis.plugins import hookspecs

logger = logging.getLogger(__name__)

PLATFORM_GROUP = "chassis.platform_plugins"
GENERAL_GROUP = "chassis.general_plugins"
GROUPS = (PLATFORM_GROUP, GENERAL_GROUP)
#: The distribution whose entry points are the built-ins.
BUILTIN_DISTRIBUTION = "chassis-llm"
ALLOW_LIST_ENV = "CHASSIS_PLUGINS"
#: The only hook a ``chassis.platform_plugins`` entry point may implement (and the one hook a
#: ``chassis.general_plugins`` entry point may not): platform detection must not depend on
#: which group happened to be loaded first.
PLATFORM_HOOK = "chassis_platform"


class EntryPointLike(Protocol):
    """What the manager needs of an entry point (``importlib.metadata.EntryPoint`` or a fake)."""

    name: str
    value: str

    def load(self) -> Any: ...


EntryPointSource = Callable[[str], Iterable[EntryPointLike]]


class PluginLoadError(RuntimeError):
    """A plugin could not be loaded; the message names distribution, entry point, hook, cause."""


@dataclass
class PluginRecord:
    """What ``chassis plugins`` shows for one discovered entry point."""

    group: str
    name: str
    value: str
    distribution: str
    #: ``"not loaded"`` (group not read yet), ``"loaded"``, ``"skipped"`` (not in
    #: ``CHASSIS_PLUGINS``) or ``"failed"`` (``reason`` says why)
    status: str = "not loaded"
    reason: str = ""
    hooks: list[str] = field(default_factory=list)
    #: set when another distribution provides an entry point of the same name and group
    conflict: str = ""

    @property
    def is_builtin(self) -> bool:
        return is_builtin_distribution(self.distribution)


def canonical_distribution_name(name: str) -> str:
    """PEP 503 normalisation: ``Chassis_LLM`` and ``chassis-llm`` are one distribution."""
    return re.sub(r"[-_.]+", "-", name).lower()


def is_builtin_distribution(name: str) -> bool:
    """Whether ``name`` is this project's own distribution (whose entry points are built-in)."""
    return canonical_distribution_name(name) == BUILTIN_DISTRIBUTION


def _installed_entry_points(group: str) -> Iterable[importlib.metadata.EntryPoint]:
    return importlib.metadata.entry_points(group=group)


def _distribution_name(ep: EntryPointLike) -> str:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "<unknown distribution>"
    name = getattr(dist, "name", None)
    if not name:
        metadata = getattr(dist, "metadata", None)
        name = metadata["Name"] if metadata is not None else None
    return name or "<unknown distribution>"


def _env_names() -> list[str] | None:
    raw = os.environ.get(ALLOW_LIST_ENV)
    if raw is None:
        return None
    return [n.strip() for n in raw.split(",") if n.strip()]


def allow_list_from_env() -> frozenset[str] | None:
    """Entry-point names to load from ``CHASSIS_PLUGINS=a,b``; ``None`` (load all) when it is
    unset or names only exclusions (``-c``)."""
    names = _env_names()
    if names is None:
        return None
    allowed = frozenset(n for n in names if not n.startswith("-"))
    if not allowed and names:  # only exclusions: everything else loads
        return None
    return allowed


def deny_list_from_env() -> frozenset[str]:
    """Entry-point names never to load: the ``-name`` items of ``CHASSIS_PLUGINS`` (e.g.
    ``CHASSIS_PLUGINS=-broken`` skips a broken plugin and loads all others)."""
    return frozenset(n[1:].strip() for n in _env_names() or [] if n.startswith("-"))


def _unmarked_hook_functions(plugin: object) -> list[str]:
    """Names of ``chassis_*`` functions on ``plugin`` that lack ``@hookimpl``.

    pluggy ignores them silently, which would make a forgotten decorator a plugin that
    "loads" and does nothing; chassis reports it instead.
    """
    marker = f"{hookspecs.PROJECT_NAME}_impl"
    names = []
    for attr in dir(plugin):
        if not attr.startswith(f"{hookspecs.PROJECT_NAME}_"):
            continue
        value = inspect.getattr_static(plugin, attr, None)
        if isinstance(value, staticmethod | classmethod):
            value = value.__func__
        if inspect.isfunction(value) and not hasattr(value, marker):
            names.append(attr)
    return names


class PluginManager:
    """Owns the pluggy manager of one process and the records of what was discovered.

    ``entry_points`` and ``allow_list`` are injectable so tests can use fake entry points
    without installing anything. A plugin's name is its entry-point name; two different
    objects under one name is an error.
    """

    def __init__(
        self,
        entry_points: EntryPointSource | None = None,
        allow_list: frozenset[str] | None = None,
        *,
        read_env: bool = True,
        deny_list: frozenset[str] = frozenset(),
    ) -> None:
        self._entry_points = entry_points or _installed_entry_points
        if allow_list is None and read_env:
            allow_list = allow_list_from_env()
        if not deny_list and read_env:
            deny_list = deny_list_from_env()
        #: entry-point names to load (``None``: all)
        self.allow_list = allow_list
        #: entry-point names never to load (``CHASSIS_PLUGINS=-name``)
        self.deny_list = deny_list
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.records: dict[tuple[str, str], PluginRecord] = {}
        self._distributions: dict[str, str] = {}
        self._groups: dict[str, str] = {}
        self._loaded_groups: set[str] = set()
        self._warned_allow_list = False
        self._lock = threading.RLock()
        #: derived objects (the registries) rebuilt after any new registration
        self.cache: dict[str, Any] = {}

    # -- discovery ----------------------------------------------------------------------------

    def discover(self, group: str) -> list[PluginRecord]:
        """Records of every entry point in ``group`` (without loading them)."""
        with self._lock:
            return [self.discover_one(group, ep) for ep in self._entry_points(group)]

    def discover_one(self, group: str, ep: EntryPointLike) -> PluginRecord:
        """The record of entry point ``ep`` of ``group`` (created on first sight).

        A second entry point with the same name in the group (another distribution, or
        another value) marks the record ``"failed"``: names must be unique.
        """
        key = (group, ep.name)
        distribution = _distribution_name(ep)
        record = self.records.get(key)
        if record is None:
            record = self.records[key] = PluginRecord(group, ep.name, ep.value, distribution)
        elif (record.distribution, record.value) != (distribution, ep.value):
            record.status = "failed"
            record.reason = record.conflict = (
                f"entry point {ep.name!r} of group {group!r} is provided twice: "
                f"{record.value} by distribution {record.distribution!r} and {ep.value} by "
                f"distribution {distribution!r}; uninstall one or exclude the name with "
                f"{ALLOW_LIST_ENV}"
            )
        return record

    def unknown_allowed_names(self) -> list[str]:
        """Names in the allow- or deny-list that match no entry point of either group
        (typos)."""
        listed = (self.allow_list or frozenset()) | self.deny_list
        if not listed:
            return []
        known = {r.name for group in GROUPS for r in self.discover(group)}
        return sorted(listed - known)

    # -- loading ------------------------------------------------------------------------------

    def load_group(self, group: str) -> None:
        """Import and register every allowed entry point of ``group``; a no-op the second time.

        :raises PluginLoadError: an entry point failed to import, or its hookimpls do not
            match the hookspecs; the group stays unloaded, so the next call fails the same way.
        """
        with self._lock:
            if group in self._loaded_groups:
                return
            self._warn_unknown_allowed()
            entry_points = list(self._entry_points(group))
            records = [self.discover_one(group, ep) for ep in entry_points]
            for ep, record in zip(entry_points, records, strict=True):
                if self.allow_list is not None and ep.name not in self.allow_list:
                    record.status = "skipped"
                    record.reason = f"not in {ALLOW_LIST_ENV}"
                    continue
                if ep.name in self.deny_list:
                    record.status = "skipped"
                    record.reason = f"excluded by {ALLOW_LIST_ENV}=-{ep.name}"
                    continue
                if record.conflict:
                    raise PluginLoadError(record.conflict)
                try:
                    obj = ep.load()
                except Exception as exc:
                    record.status = "failed"
                    record.reason = f"{type(exc).__name__}: {exc}"
                    raise PluginLoadError(
                        f"cannot import plugin {ep.name!r} ({ep.value}) from distribution "
                        f"{record.distribution!r}, group {group!r}: {type(exc).__name__}: {exc}"
                        f"{_raised_at(exc)}. Fix or uninstall it, or leave it out with "
                        f"{ALLOW_LIST_ENV}=-{ep.name}"
                    ) from exc
                try:
                    self.register(obj, ep.name, distribution=record.distribution, group=group)
                except PluginLoadError as exc:
                    record.status = "failed"
                    record.reason = str(exc)
                    raise
                record.status = "loaded"
                record.reason = ""
                record.hooks = self.hooks_of(ep.name)
                if not record.hooks:
                    # Often the wrong module: e.g. a project folder of the same name on
                    # sys.path shadowing the package, imported as an empty namespace.
                    where = getattr(obj, "__file__", None) or getattr(obj, "__path__", None)
                    record.reason = f"implements no chassis_* hook (loaded from {where})"
                    logger.warning("plugin %r %s", ep.name, record.reason)
            self._loaded_groups.add(group)
            logger.debug("loaded plugin group %s", group)

    def _warn_unknown_allowed(self) -> None:
        if self._warned_allow_list:
            return
        self._warned_allow_list = True
        unknown = self.unknown_allowed_names()
        if unknown:
            logger.warning(
                "%s names entry points that no installed plugin provides: %s",
                ALLOW_LIST_ENV,
                ", ".join(unknown),
            )

    def is_loaded(self, group: str) -> bool:
        """Whether ``group`` has been loaded in this manager."""
        return group in self._loaded_groups

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

        Registering the same object under the same name again is a no-op (loading is
        idempotent). Raises :class:`PluginLoadError`, naming the plugin, its distribution,
        its group and the hook, when:

        * another object is already registered under ``name``;
        * a hookimpl's name matches no hookspec, or it asks for an argument the hookspec lacks;
        * a ``chassis_*`` function lacks the ``@hookimpl`` decorator;
        * a hookimpl is a wrapper (chassis calls each implementation itself);
        * ``chassis_platform`` comes from the general group, or another hook from the
          platform group.
        """
        if group not in GROUPS:
            raise ValueError(f"unknown plugin group {group!r}; known: {', '.join(GROUPS)}")
        with self._lock:
            where = f"plugin {name!r} from distribution {distribution!r}, group {group!r}"
            existing = self.pm.get_plugin(name)
            if existing is not None:
                if existing is plugin:
                    return
                raise PluginLoadError(
                    f"{where}: the name is already taken by a plugin from distribution "
                    f"{self.distribution_of(name)!r}, group {self._groups.get(name)!r}; "
                    "entry-point names must be unique across distributions and groups"
                )
            unmarked = _unmarked_hook_functions(plugin)
            if unmarked:
                raise PluginLoadError(
                    f"{where}: {', '.join(unmarked)} not decorated with "
                    "@chassis.plugins.hookimpl, so it would never be called"
                )
            try:
                self.pm.register(plugin, name=name)
            except (pluggy.PluginValidationError, ValueError) as exc:
                # pluggy leaves a half-registered plugin behind when validation fails.
                if self.pm.get_plugin(name) is plugin:
                    self.pm.unregister(name=name)
                # ValueError: the same object is already registered under another name.
                raise PluginLoadError(f"{where}: {exc}") from exc
            try:
                self._validate_hooks(plugin, name, group, where)
            except PluginLoadError:
                self.pm.unregister(name=name)
                raise
            self._distributions[name] = distribution
            self._groups[name] = group
            self.cache.clear()

    def _validate_hooks(self, plugin: object, name: str, group: str, where: str) -> None:
        known = ", ".join(sorted(h for h in dir(hookspecs) if h.startswith("chassis_")))
        for caller in self.pm.get_hookcallers(plugin) or []:
            if not caller.has_spec():
                raise PluginLoadError(
                    f"{where}: hook {caller.name!r} matches no hookspec (known hooks: {known})"
                )
            if group == PLATFORM_GROUP and caller.name != PLATFORM_HOOK:
                raise PluginLoadError(
                    f"{where}: hook {caller.name!r} belongs in a 'chassis.general_plugins' entry "
                    f"point; platform plugins implement only {PLATFORM_HOOK!r}"
                )
            if group == GENERAL_GROUP and caller.name == PLATFORM_HOOK:
                raise PluginLoadError(
                    f"{where}: hook {PLATFORM_HOOK!r} must be exposed through a "
                    "'chassis.platform_plugins' entry point"
                )
            for impl in caller.get_hookimpls():
                if impl.plugin_name == name and (impl.hookwrapper or impl.wrapper):
                    raise PluginLoadError(
                        f"{where}: hook {caller.name!r} is a wrapper; chassis calls every "
                        "implementation itself, so wrappers are not supported"
                    )

    # -- queries ------------------------------------------------------------------------------

    def hooks_of(self, name: str) -> list[str]:
        """Hooks implemented by plugin ``name``, sorted (empty if not registered)."""
        plugin = self.pm.get_plugin(name)
        return sorted(c.name for c in self.pm.get_hookcallers(plugin) or []) if plugin else []

    def distribution_of(self, plugin_name: str) -> str:
        """The distribution that provided plugin ``plugin_name`` (``"<direct>"`` if none)."""
        return self._distributions.get(plugin_name, "<direct>")

    def group_of(self, plugin_name: str) -> str | None:
        """The entry-point group plugin ``plugin_name`` was registered for."""
        return self._groups.get(plugin_name)

    def is_builtin(self, plugin_name: str) -> bool:
        """Whether plugin ``plugin_name`` came from this project's own distribution."""
        return is_builtin_distribution(self.distribution_of(plugin_name))

    def hookimpls(self, hook_name: str) -> list[tuple[str, Callable[..., Any], list[str]]]:
        """``(plugin name, function, argument names)`` of every implementation of a hook,
        in registration order (``tryfirst``/``trylast`` hookimpls move to the end/start)."""
        caller = getattr(self.pm.hook, hook_name)
        # pluggy keeps implementations in registration order (and calls them in reverse).
        return [(i.plugin_name, i.function, list(i.argnames)) for i in caller.get_hookimpls()]

    def call_each(self, hook_name: str, **kwargs: Any) -> list[tuple[str, Any]]:
        """Call every implementation of ``hook_name`` one by one; ``(plugin, result)`` pairs.

        Each implementation receives the subset of ``kwargs`` it names. An exception from a
        hookimpl becomes a :class:`PluginLoadError` naming the plugin and the hook.
        """
        return [
            (plugin_name, self.call_impl(plugin_name, hook_name, fn, argnames, **kwargs))
            for plugin_name, fn, argnames in self.hookimpls(hook_name)
        ]

    def call_impl(
        self,
        plugin_name: str,
        hook_name: str,
        fn: Callable[..., Any],
        argnames: list[str],
        **kwargs: Any,
    ) -> Any:
        """Call one implementation (an item of :meth:`hookimpls`) with the arguments it names.

        :raises PluginLoadError: the implementation raised; names the plugin and the hook.
        """
        try:
            return fn(**{a: kwargs[a] for a in argnames})
        except PluginLoadError:
            raise
        except Exception as exc:
            raise PluginLoadError(
                f"plugin {plugin_name!r} from distribution "
                f"{self.distribution_of(plugin_name)!r}: hook {hook_name!r} failed: "
                f"{type(exc).__name__}: {exc}"
            ) from exc


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
    """Register a general plugin object directly, without an entry point (scripts, tests).

    Only takes effect in the calling process: an engine-core child process loads plugins
    from entry points, so ship an entry point for anything that must reach it.
    """
    get_plugin_manager().register(plugin, name)


def _raised_at(exc: BaseException) -> str:
    """`` (raised at file:line)`` of the innermost frame of ``exc``'s traceback, or ``""``:
    a plugin author reading ``KeyError: 7`` needs to know where."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    last = frames[-1]
    return f" (raised at {last.filename}:{last.lineno})"
