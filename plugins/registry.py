"""A registry maps names to plugin-provided classes; pick-one choices are made from it."""

from __future__ import annotations

import importlib
from typing import Generic, TypeVar

T = TypeVar("T")


class UnknownNameError(ValueError):
    """A name was asked of a registry that does not hold it; the message lists known names."""


class DuplicateNameError(ValueError):
    """Two plugins registered the same name in one registry."""


class PluginObjectError(ImportError):
    """What a plugin registered under a name cannot be used: its lazy ``"module:Class"``
    does not import, or it is not a subclass of the class the registry holds. The message
    names the plugin."""


class Registry(Generic[T]):
    """Name -> class (or lazy ``"module:Class"`` string) for one kind of plugin object.

    Registration hooks call :meth:`register`; the engine calls :meth:`get`. Lazy strings are
    imported on the first :meth:`get`, so registering is cheap and import-safe.
    """

    def __init__(self, kind: str, base: str | None = None) -> None:
        """``base``: ``"package.module:Class"`` every registered class must subclass (checked
        on :meth:`get`, imported then, so no import cycle at registry creation)."""
        self.kind = kind
        self.base = base
        self._entries: dict[str, T | str] = {}
        self._owners: dict[str, str] = {}
        #: Set by the plugin manager while a plugin's hook runs, to attribute registrations.
        self.current_owner: str = "<direct>"

    def register(self, name: str, obj: T | str) -> None:
        """Add ``name``; ``obj`` is the class itself or ``"package.module:Class"``."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
        if isinstance(obj, str) and ":" not in obj:
            raise ValueError(
                f"lazy {self.kind} {name!r} must be 'package.module:Class', got {obj!r}"
            )
        if name in self._entries:
            raise DuplicateNameError(
                f"{self.kind} {name!r} is registered twice: by {self._owners[name]!r} "
                f"and by {self.current_owner!r}"
            )
        self._entries[name] = obj
        self._owners[name] = self.current_owner

    def get(self, name: str) -> T:
        """Return the class registered as ``name``; raise :class:`UnknownNameError` if none,
        :class:`PluginObjectError` if it does not import or is not a ``base`` subclass."""
        try:
            obj = self._entries[name]
        except KeyError:
            known = ", ".join(sorted(self._entries)) or "(none)"
            raise UnknownNameError(f"unknown {self.kind} {name!r}; known: {known}") from None
        if isinstance(obj, str):
            try:
                obj = _import_object(obj)
            except (ImportError, AttributeError) as exc:
                raise PluginObjectError(
                    f"{self.kind} {name!r} (registered by {self._owners[name]!r}) points to "
                    f"{self._entries[name]!r}, which cannot be imported: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
        if self.base is not None:
            base = _import_object(self.base)
            if not (isinstance(obj, type) and issubclass(obj, base)):
                raise PluginObjectError(
                    f"{self.kind} {name!r} (registered by {self._owners[name]!r}) is {obj!r}, "
                    f"not a subclass of {base.__module__}.{base.__qualname__}"
                )
        self._entries[name] = obj
        return obj  # type: ignore[return-value]

    def owner(self, name: str) -> str:
        """The plugin that registered ``name``; :class:`UnknownNameError` if none did."""
        if name not in self._owners:
            self.get(name)  # raises UnknownNameError listing the known names
        return self._owners[name]

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._entries)

    def names_by(self, owner: str) -> list[str]:
        """Names that plugin ``owner`` registered."""
        return sorted(n for n, o in self._owners.items() if o == owner)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"


def _import_object(target: str) -> object:
    module_name, _, attr = target.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def import_subclass(target: str, base: type, kind: str) -> type:
    """The class a qualified ``"package.module:Class"`` names (vLLM's form for selecting a
    plugin class that no hook registered), which must subclass ``base``; ``kind`` names it in
    errors (``"logits processor"``).

    :raises ValueError: the target does not import, or is not a subclass of ``base``
    """
    try:
        obj = _import_object(target)
    except (ImportError, AttributeError) as exc:
        raise ValueError(
            f"{kind} {target!r} cannot be imported: {type(exc).__name__}: {exc}"
        ) from exc
    if not (isinstance(obj, type) and issubclass(obj, base)):
        raise ValueError(
            f"{kind} {target!r} is {obj!r}, not a subclass of {base.__module__}.{base.__qualname__}"
        )
    return obj
