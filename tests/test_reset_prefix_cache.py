"""Resetting the prefix cache: ``LLM.reset_prefix_cache``, ``AsyncLLM.reset_prefix_cache``
(a utility call over the engine core's socket) and the development routes
``POST /reset_prefix_cache`` and ``GET /server_info``."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
from engines import tiny_async_llm
from fastapi.testclient import TestClient

from chassis.core.engine_utility import UtilityCall, run_utility
from chassis.core.errors import EngineDeadError
from chassis.core.llm import LLM
from chassis.core.sampling_params import SamplingParams
from chassis.serve.app import build_app
from chassis.serve.dev_routes import server_dev_mode_enabled
from chassis.serve.settings import ServerSettings

#: long enough for several full 16-token blocks with the SmolLM2 tokenizer
PROMPT = " ".join(f"item {i} is on the shelf," for i in range(20))
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def test_llm_reset_makes_the_next_prompt_compute_from_scratch(tiny_llama_dir) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256, num_kv_blocks=64)
    first, second = (llm.generate(PROMPT, GREEDY)[0] for _ in range(2))
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens >= 3 * 16  # the prompt's full blocks, hit
    assert llm.reset_prefix_cache() is True
    third = llm.generate(PROMPT, GREEDY)[0]
    assert third.num_cached_tokens == 0
    # the same tokens from a cold cache, a hit cache and a cold cache again
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == third.outputs[0].token_ids
    fourth = llm.generate(PROMPT, GREEDY)[0]
    assert fourth.num_cached_tokens == second.num_cached_tokens  # cached again
    llm.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        llm.reset_prefix_cache()


def test_a_reset_while_a_request_runs_leaves_its_output_unchanged(tiny_llama_dir) -> None:
    """The reset drops hashes only: a request holding blocks keeps its K/V and its tokens."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256, num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = llm.generate(PROMPT, params)[0].outputs[0].token_ids
    engine = llm.engine
    # drive the engine by hand: a reset between two of the request's steps
    (request,) = llm.input_processor.process(PROMPT, params, "mid")
    engine.add_request(request)
    tokens: list[int] = []
    steps = 0
    while engine.has_unfinished():
        for out in engine.step().outputs:
            tokens += out.new_token_ids
        steps += 1
        if steps == 3:
            assert engine.reset_prefix_cache() is True
    assert tokens == expected
    llm.shutdown()


def test_utility_calls_run_only_known_methods_and_report_errors() -> None:
    class Core:
        def reset_prefix_cache(self) -> bool:
            raise OSError("disk gone")

        def shutdown(self) -> None:
            raise AssertionError("never reachable as a utility")

    unknown = run_utility(Core(), UtilityCall(call_id=7, method="shutdown"))
    assert unknown.call_id == 7 and unknown.result is None
    assert unknown.error is not None and "'shutdown' is not an engine utility" in unknown.error
    failed = run_utility(Core(), UtilityCall(call_id=8, method="reset_prefix_cache"))
    assert failed.call_id == 8 and failed.error == "OSError: disk gone"


def test_dev_mode_comes_from_vllm_s_or_chassis_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("VLLM_SERVER_DEV_MODE", "CHASSIS_SERVER_DEV_MODE"):
        monkeypatch.delenv(name, raising=False)
    assert not ServerSettings().server_dev_mode
    assert server_dev_mode_enabled({"VLLM_SERVER_DEV_MODE": "1"})
    assert server_dev_mode_enabled({"CHASSIS_SERVER_DEV_MODE": " True "})
    assert not server_dev_mode_enabled({"VLLM_SERVER_DEV_MODE": "0"})
    monkeypatch.setenv("CHASSIS_SERVER_DEV_MODE", "1")
    assert ServerSettings().server_dev_mode


@pytest.fixture(scope="module")
def async_engine(tiny_llama_dir):
    engine = tiny_async_llm(tiny_llama_dir)
    yield engine
    engine.shutdown_sync()


def _cached_tokens(client: TestClient) -> int:
    body = {"model": client.app.state.chassis.engine.model_name, "prompt": PROMPT}
    response = client.post("/v1/completions", json={**body, "max_tokens": 2, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_the_route_resets_the_engine_s_cache_in_dev_mode_only(async_engine) -> None:
    settings = ServerSettings(server_dev_mode=False, shutdown_engine_on_exit=False)
    with TestClient(build_app(async_engine, settings)) as client:
        assert client.post("/reset_prefix_cache").status_code == 404
    settings = ServerSettings(server_dev_mode=True, shutdown_engine_on_exit=False)
    with TestClient(build_app(async_engine, settings)) as client:
        assert client.post("/reset_prefix_cache").status_code == 200  # also when cold
        assert _cached_tokens(client) == 0
        assert _cached_tokens(client) >= 3 * 16
        response = client.post("/reset_prefix_cache?reset_running_requests=true")
        assert response.status_code == 200 and response.content == b""
        assert _cached_tokens(client) == 0
        assert _cached_tokens(client) >= 3 * 16


def test_server_info_shows_the_resolved_engine_settings(async_engine, tiny_llama_dir) -> None:
    settings = ServerSettings(server_dev_mode=True, shutdown_engine_on_exit=False, api_key="k")
    with TestClient(build_app(async_engine, settings)) as client:
        assert client.get("/server_info").status_code == 401
        info = client.get("/server_info", headers={"Authorization": "Bearer k"}).json()
    config, engine = info["engine_config"], info["engine_info"]
    assert config["model"] == str(tiny_llama_dir) and config["max_model_len"] == 256
    assert config["attention_backend"] == engine["attention_backend"] is not None
    assert engine["num_kv_blocks"] == 64 and engine["platform"] == "cpu"
    assert engine["kv_capacity_tokens"] == 64 * config["block_size"]
    assert "api_key" not in str(info)  # the server's settings are not shown
    with TestClient(build_app(async_engine, ServerSettings(shutdown_engine_on_exit=False))) as c:
        assert c.get("/server_info").status_code == 404


def test_an_unknown_utility_is_an_error_and_the_engine_keeps_serving(async_engine) -> None:
    async def main() -> None:
        future = async_engine.client.call_utility("load_weights")
        with pytest.raises(RuntimeError, match="'load_weights' is not an engine utility"):
            await asyncio.wrap_future(future)
        assert await async_engine.reset_prefix_cache() is True
        outs = [o async for o in async_engine.generate("Hello", GREEDY, "after")]
        assert sum(len(o.outputs[0].token_ids) for o in outs) == 4

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_call_to_a_dead_engine_core_fails(tiny_llama_dir) -> None:
    engine = tiny_async_llm(tiny_llama_dir)

    async def main() -> None:
        died = asyncio.Event()
        engine.add_dead_callback(died.set)
        os.kill(engine.client.process.pid, signal.SIGKILL)
        # sent before the death is noticed or refused after: either way it fails
        with pytest.raises(EngineDeadError):
            await asyncio.wrap_future(engine.client.call_utility("reset_prefix_cache"))
        await asyncio.wait_for(died.wait(), 10)
        with pytest.raises(EngineDeadError):
            await engine.reset_prefix_cache()

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        engine.shutdown_sync()
