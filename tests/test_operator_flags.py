"""Operator flags of ``chassis serve`` that vLLM has: ``--hf-overrides``,
``--override-generation-config``, ``--return-tokens-as-token-ids``,
``--enable-log-requests`` / ``--max-log-len``, ``--root-path``, ``--disable-fastapi-docs``
and ``--enable-prompt-tokens-details``.

Server behaviour runs on the fake engine (tests/fake_engine.py); ``--hf-overrides`` on a
real tiny engine, compared with HF transformers under the same override.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from fake_engine import FakeAsyncLLM
from fastapi.testclient import TestClient
from fixtures_models import hf_greedy_tokens

from chassis.core.config import EngineConfig
from chassis.core.generation_defaults import generation_defaults
from chassis.core.lora.request import LoRARequest
from chassis.core.model_loader import apply_hf_overrides, load_hf_config
from chassis.core.sampling_params import SamplingParams
from chassis.serve.app import build_app
from chassis.serve.args import engine_config_from_args
from chassis.serve.cli_serve import add_server_args, settings_from_args
from chassis.serve.request_log import log_request
from chassis.serve.settings import ServerSettings

CHAT = [{"role": "user", "content": "hi"}]
QWEN3_STYLE = {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_new_tokens": 4096}


def parse_serve(*argv: str) -> argparse.Namespace:
    from chassis.serve.args import add_engine_args

    parser = argparse.ArgumentParser()
    add_server_args(parser)
    add_engine_args(parser, with_plugins=False)
    return parser.parse_args(list(argv))


def serve(engine: FakeAsyncLLM, **settings: Any) -> TestClient:
    return TestClient(build_app(engine, ServerSettings(**settings)))


def sse_events(text: str) -> list[dict[str, Any]]:
    return [
        json.loads(line[6:])
        for line in text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


# -- --hf-overrides ----------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:`rope_scaling` is deprecated:FutureWarning")
def test_hf_overrides_set_keys_merge_sub_configs_and_replace_other_dicts() -> None:
    from transformers import LlavaConfig

    config = LlavaConfig()
    vocab = config.text_config.vocab_size
    theta = config.text_config.rope_parameters["rope_theta"]
    overrides = {
        "image_token_index": 7,  # a known key
        "my_new_key": [1, 2],  # unknown keys are set too, as vLLM's config.update
        "text_config": {
            "max_position_embeddings": 1234,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        },
    }
    apply_hf_overrides(config, overrides)
    assert "rope_theta" not in overrides["text_config"]["rope_scaling"]  # not the caller's
    assert config.image_token_index == 7 and config.my_new_key == [1, 2]
    text = config.text_config
    assert text.max_position_embeddings == 1234
    assert text.vocab_size == vocab  # merged into the sub-config, not replacing it
    assert text.rope_parameters["rope_type"] == "linear"
    assert text.rope_parameters["factor"] == 2.0
    assert text.rope_parameters["rope_theta"] == theta  # kept in the sub-config too


@pytest.mark.filterwarnings("ignore:`rope_scaling` is deprecated:FutureWarning")
def test_a_rope_override_keeps_the_checkpoints_theta(tiny_llama_dir: Path) -> None:
    plain = load_hf_config(tiny_llama_dir)
    config = load_hf_config(
        tiny_llama_dir, {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    )
    # a dict that is no sub-config is replaced whole (the llama3 keys are gone) ...
    assert config.rope_parameters["rope_type"] == "linear"
    assert "low_freq_factor" not in config.rope_parameters
    # ... but transformers 5 would lose rope_theta with it: kept
    assert config.rope_parameters["rope_theta"] == plain.rope_parameters["rope_theta"]


def test_a_rope_theta_override_reaches_the_rope_tables(tiny_llama_dir: Path) -> None:
    """transformers 5 keeps the theta in ``rope_parameters``, which the engine reads: a
    ``rope_theta`` override (of the config, or of a sub-config) is written there too."""
    from transformers import LlavaConfig

    from chassis.core.layers.rotary import rope_parameters

    config = load_hf_config(tiny_llama_dir, {"rope_theta": 20000.0})
    assert rope_parameters(config)["rope_theta"] == 20000.0
    llava = LlavaConfig()
    apply_hf_overrides(llava, {"text_config": {"rope_theta": 30000.0}})
    assert rope_parameters(llava.text_config)["rope_theta"] == 30000.0


def test_hf_overrides_must_be_an_object() -> None:
    with pytest.raises(ValueError, match="--hf-overrides must be a JSON object"):
        EngineConfig(hf_overrides=[1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="--hf-overrides must be a JSON object"):
        apply_hf_overrides(object(), "max_position_embeddings=4")  # type: ignore[arg-type]
    args = parse_serve("--hf-overrides", '{"max_position_embeddings": 64}')
    assert engine_config_from_args(args).hf_overrides == {"max_position_embeddings": 64}
    with pytest.raises(SystemExit):
        parse_serve("--hf-overrides", "[1]")


def test_hf_overrides_size_the_engine(tiny_llama_dir: Path) -> None:
    from chassis.core.engine_setup import finalize_config

    config = EngineConfig(model=str(tiny_llama_dir), hf_overrides={"max_position_embeddings": 96})
    finalize_config(config)
    assert config.max_model_len == 96  # the model's 512 positions, overridden
    too_long = EngineConfig(
        model=str(tiny_llama_dir), max_model_len=200, hf_overrides={"max_position_embeddings": 96}
    )
    with pytest.raises(ValueError, match="exceeds the model's context length 96"):
        finalize_config(too_long)


def test_tensor_parallel_checks_read_the_overridden_config(tiny_llama_dir: Path) -> None:
    from chassis.core.tp_executor import _check_model_splits

    config = EngineConfig(model=str(tiny_llama_dir), tensor_parallel_size=2)
    _check_model_splits(config)  # 4 heads split over 2 ranks
    config.hf_overrides = {"num_attention_heads": 3}
    with pytest.raises(ValueError, match=r"num_attention_heads \(3\) is not divisible"):
        _check_model_splits(config)


ROPE_OVERRIDE = {"rope_scaling": {"rope_type": "linear", "factor": 8.0}}
ROPE_PROMPTS = ["1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_rope_tokens(tiny_llama_dir: Path) -> list[list[int]]:
    """HF's greedy tokens with :data:`ROPE_OVERRIDE`, set the transformers 5 way
    (independently of chassis' helper); checked to differ from the checkpoint's own."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from chassis.core.tokenizer import load_tokenizer

    def hf(with_override: bool) -> list[list[int]]:
        config = AutoConfig.from_pretrained(str(tiny_llama_dir))
        if with_override:
            theta = config.rope_parameters["rope_theta"]
            config.rope_parameters = {"rope_type": "linear", "factor": 8.0, "rope_theta": theta}
        model = AutoModelForCausalLM.from_pretrained(
            str(tiny_llama_dir), config=config, dtype=torch.float32
        ).eval()
        return hf_greedy_tokens(model, load_tokenizer(tiny_llama_dir), ROPE_PROMPTS, 8)

    expected = hf(True)
    assert expected != hf(False)  # the override changes what the model computes
    return expected


@pytest.mark.filterwarnings("ignore:`rope_scaling` is deprecated:FutureWarning")
def test_hf_overrides_reach_the_model_as_hf_builds_it(
    tiny_llama_dir: Path, hf_rope_tokens: list[list[int]]
) -> None:
    from chassis import LLM

    llm = LLM(
        str(tiny_llama_dir),
        dtype="float32",
        max_model_len=128,
        num_kv_blocks=32,
        hf_overrides=ROPE_OVERRIDE,
    )
    outputs = llm.generate(ROPE_PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == hf_rope_tokens


@pytest.mark.filterwarnings("ignore:`rope_scaling` is deprecated:FutureWarning")
def test_hf_overrides_reach_the_engine_core_process(
    tiny_llama_dir: Path, hf_rope_tokens: list[list[int]]
) -> None:
    """``chassis serve``'s engine runs in its own process: the override travels with the
    config and the model there is built from it."""
    import asyncio

    from chassis.core.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_config(
        EngineConfig(
            model=str(tiny_llama_dir),
            dtype="float32",
            max_model_len=128,
            num_kv_blocks=32,
            hf_overrides=ROPE_OVERRIDE,
        )
    )

    async def greedy() -> list[int]:
        ids: list[int] = []
        async for out in engine.generate(ROPE_PROMPTS[0], GREEDY, "r", delta=True):
            ids += out.outputs[0].token_ids
        return ids

    try:
        assert [asyncio.run(asyncio.wait_for(greedy(), 60))] == hf_rope_tokens
    finally:
        engine.shutdown_sync()


# -- --override-generation-config --------------------------------------------------------------


def write_generation_config(folder: Path, values: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(values))
    return folder


def test_override_generation_config_merges_over_the_models_values(tmp_path: Path) -> None:
    model = str(write_generation_config(tmp_path / "m", QWEN3_STYLE))
    assert generation_defaults("auto", model, {"temperature": 0.5, "min_p": 0.1}) == {
        "temperature": 0.5,
        "top_k": 20,
        "top_p": 0.95,
        "min_p": 0.1,
    }
    # with --generation-config none (vLLM's "vllm") the overrides are the only defaults
    assert generation_defaults("vllm", model, {"temperature": 0.5}) == {"temperature": 0.5}
    assert generation_defaults("auto", model, {}) == generation_defaults("auto", model)


def test_override_generation_config_refuses_what_it_cannot_apply() -> None:
    with pytest.raises(ValueError, match=r"unknown key.*max_new_tokens.*temperature, top_p"):
        EngineConfig(override_generation_config={"max_new_tokens": 8})
    with pytest.raises(ValueError, match=r"--override-generation-config: .*top_p"):
        EngineConfig(override_generation_config={"top_p": 0.0})
    with pytest.raises(ValueError, match="--override-generation-config must be a JSON object"):
        EngineConfig(override_generation_config="temperature=0.5")  # type: ignore[arg-type]
    args = parse_serve("--override-generation-config", '{"temperature": 0.5}')
    assert engine_config_from_args(args).override_generation_config == {"temperature": 0.5}


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_server_requests_take_the_overridden_defaults(tmp_path: Path, route: str) -> None:
    engine = FakeAsyncLLM()
    engine.config.model = str(write_generation_config(tmp_path / "m", QWEN3_STYLE))
    engine.config.override_generation_config = {"temperature": 0.5, "repetition_penalty": 1.2}
    body: dict[str, Any] = (
        {"prompt": "hi", "max_tokens": 2}
        if route == "/v1/completions"
        else {"messages": CHAT, "max_tokens": 2}
    )
    with serve(engine) as client:
        assert client.post(route, json=body).status_code == 200
        assert client.post(route, json={**body, "temperature": 0.0}).status_code == 200
    (_, _, unset, _), (_, _, given, _) = engine.requests
    assert (unset.temperature, unset.top_p, unset.repetition_penalty) == (0.5, 0.95, 1.2)
    assert (given.temperature, given.top_p) == (0.0, 0.95)  # the request's own value wins


# -- --return-tokens-as-token-ids --------------------------------------------------------------


def token_of(engine: FakeAsyncLLM, label: str) -> str:
    """The text of the token a ``"token_id:ID"`` label names."""
    assert label.startswith("token_id:"), label
    return engine.tokenizer.decode([int(label.removeprefix("token_id:"))])


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_name_tokens_by_id(stream: bool) -> None:
    engine = FakeAsyncLLM()
    body = {"prompt": "hi", "max_tokens": 3, "logprobs": 2, "stream": stream}
    with serve(engine, return_tokens_as_token_ids=True) as client:
        response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    if stream:
        parts = [e["choices"][0] for e in sse_events(response.text) if e["choices"]]
        tokens = [t for p in parts if p["logprobs"] for t in p["logprobs"]["tokens"]]
        tops = [t for p in parts if p["logprobs"] for t in p["logprobs"]["top_logprobs"]]
        text = "".join(p["text"] for p in parts)
    else:
        choice = response.json()["choices"][0]
        tokens, tops, text = (
            choice["logprobs"]["tokens"],
            choice["logprobs"]["top_logprobs"],
            choice["text"],
        )
    assert "".join(token_of(engine, t) for t in tokens) == text == "abc"
    for token, top in zip(tokens, tops, strict=True):
        assert token in top and all(key.startswith("token_id:") for key in top)


def test_echoed_prompt_logprobs_name_tokens_by_id_and_a_request_may_opt_out() -> None:
    engine = FakeAsyncLLM()
    body = {"prompt": "hi", "max_tokens": 1, "logprobs": 1, "echo": True}
    with serve(engine, return_tokens_as_token_ids=True) as client:
        echoed = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
        own = client.post(
            "/v1/completions", json={**body, "return_tokens_as_token_ids": False}
        ).json()["choices"][0]["logprobs"]
    assert [token_of(engine, t) for t in echoed["tokens"]] == ["<|bos|>", "h", "i", "a"]
    assert own["tokens"] == ["<|bos|>", "h", "i", "a"]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_name_tokens_by_id_with_the_tokens_own_bytes(stream: bool) -> None:
    engine = FakeAsyncLLM()
    body = {
        "messages": CHAT,
        "max_tokens": 2,
        "logprobs": True,
        "top_logprobs": 2,
        "stream": stream,
        "return_tokens_as_token_ids": True,  # the request asks; the server flag is off
    }
    with serve(engine) as client:
        response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    if stream:
        choices = [e["choices"][0] for e in sse_events(response.text) if e["choices"]]
        entries = [t for c in choices if c.get("logprobs") for t in c["logprobs"]["content"]]
    else:
        entries = response.json()["choices"][0]["logprobs"]["content"]
    assert [token_of(engine, e["token"]) for e in entries] == ["a", "b"]
    for entry in entries:
        assert bytes(entry["bytes"]).decode() == token_of(engine, entry["token"])
        assert entry["token"] in [top["token"] for top in entry["top_logprobs"]]
        for top in entry["top_logprobs"]:
            assert bytes(top["bytes"]).decode() == token_of(engine, top["token"])


def test_return_tokens_as_token_ids_flag() -> None:
    assert not settings_from_args(parse_serve()).return_tokens_as_token_ids
    assert settings_from_args(
        parse_serve("--return-tokens-as-token-ids")
    ).return_tokens_as_token_ids


# -- --enable-log-requests / --max-log-len -----------------------------------------------------

LOGGER = "chassis.serve.request_log"


def request_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_requests_are_not_logged_by_default(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    with serve(FakeAsyncLLM()) as client:
        client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1})
    assert request_lines(caplog) == []


def test_each_completion_prompt_is_logged_cut_to_max_log_len(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    engine = FakeAsyncLLM()
    with serve(engine, enable_log_requests=True, max_log_len=4) as client:
        body = client.post(
            "/v1/completions",
            json={"prompt": ["hello world", "goodbye"], "max_tokens": 1, "temperature": 0.25},
        ).json()
    lines = request_lines(caplog)
    assert len(lines) == 2
    for i, (line, word) in enumerate(zip(lines, ["hell", "good"], strict=True)):
        assert line.startswith(f"Received request {body['id']}-{i}: prompt: '{word}', params: ")
        assert "temperature=0.25" in line and line.endswith("lora_request: None.")
        ids = engine.requests[i][1][:4]
        assert f"prompt_token_ids: {ids}," in line


def test_a_chat_request_is_logged_as_its_rendered_prompt(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    engine = FakeAsyncLLM()
    with serve(engine, enable_log_requests=True) as client:
        body = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1})
    [line] = request_lines(caplog)
    rendered = engine.tokenizer.decode(engine.requests[0][1])
    assert line.startswith(f"Received request {body.json()['id']}: prompt: {rendered!r}, ")
    assert f"prompt_token_ids: {engine.requests[0][1]}," in line


def test_the_log_line_names_the_lora_adapter(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    settings = ServerSettings(enable_log_requests=True, max_log_len=0)
    lora = LoRARequest("sql-adapter", 1, "/adapters/sql")
    log_request(settings, "cmpl-1", "a prompt", [5, 6], SamplingParams(), lora)
    [line] = request_lines(caplog)
    assert line.startswith("Received request cmpl-1: prompt: '', params: SamplingParams(")
    assert line.endswith("prompt_token_ids: [], lora_request: sql-adapter.")


def test_outputs_are_logged_with_enable_log_outputs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    engine = FakeAsyncLLM()
    settings = {"enable_log_requests": True, "enable_log_outputs": True}
    with serve(engine, **settings) as client:
        body = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "n": 2})
        streamed = {"prompt": "hi", "max_tokens": 2, "stream": True}
        with client.stream("POST", "/v1/completions", json=streamed) as response:
            assert response.status_code == 200 and list(response.iter_lines())
    answer = body.json()
    generated = [line for line in request_lines(caplog) if line.startswith("Generated")]
    assert len(generated) == 3  # two choices, then the streamed request
    texts = [choice["text"] for choice in answer["choices"]]
    for line, text, name in zip(
        generated, texts, [answer["id"], f"{answer['id']} (choice 1)"], strict=False
    ):
        assert line.startswith(f"Generated response {name}: output: {text!r}, output_token_ids: [")
        assert line.endswith("finish_reason: length.")
    assert len(generated[0].split("output_token_ids: [")[1].split("]")[0].split(",")) == 3
    caplog.clear()
    with serve(FakeAsyncLLM(), enable_log_requests=True) as client:  # outputs off by default
        client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert not [line for line in request_lines(caplog) if line.startswith("Generated")]
    args = parse_serve("--enable-log-requests", "--enable-log-outputs")
    assert settings_from_args(args).enable_log_outputs


