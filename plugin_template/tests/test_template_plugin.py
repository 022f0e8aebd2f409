"""Tests of chassis-plugin-template, run where the package is installed (``pip install -e .``).

They call the hooks the way chassis does, and check the installed entry points through a
real :class:`chassis.plugins.PluginManager`.
"""

from __future__ import annotations

import argparse

import pytest
import torch
from chassis_plugin_template import platform, plugin
from chassis_plugin_template.sampler import TemplateGreedySampler

from chassis.core.config import EngineConfig
from chassis.core.request import Request
from chassis.core.sampling_metadata import SamplingMetadata
from chassis.core.sampling_params import SamplingParams
from chassis.platforms.cpu import CpuPlatform
from chassis.plugins import PluginManager, Registry
from chassis.plugins.registries import build_registries


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("CHASSIS_PLUGINS", "CHASSIS_PLATFORM", platform.ACTIVATE_ENV, plugin.GREETING_ENV):
        monkeypatch.delenv(name, raising=False)


def test_platform_is_offered_only_when_activated(monkeypatch: pytest.MonkeyPatch) -> None:
    assert platform.chassis_platform() is None
    assert "is not 1" in platform.TemplateCpuPlatform.detection_detail()
    monkeypatch.setenv(platform.ACTIVATE_ENV, "1")
    offered = platform.chassis_platform()
    assert offered is platform.TemplateCpuPlatform
    assert issubclass(offered, CpuPlatform)
    assert offered.name == "template_cpu"
    assert offered().device_count() == 1


def test_registers_scheduler_and_sampler_lazily() -> None:
    schedulers: Registry[object] = Registry("scheduler")
    samplers: Registry[object] = Registry("sampler")
    plugin.chassis_register_schedulers(schedulers)
    plugin.chassis_register_samplers(samplers)
    assert schedulers.names() == ["template_sjf"]
    assert samplers.names() == ["template_greedy"]
    assert samplers.get("template_greedy") is TemplateGreedySampler


def _metadata(num_rows: int, temperature: float, **kwargs: object) -> SamplingMetadata:
    return SamplingMetadata(
        temperature=torch.full((num_rows,), temperature),
        all_greedy=temperature == 0.0,
        all_random=temperature > 0.0,
        **kwargs,
    )


def test_sampler_takes_the_argmax_whatever_the_temperature() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    sampler = TemplateGreedySampler(EngineConfig())
    for temperature in (0.0, 0.7, 1.5):
        out = sampler(logits.clone(), _metadata(4, temperature))
        assert out.sampled_token_ids.dtype == torch.int64
        assert out.sampled_token_ids.tolist() == logits.argmax(dim=-1).tolist()
        assert out.logprobs is None


def test_sampler_rejects_logprobs() -> None:
    sampler = TemplateGreedySampler(EngineConfig())
    with pytest.raises(ValueError, match="does not compute logprobs"):
        sampler(torch.zeros(1, 8), _metadata(1, 1.0, max_num_logprobs=2))


