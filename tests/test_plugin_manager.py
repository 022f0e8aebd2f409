"""The plugin manager with fake entry points: loading, errors, allow-list, idempotence."""

from __future__ import annotations

import argparse
import logging
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from fixtures_plugins import FakeEntryPoint, fake_manager, isolated_plugins  # noqa: F401

from chassis.core.config import EngineConfig
from chassis.plugins import (
    GENERAL_GROUP,
    PLATFORM_GROUP,
    DuplicateNameError,
    PluginLoadError,
    PluginManager,
    PluginObjectError,
    Registry,
    UnknownNameError,
    add_plugin_cli_args,
    apply_configure_hooks,
    get_plugin_manager,
    get_registries,
    hookimpl,
    plugin_args_from,
    register_plugin,
    set_plugin_manager,
)
from chassis.plugins.registries import build_registries


class SchedulerPlugin:
    """Registers schedulers; counts how often its hook runs."""

    def __init__(self, *names: str) -> None:
        self.names = names
        self.calls = 0

    @hookimpl
    def chassis_register_schedulers(self, registry: Registry[Any]) -> None:
        self.calls += 1
        for name in self.names:
            registry.register(name, f"some.module:{name.title()}")


def module_plugin(name: str, **functions: Any) -> types.ModuleType:
    """A module object holding ``functions``, as an entry point's ``load()`` returns it."""
    module = types.ModuleType(name)
    for attr, fn in functions.items():
        setattr(module, attr, fn)
    return module


# -- loading --------------------------------------------------------------------------------


def test_loads_general_plugins_and_attributes_registrations() -> None:
    a, b = SchedulerPlugin("alpha"), SchedulerPlugin("beta", "gamma")
    manager = fake_manager(
        general=[
            FakeEntryPoint("a", "pkg_a", "dist-a", a),
            FakeEntryPoint("b", "pkg_b", "dist-b", b),
        ]
    )
    registries = build_registries(manager)
    assert registries.schedulers.names() == ["alpha", "beta", "gamma"]
    assert registries.schedulers.names_by("a") == ["alpha"]
    assert registries.schedulers.names_by("b") == ["beta", "gamma"]
    assert manager.distribution_of("b") == "dist-b"
    record = manager.records[(GENERAL_GROUP, "a")]
    assert (record.status, record.hooks, record.distribution) == (
        "loaded",
        ["chassis_register_schedulers"],
        "dist-a",
    )
    assert not record.is_builtin


def test_builtin_distribution_name_is_normalised() -> None:
    manager = fake_manager(general=[FakeEntryPoint("x", "x", "Chassis_LLM", SchedulerPlugin())])
    manager.load_general_plugins()
    assert manager.is_builtin("x")
    assert manager.records[(GENERAL_GROUP, "x")].is_builtin


@pytest.mark.usefixtures("isolated_plugins")
def test_loading_twice_imports_and_registers_once() -> None:
    plugin = SchedulerPlugin("alpha")
    ep = FakeEntryPoint("a", "pkg_a", "dist-a", plugin)
    manager = fake_manager(general=[ep])
    set_plugin_manager(manager)
    manager.load_general_plugins()
    manager.load_general_plugins()
    first = get_registries()
    assert get_registries() is first
    assert ep.load_count == 1
    assert plugin.calls == 1
    # Registering the same object under the same name again is a no-op too.
    manager.register(plugin, "a")
    assert get_registries() is first


@pytest.mark.usefixtures("isolated_plugins")
def test_new_registration_rebuilds_registries() -> None:
    manager = fake_manager(general=[FakeEntryPoint("a", "pkg_a", "dist-a", SchedulerPlugin("x"))])
    set_plugin_manager(manager)
    assert get_registries().schedulers.names() == ["x"]
    register_plugin(SchedulerPlugin("y"), "direct")
    assert get_registries().schedulers.names() == ["x", "y"]
    assert get_registries().schedulers.owner("y") == "direct"
    assert get_plugin_manager().distribution_of("direct") == "<direct>"


