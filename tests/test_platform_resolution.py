"""Choosing ``current_platform`` from fake entry points: the four rules and their errors.

The built-in platforms are the real modules behind fake entry points of distribution
chassis-llm; accelerators are made "present" by monkeypatching ``torch_facts``.
"""

from __future__ import annotations

from typing import Any

import pytest
from fixtures_plugins import (  # noqa: F401
    FakeEntryPoint,
    builtin_platform_eps,
    fake_manager,
    isolated_plugins,
)

from chassis import platforms
from chassis.platforms import PlatformError, get_current_platform, reset_current_platform
from chassis.platforms import torch_facts as facts
from chassis.platforms.cpu import CpuPlatform
from chassis.platforms.cuda import CudaPlatform
from chassis.platforms.resolve import resolve_platform
from chassis.platforms.xpu import XpuPlatform
from chassis.plugins import PluginLoadError, hookimpl, set_plugin_manager


class VendorAPlatform(CpuPlatform):
    name = "vendor_a"


class VendorBPlatform(CpuPlatform):
    name = "vendor_b"


class Offers:
    """A platform plugin offering ``cls`` (or ``None``: device absent)."""

    def __init__(self, cls: Any) -> None:
        self.cls = cls

    @hookimpl
    def chassis_platform(self) -> Any:
        return self.cls


def oot(name: str, cls: Any, distribution: str) -> FakeEntryPoint:
    return FakeEntryPoint(name, f"{name}_pkg.platform", distribution, Offers(cls))


