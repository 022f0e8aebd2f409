"""Default sampling values from the model's generation_config.json (``--generation-config``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from fake_engine import FakeAsyncLLM
from fastapi.testclient import TestClient

from chassis.core.generation_defaults import generation_defaults
from chassis.serve.app import build_app
from chassis.serve.settings import ServerSettings

QWEN3_STYLE = {
    "bos_token_id": 1,
    "do_sample": True,
    "eos_token_id": [2, 3],
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
    "max_new_tokens": 4096,
}


def write_config(folder: Path, values: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(values))
    return folder


def test_auto_reads_the_models_sampling_values_only(tmp_path: Path) -> None:
    model = write_config(tmp_path / "model", QWEN3_STYLE)
    assert generation_defaults("auto", str(model)) == {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
    }  # not the token ids, do_sample or max_new_tokens


def test_none_ignores_the_file_and_a_folder_overrides_it(tmp_path: Path) -> None:
    model = write_config(tmp_path / "model", QWEN3_STYLE)
    assert generation_defaults("none", str(model)) == {}
    assert generation_defaults("vllm", str(model)) == {}
    other = write_config(tmp_path / "other", {"repetition_penalty": 1.1, "min_p": 0.05})
    assert generation_defaults(str(other), str(model)) == {"repetition_penalty": 1.1, "min_p": 0.05}


def test_missing_files(tmp_path: Path) -> None:
    assert generation_defaults("auto", str(tmp_path)) == {}  # a model without one: no defaults
    assert generation_defaults("auto", None) == {}
    with pytest.raises(ValueError, match=r"no generation_config\.json there"):
        generation_defaults(str(tmp_path / "nowhere"), None)


def test_unusable_values_are_an_error_naming_the_way_out(tmp_path: Path) -> None:
    bad = write_config(tmp_path / "bad", {"top_p": 0.0})
    with pytest.raises(ValueError, match="--generation-config none"):
        generation_defaults("auto", str(bad))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        generation_defaults("auto", str(tmp_path / "broken"))


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_server_requests_take_the_models_values_for_what_they_leave_unset(
    tmp_path: Path, route: str
) -> None:
    engine = FakeAsyncLLM()
    engine.config.model = str(write_config(tmp_path / "model", QWEN3_STYLE))
    body = (
        {"prompt": "hi", "max_tokens": 2}
        if route == "/v1/completions"
        else {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    )
    with TestClient(build_app(engine, ServerSettings())) as client:
        assert client.post(route, json=body).status_code == 200
        assert client.post(route, json={**body, "temperature": 0, "top_k": 5}).status_code == 200
    (_, _, unset, _), (_, _, given, _) = engine.requests
    assert (unset.temperature, unset.top_p, unset.top_k) == (0.6, 0.95, 20)
    assert (given.temperature, given.top_p, given.top_k) == (0.0, 0.95, 5)


def test_generation_config_none_keeps_the_engine_defaults(tmp_path: Path) -> None:
    engine = FakeAsyncLLM()
    engine.config.model = str(write_config(tmp_path / "model", QWEN3_STYLE))
    engine.config.generation_config = "none"
    with TestClient(build_app(engine, ServerSettings())) as client:
        client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    params = engine.requests[0][2]
    assert (params.temperature, params.top_p, params.top_k) == (1.0, 1.0, 0)


def test_offline_llm_uses_them_when_given_no_params(tmp_path: Path, tiny_llama_dir: Path) -> None:
    from chassis.core.llm import LLM

    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    write_config(model, {**QWEN3_STYLE, "temperature": 0.0})  # greedy: comparable outputs
    llm = LLM(str(model), num_kv_blocks=16, max_model_len=64)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k) == (0.0, 0.95, 20)
    from chassis.core.sampling_params import SamplingParams

    implicit = llm.generate("hello", None)[0].outputs[0].token_ids
    explicit = llm.generate("hello", SamplingParams(temperature=0.0, max_tokens=16))
    assert implicit == explicit[0].outputs[0].token_ids