def test_log_request_flags() -> None:
    assert not settings_from_args(parse_serve()).enable_log_requests
    assert not settings_from_args(parse_serve("--disable-log-requests")).enable_log_requests
    on = settings_from_args(parse_serve("--enable-log-requests", "--max-log-len", "10"))
    assert on.enable_log_requests and on.max_log_len == 10
    with pytest.raises(ValueError, match="--max-log-len must be >= 0"):
        ServerSettings(max_log_len=-1)


# -- --root-path, --disable-fastapi-docs -------------------------------------------------------


def test_docs_are_served_by_default_and_disabled_by_the_flag() -> None:
    with serve(FakeAsyncLLM()) as client:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert client.get(path).status_code == 200, path
    with serve(FakeAsyncLLM(), disable_fastapi_docs=True) as client:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert client.get(path).status_code == 404, path
        assert client.get("/v1/models").status_code == 200
    assert settings_from_args(parse_serve("--disable-fastapi-docs")).disable_fastapi_docs


def test_root_path_routes_answer_with_and_without_the_prefix() -> None:
    with serve(FakeAsyncLLM(), root_path="/llm", api_key="k") as client:
        auth = {"Authorization": "Bearer k"}
        for path in ("/v1/models", "/llm/v1/models"):
            assert client.get(path, headers=auth).json()["data"][0]["id"] == "fake-model"
        # /health stays open to probes whether the proxy strips the prefix or not
        assert client.get("/health").status_code == 200
        assert client.get("/llm/health").status_code == 200
        assert client.get("/llm/v1/models").status_code == 401
        schema = client.get("/openapi.json", headers=auth).json()
        assert schema["servers"] == [{"url": "/llm"}]
        assert "/llm/openapi.json" in client.get("/docs", headers=auth).text


