"""The real ``plugin_template`` package, pip-installed into a venv and driven through the CLI.

One venv per module (``--system-site-packages``, so it sees torch and the editable chassis):
the template and a tiny second out-of-tree platform package are installed with
``venv/bin/python -m pip install --no-deps --no-build-isolation`` (no network), then every check runs
``python -m chassis.serve.cli`` or a small script in a fresh subprocess, exactly as a user's
process would discover the entry points.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import textwrap
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = REPO / "plugin_template"
TEMPLATE_DIST = "chassis-plugin-template"
FAKE_DIST = "chassis-fake-platform"
#: variables that change plugin loading; every subprocess starts without them
CONTROL_ENV = (
    "CHASSIS_PLUGINS",
    "CHASSIS_PLATFORM",
    "CHASSIS_TEMPLATE_PLATFORM",
    "CHASSIS_FAKE_PLATFORM",
    "CHASSIS_TEMPLATE_GREETING",
)

FAKE_PLATFORM_MODULE = '''\
"""A second out-of-tree platform, usable when CHASSIS_FAKE_PLATFORM=1."""

import os

from chassis.platforms.cpu import CpuPlatform
from chassis.plugins import hookimpl


class FakeCpuPlatform(CpuPlatform):
    name = "fake_cpu"

    @classmethod
    def is_available(cls):
        return os.environ.get("CHASSIS_FAKE_PLATFORM") == "1"


@hookimpl
def chassis_platform():
    return FakeCpuPlatform if FakeCpuPlatform.is_available() else None
'''

FAKE_PLATFORM_PYPROJECT = f"""\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "{FAKE_DIST}"
version = "0.0.1"

[project.entry-points."chassis.platform_plugins"]
fake_platform = "chassis_fake_platform"

[tool.setuptools]
py-modules = ["chassis_fake_platform"]
"""

# Uses the template through chassis' public API only: registries, the config hooks, a sampler.
BEHAVIOUR_SCRIPT = """\
import argparse, json
import torch
from chassis.builtin_plugins.schedulers.fcfs import FcfsScheduler
from chassis.core.config import EngineConfig
from chassis.core.sampling_metadata import SamplingMetadata
from chassis.plugins import add_plugin_cli_args, apply_configure_hooks, get_registries
from chassis.plugins import plugin_args_from

registries = get_registries()
sampler = registries.samplers.get("template_greedy")(EngineConfig(sampler="template_greedy"))
torch.manual_seed(0)
logits = torch.randn(8, 100)
metadata = SamplingMetadata(temperature=torch.full((8,), 1.0), all_greedy=False, all_random=True)
sampled = sampler(logits.clone(), metadata).sampled_token_ids

parser = argparse.ArgumentParser()
dests = add_plugin_cli_args(parser)
args = parser.parse_args(["--template-greeting", "bonjour"])
config = EngineConfig(plugin_args=plugin_args_from(args, dests))
apply_configure_hooks(config)
unset = EngineConfig(plugin_args=plugin_args_from(parser.parse_args([]), dests))
apply_configure_hooks(unset)
tool_parser = registries.tool_parsers.get("template_json_fence")(None, [])
found = tool_parser.parse('Sure.\\n```json\\n{"name": "f", "arguments": {"x": 1}}\\n```')
print(json.dumps({
    "tool_calls": [[call.name, call.arguments] for call in found.calls],
    "tool_parser_owner": registries.tool_parsers.owner("template_json_fence"),
    "argmax": sampled.tolist() == logits.argmax(dim=-1).tolist(),
    "dests": dests,
    "greeting": config.plugin_args["template_greeting"],
    "default_greeting": unset.plugin_args["template_greeting"],
    "sampler_owner": registries.samplers.owner("template_greedy"),
    "scheduler_owner": registries.schedulers.owner("template_sjf"),
    "scheduler_is_fcfs": issubclass(registries.schedulers.get("template_sjf"), FcfsScheduler),
}))
"""


# The offline engine, once with the built-in sampler and once with the template's, on a tiny
# random-weight Llama: the template's sampler at temperature 1.0 must decode like greedy.
ENGINE_SCRIPT = """\
import json, sys
from chassis import LLM, SamplingParams

prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
settings = dict(max_model_len=64, num_kv_blocks=32, dtype="float32")

