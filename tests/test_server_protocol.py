"""Request models -> SamplingParams, the engine/server flags, and the error shape (no app)."""

from __future__ import annotations

import argparse
import json
import types

import pytest
from fixtures_plugins import FakeEntryPoint, fake_manager, isolated_plugins  # noqa: F401

from chassis.core.errors import EngineDeadError
from chassis.plugins import hookimpl, set_plugin_manager
from chassis.serve.args import add_engine_args, engine_config_from_args, parse_memory_size
from chassis.serve.cli_serve import add_server_args, settings_from_args
from chassis.serve.errors import APIError, stream_error_json, to_api_error
from chassis.serve.protocol import ChatCompletionRequest, CompletionRequest
from chassis.serve.settings import ServerSettings

# -- requests -> SamplingParams ---------------------------------------------------------------


def test_completion_request_maps_openai_and_vllm_fields() -> None:
    body = CompletionRequest.model_validate(
        {
            "prompt": "hi",
            "max_tokens": 7,
            "temperature": 0.5,
            "top_p": 0.9,
            "n": 2,
            "stop": "x",
            "seed": 3,
            "presence_penalty": 0.1,
            "frequency_penalty": -0.2,
            "logit_bias": {"5": 10, "7": -100},
            "logprobs": 3,
            # vLLM extra_body fields
            "top_k": 5,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "min_tokens": 2,
            "ignore_eos": True,
            "stop_token_ids": [9],
            "include_stop_str_in_output": True,
            "skip_special_tokens": False,
            "prompt_logprobs": 1,
        }
    )
    params = body.to_sampling_params()
    assert params.max_tokens == 7 and params.n == 2 and params.seed == 3
    assert params.temperature == 0.5 and params.top_p == 0.9 and params.top_k == 5
    assert params.stop == ["x"] and params.stop_token_ids == [9]
    assert params.logit_bias == {5: 10.0, 7: -100.0}
    assert params.logprobs == 3 and params.prompt_logprobs == 1
    assert params.min_p == 0.05 and params.repetition_penalty == 1.1 and params.min_tokens == 2
    assert params.ignore_eos and params.include_stop_str_in_output
    assert not params.skip_special_tokens
    assert params.presence_penalty == 0.1 and params.frequency_penalty == -0.2


def test_explicit_nulls_mean_defaults() -> None:
    body = CompletionRequest.model_validate(
        {"prompt": "hi", "temperature": None, "top_p": None, "n": None, "stop": None}
    )
    params = body.to_sampling_params()
    assert params.temperature == 1.0 and params.top_p == 1.0 and params.n == 1
    assert params.max_tokens == 16  # OpenAI's completions default
    # an explicit null max_tokens (what the openai client sends for None) is that default too
    explicit = CompletionRequest.model_validate({"prompt": "hi", "max_tokens": None})
    assert explicit.to_sampling_params().max_tokens == 16


def test_chat_max_completion_tokens_wins_and_default_is_context() -> None:
    messages = [{"role": "user", "content": "hi"}]
    body = ChatCompletionRequest.model_validate(
        {"messages": messages, "max_tokens": 5, "max_completion_tokens": 9}
    )
    assert body.to_sampling_params().max_tokens == 9
    body = ChatCompletionRequest.model_validate({"messages": messages})
    assert body.to_sampling_params().max_tokens is None  # up to the context length


def test_chat_logprobs_and_top_logprobs() -> None:
    messages = [{"role": "user", "content": "hi"}]
    params = ChatCompletionRequest.model_validate(
        {"messages": messages, "logprobs": True, "top_logprobs": 4}
    ).to_sampling_params()
    assert params.logprobs == 4
    params = ChatCompletionRequest.model_validate(
        {"messages": messages, "logprobs": True}
    ).to_sampling_params()
    assert params.logprobs == 0
    with pytest.raises(APIError) as info:
        ChatCompletionRequest.model_validate(
            {"messages": messages, "top_logprobs": 2}
        ).to_sampling_params()
    assert info.value.status == 400 and info.value.param == "top_logprobs"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"3": 101}}, "logit_bias"),
        ({"top_p": 0}, "top_p"),
        ({"temperature": -1}, "temperature"),
        ({"n": 0}, "n"),
        # one request must not fan out into unbounded engine requests
        ({"n": 10**12}, "n"),
        ({"n": 1025}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        # integers past int64 cannot reach the engine core (msgpack): 400, not 500
        ({"top_k": 10**20}, "top_k"),
        ({"max_tokens": 2**64}, "max_tokens"),
        ({"min_tokens": 2**64}, "min_tokens"),
        ({"stop_token_ids": [2**64]}, "stop_token_ids"),
        # non-finite numbers (Python's JSON parser accepts NaN and Infinity)
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty"),
        ({"top_p": float("nan")}, "top_p"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"suffix": "x"}, "suffix"),
        ({"best_of": 3}, "best_of"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_invalid_completion_fields_are_400_naming_the_param(fields: dict, param: str) -> None:
    body = CompletionRequest.model_validate({"prompt": "hi", **fields})
    with pytest.raises(APIError) as info:
        body.to_sampling_params()
    assert info.value.status == 400
    assert info.value.param == param


@pytest.mark.parametrize(
    "fields",
    [
        {"response_format": {"type": "json_xml"}},
        {"add_generation_prompt": True, "continue_final_message": True},
    ],
)
def test_unsupported_chat_fields_are_400(fields: dict) -> None:
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], **fields}
    )
    with pytest.raises(APIError) as info:
        body.to_sampling_params()
    assert info.value.status == 400


