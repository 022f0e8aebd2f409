"""Sleep mode (``--enable-sleep-mode``): ``sleep(level)`` frees the KV cache and moves the
weights to host memory (level 1; on the CPU they stay) or frees them (level 2, read again
from the checkpoint at wake-up); ``wake_up(tags)`` brings the parts back, in either order.
The bar: after waking up, greedy tokens equal those before the sleep, the memory was
really let go, and every refusal (no flag, bad level or tag, generating while asleep,
sleeping with requests unfinished) is a clear error that leaves the engine serving.
Through ``LLM``, ``AsyncLLM``, the development routes, two tensor-parallel ranks (Ray
actors run the same commands), and decode graphs captured again (on a CPU test platform).
"""

from __future__ import annotations

import asyncio
import gc
import os
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
from engines import tiny_async_llm
from fake_engine import FakeAsyncLLM
from fastapi.testclient import TestClient
from test_cuda_graphs import REPLAY_BACKEND, GraphTestPlatform, _ReplayBackendPlugin

import chassis.platforms as platforms_module
from chassis import LLM, SamplingParams
from chassis.core.async_llm import AsyncLLM
from chassis.core.errors import EngineBusyError, EngineSleepingError
from chassis.core.ray_executor import RayExecutor
from chassis.core.sleep_mode import check_wake_tags
from chassis.core.tp_executor import RankGroupExecutor, TensorParallelExecutor, run_command
from chassis.core.tp_worker_proc import SLEEP, WAKE_UP
from chassis.platforms import reset_current_platform
from chassis.platforms.cpu_packed_linear import packed_linear_layers
from chassis.plugins import register_plugin, set_plugin_manager
from chassis.serve.app import build_app
from chassis.serve.args import engine_config_from_args
from chassis.serve.cli import build_parser, main
from chassis.serve.settings import ServerSettings

pytestmark = pytest.mark.timeout(300)