def test_greeting_flag_reaches_plugin_args(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = argparse.ArgumentParser()
    plugin.chassis_add_cli_args(parser)
    args = parser.parse_args(["--template-greeting", "hi there"])
    config = EngineConfig(plugin_args={plugin.GREETING_KEY: args.template_greeting})
    plugin.chassis_configure(config)
    assert config.plugin_args[plugin.GREETING_KEY] == "hi there"

    # Without the flag: the environment variable, then the default.
    config = EngineConfig()
    plugin.chassis_configure(config)
    assert config.plugin_args[plugin.GREETING_KEY] == plugin.DEFAULT_GREETING
    monkeypatch.setenv(plugin.GREETING_ENV, "from env")
    config = EngineConfig(plugin_args={plugin.GREETING_KEY: None})
    plugin.chassis_configure(config)
    assert config.plugin_args[plugin.GREETING_KEY] == "from env"


def test_greeting_must_be_a_string() -> None:
    config = EngineConfig(plugin_args={plugin.GREETING_KEY: 42})
    with pytest.raises(ValueError, match="must be a string"):
        plugin.chassis_configure(config)


def test_installed_entry_points_load_through_chassis() -> None:
    manager = PluginManager(allow_list=None, read_env=False)
    registries = build_registries(manager)
    assert manager.distribution_of("template") == "chassis-plugin-template"
    assert registries.schedulers.owner("template_sjf") == "template"
    assert registries.samplers.owner("template_greedy") == "template"
    assert registries.tool_parsers.owner("template_json_fence") == "template"
    assert registries.stat_loggers.owner("template_counter") == "template"
    assert registries.routes.owner("template") == "template"
    manager.load_platform_plugins()
    assert manager.hooks_of("template_platform") == ["chassis_platform"]


def test_scheduler_admits_shortest_prompt_first() -> None:
    from chassis_plugin_template.scheduler import ShortestPromptFirstScheduler

    from chassis.builtin_plugins.schedulers.fcfs import FcfsScheduler
    from chassis.core.kv_cache_manager import KVCacheManager

    assert issubclass(ShortestPromptFirstScheduler, FcfsScheduler)

    def admitted(scheduler_cls: type[FcfsScheduler]) -> tuple[list[str], dict[str, int]]:
        config = EngineConfig(max_model_len=64, max_num_batched_tokens=8)
        scheduler = scheduler_cls(config, KVCacheManager(64, config.block_size))
        params = SamplingParams(max_tokens=1)
        for request_id, length in (("long", 30), ("short", 3), ("middle", 10), ("short2", 3)):
            scheduler.add_request(Request(request_id, list(range(1, length + 1)), params))
        waiting = [r.request_id for r in scheduler.waiting]
        return waiting, scheduler.schedule().num_scheduled_tokens

    waiting, scheduled = admitted(ShortestPromptFirstScheduler)
    assert waiting == ["short", "short2", "middle", "long"]
    assert scheduled["short"] == 3 and scheduled["short2"] == 3 and "long" not in scheduled
    # The built-in it derives from serves the long prompt first.
    waiting, scheduled = admitted(FcfsScheduler)
    assert waiting == ["long", "short", "middle", "short2"]
    assert scheduled == {"long": 8}


CALL_BLOCK = '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```'


@pytest.mark.parametrize(
    ("text", "content", "names"),
    [
        (
            "I will look it up.\n" + CALL_BLOCK + "\nDone.",
            "I will look it up.\n\nDone.",
            ["get_weather"],
        ),
        ("```json\n[1, 2]\n```", "```json\n[1, 2]\n```", []),  # JSON, but not a call
        ("Use ``` fences", "Use ``` fences", []),
        ('```json\n{"name": "f"', '```json\n{"name": "f"', []),  # cut short: text
    ],
)
def test_tool_parser_finds_calls_in_json_fences(text: str, content: str, names: list[str]) -> None:
    from chassis_plugin_template.tool_parser import JsonFenceToolParser

    whole = JsonFenceToolParser(None, []).parse(text)
    assert (whole.content, [call.name for call in whole.calls]) == (content, names)
    # the streaming contract: the same result, one character at a time
    parser = JsonFenceToolParser(None, [])
    deltas = [parser.feed(char) for char in text] + [parser.finish()]
    assert "".join(d.content for d in deltas) == whole.content
    assert [call for d in deltas for call in d.calls] == whole.calls


def test_stat_logger_counts_steps_tokens_and_finished_requests() -> None:
    from chassis_plugin_template.stats import TemplateCounterStatLogger

    from chassis.core.stat_logger import (
        FinishedRequestStats,
        IterationStats,
        SchedulerStats,
        StatLoggerBase,
        StatLoggerInfo,
    )

    registry: Registry[object] = Registry("stat logger")
    plugin.chassis_register_stat_loggers(registry)
    cls = registry.get("template_counter")
    assert cls is TemplateCounterStatLogger and issubclass(cls, StatLoggerBase)
    counter = cls(StatLoggerInfo("m", EngineConfig()))
    counter.record(SchedulerStats(num_running=2), IterationStats(num_prompt_tokens=7))
    finished = FinishedRequestStats("r", "length", num_prompt_tokens=7, num_generation_tokens=3)
    counter.record(
        SchedulerStats(num_running=1),
        IterationStats(num_generation_tokens=3, finished_requests=[finished]),
    )
    counter.log()
    assert counter.snapshot() == {
        "num_steps": 2,
        "num_prompt_tokens": 7,
        "num_generation_tokens": 3,
        "num_finished_requests": 1,
        "finish_reasons": {"length": 1},
        "max_running": 2,
    }


def test_route_is_registered_under_its_own_prefix() -> None:
    from fastapi import APIRouter

    registry: Registry[object] = Registry("HTTP router")
    plugin.chassis_register_routes(registry)
    router = registry.get("template")
    assert isinstance(router, APIRouter)
    assert [(r.path, sorted(r.methods)) for r in router.routes] == [("/template/stats", ["GET"])]
