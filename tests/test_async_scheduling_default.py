"""The default of ``--async-scheduling`` (core/async_scheduling_default.py): on where the
platform's device runs asynchronously to the host, off on the CPU, off without an error where
the config or the scheduler rules it out; an explicit value kept. The rule alone, through the
real engine (tiny Llama, CPU, the platform patched to claim an asynchronous device), and the
command line."""

from __future__ import annotations

from pathlib import Path

import pytest

from chassis import LLM, SamplingParams
from chassis.builtin_plugins.schedulers.fcfs import FcfsScheduler
from chassis.core.async_scheduling_default import resolve_async_scheduling
from chassis.core.config import EngineConfig
from chassis.platforms.cpu import CpuPlatform
from chassis.platforms.cuda import CudaPlatform
from chassis.platforms.rocm import RocmPlatform
from chassis.platforms.tpu import TpuPlatform
from chassis.platforms.xpu import XpuPlatform
from chassis.plugins import get_registries
from chassis.serve import cli
from chassis.serve.args import engine_config_from_args

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
PROMPTS = ["Once upon a time in a land far away", "1 2 3 4 5 6 7 8", "Hello, world!"]


class AsyncDevicePlatform(CpuPlatform):
    """The CPU platform, claiming a device that runs ahead of the host (as CUDA's does)."""

    device_runs_async = True


class NoAsyncScheduler(FcfsScheduler):
    supports_async_scheduling = False


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Every test of this module runs on one intra-op thread (``fixtures_threads``)."""


# -- the rule -------------------------------------------------------------------------------------


def test_the_platforms_that_run_ahead_are_cuda_and_rocm() -> None:
    assert CudaPlatform.device_runs_async and RocmPlatform.device_runs_async
    for platform in (CpuPlatform, XpuPlatform, TpuPlatform):
        assert not platform.device_runs_async, platform.name


@pytest.mark.parametrize("scheduler", ["fcfs", "priority"])
def test_auto_is_on_where_the_device_runs_ahead_and_off_on_the_cpu(scheduler: str) -> None:
    scheduler_cls = get_registries().schedulers.get(scheduler)
    config = EngineConfig(scheduler=scheduler)
    assert config.async_scheduling is None
    assert resolve_async_scheduling(config, AsyncDevicePlatform, scheduler_cls) is True
    assert resolve_async_scheduling(config, CpuPlatform, scheduler_cls) is False
    assert config.async_scheduling is None  # (reads only)


def test_auto_is_off_without_an_error_where_something_refuses_it() -> None:
    fcfs = get_registries().schedulers.get("fcfs")
    speculative = EngineConfig(speculative_config=SPEC)  # no error: auto, not asked for
    assert resolve_async_scheduling(speculative, AsyncDevicePlatform, fcfs) is False
    # the multi-rank executors would not overlap anything
    for ranks in ({"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}):
        assert resolve_async_scheduling(EngineConfig(**ranks), AsyncDevicePlatform, fcfs) is False
    ray = EngineConfig(distributed_executor_backend="ray")
    assert resolve_async_scheduling(ray, AsyncDevicePlatform, fcfs) is False
    assert resolve_async_scheduling(EngineConfig(), AsyncDevicePlatform, NoAsyncScheduler) is False


def test_an_explicit_value_is_kept() -> None:
    fcfs = get_registries().schedulers.get("fcfs")
    off, on = EngineConfig(async_scheduling=False), EngineConfig(async_scheduling=True)
    assert resolve_async_scheduling(off, AsyncDevicePlatform, fcfs) is False
    assert resolve_async_scheduling(on, CpuPlatform, fcfs) is True
    off_spec = EngineConfig(speculative_config=SPEC, async_scheduling=False)
    assert resolve_async_scheduling(off_spec, AsyncDevicePlatform, fcfs) is False
    with pytest.raises(ValueError, match="--async-scheduling"):  # asked for: still an error
        EngineConfig(speculative_config=SPEC, async_scheduling=True)


# -- through the engine ---------------------------------------------------------------------------


def _llm(model_dir, **engine) -> LLM:
    settings = {"dtype": "float32", "max_model_len": 64, "block_size": 4, "num_kv_blocks": 64}
    return LLM(str(model_dir), **settings, **engine)


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params)]


def test_the_engine_resolves_auto_by_the_platform(tiny_llama_dir, monkeypatch, caplog) -> None:
    on_cpu = _llm(tiny_llama_dir)
    assert on_cpu.config.async_scheduling is False
    assert on_cpu.engine.info.async_scheduling is False
    sync = _greedy(on_cpu)
    on_cpu.shutdown()
    monkeypatch.setattr(CpuPlatform, "device_runs_async", True)
    with caplog.at_level("INFO", logger="chassis.core.engine_core"):
        ahead = _llm(tiny_llama_dir)
    assert ahead.config.async_scheduling is True and ahead.engine.info.async_scheduling
    assert any("async_scheduling=True" in r.getMessage() for r in caplog.records)
    assert _greedy(ahead) == sync
    ahead.shutdown()
    explicit_off = _llm(tiny_llama_dir, async_scheduling=False)
    assert explicit_off.config.async_scheduling is False
    assert _greedy(explicit_off) == sync
    explicit_off.shutdown()


def test_auto_with_a_scheduler_without_async_support_is_off_not_refused(
    tiny_llama_dir, monkeypatch
) -> None:
    monkeypatch.setattr(CpuPlatform, "device_runs_async", True)
    monkeypatch.setattr(FcfsScheduler, "supports_async_scheduling", False)
    llm = _llm(tiny_llama_dir)
    assert llm.config.async_scheduling is False
    llm.shutdown()
    with pytest.raises(ValueError, match="does not support --async-scheduling"):
        _llm(tiny_llama_dir, async_scheduling=True)


# -- the command line -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "expected"),
    [([], None), (["--async-scheduling"], True), (["--no-async-scheduling"], False)],
)
def test_the_flag_is_tri_state(argv: list[str], expected: bool | None) -> None:
    args = cli.build_parser().parse_args(["serve", *argv])
    assert args.async_scheduling is expected
    assert engine_config_from_args(args).async_scheduling is expected


@pytest.mark.parametrize(("value", "expected"), [("false", False), ("true", True)])
def test_a_config_file_sets_it_either_way(tmp_path: Path, value: str, expected: bool) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(f"async-scheduling: {value}\n")
    parser = cli.build_parser()
    argv = ["serve", "--config", str(path)]
    args = cli._with_config_file(parser, parser.parse_args(argv), argv)
    assert engine_config_from_args(args).async_scheduling is expected
