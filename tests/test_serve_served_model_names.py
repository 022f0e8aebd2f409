"""Several ``--served-model-name`` values, as in vLLM: every name selects the model, the first
is the one answers, /metrics and adapters' ``parent`` carry, /v1/models lists them all."""

from __future__ import annotations

import argparse
from pathlib import Path
from types import SimpleNamespace

import pytest
from fake_engine import FakeAsyncLLM
from fastapi.testclient import TestClient

from chassis.serve.app import build_app
from chassis.serve.args import add_engine_args, engine_config_from_args
from chassis.serve.cli_serve import add_server_args, settings_from_args
from chassis.serve.lora import AdapterNameError, LoRAAdapters, LoRAModule, check_lora_modules
from chassis.serve.settings import ServerSettings


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    add_server_args(parser)
    return parser.parse_args(argv)


def test_several_names_parse_as_vllm_does() -> None:
    args = _parse(["some/model", "--served-model-name", "a", "b", "--max-model-len", "64"])
    config = engine_config_from_args(args)
    # the model is still MODEL, not the second name; the engine reports the first name
    assert config.model == "some/model" and config.served_model_name == "a"
    assert settings_from_args(args).served_model_aliases == ["b"]
    one = _parse(["m", "--served-model-name", "x"])
    assert engine_config_from_args(one).served_model_name == "x"
    assert settings_from_args(one).served_model_aliases == []
    none = _parse(["m"])
    assert engine_config_from_args(none).served_model_name is None
    assert settings_from_args(none).served_model_aliases == []
    with pytest.raises(ValueError, match="must not be empty"):
        settings_from_args(_parse(["m", "--served-model-name", "a", " "]))


def test_every_name_selects_the_model_and_answers_carry_the_first() -> None:
    engine = FakeAsyncLLM(model_name="a")
    with TestClient(build_app(engine, ServerSettings(served_model_aliases=["b"]))) as client:
        cards = client.get("/v1/models").json()["data"]
        assert [card["id"] for card in cards] == ["a", "b"]
        assert all(card["parent"] is None for card in cards)
        for name in ("a", "b"):
            body = {"model": name, "prompt": "hi", "max_tokens": 2}
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            assert response.json()["model"] == "a"
            chat = {"model": name, "messages": [{"role": "user", "content": "hi"}]}
            response = client.post("/v1/chat/completions", json={**chat, "max_tokens": 2})
            assert response.status_code == 200, response.text
            assert response.json()["model"] == "a"
        response = client.post("/v1/completions", json={"model": "c", "prompt": "hi"})
        assert response.status_code == 404
        error = response.json()["error"]
        assert error["code"] == "model_not_found"
        assert "'a'" in error["message"] and "'b'" in error["message"]
        assert 'model_name="a"' in client.get("/metrics").text
        assert 'model_name="b"' not in client.get("/metrics").text


def test_adapters_beside_several_names(tmp_path: Path) -> None:
    engine = FakeAsyncLLM(model_name="a")
    engine.input_processor = SimpleNamespace(check_lora=lambda lora: None)  # accept any
    settings = ServerSettings(
        served_model_aliases=["b"], lora_modules=[LoRAModule("sql", str(tmp_path))]
    )
    with TestClient(build_app(engine, settings)) as client:
        cards = client.get("/v1/models").json()["data"]
        assert [card["id"] for card in cards] == ["a", "b", "sql"]
        assert cards[2]["parent"] == "a"
        state = client.app.state.chassis
        name, lora = state.resolve_model("sql")
        assert name == "sql" and lora is not None and lora.lora_name == "sql"
        assert state.resolve_model("b") == ("a", None)
    # no adapter may take any of the model's names
    adapters = LoRAAdapters("a", lambda lora: None, ["b"])
    with pytest.raises(AdapterNameError, match="served model"):
        adapters.add("b", str(tmp_path))
    with pytest.raises(ValueError, match="'b' is the served model's name"):
        check_lora_modules(
            [LoRAModule("b", str(tmp_path))], enable_lora=True, served_model_name="a", aliases=["b"]
        )


def test_chassis_serve_with_two_names_starts(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """The reported failure: ``--served-model-name a b`` took ``b`` for the model to load."""
    import httpx
    from server_process import start_server

    names = ["--served-model-name", "a", "b"]  # the last --served-model-name wins
    server = start_server(tiny_llama_dir, tmp_path, names, served_model_name="a")
    try:
        models = httpx.get(server.base + "/v1/models", headers=server.headers).json()["data"]
        assert [card["id"] for card in models] == ["a", "b"]
        body = {"model": "b", "prompt": "hi", "max_tokens": 1}
        answer = httpx.post(server.base + "/v1/completions", json=body, headers=server.headers)
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == "a"
    finally:
        server.stop()