#: long enough for several full 16-token blocks (prefix-cache hits) with the SmolLM2 tokenizer
PROMPT = " ".join(f"item {i} is on the shelf," for i in range(12))
PROMPTS = [PROMPT, "The capital of France is", "Once upon a time"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
#: a small engine; bfloat16 so that the CPU platform packs the linear weights (where the CPU
#: can), whose packed copies sleep mode must drop and rebuild
ENGINE = {"max_model_len": 256, "num_kv_blocks": 64, "enable_sleep_mode": True}


def greedy(llm: LLM, prompts: list[str] = PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> Iterator[LLM]:
    engine = LLM(str(tiny_llama_dir), dtype="bfloat16", **ENGINE)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def reference(llm: LLM) -> list[list[int]]:
    """The greedy tokens of :data:`PROMPTS` before any sleep."""
    return greedy(llm)


@pytest.fixture
def awake(llm: LLM, reference) -> Iterator[LLM]:
    """The module's engine, awake, woken up again after the test whatever it did."""
    assert not llm.is_sleeping()
    yield llm
    if llm.is_sleeping():
        llm.wake_up()


# -- LLM --------------------------------------------------------------------------------------


@pytest.mark.parametrize("level", [1, 2])
def test_greedy_tokens_are_unchanged_after_waking_up(awake: LLM, reference, level: int) -> None:
    greedy(awake)  # the long prompt's blocks are in the prefix cache now
    assert awake.generate(PROMPT, GREEDY)[0].num_cached_tokens >= 3 * 16
    awake.sleep(level)
    assert awake.is_sleeping()
    awake.wake_up()
    assert not awake.is_sleeping()
    # the KV cache's contents were dropped, and the prefix cache with them
    assert awake.generate(PROMPT, GREEDY)[0].num_cached_tokens == 0
    assert greedy(awake) == reference


@pytest.mark.parametrize(("level", "order"), [(2, "weights first"), (1, "kv_cache first")])
def test_the_parts_wake_up_one_at_a_time(awake: LLM, reference, level: int, order: str) -> None:
    """RLHF's flow: wake the weights (update them), then the KV cache; either order works,
    and the engine refuses to generate until both are back."""
    tags = ["weights", "kv_cache"] if order == "weights first" else ["kv_cache", "weights"]
    awake.sleep(level)
    awake.wake_up([tags[0]])
    assert awake.is_sleeping()
    with pytest.raises(EngineSleepingError, match=r"its (weights|KV cache) are released"):
        awake.generate(PROMPT, GREEDY)
    awake.wake_up([tags[0]])  # awake already: nothing to do
    awake.wake_up([tags[1]])
    assert not awake.is_sleeping()
    assert greedy(awake) == reference


def test_memory_is_let_go_and_brought_back(awake: LLM, reference) -> None:
    """Level 1 on the CPU (device memory is host memory): the KV cache is freed, the weights
    stay as they are. Level 2: the weights' storages are freed too, and the platform's packed
    copies dropped; waking up refills the same tensors (same objects) and packs them again."""
    runner = awake.engine.executor.worker.runner
    cache = weakref.ref(runner.kv_caches[0])
    weight = runner.model.get_parameter("model.layers.0.mlp.down_proj.weight")
    nbytes = weight.untyped_storage().nbytes()
    packed = packed_linear_layers(runner.model)
    awake.sleep(1)
    gc.collect()
    assert cache() is None and runner.kv_caches == [] and runner.num_kv_blocks == 64
    assert weight.untyped_storage().nbytes() == nbytes
    assert not any(layer.is_released for layer in packed)
    awake.wake_up()
    cache = weakref.ref(runner.kv_caches[0])
    awake.sleep(2)
    gc.collect()
    assert cache() is None and weight.untyped_storage().nbytes() == 0
    assert all(layer.is_released for layer in packed)
    awake.wake_up(["weights"])
    assert weight.untyped_storage().nbytes() == nbytes
    assert runner.model.get_parameter("model.layers.0.mlp.down_proj.weight") is weight
    assert not any(layer.is_released for layer in packed)
    assert runner.kv_caches == []
    awake.wake_up(["kv_cache"])
    assert len(runner.kv_caches) == 2
    assert greedy(awake) == reference


def test_refusals_leave_the_engine_serving(awake: LLM, reference) -> None:
    for level in (0, 3, True, "1"):
        with pytest.raises(ValueError, match=r"sleep level must be 1 .* or 2"):
            awake.sleep(level)  # type: ignore[arg-type]
    assert not awake.is_sleeping()
    with pytest.raises(ValueError, match=r"unknown wake_up tag.*'weight'.*'weights', 'kv_cache'"):
        awake.wake_up(["weight"])
    with pytest.raises(ValueError, match="a list of weights, kv_cache"):
        awake.wake_up("weights")  # type: ignore[arg-type]
    awake.sleep(1)
    awake.sleep(2)  # asleep already: ignored (a warning), as vLLM
    with pytest.raises(EngineSleepingError, match=r"sleeping .* call wake_up"):
        awake.generate(PROMPTS, GREEDY)
    with pytest.raises(EngineSleepingError):
        awake.chat([{"role": "user", "content": "Hi"}], GREEDY)
    awake.wake_up()
    awake.wake_up()  # awake already: nothing to do
    assert greedy(awake) == reference


def test_sleeping_with_unfinished_requests_is_refused(awake: LLM) -> None:
    expected = greedy(awake, PROMPTS[:2])
    engine = awake.engine
    for i, prompt in enumerate(PROMPTS[:2]):
        (request,) = awake.input_processor.process(prompt, GREEDY, f"busy-{i}")
        engine.add_request(request)
    tokens: dict[str, list[int]] = {}
    for out in engine.step().outputs:
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    with pytest.raises(EngineBusyError, match="mode 'keep' while 2 request"):
        awake.sleep(1, "keep")  # (the default mode aborts them: tests/test_pause_generation.py)
    assert not awake.is_sleeping()
    while engine.has_unfinished():  # the requests were not disturbed
        for out in engine.step().outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert [tokens["busy-0"], tokens["busy-1"]] == expected
    awake.sleep(1)
    assert awake.is_sleeping()


def test_a_step_async_scheduling_left_in_flight_is_collected_first(tiny_llama_dir) -> None:
    """With ``--async-scheduling`` the plan after a request's stop token is still in flight
    once the request has finished: sleep collects it (its outputs go out with the next
    step) instead of refusing."""
    ahead = LLM(str(tiny_llama_dir), dtype="float32", async_scheduling=True, **ENGINE)
    try:
        (tokens_8,) = greedy(ahead, [PROMPT])
        stop_id = tokens_8[2]
        stop = SamplingParams(
            temperature=0.0, max_tokens=8, ignore_eos=True, stop_token_ids=[stop_id]
        )
        expected = ahead.generate(PROMPT, stop)[0].outputs[0].token_ids
        assert expected == tokens_8[: tokens_8.index(stop_id) + 1]
        engine = ahead.engine
        (request,) = ahead.input_processor.process(PROMPT, stop, "ahead")
        engine.add_request(request)
        tokens: list[int] = []
        while engine.scheduler.has_unfinished():
            for out in engine.step().outputs:
                tokens += out.new_token_ids
        assert engine.has_unfinished()  # the plan in flight
        ahead.sleep(1)
        while engine.has_unfinished():
            for out in engine.step().outputs:
                tokens += out.new_token_ids
        assert tokens == expected
        ahead.wake_up()
        assert greedy(ahead, [PROMPT]) == [tokens_8]
    finally:
        ahead.shutdown()


def test_a_sleep_that_fails_half_way_leaves_the_engine_awake(
    awake: LLM, reference, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker brings back what it had released (level 2: the weights, reloaded) before
    the error propagates; the engine stays awake and serves the same tokens."""
    platform = awake.engine.executor.worker.sleep_mode.platform
    calls: list[int] = []

    def fails_once() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("the allocator says no")

    monkeypatch.setattr(platform, "empty_cache", fails_once)
    with pytest.raises(RuntimeError, match="the allocator says no"):
        awake.sleep(2)
    assert not awake.is_sleeping() and len(calls) == 2
    assert greedy(awake) == reference


def test_the_engine_core_refuses_a_request_that_arrives_while_asleep(awake: LLM) -> None:
    """What a front-end's own check misses (a request racing a sleep) is refused by the
    engine core, flagged so that it becomes EngineSleepingError (HTTP 503)."""
    awake.sleep(2)
    (request,) = awake.input_processor.process(PROMPT, GREEDY, "late")
    awake.engine.add_request(request)
    (out,) = awake.engine.step().outputs
    assert out.request_id == "late" and out.error is not None and out.error.engine_sleeping
    assert "sleeping" in out.error.message and not awake.engine.has_unfinished()


@pytest.mark.parametrize("variant", ["draft model", "LoRA wrappers"])
def test_a_draft_model_and_lora_wrappers_sleep_too(tiny_llama_dir, variant: str) -> None:
    """A draft model's KV cache is freed and its weights kept (level 2 too); LoRA wrappers
    rename the linear layers' weights (``...qkv_proj.base_layer.weight``), which level 2's
    reload still finds (by the names the model had when it was loaded)."""
    extra: dict[str, Any] = (
        {"speculative_config": {"model": str(tiny_llama_dir), "num_speculative_tokens": 2}}
        if variant == "draft model"
        else {"enable_lora": True}
    )
    engine = LLM(str(tiny_llama_dir), dtype="bfloat16", **ENGINE, **extra)
    try:
        runner = engine.engine.executor.worker.runner
        expected = greedy(engine)
        for level in (1, 2):
            caches = [weakref.ref(t) for t in runner.kv_caches]
            if runner.drafter is not None:
                caches += [weakref.ref(t) for t in runner.drafter.kv_caches]
            engine.sleep(level)
            gc.collect()
            assert all(cache() is None for cache in caches)
            engine.wake_up()
            assert greedy(engine) == expected
    finally:
        engine.shutdown()


def test_without_the_flag_sleep_mode_is_refused_naming_it(tiny_llama_dir) -> None:
    plain = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=128, num_kv_blocks=16)
    try:
        assert not plain.is_sleeping()
        with pytest.raises(ValueError, match="--enable-sleep-mode"):
            plain.sleep()
        with pytest.raises(ValueError, match="enable_sleep_mode=True"):
            plain.wake_up()
        assert len(greedy(plain)) == 3
    finally:
        plain.shutdown()


def test_the_flag_is_a_serve_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "--enable-sleep-mode" in capsys.readouterr().out
    args = build_parser().parse_args(["serve", "--enable-sleep-mode"])
    assert engine_config_from_args(args).enable_sleep_mode is True
    assert check_wake_tags([]) == check_wake_tags(None) == ("weights", "kv_cache")
    assert check_wake_tags(["kv_cache", "weights"]) == ("weights", "kv_cache")


# -- AsyncLLM and the server ------------------------------------------------------------------


@pytest.fixture(scope="module")
def async_engine(tiny_llama_dir) -> Iterator[AsyncLLM]:
    engine = tiny_async_llm(tiny_llama_dir, enable_sleep_mode=True)
    yield engine
    engine.shutdown_sync()


async def _tokens(engine: AsyncLLM, prompt: str, request_id: str) -> list[int]:
    tokens: list[int] = []
    async for out in engine.generate(prompt, GREEDY, request_id):
        tokens += out.outputs[0].token_ids
    return tokens


def test_async_llm_sleeps_and_wakes_up(async_engine: AsyncLLM) -> None:
    async def main() -> None:
        before = await _tokens(async_engine, PROMPT, "before")
        assert not await async_engine.is_sleeping()
        with pytest.raises(ValueError, match="sleep level"):
            await async_engine.sleep(3)
        with pytest.raises(ValueError, match="unknown wake_up tag"):
            await async_engine.wake_up(["weigths"])
        await async_engine.sleep(2)
        assert await async_engine.is_sleeping()
        with pytest.raises(EngineSleepingError):
            await _tokens(async_engine, PROMPT, "asleep")
        await async_engine.wake_up(["weights"])
        assert await async_engine.is_sleeping()
        await async_engine.wake_up(["kv_cache"])
        assert not await async_engine.is_sleeping()
        assert await _tokens(async_engine, PROMPT, "after") == before

        # a running request and mode keep: refused with the count, relayed as EngineBusyError
        long = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
        stream = async_engine.generate(PROMPT, long, "running")
        await stream.__anext__()
        with pytest.raises(EngineBusyError, match="mode 'keep' while 1 request"):
            await async_engine.sleep(1, mode="keep")
        await stream.aclose()  # aborts it: the engine core sees the abort first
        await async_engine.sleep(1)
        await async_engine.wake_up()
        assert await _tokens(async_engine, PROMPT, "again") == before

    asyncio.run(asyncio.wait_for(main(), 60))


def _complete(client: TestClient) -> Any:
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    return client.post("/v1/completions", json=body)


def test_the_development_routes(async_engine: AsyncLLM) -> None:
    settings = ServerSettings(server_dev_mode=True, shutdown_engine_on_exit=False)
    with TestClient(build_app(async_engine, settings)) as client:
        expected = _complete(client).json()["choices"][0]["text"]
        assert client.get("/is_sleeping").json() == {"is_sleeping": False}
        for query, param in (("?level=3", "level"), ("?level=one", "level")):
            error = client.post(f"/sleep{query}").json()["error"]
            assert error["param"] == param and error["type"] == "invalid_request_error"
        response = client.post("/wake_up?tags=weights&tags=kv_cach")
        assert response.status_code == 400 and response.json()["error"]["param"] == "tags"
        assert "'weights', 'kv_cache'" in response.json()["error"]["message"]

        response = client.post("/sleep")  # level 1 by default
        assert response.status_code == 200 and response.content == b""
        assert client.get("/is_sleeping").json() == {"is_sleeping": True}
        response = _complete(client)
        assert response.status_code == 503
        error = response.json()["error"]
        assert error["code"] == "engine_sleeping" and "wake_up" in error["message"]
        assert client.post("/wake_up?tags=weights").status_code == 200
        assert client.get("/is_sleeping").json() == {"is_sleeping": True}
        assert _complete(client).status_code == 503
        assert client.post("/wake_up?tags=kv_cache").status_code == 200
        assert client.get("/is_sleeping").json() == {"is_sleeping": False}
        assert _complete(client).json()["choices"][0]["text"] == expected

        assert client.post("/sleep?level=2").status_code == 200
        assert client.post("/wake_up").status_code == 200  # no tags: both
        assert _complete(client).json()["choices"][0]["text"] == expected
    with TestClient(build_app(async_engine, ServerSettings(shutdown_engine_on_exit=False))) as c:
        assert c.post("/sleep").status_code == 404  # development mode only


class _NoSleepModeEngine(FakeAsyncLLM):
    """A test engine started without ``--enable-sleep-mode``, with AsyncLLM's sleep API
    (which refuses before it reaches the engine core)."""

    sleep = AsyncLLM.sleep
    wake_up = AsyncLLM.wake_up
    is_sleeping = AsyncLLM.is_sleeping


def test_the_routes_name_the_flag_when_sleep_mode_is_off() -> None:
    settings = ServerSettings(server_dev_mode=True)
    with TestClient(build_app(_NoSleepModeEngine(), settings)) as client:
        for route in ("/sleep", "/wake_up"):
            response = client.post(route)
            assert response.status_code == 400
            assert "--enable-sleep-mode" in response.json()["error"]["message"]
        assert client.get("/is_sleeping").json() == {"is_sleeping": False}


# -- several ranks ----------------------------------------------------------------------------


def _every_rank_sleeps(model_dir, **engine: Any) -> None:
    ranks = LLM(str(model_dir), dtype="float32", tensor_parallel_size=2, **ENGINE, **engine)
    try:
        expected = greedy(ranks)
        ranks.sleep(2)
        ranks.wake_up(["weights"])
        ranks.wake_up(["kv_cache"])
        assert greedy(ranks) == expected
        ranks.sleep(1)
        ranks.wake_up()
        assert greedy(ranks) == expected
    finally:
        ranks.shutdown()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_tensor_parallel_ranks_sleep_and_wake_up(tiny_llama_dir) -> None:
    _every_rank_sleeps(tiny_llama_dir)


def test_every_carrier_of_the_rank_protocol_runs_the_commands() -> None:
    """Worker processes and Ray actors run a rank's commands through ``run_command``, and
    the Ray executor inherits the group's sleep and wake_up (a real Ray run costs ~40 s:
    the two-process run above covers the protocol)."""
    calls: list[tuple[str, Any]] = []

    class Worker:
        def sleep(self, level: int) -> None:
            calls.append(("sleep", level))

        def wake_up(self, tags: list[str]) -> None:
            calls.append(("wake_up", tags))

    assert run_command(Worker(), SLEEP, 2, rank=1) is None
    assert run_command(Worker(), WAKE_UP, ("weights",), rank=1) is None
    assert calls == [("sleep", 2), ("wake_up", ["weights"])]
    assert RayExecutor.sleep is RankGroupExecutor.sleep is TensorParallelExecutor.sleep
    assert RayExecutor.wake_up is RankGroupExecutor.wake_up


# -- decode graphs ----------------------------------------------------------------------------


@pytest.fixture
def graph_platform() -> Iterator[GraphTestPlatform]:
    """A CPU platform that captures (eagerly replayed) decode graphs, as current platform."""
    set_plugin_manager(None)
    reset_current_platform()
    platform = GraphTestPlatform()
    platforms_module._current = platform
    register_plugin(_ReplayBackendPlugin(), "sleep-mode-graph-test-backends")
    try:
        yield platform
    finally:
        set_plugin_manager(None)
        reset_current_platform()


def test_decode_graphs_are_captured_again_after_waking_up(
    graph_platform: GraphTestPlatform, tiny_llama_dir
) -> None:
    """The graphs hold the KV caches and weights they were captured with: sleep drops them
    and the wake-up that brings the last part back captures new ones, which the decode
    steps then replay (a stale graph would read the freed caches)."""
    engine = LLM(
        str(tiny_llama_dir),
        dtype="float32",
        block_size=4,
        attention_backend=REPLAY_BACKEND,
        cuda_graph_sizes=[1, 2, 4],
        **ENGINE,
    )
    try:
        runner = engine.engine.executor.worker.runner
        expected = greedy(engine)
        for level in (1, 2):
            old = runner.graphs
            engine.sleep(level)
            assert runner.graphs is None
            engine.wake_up(["kv_cache"])
            assert runner.graphs is None  # the weights are not back yet
            captured = len(graph_platform.graphs)
            engine.wake_up(["weights"])
            assert runner.graphs is not None and runner.graphs is not old
            assert len(graph_platform.graphs) == captured + 3
            replays = runner.graphs.num_replays
            assert greedy(engine) == expected
            assert runner.graphs.num_replays > replays
    finally:
        engine.shutdown()