@pytest.fixture
def cuda_present(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(facts, "hip_version", lambda: None)
    monkeypatch.setattr(facts, "cuda_version", lambda: "12.8")
    monkeypatch.setattr(facts, "cuda_device_count", lambda: 1)


@pytest.fixture(autouse=True)
def _no_platform_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CHASSIS_PLATFORM", raising=False)
    monkeypatch.delenv("CHASSIS_PLUGINS", raising=False)


def test_cpu_fallback() -> None:
    platform = resolve_platform(fake_manager(builtin_platform_eps()))
    assert type(platform) is CpuPlatform
    assert platform.selection_reason == "no accelerator platform is usable; falling back to the CPU"


def test_single_builtin_accelerator_is_chosen(cuda_present: None) -> None:
    platform = resolve_platform(fake_manager(builtin_platform_eps()))
    assert type(platform) is CudaPlatform
    assert "the only usable accelerator" in platform.selection_reason
    assert "CUDA 12.8" in platform.selection_reason


def test_out_of_tree_wins_over_builtin_accelerator(cuda_present: None) -> None:
    eps = [*builtin_platform_eps(), oot("vendor_a", VendorAPlatform, "vendor-a-dist")]
    platform = resolve_platform(fake_manager(eps))
    assert type(platform) is VendorAPlatform
    assert "vendor-a-dist" in platform.selection_reason
    assert "out-of-tree" in platform.selection_reason


def test_inactive_out_of_tree_platform_is_ignored() -> None:
    eps = [*builtin_platform_eps(), oot("vendor_a", None, "vendor-a-dist")]
    assert type(resolve_platform(fake_manager(eps))) is CpuPlatform


def test_two_out_of_tree_platforms_is_an_error_naming_both() -> None:
    eps = [
        *builtin_platform_eps(),
        oot("vendor_a", VendorAPlatform, "vendor-a-dist"),
        oot("vendor_b", VendorBPlatform, "vendor-b-dist"),
    ]
    with pytest.raises(PlatformError) as info:
        resolve_platform(fake_manager(eps))
    message = str(info.value)
    for part in ("vendor_a", "vendor-a-dist", "vendor_b", "vendor-b-dist", "CHASSIS_PLATFORM"):
        assert part in message


def test_two_builtin_accelerators_is_an_error(
    cuda_present: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(facts, "xpu_built", lambda: True)
    monkeypatch.setattr(facts, "xpu_device_count", lambda: 2)
    assert XpuPlatform.is_available()
    with pytest.raises(PlatformError) as info:
        resolve_platform(fake_manager(builtin_platform_eps()))
    message = str(info.value)
    assert "more than one built-in accelerator" in message
    assert "cuda" in message and "xpu" in message and "CHASSIS_PLATFORM" in message


def test_chassis_platform_env_forces_a_platform(
    cuda_present: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    eps = [*builtin_platform_eps(), oot("vendor_a", VendorAPlatform, "vendor-a-dist")]
    monkeypatch.setenv("CHASSIS_PLATFORM", "cpu")
    platform = resolve_platform(fake_manager(eps))
    assert type(platform) is CpuPlatform
    assert platform.selection_reason == "forced by CHASSIS_PLATFORM=cpu (plugin 'cpu')"
    # The argument wins over the environment; forcing also settles two out-of-tree platforms.
    eps.append(oot("vendor_b", VendorBPlatform, "vendor-b-dist"))
    assert type(resolve_platform(fake_manager(eps), forced="vendor_b")) is VendorBPlatform


def test_forcing_a_missing_platform_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHASSIS_PLATFORM", "quantum")
    with pytest.raises(PlatformError) as info:
        resolve_platform(fake_manager(builtin_platform_eps()))
    message = str(info.value)
    assert "CHASSIS_PLATFORM='quantum'" in message
    assert "Usable here: cpu" in message
    assert "cuda, rocm, tpu, xpu" in message  # found no usable device


def test_forcing_an_unusable_builtin_is_an_error() -> None:
    with pytest.raises(PlatformError, match=r"CHASSIS_PLATFORM='cuda'"):
        resolve_platform(fake_manager(builtin_platform_eps()), forced="cuda")


def test_one_name_offered_twice_when_forced_is_an_error() -> None:
    eps = [
        oot("vendor_a", VendorAPlatform, "dist-1"),
        oot("vendor_a2", VendorAPlatform, "dist-2"),
    ]
    with pytest.raises(PlatformError, match=r"offered by more than one plugin"):
        resolve_platform(fake_manager(eps), forced="vendor_a")


def test_cpu_excluded_by_allow_list_is_a_clear_error() -> None:
    manager = fake_manager(builtin_platform_eps(), allow_list=frozenset({"cuda"}))
    with pytest.raises(PlatformError, match=r"CPU platform plugin is not loaded"):
        resolve_platform(manager)


def test_allow_list_can_exclude_an_out_of_tree_platform() -> None:
    eps = [*builtin_platform_eps(), oot("vendor_a", VendorAPlatform, "vendor-a-dist")]
    manager = fake_manager(eps, allow_list=frozenset({"cpu", "cuda"}))
    platform = resolve_platform(manager)
    assert type(platform) is CpuPlatform
    # the CPU fallback says which detectors the operator's CHASSIS_PLUGINS left out
    assert "by CHASSIS_PLUGINS: rocm, tpu, vendor_a, xpu" in platform.selection_reason


def test_offer_that_is_not_a_platform_class_is_an_error() -> None:
    eps = [*builtin_platform_eps(), oot("weird", VendorAPlatform(), "weird-dist")]
    with pytest.raises(PlatformError, match=r"'weird' returned .* must return a chassis"):
        resolve_platform(fake_manager(eps))


def test_detection_that_raises_stops_start_up() -> None:
    class Broken:
        @hookimpl
        def chassis_platform(self) -> Any:
            raise OSError("driver exploded")

    eps = [*builtin_platform_eps(), FakeEntryPoint("broken", "b", "broken-dist", Broken())]
    with pytest.raises(
        PluginLoadError, match=r"'broken' from distribution 'broken-dist'.*exploded"
    ):
        resolve_platform(fake_manager(eps))


def test_broken_platform_plugin_import_stops_start_up() -> None:
    eps = [*builtin_platform_eps(), FakeEntryPoint("gone", "chassis_gone_xyz", "gone-dist")]
    with pytest.raises(PluginLoadError, match=r"gone-dist"):
        resolve_platform(fake_manager(eps))


# -- the process-wide current_platform ------------------------------------------------------


@pytest.mark.usefixtures("isolated_plugins")
def test_current_platform_resolves_lazily_once() -> None:
    calls: list[int] = []

    class Counting(Offers):
        @hookimpl
        def chassis_platform(self) -> Any:
            calls.append(1)
            return self.cls

    eps = [*builtin_platform_eps(), FakeEntryPoint("v", "v", "v-dist", Counting(VendorAPlatform))]
    set_plugin_manager(fake_manager(eps))
    assert calls == []  # nothing resolved before the first read
    first = platforms.current_platform
    assert type(first) is VendorAPlatform
    assert platforms.current_platform is first
    assert get_current_platform() is first
    assert calls == [1]
    reset_current_platform()
    assert platforms.current_platform is not first
    assert calls == [1, 1]


@pytest.mark.usefixtures("isolated_plugins")
def test_failed_resolution_is_not_cached() -> None:
    eps = [
        *builtin_platform_eps(),
        oot("vendor_a", VendorAPlatform, "a-dist"),
        oot("vendor_b", VendorBPlatform, "b-dist"),
    ]
    set_plugin_manager(fake_manager(eps))
    for _ in range(2):
        with pytest.raises(PlatformError):
            get_current_platform()


@pytest.mark.usefixtures("isolated_plugins")
def test_reading_current_platform_during_detection_is_an_error() -> None:
    class Recursive:
        @hookimpl
        def chassis_platform(self) -> Any:
            return type(platforms.current_platform)

    set_plugin_manager(fake_manager([FakeEntryPoint("r", "r", "r-dist", Recursive())]))
    with pytest.raises(PluginLoadError, match=r"being resolved"):
        get_current_platform()


@pytest.mark.usefixtures("isolated_plugins")
def test_installed_platforms_resolve_to_cpu_here() -> None:
    if CudaPlatform.is_available():
        pytest.skip("an accelerator is present")
    platform = get_current_platform()
    assert platform.name == "cpu"
    assert "falling back to the CPU" in platform.selection_reason
    described = platform.describe()
    assert described["platform"] == "cpu" and described["device_count"] == 1
