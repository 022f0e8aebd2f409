"""The ``chassis`` dispatcher and the ``env`` and ``plugins`` sub-commands."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from fixtures_plugins import (  # noqa: F401
    FakeEntryPoint,
    builtin_platform_eps,
    fake_manager,
    isolated_plugins,
)

from chassis.platforms.cpu import CpuPlatform
from chassis.plugins import hookimpl, register_plugin, set_plugin_manager
from chassis.serve.cli import main


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "chassis.serve.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_help_lists_env_and_plugins() -> None:
    result = run_cli("--help")
    assert result.returncode == 0, result.stderr
    assert "env" in result.stdout and "plugins" in result.stdout


def test_no_command_prints_help_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


def test_env_in_a_fresh_process_says_cpu_and_why() -> None:
    result = run_cli("env")
    assert result.returncode == 0, result.stderr
    if "cuda" in result.stdout.split("Platform:")[1].splitlines()[1]:
        pytest.skip("an accelerator is present")
    assert "cpu (device type cpu)" in result.stdout
    assert "why: no accelerator platform is usable; falling back to the CPU" in result.stdout
    assert "torch is built without CUDA" in result.stdout or "device(s)" in result.stdout


@pytest.mark.usefixtures("isolated_plugins")
def test_env_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["env", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["error"] is None
    assert set(report["versions"]) == {
        "chassis",
        "python",
        "torch",
        "triton",
        "transformers",
        "pluggy",
    }
    assert report["versions"]["chassis"] == "0.1.0"
    assert set(report["detectors"]) == {"cpu", "cuda", "rocm", "xpu", "tpu"}
    assert report["detectors"]["cpu"]["available"] is True
    platform = report["platform"]
    assert platform["selection_reason"]
    if platform["platform"] == "cpu":
        assert "falling back to the CPU" in platform["selection_reason"]
        assert len(report["devices"]) == 1
    device = report["devices"][0]
    assert 0 < device["memory_available"] <= device["memory_total"]
    offered = {p["plugin"]: p["offers"] for p in report["platform_plugins"]}
    assert offered["cpu"] == "cpu"


class VendorPlatform(CpuPlatform):
    name = "vendor"


class Offers:
    def __init__(self, cls: Any) -> None:
        self.cls = cls

    @hookimpl
    def chassis_platform(self) -> Any:
        return self.cls


@pytest.mark.usefixtures("isolated_plugins")
def test_env_reports_a_platform_conflict(capsys: pytest.CaptureFixture[str]) -> None:
    eps = [
        *builtin_platform_eps(),
        FakeEntryPoint("a", "a", "dist-a", Offers(VendorPlatform)),
        FakeEntryPoint("b", "b", "dist-b", Offers(VendorPlatform)),
    ]
    set_plugin_manager(fake_manager(eps))
    assert main(["env"]) == 1
    captured = capsys.readouterr()
    assert "none selected: PlatformError: more than one out-of-tree platform" in captured.out
    assert "dist-a" in captured.err and "dist-b" in captured.err
    assert "Built-in platform detectors:" in captured.out  # still shown, to diagnose


@pytest.mark.usefixtures("isolated_plugins")
def test_env_shows_an_out_of_tree_platform(capsys: pytest.CaptureFixture[str]) -> None:
    eps = [*builtin_platform_eps(), FakeEntryPoint("v", "v", "vendor-dist", Offers(VendorPlatform))]
    set_plugin_manager(fake_manager(eps))
    assert main(["env", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["platform"]["platform"] == "vendor"
    assert "out-of-tree" in report["platform"]["selection_reason"]
    vendor = next(p for p in report["platform_plugins"] if p["plugin"] == "v")
    assert vendor == {
        "plugin": "v",
        "distribution": "vendor-dist",
        "builtin": False,
        "offers": "vendor",
        "detail": VendorPlatform.detection_detail(),
    }


@pytest.mark.usefixtures("isolated_plugins")
def test_plugins_json_lists_builtins(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["plugin_api_version"] == "1.1"
    assert report["allow_list"] is None
    by_name = {(p["group"], p["name"]): p for p in report["plugins"]}
    cpu = by_name[("chassis.platform_plugins", "cpu")]
    assert (cpu["value"], cpu["distribution"], cpu["status"], cpu["builtin"]) == (
        "chassis.platforms.cpu",
        "chassis-llm",
        "loaded",
        True,
    )
    assert cpu["hooks"] == ["chassis_platform"]
    schedulers = by_name[("chassis.general_plugins", "builtin_schedulers")]
    assert schedulers["hooks"] == ["chassis_register_schedulers"]
    assert {"fcfs", "priority"} <= set(schedulers["registered"]["schedulers"])
    assert report["registries"]["schedulers"]["fcfs"] == "builtin_schedulers"
    assert report["registries"]["samplers"]["default"] == "builtin_samplers"


@pytest.mark.usefixtures("isolated_plugins")
def test_plugins_text_and_allow_list(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CHASSIS_PLUGINS", "cpu,builtin_schedulers,no_such_plugin")
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "CHASSIS_PLUGINS allow-list: builtin_schedulers, cpu, no_such_plugin" in out
    assert "warning: no entry point is named no_such_plugin" in out
    assert "cuda = chassis.platforms.cuda  [chassis-llm]  skipped (not in CHASSIS_PLUGINS)" in out
    assert "schedulers: fcfs, priority" in out


@pytest.mark.usefixtures("isolated_plugins")
def test_plugins_load_failure_exits_1_with_the_message(capsys: pytest.CaptureFixture[str]) -> None:
    broken = FakeEntryPoint("broken", "chassis_no_such_module_xyz", "broken-dist")
    set_plugin_manager(fake_manager(builtin_platform_eps(), [broken]))
    assert main(["plugins", "--json"]) == 1
    captured = capsys.readouterr()
    assert "chassis plugins: cannot import plugin 'broken'" in captured.err
    assert "broken-dist" in captured.err
    report = json.loads(captured.out)
    assert "ModuleNotFoundError" in report["error"]
    status = {p["name"]: p["status"] for p in report["plugins"]}
    assert status["broken"] == "failed" and status["cpu"] == "loaded"
    # The text form lists the failed entry point with its reason too.
    assert main(["plugins"]) == 1
    out = capsys.readouterr().out
    assert "broken = chassis_no_such_module_xyz  [broken-dist]  failed (ModuleNotFoundError" in out


class _WrongKindSamplerPlugin:
    @hookimpl
    def chassis_register_samplers(self, registry: Any) -> None:
        registry.register("not_a_sampler", "collections:OrderedDict")


def test_serve_with_a_wrong_kind_of_plugin_class_exits_1_naming_the_plugin(
    isolated_plugins: None,  # noqa: F811
    tiny_llama_dir: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The name is resolved in the front-end, so no engine process starts.
    register_plugin(_WrongKindSamplerPlugin(), "wrong-kind")
    code = main(["serve", str(tiny_llama_dir), "--sampler", "not_a_sampler", "--port", "0"])
    assert code == 1
    err = capsys.readouterr().err
    assert "PluginObjectError: sampler 'not_a_sampler' (registered by 'wrong-kind')" in err
    assert "not a subclass of chassis.core.sampler_interface.Sampler" in err
    assert "Traceback" not in err