def test_root_path_must_be_an_absolute_prefix() -> None:
    for bad in ("llm", "/llm/"):
        with pytest.raises(ValueError, match="--root-path must start with '/'"):
            ServerSettings(root_path=bad)
    assert settings_from_args(parse_serve("--root-path", "/llm")).root_path == "/llm"


@pytest.fixture
def uvicorn_url() -> Iterator[str]:
    """The app (``--root-path /llm``) under a real uvicorn server, as ``chassis serve``
    runs it (uvicorn itself is given no root path)."""
    import uvicorn

    app = build_app(FakeAsyncLLM(), ServerSettings(root_path="/llm"))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def test_root_path_under_uvicorn(uvicorn_url: str) -> None:
    with httpx.Client(base_url=uvicorn_url) as client:
        # a proxy that strips /llm, and one that passes it on
        assert client.get("/v1/models").status_code == 200
        assert client.get("/llm/v1/models").status_code == 200
        assert client.get("/openapi.json").json()["servers"] == [{"url": "/llm"}]
        assert "/llm/openapi.json" in client.get("/llm/docs").text


# -- --enable-prompt-tokens-details ------------------------------------------------------------


class CachingFakeLLM(FakeAsyncLLM):
    """Reports ``cached`` prompt tokens served from the prefix cache on every output."""

    cached = 3

    async def generate(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        async for output in super().generate(*args, **kwargs):
            yield dataclasses.replace(output, num_cached_tokens=self.cached)


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_prompt_tokens_details_follow_the_flag(route: str, enabled: bool) -> None:
    body: dict[str, Any] = (
        {"prompt": "hello", "max_tokens": 2}
        if route == "/v1/completions"
        else {"messages": CHAT, "max_tokens": 2}
    )
    expected = {"cached_tokens": 3} if enabled else None
    with serve(CachingFakeLLM(), enable_prompt_tokens_details=enabled) as client:
        usage = client.post(route, json=body).json()["usage"]
        assert usage["prompt_tokens_details"] == expected
        streamed = client.post(
            route, json={**body, "stream": True, "stream_options": {"include_usage": True}}
        )
        assert sse_events(streamed.text)[-1]["usage"]["prompt_tokens_details"] == expected


def test_responses_report_cached_tokens_whatever_the_flag() -> None:
    with serve(CachingFakeLLM(), enable_prompt_tokens_details=False) as client:
        body = client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2}).json()
    assert body["usage"]["input_tokens_details"]["cached_tokens"] == 3


def test_prompt_tokens_details_flag() -> None:
    assert settings_from_args(parse_serve()).enable_prompt_tokens_details
    assert settings_from_args(
        parse_serve("--enable-prompt-tokens-details")
    ).enable_prompt_tokens_details
    off = settings_from_args(parse_serve("--no-enable-prompt-tokens-details"))
    assert not off.enable_prompt_tokens_details