def test_hookimpls_run_in_registration_order() -> None:
    order: list[str] = []

    def configure_hook(tag: str) -> Any:
        @hookimpl
        def chassis_configure(config: EngineConfig) -> None:
            order.append(tag)

        return chassis_configure

    manager = fake_manager(
        general=[
            FakeEntryPoint(tag, tag, "d", module_plugin(tag, chassis_configure=configure_hook(tag)))
            for tag in ("first", "second", "third")
        ]
    )
    manager.load_general_plugins()
    assert [name for name, _, _ in manager.hookimpls("chassis_configure")] == [
        "first",
        "second",
        "third",
    ]
    apply_configure_hooks(EngineConfig(), manager)
    assert order == ["first", "second", "third"]


# -- allow-list -----------------------------------------------------------------------------


@pytest.mark.usefixtures("isolated_plugins")
def test_allow_list_from_env_limits_loading(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CHASSIS_PLUGINS", " a , typo_name")
    a, b = SchedulerPlugin("alpha"), SchedulerPlugin("beta")
    eps = [FakeEntryPoint("a", "pkg_a", "d", a), FakeEntryPoint("b", "pkg_b", "d", b)]
    manager = PluginManager(lambda group: eps if group == GENERAL_GROUP else [])
    assert manager.allow_list == frozenset({"a", "typo_name"})
    with caplog.at_level(logging.WARNING, logger="chassis.plugins.manager"):
        registries = build_registries(manager)
    assert registries.schedulers.names() == ["alpha"]
    assert eps[1].load_count == 0
    skipped = manager.records[(GENERAL_GROUP, "b")]
    assert (skipped.status, skipped.reason) == ("skipped", "not in CHASSIS_PLUGINS")
    assert manager.unknown_allowed_names() == ["typo_name"]
    assert "typo_name" in caplog.text


@pytest.mark.usefixtures("isolated_plugins")
def test_a_minus_name_in_the_env_excludes_that_plugin_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CHASSIS_PLUGINS", "-broken")
    good = FakeEntryPoint("good", "pkg_good", "d", SchedulerPlugin("alpha"))
    broken = FakeEntryPoint("broken", "chassis_no_such_module_xyz", "d")
    manager = PluginManager(lambda group: [good, broken] if group == GENERAL_GROUP else [])
    assert manager.allow_list is None and manager.deny_list == frozenset({"broken"})
    assert build_registries(manager).schedulers.names() == ["alpha"]
    skipped = manager.records[(GENERAL_GROUP, "broken")]
    assert (skipped.status, skipped.reason) == ("skipped", "excluded by CHASSIS_PLUGINS=-broken")
    assert broken.load_count == 0
    # names and exclusions together: only the named, minus the excluded
    monkeypatch.setenv("CHASSIS_PLUGINS", "good,broken,-broken")
    manager = PluginManager(lambda group: [good, broken] if group == GENERAL_GROUP else [])
    assert build_registries(manager).schedulers.names() == ["alpha"]


def test_a_plugin_without_hooks_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    manager = fake_manager(general=[FakeEntryPoint("empty", "types", "d", types.ModuleType("x"))])
    with caplog.at_level(logging.WARNING, logger="chassis.plugins.manager"):
        build_registries(manager)
    record = manager.records[(GENERAL_GROUP, "empty")]
    assert record.status == "loaded" and "implements no chassis_* hook" in record.reason
    assert "'empty' implements no chassis_* hook" in caplog.text


def test_explicit_allow_list_overrides_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHASSIS_PLUGINS", "a")
    manager = fake_manager(
        general=[FakeEntryPoint("a", "a", "d", SchedulerPlugin("alpha"))], allow_list=frozenset()
    )
    assert build_registries(manager).schedulers.names() == []


# -- loud failures --------------------------------------------------------------------------


def test_plugin_that_fails_to_import_names_distribution_entry_point_and_cause() -> None:
    ep = FakeEntryPoint("broken", "chassis_no_such_module_xyz.plugin", "broken-dist")
    manager = fake_manager(general=[ep])
    with pytest.raises(PluginLoadError) as info:
        manager.load_general_plugins()
    message = str(info.value)
    for part in ("'broken'", "broken-dist", "chassis_no_such_module_xyz", "ModuleNotFoundError"):
        assert part in message
    assert isinstance(info.value.__cause__, ModuleNotFoundError)
    record = manager.records[(GENERAL_GROUP, "broken")]
    assert record.status == "failed" and "ModuleNotFoundError" in record.reason
    # Still unloaded: the next attempt fails the same way instead of half-working.
    assert not manager.is_loaded(GENERAL_GROUP)
    with pytest.raises(PluginLoadError):
        manager.load_general_plugins()


def test_hookimpl_with_wrong_argument_name_names_the_hook() -> None:
    @hookimpl
    def chassis_register_schedulers(registy: Any) -> None:  # typo: registy
        raise AssertionError("never called")

    plugin = module_plugin("typo", chassis_register_schedulers=chassis_register_schedulers)
    manager = fake_manager(general=[FakeEntryPoint("typo", "typo", "typo-dist", plugin)])
    with pytest.raises(PluginLoadError) as info:
        manager.load_general_plugins()
    message = str(info.value)
    assert "chassis_register_schedulers" in message and "registy" in message
    assert "typo-dist" in message
    assert manager.records[(GENERAL_GROUP, "typo")].status == "failed"
    # The half-registered plugin was removed again.
    assert manager.hookimpls("chassis_register_schedulers") == []


def test_hook_matching_no_hookspec_lists_known_hooks() -> None:
    @hookimpl
    def chassis_register_schedulerz(registry: Any) -> None:
        raise AssertionError("never called")

    plugin = module_plugin("z", chassis_register_schedulerz=chassis_register_schedulerz)
    manager = fake_manager(general=[FakeEntryPoint("z", "z", "z-dist", plugin)])
    with pytest.raises(PluginLoadError, match=r"'chassis_register_schedulerz' matches no hookspec"):
        manager.load_general_plugins()
    with pytest.raises(PluginLoadError, match=r"chassis_register_schedulers"):
        manager.load_general_plugins()
    assert manager.pm.get_plugin("z") is None


def test_hook_function_without_hookimpl_marker_is_an_error() -> None:
    def chassis_register_samplers(registry: Any) -> None:
        raise AssertionError("never called")

    plugin = module_plugin("nomark", chassis_register_samplers=chassis_register_samplers)
    manager = fake_manager(general=[FakeEntryPoint("nomark", "nomark", "d", plugin)])
    with pytest.raises(PluginLoadError, match=r"not decorated with @chassis.plugins.hookimpl"):
        manager.load_general_plugins()


def test_hooks_must_come_from_their_group() -> None:
    @hookimpl
    def chassis_platform() -> None:
        return None

    platform_in_general = module_plugin("p", chassis_platform=chassis_platform)
    manager = fake_manager(general=[FakeEntryPoint("p", "p", "d", platform_in_general)])
    with pytest.raises(PluginLoadError, match=r"'chassis.platform_plugins' entry point"):
        manager.load_general_plugins()

    registry_in_platform = SchedulerPlugin("x")
    manager = fake_manager(platform=[FakeEntryPoint("s", "s", "d", registry_in_platform)])
    with pytest.raises(PluginLoadError, match=r"platform plugins implement only"):
        manager.load_platform_plugins()


def test_hook_wrappers_are_rejected() -> None:
    @hookimpl(wrapper=True)
    def chassis_configure(config: Any) -> Any:
        return (yield)

    manager = fake_manager(
        general=[
            FakeEntryPoint("w", "w", "d", module_plugin("w", chassis_configure=chassis_configure))
        ]
    )
    with pytest.raises(PluginLoadError, match=r"wrapper"):
        manager.load_general_plugins()


def test_two_plugins_with_one_entry_point_name_is_an_error() -> None:
    manager = fake_manager(
        general=[
            FakeEntryPoint("same", "one", "dist-one", SchedulerPlugin("x")),
            FakeEntryPoint("same", "two", "dist-two", SchedulerPlugin("y")),
        ]
    )
    with pytest.raises(PluginLoadError) as info:
        manager.load_general_plugins()
    assert "dist-one" in str(info.value) and "dist-two" in str(info.value)


def test_duplicate_registration_names_both_plugins() -> None:
    manager = fake_manager(
        general=[
            FakeEntryPoint("first", "f", "dist-f", SchedulerPlugin("fcfs")),
            FakeEntryPoint("second", "s", "dist-s", SchedulerPlugin("fcfs")),
        ]
    )
    with pytest.raises(PluginLoadError) as info:
        build_registries(manager)
    message = str(info.value)
    assert (
        "'second'" in message and "dist-s" in message and "chassis_register_schedulers" in message
    )
    assert isinstance(info.value.__cause__, DuplicateNameError)
    assert "'first'" in str(info.value.__cause__)


def test_failing_registration_hook_is_wrapped() -> None:
    @hookimpl
    def chassis_register_models(registry: Any) -> None:
        raise RuntimeError("boom")

    plugin = module_plugin("m", chassis_register_models=chassis_register_models)
    manager = fake_manager(general=[FakeEntryPoint("m", "m", "m-dist", plugin)])
    with pytest.raises(PluginLoadError, match=r"'m' from distribution 'm-dist'.*boom"):
        build_registries(manager)


# -- registries -----------------------------------------------------------------------------


def test_unknown_name_lists_known_names() -> None:
    registry: Registry[Any] = Registry("scheduler")
    registry.register("fcfs", "a.b:C")
    registry.register("priority", "a.b:D")
    with pytest.raises(UnknownNameError, match=r"unknown scheduler 'sjf'; known: fcfs, priority"):
        registry.get("sjf")
    assert isinstance(UnknownNameError("x"), ValueError)


def test_registry_rejects_bad_entries_and_reports_broken_lazy_imports() -> None:
    registry: Registry[Any] = Registry("sampler")
    with pytest.raises(ValueError, match=r"'package.module:Class'"):
        registry.register("bad", "no_colon_here")
    with pytest.raises(ValueError, match=r"non-empty string"):
        registry.register("", object)
    registry.current_owner = "plugin-x"
    registry.register("lazy", "chassis_no_such_module_xyz:Sampler")
    with pytest.raises(ImportError, match=r"registered by 'plugin-x'"):
        registry.get("lazy")
    registry.register("real", "collections:OrderedDict")
    import collections

    assert registry.get("real") is collections.OrderedDict
    with pytest.raises(DuplicateNameError, match=r"'plugin-x' and by 'plugin-x'"):
        registry.register("real", dict)


def test_registry_checks_the_kind_of_class_it_hands_out() -> None:
    registry: Registry[Any] = Registry("sampler", base="chassis.core.sampler_interface:Sampler")
    registry.current_owner = "plugin-y"
    registry.register("not_a_sampler", "collections:OrderedDict")
    registry.register("instance", object())
    registry.register("good", "chassis.builtin_plugins.samplers.default:DefaultSampler")
    for name in ("not_a_sampler", "instance"):
        with pytest.raises(PluginObjectError, match=r"registered by 'plugin-y'.*not a subclass"):
            registry.get(name)
    assert registry.get("good").__name__ == "DefaultSampler"
    registry.register("lazy_broken", "chassis_no_such_module_xyz:S")
    with pytest.raises(PluginObjectError, match=r"ModuleNotFoundError"):
        registry.get("lazy_broken")
    assert issubclass(PluginObjectError, ImportError)


def test_an_entry_point_that_fails_to_import_says_where_and_what_to_do(
    isolated_plugins: None,  # noqa: F811
    tmp_path: Path,
) -> None:
    (tmp_path / "raises_in_helper.py").write_text("def helper():\n    return {}[7]\n\nhelper()\n")
    sys.path.insert(0, str(tmp_path))
    try:
        broken = FakeEntryPoint("raiser", "raises_in_helper", "raiser-dist")
        manager = fake_manager([], [broken])
        with pytest.raises(PluginLoadError) as info:
            manager.load_general_plugins()
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("raises_in_helper", None)
    message = str(info.value)
    assert "KeyError: 7" in message
    assert f"raised at {tmp_path / 'raises_in_helper.py'}:2" in message
    assert "CHASSIS_PLUGINS" in message


@pytest.mark.usefixtures("isolated_plugins")
def test_builtin_registries_from_installed_entry_points() -> None:
    registries = get_registries()
    assert {"fcfs", "priority"} <= set(registries.schedulers.names())
    assert "default" in registries.samplers
    assert registries.schedulers.owner("fcfs") == "builtin_schedulers"
    assert get_plugin_manager().is_builtin("builtin_schedulers")


# -- configuration hooks --------------------------------------------------------------------


class FlagPlugin:
    @hookimpl
    def chassis_add_cli_args(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--flag-plugin-level", type=int, default=3)

    @hookimpl
    def chassis_configure(self, config: EngineConfig) -> None:
        config.max_num_seqs = config.plugin_args["flag_plugin_level"]


def test_cli_args_reach_configure_through_plugin_args() -> None:
    manager = fake_manager(general=[FakeEntryPoint("flag", "flag", "flag-dist", FlagPlugin())])
    parser = argparse.ArgumentParser()
    parser.add_argument("--unrelated")
    dests = add_plugin_cli_args(parser, manager)
    assert dests == ["flag_plugin_level"]
    args = parser.parse_args(["--flag-plugin-level", "7"])
    config = EngineConfig(plugin_args=plugin_args_from(args, dests))
    assert config.plugin_args == {"flag_plugin_level": 7}
    apply_configure_hooks(config, manager)
    assert config.max_num_seqs == 7


def test_configure_hook_leaving_an_invalid_config_is_blamed() -> None:
    manager = fake_manager(general=[FakeEntryPoint("flag", "flag", "flag-dist", FlagPlugin())])
    config = EngineConfig(plugin_args={"flag_plugin_level": 0})
    with pytest.raises(
        ValueError, match=r"plugin 'flag' from distribution 'flag-dist'.*max-num-seqs"
    ):
        apply_configure_hooks(config, manager)


def test_clashing_cli_flags_name_the_plugin() -> None:
    manager = fake_manager(
        general=[
            FakeEntryPoint("one", "one", "d1", FlagPlugin()),
            FakeEntryPoint("two", "two", "d2", FlagPlugin()),
        ]
    )
    with pytest.raises(PluginLoadError, match=r"plugin 'two' from distribution 'd2'"):
        add_plugin_cli_args(argparse.ArgumentParser(), manager)


def test_register_rejects_unknown_group() -> None:
    with pytest.raises(ValueError, match=r"unknown plugin group"):
        fake_manager().register(SchedulerPlugin(), "x", group="chassis.nope")
    assert PLATFORM_GROUP != GENERAL_GROUP


def test_owner_of_an_unknown_name_lists_known_names() -> None:
    registry: Registry[Any] = Registry("sampler")
    registry.register("default", "a.b:C")
    assert registry.owner("default") == "<direct>"
    with pytest.raises(UnknownNameError, match="known: default"):
        registry.owner("nope")