def test_completion_prompt_forms() -> None:
    def batch(prompt):
        return CompletionRequest.model_validate({"prompt": prompt}).prompts()

    assert batch("a") == ["a"]
    assert batch(["a", "b"]) == ["a", "b"]
    assert batch([1, 2, 3]) == [[1, 2, 3]]
    assert batch([[1], [2, 3]]) == [[1], [2, 3]]
    for empty in ([], "", [[]]):
        with pytest.raises(APIError):
            batch(empty)


def test_unknown_fields_are_ignored() -> None:
    body = CompletionRequest.model_validate({"prompt": "a", "no_such_field": 1})
    assert body.to_sampling_params().max_tokens == 16


# -- errors -----------------------------------------------------------------------------------


def test_error_shape_and_mapping() -> None:
    assert APIError(404, "nope", param="model", code="model_not_found").body() == {
        "error": {
            "message": "nope",
            "type": "not_found_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    assert to_api_error(ValueError("bad")).status == 400
    assert to_api_error(EngineDeadError("gone")).status == 503
    assert to_api_error(RuntimeError("bug")).status == 500
    assert "bug" not in to_api_error(RuntimeError("bug")).message  # no internals leak
    event = json.loads(stream_error_json(ValueError("bad")))
    assert event["error"]["code"] == 400 and event["error"]["message"] == "bad"


# -- flags -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("1024", 1024),
        ("4GiB", 4 * 1024**3),
        ("512MiB", 512 * 1024**2),
        ("512mib", 512 * 1024**2),
        ("2GB", 2 * 1000**3),
        ("1.5G", int(1.5 * 1024**3)),
        ("64k", 64 * 1024),
    ],
)
def test_parse_memory_size(text: str, size: int) -> None:
    assert parse_memory_size(text) == size


@pytest.mark.parametrize("text", ["", "GiB", "4 parsecs", "-1", "0"])
def test_parse_memory_size_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="memory size"):
        parse_memory_size(text)


def _serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    add_engine_args(parser, with_plugins=False)
    return parser


def test_engine_flags_fill_engine_config_and_keep_its_defaults() -> None:
    args = _serve_parser().parse_args(
        [
            "some/model",
            "--max-model-len",
            "128",
            "--kv-cache-memory",
            "512MiB",
            "--no-enable-prefix-caching",
            "--no-enable-chunked-prefill",
            "--max-num-batched-tokens",
            "256",
            "--enforce-eager",
            "--served-model-name",
            "m",
            "--dtype",
            "float32",
            "--scheduler",
            "priority",
            "--chat-template",
            "{{ messages }}",
        ]
    )
    config = engine_config_from_args(args)
    assert config.model == "some/model" and config.served_model_name == "m"
    assert config.max_model_len == 128 and config.kv_cache_memory == 512 * 1024**2
    assert config.enable_prefix_caching is False and config.enable_chunked_prefill is False
    assert config.enforce_eager is True and config.dtype == "float32"
    assert config.scheduler == "priority" and config.chat_template == "{{ messages }}"
    assert config.block_size == 16 and config.max_num_seqs == 128  # EngineConfig defaults
    default = engine_config_from_args(_serve_parser().parse_args([]))
    assert default.model is None  # the embedded default model
    assert default.enable_prefix_caching is True and default.enforce_eager is False


