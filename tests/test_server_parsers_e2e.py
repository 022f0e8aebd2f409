"""``chassis serve --reasoning-parser deepseek_r1 --enable-auto-tool-choice --tool-call-parser
hermes`` as a real process on a tiny random Llama, driven by the official ``openai`` client.

The model is random, so it writes neither ``</think>`` nor tool calls: under ``deepseek_r1``
its whole greedy output is reasoning. The reference is the same prompt's greedy completion
from ``/v1/completions``, which no parser touches.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_process import ServerProcess, free_port, running_server

openai = pytest.importorskip("openai")

CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def server(
    tiny_llama_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ServerProcess]:
    flags = ["--reasoning-parser", "deepseek_r1", "--enable-auto-tool-choice"]
    flags += ["--tool-call-parser", "hermes"]
    with running_server(
        tiny_llama_dir, tmp_path_factory.mktemp("serve"), extra_args=flags
    ) as server:
        yield server


def reference_text(server: ServerProcess, max_tokens: int) -> str:
    """The greedy output for CHAT with TOOLS, from the routes no parser touches."""
    headers = {"Authorization": f"Bearer {server.api_key}"}
    ids = httpx.post(
        f"{server.base}/tokenize",
        json={"messages": CHAT, "tools": TOOLS},
        headers=headers,
    ).json()["tokens"]
    completion = server.client().completions.create(
        model="tiny", prompt=ids, max_tokens=max_tokens, temperature=0
    )
    return completion.choices[0].text


def test_the_output_is_reasoning_streamed_or_not(server: ServerProcess) -> None:
    expected = reference_text(server, 12).strip()
    assert expected and "</think>" not in expected
    client = server.client()
    kwargs = {"model": "tiny", "messages": CHAT, "tools": TOOLS, "max_tokens": 12}
    response = client.chat.completions.create(temperature=0, **kwargs)
    [choice] = response.choices
    assert choice.finish_reason == "length"
    assert choice.message.reasoning == expected
    assert choice.message.reasoning_content == expected  # the name other clients read
    assert choice.message.content is None and not choice.message.tool_calls

    chunks = list(client.chat.completions.create(temperature=0, stream=True, **kwargs))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == expected
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == expected
    assert not any(d.content for d in deltas) and not any(d.tool_calls for d in deltas)


#: tools whose every call is short (enums), so a random model's constrained output ends
FINITE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "set_unit",
            "parameters": {
                "type": "object",
                "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["unit"],
            },
        },
    },
    {"type": "function", "function": {"name": "get_time"}},
]


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_choice_makes_a_random_model_call_tools(
    server: ServerProcess, stream: bool
) -> None:
    """``required`` and a named function constrain the output to calls: even a random model
    then makes valid ones (and the reasoning parser, which would take the whole output of
    this model as reasoning, stays out of the way)."""
    client = server.client()
    named = {"type": "function", "function": {"name": "set_unit"}}
    for tool_choice, parallel in (("required", True), ("required", False), (named, True)):
        kwargs = {"model": "tiny", "messages": CHAT, "tools": FINITE_TOOLS, "max_tokens": 200}
        kwargs |= {"tool_choice": tool_choice, "parallel_tool_calls": parallel, "seed": 1}
        if stream:  # the calls come in pieces: put together by the client's helper
            from openai.lib.streaming.chat import ChatCompletionStreamState

            state = ChatCompletionStreamState()
            for chunk in client.chat.completions.create(temperature=1.0, stream=True, **kwargs):
                state.handle_chunk(chunk)
            message = state.get_final_completion().choices[0].message
            calls = message.tool_calls
            assert not message.content
        else:
            response = client.chat.completions.create(temperature=1.0, **kwargs)
            calls = response.choices[0].message.tool_calls
            assert not response.choices[0].message.content
        assert calls and (parallel or len(calls) == 1)
        for call in calls:
            arguments = json.loads(call.function.arguments)
            if call.function.name == "set_unit":
                assert arguments["unit"] in ("celsius", "fahrenheit")
            else:
                assert call.function.name == "get_time" and arguments == {}
        if tool_choice is named:
            assert [c.function.name for c in calls] == ["set_unit"]


def test_response_format_json_schema_through_the_client(server: ServerProcess) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    response = server.client().chat.completions.create(
        model="tiny",
        messages=CHAT,
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}},
        max_tokens=60,
    )
    value = json.loads(response.choices[0].message.content)
    assert isinstance(value["ok"], bool) and value["n"] in (1, 2, 3) and set(value) == {"ok", "n"}
    with pytest.raises(openai.BadRequestError, match="uniqueItems") as refused:
        server.client().chat.completions.create(
            model="tiny",
            messages=CHAT,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "r", "schema": {"type": "array", "uniqueItems": True}},
            },
        )
    assert refused.value.param == "structured_outputs"


def test_compact_json_on_every_route(server: ServerProcess) -> None:
    """vLLM's ``disable_any_whitespace: true`` in ``structured_outputs``, alone there to shape
    the JSON another field asks for or next to the constraint: chat (response_format, a
    forced tool call's arguments), completions and responses write JSON with no whitespace
    between tokens; a whitespace_pattern that could write something else is a 400."""
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, [2, 3], {"k": None}]}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    compact = {"structured_outputs": {"disable_any_whitespace": True}}
    client = server.client()
    texts = [
        client.chat.completions.create(
            model="tiny",
            messages=CHAT,
            response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}},
            max_tokens=60,
            extra_body=compact,
        )
        .choices[0]
        .message.content,
        client.completions.create(
            model="tiny",
            prompt="JSON:",
            max_tokens=60,
            extra_body={"structured_outputs": {"json": schema, "disable_any_whitespace": True}},
        )
        .choices[0]
        .text,
        client.responses.create(
            model="tiny",
            input="JSON please",
            text={"format": {"type": "json_schema", "name": "r", "schema": schema}},
            max_output_tokens=60,
            extra_body=compact,
        ).output_text,
    ]
    for text in texts:
        value = json.loads(text)
        assert isinstance(value["ok"], bool) and value["n"] in (1, [2, 3], {"k": None}), text
        assert text == json.dumps(value, separators=(",", ":")), text  # (no whitespace)
    # a forced call's arguments are written compact too, but handed back re-written as every
    # tool call's are (json.dumps: ", " and ": ", serve/forced_tool_calls.py)
    forced = client.chat.completions.create(
        model="tiny",
        messages=CHAT,
        tools=[{"type": "function", "function": {"name": "report", "parameters": schema}}],
        tool_choice={"type": "function", "function": {"name": "report"}},
        max_tokens=60,
        extra_body=compact,
    )
    arguments = forced.choices[0].message.tool_calls[0].function.arguments
    assert arguments == json.dumps(json.loads(arguments))
    with pytest.raises(openai.BadRequestError, match="only JSON whitespace") as refused:
        client.chat.completions.create(
            model="tiny",
            messages=CHAT,
            response_format={"type": "json_object"},
            extra_body={"structured_outputs": {"whitespace_pattern": "[ ,]"}},
        )
    assert refused.value.param == "structured_outputs"


def test_an_unknown_parser_fails_before_the_model_loads(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            *(sys.executable, "-m", "chassis.serve.cli", "serve", str(tmp_path / "no-model")),
            *("--port", str(free_port()), "--reasoning-parser", "nope"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    from chassis.plugins import get_registries

    known = ", ".join(sorted(get_registries().reasoning_parsers.names()))
    assert f"unknown reasoning parser 'nope'; known: {known}" in result.stderr
    assert "Traceback" not in result.stderr and "no-model" not in result.stderr


def test_constrained_logprobs_are_finite_numbers(server: ServerProcess) -> None:
    """Forbidden tokens have -inf logprobs, which JSON cannot carry: responses clamp them to
    -9999.0, as vLLM does, instead of sending null."""
    client = server.client()
    completion = client.completions.create(
        model="tiny",
        prompt="Yes or no?",
        max_tokens=4,
        logprobs=5,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert completion.choices[0].text in ("yes", "no")
    logprobs = completion.choices[0].logprobs
    values = [v for top in logprobs.top_logprobs for v in top.values()]
    values += logprobs.token_logprobs
    assert values and all(isinstance(v, float) and v >= -9999.0 for v in values)
    chat = client.chat.completions.create(
        model="tiny",
        messages=CHAT,
        max_tokens=4,
        logprobs=True,
        top_logprobs=5,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    content = chat.choices[0].logprobs.content
    assert all(t.logprob >= -9999.0 for t in content)
    assert all(isinstance(top.logprob, float) for t in content for top in t.top_logprobs)


#: the hermes call the model is made to write (``guided_choice`` allows only this text; a
#: choice constraint leaves the reasoning parser out, so the tool parser reads all of it)
HERMES_CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}'
    "\n</tool_call>"
)


def test_tool_call_arguments_stream_in_openai_shape(server: ServerProcess) -> None:
    """The call streams as OpenAI's do (a first delta with id, type and name, then pieces of
    the arguments), and the official client's stream helper puts together exactly the
    non-streamed message."""
    from openai.lib.streaming.chat import ChatCompletionStreamState

    client = server.client()
    kwargs: dict[str, Any] = {"model": "tiny", "messages": CHAT, "tools": TOOLS}
    kwargs |= {"max_tokens": 200, "temperature": 0, "extra_body": {"guided_choice": [HERMES_CALL]}}
    response = client.chat.completions.create(**kwargs)
    [choice] = response.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [whole] = choice.message.tool_calls
    assert whole.function.name == "get_weather"
    assert json.loads(whole.function.arguments) == {"city": "Paris", "days": [1, 2]}

    state = ChatCompletionStreamState()
    items = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        state.handle_chunk(chunk)
        for c in chunk.choices:
            items += c.delta.tool_calls or []
    first, *rest = items
    assert (first.index, first.type, first.function.name) == (0, "function", "get_weather")
    assert first.id.startswith("call_")
    assert len(rest) > 3, "the arguments come in pieces"
    assert all(i.index == 0 and i.id is None and i.function.name is None for i in rest)
    [streamed] = state.get_final_completion().choices
    assert streamed.finish_reason == "tool_calls" and not streamed.message.content
    [call] = streamed.message.tool_calls
    assert (call.function.name, call.function.arguments) == (
        whole.function.name,
        whole.function.arguments,
    )

    # the stream helper of the client, with its events
    with client.chat.completions.stream(**kwargs) as stream:
        pieces = [
            e.arguments_delta for e in stream if e.type == "tool_calls.function.arguments.delta"
        ]
        final = stream.get_final_completion()
    assert "".join(pieces) == whole.function.arguments and len(pieces) > 3
    assert final.choices[0].message.tool_calls[0].function.arguments == whole.function.arguments
