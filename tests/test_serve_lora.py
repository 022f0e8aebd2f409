"""LoRA adapters through ``chassis serve``: ``--lora-modules``, the ``model`` field selecting
an adapter, ``/v1/models``, and vLLM's load/unload routes, end to end with the official
``openai`` client on a tiny random Llama; outputs are checked against HF transformers with
the adapter's deltas merged into the weights (greedy, float32).

One server (module scope, runtime updating on through ``$VLLM_ALLOW_RUNTIME_LORA_UPDATING``)
serves most tests; start-up refusals run the CLI in-process where they stop before the model
loads, and in a subprocess where the engine must be up to see the adapter does not fit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_engine import FakeAsyncLLM
from fastapi.testclient import TestClient
from fixtures_lora import hf_greedy, hf_merged_model, write_peft_adapter
from server_process import ServerProcess, start_server

from chassis.core.lora import LoRARequest
from chassis.serve.app import build_app
from chassis.serve.args import add_engine_args, engine_config_from_args
from chassis.serve.cli import main
from chassis.serve.lora import (
    AdapterNameError,
    LoRAAdapters,
    LoRAModule,
    UnknownAdapterError,
    parse_lora_modules,
    runtime_lora_updating_allowed,
)
from chassis.serve.settings import ServerSettings

openai = pytest.importorskip("openai")

NEW_TOKENS = 8
MAX_LORA_RANK = 8
PROMPT_IDS = [1, 422, 3108, 314, 9216, 253, 1345, 2442, 88, 913]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "max_tokens": NEW_TOKENS}
EXTRA = {"ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Adapters for the tiny Llama: two served from the start, two loaded at run time, one
    of too high a rank, one for a model of other shapes."""
    root = tmp_path_factory.mktemp("adapters")
    made = {
        name: write_peft_adapter(root / name, tiny_llama_dir, seed=seed, rank=rank)
        for name, seed, rank in (("sql", 1, 8), ("poem", 2, 4), ("new", 3, 8), ("new2", 4, 2))
    }
    made["rank16"] = write_peft_adapter(
        root / "rank16", tiny_llama_dir, seed=5, rank=16, targets=("q_proj",)
    )
    made["other"] = _other_shapes_adapter(made["sql"], root / "other")
    return made


def _other_shapes_adapter(source: Path, directory: Path) -> Path:
    """A copy of ``source`` whose first ``lora_A`` reads a wider input (another model's)."""
    from safetensors.torch import load_file, save_file

    directory.mkdir()
    shutil.copy(source / "adapter_config.json", directory / "adapter_config.json")
    tensors = load_file(str(source / "adapter_model.safetensors"))
    key = sorted(k for k in tensors if ".lora_A." in k)[0]
    a = tensors[key]
    tensors[key] = a.new_zeros(a.shape[0], a.shape[1] * 2)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return directory


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path, adapters: dict[str, Path]):
    """``reference(name, prompt_ids)``: HF's greedy tokens with adapter ``name`` merged
    (``None``: the base model); models built once each."""
    models: dict[str | None, Any] = {}

    def greedy(name: str | None, prompt_ids: list[int]) -> list[int]:
        if name not in models:
            models[name] = hf_merged_model(tiny_llama_dir, adapters[name] if name else None)
        return hf_greedy(models[name], prompt_ids, NEW_TOKENS)

    return greedy


@pytest.fixture(scope="module")
def server(
    tiny_llama_dir: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    modules = [
        f"sql={adapters['sql']}",
        json.dumps({"name": "poem", "path": str(adapters["poem"]), "base_model_name": "tiny"}),
    ]
    args = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", str(MAX_LORA_RANK)]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")  # the child process reads it
        server = start_server(
            tiny_llama_dir,
            tmp_path_factory.mktemp("serve_lora"),
            extra_args=[*args, "--lora-modules", *modules],
        )
    yield server
    server.stop()  # SIGTERM, and checks the exit was clean


def _completion_ids(server: ServerProcess, model: str, prompt: list[int] = PROMPT_IDS) -> tuple:
    response = server.client().completions.create(
        model=model, prompt=prompt, extra_body=EXTRA, **GREEDY
    )
    return response.model, response.choices[0].model_extra["token_ids"]


def _post(server: ServerProcess, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.base + route, json=body, headers=server.headers, timeout=60)


# -- routing -------------------------------------------------------------------------------------


def test_completions_run_the_adapter_named_as_model(server: ServerProcess, reference) -> None:
    """Each adapter's tokens are HF's with that adapter merged; the base name runs the base
    model; the response names the model asked for."""
    for model, name in (("sql", "sql"), ("poem", "poem"), ("tiny", None)):
        answered, token_ids = _completion_ids(server, model)
        assert answered == model
        assert token_ids == reference(name, PROMPT_IDS), model
    assert reference("sql", PROMPT_IDS) != reference(None, PROMPT_IDS)  # the adapter matters


def test_chat_and_streaming_with_an_adapter(server: ServerProcess, reference) -> None:
    client = server.client()
    chat = client.chat.completions.create(model="poem", messages=CHAT, extra_body=EXTRA, **GREEDY)
    assert chat.model == "poem"
    prompt_ids = chat.model_extra["prompt_token_ids"]
    assert chat.choices[0].model_extra["token_ids"] == reference("poem", prompt_ids)

    chunks = list(
        client.completions.create(
            model="sql", prompt=PROMPT_IDS, stream=True, extra_body=EXTRA, **GREEDY
        )
    )
    assert {chunk.model for chunk in chunks} == {"sql"}
    streamed = [t for chunk in chunks for c in chunk.choices for t in c.model_extra["token_ids"]]
    assert streamed == reference("sql", PROMPT_IDS)


def test_unknown_model_is_a_404_naming_the_adapters(server: ServerProcess) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        server.client().completions.create(model="gpt-4", prompt="hi", max_tokens=1)
    error = caught.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert all(name in error["message"] for name in ("gpt-4", "'tiny'", "'sql'", "'poem'"))


def test_models_lists_the_adapters_after_the_base_model(
    server: ServerProcess, adapters: dict[str, Path]
) -> None:
    cards = httpx.get(server.base + "/v1/models", headers=server.headers).json()["data"]
    assert [card["id"] for card in cards] == ["tiny", "sql", "poem"]
    assert cards[0]["parent"] is None
    for card in cards[1:]:
        assert card["parent"] == "tiny" and card["object"] == "model"
        assert card["root"] == str(adapters[card["id"]])
    assert [m.id for m in server.client().models.list()] == ["tiny", "sql", "poem"]
    # the official client's retrieve: GET /v1/models/{model}
    sql = server.client().models.retrieve("sql")
    assert sql.id == "sql" and sql.model_extra["parent"] == "tiny"
    with pytest.raises(openai.NotFoundError):
        server.client().models.retrieve("gpt-4")


# -- loading and unloading at run time -----------------------------------------------------------