def test_model_flag_and_positional() -> None:
    assert engine_config_from_args(_serve_parser().parse_args(["--model", "x"])).model == "x"
    with pytest.raises(ValueError, match="disagree"):
        engine_config_from_args(_serve_parser().parse_args(["y", "--model", "x"]))


def test_invalid_engine_flag_value_is_value_error(tmp_path) -> None:
    with pytest.raises(ValueError, match="block-size"):
        engine_config_from_args(_serve_parser().parse_args(["--block-size", "3"]))
    with pytest.raises(ValueError, match="--served-model-name must not be empty"):
        engine_config_from_args(_serve_parser().parse_args(["--served-model-name", " "]))
    # a mistyped template path is found with the other settings, before the model loads
    with pytest.raises(ValueError, match=r"--chat-template .* neither an existing file"):
        engine_config_from_args(
            _serve_parser().parse_args(["--chat-template", str(tmp_path / "typo.jinja")])
        )
    with pytest.raises(ValueError, match="--num-kv-blocks must be >= 1"):
        engine_config_from_args(_serve_parser().parse_args(["--num-kv-blocks", "0"]))


def test_the_api_key_comes_from_the_flag_then_chassis_then_vllm_s_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CHASSIS_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "vllm-key")
    assert settings_from_args(_serve_parser().parse_args([])).api_key == "vllm-key"
    monkeypatch.setenv("CHASSIS_API_KEY", "chassis-key")
    assert settings_from_args(_serve_parser().parse_args([])).api_key == "chassis-key"
    args = _serve_parser().parse_args(["--api-key", "flag-key"])
    assert settings_from_args(args).api_key == "flag-key"
    monkeypatch.delenv("CHASSIS_API_KEY")
    monkeypatch.delenv("VLLM_API_KEY")
    assert settings_from_args(_serve_parser().parse_args([])).api_key is None


def test_server_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHASSIS_API_KEY", "from-env")
    args = _serve_parser().parse_args(
        [
            "--allowed-origins",
            '["http://a.example", "http://b.example"]',
            "--allowed-methods",
            "GET,POST",
            "--max-request-body-size",
            "1MiB",
            "--port",
            "9000",
        ]
    )
    settings = settings_from_args(args)
    assert settings.api_key == "from-env"
    assert settings.allowed_origins == ["http://a.example", "http://b.example"]
    assert settings.allowed_methods == ["GET", "POST"]
    assert settings.max_request_body_bytes == 1024**2 and settings.port == 9000
    assert settings.host == "127.0.0.1"
    args = _serve_parser().parse_args(["--api-key", "flag"])
    assert settings_from_args(args).api_key == "flag"


def test_server_settings_validation() -> None:
    with pytest.raises(ValueError, match="port"):
        ServerSettings(port=70000)
    with pytest.raises(ValueError, match="allow-credentials"):
        ServerSettings(allowed_origins=["*"], allow_credentials=True)
    with pytest.raises(ValueError, match="api-key"):
        ServerSettings(api_key="")
    with pytest.raises(ValueError, match="--timeout-keep-alive must be >= 0"):
        ServerSettings(timeout_keep_alive_s=-1)


def test_log_level_is_checked_and_case_insensitive() -> None:
    from chassis.serve.cli import build_parser

    assert build_parser().parse_args(["--log-level", "debug", "env"]).log_level == "DEBUG"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--log-level", "bogus", "env"])


def test_plugin_flags_reach_plugin_args(isolated_plugins: None) -> None:  # noqa: F811
    plugin = types.SimpleNamespace()

    @hookimpl
    def chassis_add_cli_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--myplugin-level", type=int, default=1)

    plugin.chassis_add_cli_args = chassis_add_cli_args
    set_plugin_manager(fake_manager(general=[FakeEntryPoint("myplugin", "x", obj=plugin)]))
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    add_engine_args(parser)
    config = engine_config_from_args(parser.parse_args(["--myplugin-level", "3", "--port", "1"]))
    # only the plugin's flag lands in plugin_args, not the server's own flags
    assert config.plugin_args == {"myplugin_level": 3}


def test_plugin_that_fails_to_load_is_reported_by_engine_config(
    isolated_plugins: None,  # noqa: F811
) -> None:
    broken = FakeEntryPoint("broken", "chassis_no_such_module_xyz")
    set_plugin_manager(fake_manager(general=[broken]))
    parser = argparse.ArgumentParser()
    add_engine_args(parser)  # does not raise: other sub-commands must keep working
    with pytest.raises(ValueError, match="broken"):
        engine_config_from_args(parser.parse_args([]))
