"""Fixtures and fakes for tests of the plugin manager and platform selection.

Import what you need::

    from fixtures_plugins import FakeEntryPoint, fake_manager, isolated_plugins  # noqa: F401

``isolated_plugins`` resets the process-wide plugin manager and ``current_platform`` before
and after the test and removes ``CHASSIS_PLUGINS`` / ``CHASSIS_PLATFORM`` from the
environment; use it in every test that reads or replaces them.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from chassis.platforms import reset_current_platform
from chassis.plugins import GENERAL_GROUP, PLATFORM_GROUP, PluginManager, set_plugin_manager

BUILTIN = "chassis-llm"

#: the built-in platform modules, as pyproject.toml registers them
BUILTIN_PLATFORMS = {
    "cpu": "chassis.platforms.cpu",
    "cuda": "chassis.platforms.cuda",
    "rocm": "chassis.platforms.rocm",
    "xpu": "chassis.platforms.xpu",
    "tpu": "chassis.platforms.tpu",
}


@dataclass
class FakeDistribution:
    """The part of ``importlib.metadata.Distribution`` the manager reads."""

    name: str


class FakeEntryPoint:
    """An entry point that loads ``obj`` if given, else imports ``value`` like the real one.

    ``load_count`` counts the loads, to check that loading is idempotent.
    """

    def __init__(
        self, name: str, value: str, distribution: str = "fake-dist", obj: Any = None
    ) -> None:
        self.name = name
        self.value = value
        self.dist = FakeDistribution(distribution)
        self.obj = obj
        self.load_count = 0

    def load(self) -> Any:
        self.load_count += 1
        if self.obj is not None:
            return self.obj
        module_name, _, attr = self.value.partition(":")
        module = importlib.import_module(module_name)
        return getattr(module, attr) if attr else module

    def __repr__(self) -> str:
        return f"FakeEntryPoint({self.name!r}, {self.value!r}, {self.dist.name!r})"


def builtin_platform_eps() -> list[FakeEntryPoint]:
    """Fake entry points for the five real built-in platform modules (distribution chassis-llm)."""
    return [FakeEntryPoint(n, v, BUILTIN) for n, v in BUILTIN_PLATFORMS.items()]


def fake_manager(
    platform: list[FakeEntryPoint] | None = None,
    general: list[FakeEntryPoint] | None = None,
    allow_list: frozenset[str] | None = None,
) -> PluginManager:
    """A manager that sees only the given entry points (nothing installed is read)."""
    groups = {PLATFORM_GROUP: list(platform or []), GENERAL_GROUP: list(general or [])}
    return PluginManager(lambda group: groups.get(group, []), allow_list, read_env=False)


@pytest.fixture
def isolated_plugins(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fresh process-wide plugin manager and platform for the test; restored afterwards."""
    monkeypatch.delenv("CHASSIS_PLUGINS", raising=False)
    monkeypatch.delenv("CHASSIS_PLATFORM", raising=False)
    set_plugin_manager(None)
    reset_current_platform()
    try:
        yield
    finally:
        set_plugin_manager(None)
        reset_current_platform()