def test_load_use_unload_and_reload_under_a_fresh_id(
    server: ServerProcess, adapters: dict[str, Path], reference
) -> None:
    loaded = _post(
        server, "/v1/load_lora_adapter", {"lora_name": "new", "lora_path": str(adapters["new"])}
    )
    assert loaded.status_code == 200 and "Success" in loaded.text, loaded.text
    assert _completion_ids(server, "new")[1] == reference("new", PROMPT_IDS)
    ids = [m.id for m in server.client().models.list()]
    assert ids == ["tiny", "sql", "poem", "new"]

    unloaded = _post(server, "/v1/unload_lora_adapter", {"lora_name": "new"})
    assert unloaded.status_code == 200 and "Success" in unloaded.text, unloaded.text
    with pytest.raises(openai.NotFoundError):
        _completion_ids(server, "new")

    # The same name for another adapter: a new id, so neither the engine's slot nor its
    # prefix cache serves the old adapter's weights or KV.
    reloaded = _post(
        server, "/v1/load_lora_adapter", {"lora_name": "new", "lora_path": str(adapters["new2"])}
    )
    assert reloaded.status_code == 200, reloaded.text
    assert _completion_ids(server, "new")[1] == reference("new2", PROMPT_IDS)
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "new"}).status_code == 200


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        ({"lora_name": "sql", "lora_path": "ADAPTER:new"}, "lora_name", "already served"),
        ({"lora_name": "tiny", "lora_path": "ADAPTER:new"}, "lora_name", "served model's name"),
        ({"lora_name": "x", "lora_path": "/no/such/adapter"}, "lora_path", "does not exist"),
        ({"lora_name": "x", "lora_path": "ADAPTER:rank16"}, "lora_path", "--max-lora-rank"),
        ({"lora_name": "x", "lora_path": "ADAPTER:other"}, "lora_path", "another base model"),
        ({"lora_name": "x"}, "lora_path", "Field required"),
    ],
)
def test_load_refusals_are_400_with_the_reason(
    server: ServerProcess, adapters: dict[str, Path], body: dict[str, str], param: str, needle: str
) -> None:
    body = {
        k: str(adapters[v.removeprefix("ADAPTER:")]) if v.startswith("ADAPTER:") else v
        for k, v in body.items()
    }
    response = _post(server, "/v1/load_lora_adapter", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and needle in error["message"], error
    assert "x" not in [m.id for m in server.client().models.list()]


def test_unload_of_an_unknown_name_is_a_404(server: ServerProcess) -> None:
    response = _post(server, "/v1/unload_lora_adapter", {"lora_name": "nope"})
    assert response.status_code == 404, response.text
    assert "nope" in response.json()["error"]["message"]


def test_routes_need_the_api_key(server: ServerProcess, adapters: dict[str, Path]) -> None:
    body = {"lora_name": "y", "lora_path": str(adapters["new"])}
    response = httpx.post(server.base + "/v1/load_lora_adapter", json=body, timeout=30)
    assert response.status_code == 401


def test_runtime_updating_is_off_without_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "CHASSIS_ALLOW_RUNTIME_LORA_UPDATING"):
        monkeypatch.delenv(name, raising=False)
    assert not ServerSettings().allow_runtime_lora_updating
    assert runtime_lora_updating_allowed({"CHASSIS_ALLOW_RUNTIME_LORA_UPDATING": "1"})
    assert runtime_lora_updating_allowed({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": " TRUE "})
    assert not runtime_lora_updating_allowed({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "0"})
    with TestClient(build_app(FakeAsyncLLM(), ServerSettings())) as client:
        body = {"lora_name": "a", "lora_path": "/x"}
        assert client.post("/v1/load_lora_adapter", json=body).status_code == 404
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 404


def test_adapter_ids_are_never_given_twice() -> None:
    """Ids count up across refusals and unloads; concurrent loads of one name: one wins."""

    def check(lora: LoRARequest) -> None:
        time.sleep(0.05)  # a check that reads files: loads overlap while it runs
        if "bad" in lora.lora_path:
            raise ValueError("refused")

    adapters = LoRAAdapters("base", check)
    assert adapters.add("a", "/a").lora_int_id == 1
    with pytest.raises(ValueError, match="refused"):
        adapters.add("b", "/bad")
    assert adapters.add("c", "/c").lora_int_id == 3
    assert adapters.remove("a").lora_int_id == 1
    with pytest.raises(UnknownAdapterError):
        adapters.remove("a")
    assert adapters.add("a", "/a").lora_int_id == 4
    assert [lora.lora_name for lora in adapters] == ["c", "a"]

    async def load_twice() -> list[object]:
        loads = [adapters.load("d", f"/d{i}") for i in range(2)]
        return await asyncio.gather(*loads, return_exceptions=True)

    first, second = asyncio.run(load_twice())
    assert isinstance(first, LoRARequest) and first.lora_int_id == 5
    assert isinstance(second, AdapterNameError)


# -- --lora-modules ------------------------------------------------------------------------------


def test_engine_lora_flags_reach_the_config() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser, with_plugins=False)
    flags = ["--enable-lora", "--max-loras", "3", "--max-lora-rank", "32", "--max-cpu-loras", "5"]
    config = engine_config_from_args(parser.parse_args(flags))
    assert (config.enable_lora, config.max_loras, config.max_lora_rank) == (True, 3, 32)
    assert config.max_cpu_loras == 5
    assert not engine_config_from_args(parser.parse_args([])).enable_lora


def test_lora_modules_forms() -> None:
    assert parse_lora_modules("a=/p/a") == [LoRAModule("a", "/p/a")]
    assert parse_lora_modules('{"name": "b", "path": "/p/b", "base_model_name": "m"}') == [
        LoRAModule("b", "/p/b", "m")
    ]
    assert parse_lora_modules('[{"name": "c", "path": "/c"}, {"name": "d", "path": "/d"}]') == [
        LoRAModule("c", "/c"),
        LoRAModule("d", "/d"),
    ]
    for bad, needle in (
        ("a", "name=path"),
        ("=/p", "name=path"),
        ('{"name": "a"}', "'path'"),
        ('{"name": "a", "path": "/p", "rank": 8}', "unknown field"),
        ("{oops", "invalid JSON"),
    ):
        with pytest.raises(ValueError, match=needle):
            parse_lora_modules(bad)


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--lora-modules", "a=ADAPTER"], "needs --enable-lora"),
        (["--enable-lora", "--lora-modules", "a=/no/such/adapter"], "does not exist"),
        (["--enable-lora", "--lora-modules", "a=ADAPTER", "a=ADAPTER"], "repeated: a"),
        (["--enable-lora", "--lora-modules", "tiny=ADAPTER"], "served model's name"),
    ],
)
def test_lora_modules_refused_before_the_model_loads(
    tiny_llama_dir: Path,
    adapters: dict[str, Path],
    caplog: pytest.LogCaptureFixture,
    extra: list[str],
    needle: str,
) -> None:
    extra = [item.replace("ADAPTER", str(adapters["sql"])) for item in extra]
    argv = ["serve", str(tiny_llama_dir), "--served-model-name", "tiny", "--port", "0", *extra]
    assert main(argv) == 2
    assert needle in caplog.text


def test_bad_lora_modules_item_is_a_usage_error(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["serve", "--lora-modules", '{"name": "a"}'])
    assert caught.value.code == 2
    assert "--lora-modules" in capsys.readouterr().err


def test_adapter_that_does_not_fit_stops_start_up(
    tiny_llama_dir: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """The shapes are checked against the engine's model once it is up: exit status 2 with
    the adapter and the reason, before the server listens."""
    cmd = [
        sys.executable, "-m", "chassis.serve.cli", "serve", str(tiny_llama_dir),
        "--port", "0", "--dtype", "float32", "--max-model-len", "128", "--num-kv-blocks", "16",
        "--enforce-eager", "--enable-lora", "--max-lora-rank", str(MAX_LORA_RANK),
        "--lora-modules", f"big={adapters['rank16']}",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert done.returncode == 2, done.stdout + done.stderr
    output = done.stdout + done.stderr
    assert "--lora-modules big=" in output and "--max-lora-rank" in output
    assert "ready on" not in output and "Traceback" not in output