def run(llm, **params):
    outputs = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True, **params))
    return [list(o.outputs[0].token_ids) for o in outputs]

builtin = LLM(sys.argv[1], **settings)
template = LLM(sys.argv[1], sampler="template_greedy", scheduler="template_sjf", **settings)
print(json.dumps({
    "greedy": run(builtin, temperature=0.0),
    "random": run(builtin, temperature=1.0, seed=3),
    "template": run(template, temperature=1.0, seed=3),
    "plugin_args": template.config.plugin_args,
}))
"""


@dataclass
class Venv:
    root: Path
    python: Path
    template_copy: Path

    def run(
        self, *args: str, env: dict[str, str] | None = None, timeout: int = 120
    ) -> subprocess.CompletedProcess[str]:
        full_env = {k: v for k, v in os.environ.items() if k not in CONTROL_ENV}
        full_env.update(env or {})
        return subprocess.run(
            [str(self.python), *args],
            capture_output=True,
            text=True,
            cwd=self.root,  # not the repository: nothing but the installed packages is seen
            env=full_env,
            timeout=timeout,
            check=False,
        )

    def cli(self, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return self.run("-m", "chassis.serve.cli", *args, env=env)

    def cli_json(self, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
        result = self.cli(*args, "--json", env=env)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)


def _see_this_environment(venv_dir: Path) -> None:
    """Let ``venv_dir`` import what this interpreter's virtual environment holds, if any.

    A venv's ``--system-site-packages`` are its base interpreter's, not those of the venv
    whose Python created it: run from a virtual environment (the GPU image's versions,
    docs/gpu.md), the new venv would see neither chassis nor torch nor the setuptools that
    ``--no-build-isolation`` builds with. A ``.pth`` line adds this environment's
    site-packages, its own ``.pth`` files (chassis' editable install) included, ahead of the
    base interpreter's.
    """
    if sys.prefix == sys.base_prefix:
        return
    paths = {"base": str(venv_dir), "platbase": str(venv_dir)}
    target = Path(sysconfig.get_path("purelib", "venv", vars=paths))
    lines = [f"import site; site.addsitedir({d!r})\n" for d in site.getsitepackages()]
    (target / "_chassis_test_parent_env.pth").write_text("".join(lines))


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Venv:
    root = tmp_path_factory.mktemp("plugin_template")
    # --without-pip: the venv uses the system's pip and setuptools (a bundled, older
    # setuptools in the venv would shadow the system one and cannot build wheels offline).
    subprocess.run(
        [
            sys.executable,
            "-m",
            "venv",
            "--system-site-packages",
            "--without-pip",
            str(root / "venv"),
        ],
        check=True,
        timeout=120,
    )
    _see_this_environment(root / "venv")
    # Build from a copy, so pip's build/ and *.egg-info never land in the shared checkout.
    template_copy = root / "src" / "plugin_template"
    shutil.copytree(
        TEMPLATE,
        template_copy,
        ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", ".pytest_cache"),
    )
    fake = root / "src" / "fake_platform"
    fake.mkdir()
    (fake / "pyproject.toml").write_text(FAKE_PLATFORM_PYPROJECT)
    (fake / "chassis_fake_platform.py").write_text(FAKE_PLATFORM_MODULE)
    pip_env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INDEX": "1"}
    result = subprocess.run(
        [
            str(root / "venv" / "bin" / "python"),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            str(template_copy),
            str(fake),
        ],
        capture_output=True,
        text=True,
        env=pip_env,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return Venv(root, root / "venv" / "bin" / "python", template_copy)


def plugin(report: dict[str, Any], group: str, name: str) -> dict[str, Any]:
    matches = [p for p in report["plugins"] if (p["group"], p["name"]) == (group, name)]
    assert len(matches) == 1, report["plugins"]
    return matches[0]


def test_template_declares_its_entry_points() -> None:
    pyproject = tomllib.loads((TEMPLATE / "pyproject.toml").read_text())
    assert pyproject["project"]["name"] == TEMPLATE_DIST
    entry_points = pyproject["project"]["entry-points"]
    assert entry_points["chassis.platform_plugins"] == {
        "template_platform": "chassis_plugin_template.platform"
    }
    assert entry_points["chassis.general_plugins"] == {"template": "chassis_plugin_template.plugin"}


def test_plugins_lists_the_installed_template(venv: Venv) -> None:
    report = venv.cli_json("plugins")
    platform_ep = plugin(report, "chassis.platform_plugins", "template_platform")
    assert platform_ep["distribution"] == TEMPLATE_DIST
    assert (platform_ep["status"], platform_ep["builtin"]) == ("loaded", False)
    assert platform_ep["hooks"] == ["chassis_platform"]
    general_ep = plugin(report, "chassis.general_plugins", "template")
    assert (general_ep["value"], general_ep["distribution"], general_ep["status"]) == (
        "chassis_plugin_template.plugin",
        TEMPLATE_DIST,
        "loaded",
    )
    assert general_ep["hooks"] == [
        "chassis_add_cli_args",
        "chassis_configure",
        "chassis_register_routes",
        "chassis_register_samplers",
        "chassis_register_schedulers",
        "chassis_register_stat_loggers",
        "chassis_register_tool_parsers",
    ]
    assert general_ep["registered"] == {
        "samplers": ["template_greedy"],
        "schedulers": ["template_sjf"],
        "tool_parsers": ["template_json_fence"],
        "stat_loggers": ["template_counter"],
        "routes": ["template"],
    }
    assert report["registries"]["schedulers"]["template_sjf"] == "template"
    assert report["registries"]["samplers"]["template_greedy"] == "template"
    # the built-ins are still there, next to the template's additions
    assert report["registries"]["schedulers"]["fcfs"] == "builtin_schedulers"
    assert plugin(report, "chassis.platform_plugins", "fake_platform")["distribution"] == FAKE_DIST


def test_template_platform_wins_when_active(venv: Venv) -> None:
    report = venv.cli_json("env", env={"CHASSIS_TEMPLATE_PLATFORM": "1"})
    assert report["error"] is None
    assert report["platform"]["platform"] == "template_cpu"
    reason = report["platform"]["selection_reason"]
    assert "out-of-tree" in reason and TEMPLATE_DIST in reason
    offers = {p["plugin"]: p for p in report["platform_plugins"]}
    assert offers["template_platform"]["offers"] == "template_cpu"
    assert offers["template_platform"]["builtin"] is False
    assert offers["fake_platform"]["offers"] is None


def test_template_platform_is_inactive_by_default(venv: Venv) -> None:
    report = venv.cli_json("env")
    assert report["platform"]["platform"] != "template_cpu"
    offers = {p["plugin"]: p["offers"] for p in report["platform_plugins"]}
    assert offers["template_platform"] is None


def test_allow_list_excluding_the_template_hides_it(venv: Venv) -> None:
    env = {
        "CHASSIS_PLUGINS": "cpu,builtin_schedulers,builtin_samplers",
        "CHASSIS_TEMPLATE_PLATFORM": "1",
    }
    report = venv.cli_json("plugins", env=env)
    for group, name in (
        ("chassis.platform_plugins", "template_platform"),
        ("chassis.general_plugins", "template"),
    ):
        entry = plugin(report, group, name)
        assert (entry["status"], entry["reason"]) == ("skipped", "not in CHASSIS_PLUGINS")
        assert entry["registered"] == {}
    assert "template_sjf" not in report["registries"]["schedulers"]
    assert "template_greedy" not in report["registries"]["samplers"]
    assert "fcfs" in report["registries"]["schedulers"]
    # Activated, but not loaded: the platform stays the CPU.
    assert venv.cli_json("env", env=env)["platform"]["platform"] == "cpu"


def test_two_active_out_of_tree_platforms_conflict(venv: Venv) -> None:
    env = {"CHASSIS_TEMPLATE_PLATFORM": "1", "CHASSIS_FAKE_PLATFORM": "1"}
    result = venv.cli("env", env=env)
    assert result.returncode == 1
    assert "more than one out-of-tree platform is usable" in result.stderr
    for part in ("template_cpu", TEMPLATE_DIST, "fake_cpu", FAKE_DIST, "CHASSIS_PLATFORM"):
        assert part in result.stderr
    # Naming one settles it.
    forced = venv.cli_json("env", env={**env, "CHASSIS_PLATFORM": "fake_cpu"})
    assert forced["platform"]["platform"] == "fake_cpu"
    assert forced["platform"]["selection_reason"].startswith("forced by CHASSIS_PLATFORM=fake_cpu")


def test_template_changes_behaviour_through_the_public_contract(venv: Venv) -> None:
    script = venv.root / "behaviour.py"
    script.write_text(textwrap.dedent(BEHAVIOUR_SCRIPT))
    result = venv.run(str(script), env={"CHASSIS_TEMPLATE_GREETING": "from env"})
    assert result.returncode == 0, result.stderr
    facts = json.loads(result.stdout)
    assert facts == {
        "tool_calls": [["f", '{"x": 1}']],
        "tool_parser_owner": "template",
        "argmax": True,  # temperature 1.0 ignored: the template's sampler is greedy
        "dests": ["template_greeting"],
        "greeting": "bonjour",
        "default_greeting": "from env",
        "sampler_owner": "template",
        "scheduler_owner": "template",
        "scheduler_is_fcfs": True,
    }


def test_template_sampler_changes_what_the_engine_generates(venv: Venv) -> None:
    import fixtures_models

    model_dir = fixtures_models.write_tiny_checkpoint("llama", venv.root / "tiny_llama")
    script = venv.root / "engine.py"
    script.write_text(textwrap.dedent(ENGINE_SCRIPT))
    result = venv.run(str(script), str(model_dir), timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    tokens = json.loads(result.stdout.strip().splitlines()[-1])
    assert tokens["template"] == tokens["greedy"]  # temperature 1.0, yet greedy
    assert tokens["random"] != tokens["greedy"]  # the built-in sampler does sample
    # chassis_configure ran in the engine's config finalization
    assert tokens["plugin_args"] == {"template_greeting": "hello from chassis-plugin-template"}


def test_template_route_serves_what_its_stat_logger_counted(venv: Venv) -> None:
    """``chassis serve`` with the installed template: its stat logger counts a completion,
    its route ``GET /template/stats`` (behind the API key) answers the counts, and the
    built-in ``logging`` stat logger writes its periodic line."""
    import fixtures_models
    import httpx
    from server_process import API_KEY, ServerProcess, free_port

    model_dir = fixtures_models.write_tiny_checkpoint("llama", venv.root / "tiny_llama_srv")
    port = free_port()
    log = venv.root / "serve.log"
    cmd = [str(venv.python), "-m", "chassis.serve.cli", "serve", str(model_dir)]
    cmd += ["--port", str(port), "--served-model-name", "tiny", "--max-model-len", "128"]
    cmd += ["--num-kv-blocks", "32", "--dtype", "float32", "--enforce-eager"]
    cmd += ["--stat-loggers", "logging,template_counter", "--stat-log-interval", "0.5"]
    env = {k: v for k, v in os.environ.items() if k not in CONTROL_ENV}
    env["CHASSIS_API_KEY"] = API_KEY
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=venv.root,
            start_new_session=True,
        )  # fmt: skip
    server = ServerProcess(proc, f"http://127.0.0.1:{port}", log, "tiny", API_KEY)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, server.output()
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(server.base + "/health", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, server.output()
            time.sleep(0.25)
        body = {"model": "tiny", "prompt": [1, 2, 3, 4, 5], "max_tokens": 6, "ignore_eos": True}
        completion = httpx.post(
            server.base + "/v1/completions", json=body, headers=server.headers, timeout=60
        ).json()
        assert completion["usage"]["completion_tokens"] == 6, completion
        assert httpx.get(server.base + "/template/stats", timeout=10).status_code == 401
        stats = httpx.get(server.base + "/template/stats", headers=server.headers, timeout=10)
        assert stats.status_code == 200, stats.text
        counted = stats.json()
        assert counted["model"] == "tiny" and counted["running"] == 0
        assert counted["stat_logger"]["num_prompt_tokens"] == 5
        assert counted["stat_logger"]["num_generation_tokens"] == 6
        assert counted["stat_logger"]["finish_reasons"] == {"length": 1}
        deadline = time.monotonic() + 10
        while "Avg generation throughput" not in server.output():
            assert time.monotonic() < deadline, server.output()
            time.sleep(0.2)
    finally:
        output = server.stop()
    assert "template_counter: 1 requests finished, 6 tokens generated" in output


def test_template_own_tests_pass(venv: Venv) -> None:
    result = venv.run(
        "-m", "pytest", "-q", "-p", "no:cacheprovider", str(venv.template_copy / "tests")
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout
