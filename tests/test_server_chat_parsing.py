"""``/v1/chat/completions`` with ``--reasoning-parser`` and ``--enable-auto-tool-choice
--tool-call-parser``: the routes against the fake engine (tests/fake_engine.py), which writes
a scripted message one character per step, so every streamed chunk boundary is exercised.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
from fake_engine import FakeAsyncLLM
from fastapi.testclient import TestClient
from test_server_lifecycle import AsgiCall, wait_until
from test_server_routes import assert_error, sse_events

from chassis.plugins.registry import UnknownNameError
from chassis.serve.app import build_app, get_state
from chassis.serve.settings import ServerSettings

CHAT = [{"role": "user", "content": "Weather in Paris?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
THOUGHT = "<think>\nThe user wants the weather.\n</think>\n\n"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
BOTH = ServerSettings(
    enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3"
)


def client_for(script: str, settings: ServerSettings) -> Iterator[TestClient]:
    with TestClient(build_app(FakeAsyncLLM(script=script), settings)) as client:
        yield client


@pytest.fixture
def tool_client() -> Iterator[TestClient]:
    yield from client_for(THOUGHT + "Checking.\n" + CALL, BOTH)


def chat(client: TestClient, **fields: Any) -> Any:
    return client.post("/v1/chat/completions", json={"messages": CHAT, **fields})


def streamed_calls(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The calls of one choice's streamed deltas, put together as an OpenAI client does,
    after checking their shape: a call's first item has ``index``, ``id``, ``type`` and
    ``function.name``; later items only ``index`` and ``function.arguments``."""
    calls: list[dict[str, Any]] = []
    for delta in deltas:
        for item in delta.get("tool_calls") or []:
            if item["index"] == len(calls):  # a new call
                assert set(item) == {"index", "id", "type", "function"}, item
                assert item["type"] == "function" and set(item["function"]) == {
                    "name",
                    "arguments",
                }
                calls.append({k: item[k] for k in ("id", "type")} | {"function": item["function"]})
            else:
                assert item == {"index": len(calls) - 1, "function": item["function"]}, item
                assert set(item["function"]) == {"arguments"}
                function = calls[-1]["function"]
                calls[-1]["function"] = function | {
                    "arguments": function["arguments"] + item["function"]["arguments"]
                }
    return calls


def calls_content_finish(response: Any, stream: bool) -> tuple[list[dict[str, Any]], str, str]:
    """The calls, content and finish reason of a one-choice response, streamed or not."""
    if stream:
        deltas = [e["choices"][0] for e in sse_events(response.text) if e["choices"]]
        calls = streamed_calls([d["delta"] for d in deltas])
        content = "".join(d["delta"].get("content") or "" for d in deltas)
        return calls, content, deltas[-1]["finish_reason"]
    [choice] = response.json()["choices"]
    message = choice["message"]
    return message["tool_calls"], message["content"] or "", choice["finish_reason"]


def test_reasoning_and_a_tool_call_in_one_message(tool_client: TestClient) -> None:
    response = chat(tool_client, tools=TOOLS)
    assert response.status_code == 200, response.text
    [choice] = response.json()["choices"]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["reasoning"] == "The user wants the weather."
    assert message["content"] == "Checking."
    [tool_call] = message["tool_calls"]
    assert tool_call["type"] == "function" and tool_call["id"].startswith("call_")
    assert tool_call["function"]["name"] == "get_weather"
    assert json.loads(tool_call["function"]["arguments"]) == {"city": "Paris"}


def test_streamed_deltas_add_up_to_the_message(tool_client: TestClient) -> None:
    whole = chat(tool_client, tools=TOOLS).json()["choices"][0]["message"]
    events = sse_events(chat(tool_client, tools=TOOLS, stream=True).text)
    deltas = [event["choices"][0] for event in events if event["choices"]]
    assert deltas[0]["delta"] == {"role": "assistant", "content": ""}
    reasoning = "".join(d["delta"].get("reasoning", "") for d in deltas)
    content = "".join(d["delta"].get("content", "") for d in deltas)
    calls = streamed_calls([d["delta"] for d in deltas])
    assert (reasoning, content) == (whole["reasoning"], whole["content"])
    [streamed_call] = calls
    assert streamed_call["id"].startswith("call_")
    assert streamed_call["function"] == whole["tool_calls"][0]["function"]
    # the arguments stream as they are written, not all at the end
    assert sum(1 for d in deltas for _ in d["delta"].get("tool_calls", [])) > 5
    # reasoning streams as it is written, not all at the end
    assert sum(1 for d in deltas if "reasoning" in d["delta"]) > 5
    assert deltas[-1]["finish_reason"] == "tool_calls"
    assert all(d["finish_reason"] is None for d in deltas[:-1])


def test_several_choices_each_get_their_calls(tool_client: TestClient) -> None:
    body = chat(tool_client, tools=TOOLS, n=2, stream=True)
    events = sse_events(body.text)
    deltas: dict[int, list[Any]] = {0: [], 1: []}
    for event in events:
        for choice in event["choices"]:
            deltas[choice["index"]].append(choice["delta"])
    calls = {i: streamed_calls(deltas[i]) for i in (0, 1)}
    assert [len(calls[0]), len(calls[1])] == [1, 1]
    assert calls[0][0]["id"] != calls[1][0]["id"]


def test_tool_choice_none_or_no_tools_leaves_the_call_as_text(tool_client: TestClient) -> None:
    for fields in ({"tools": TOOLS, "tool_choice": "none"}, {}):
        [choice] = chat(tool_client, **fields).json()["choices"]
        assert choice["finish_reason"] == "stop"
        assert choice["message"]["content"] == "Checking.\n" + CALL
        assert choice["message"]["tool_calls"] == []
        assert choice["message"]["reasoning"] == "The user wants the weather."


def test_several_choices_non_streamed(tool_client: TestClient) -> None:
    choices = chat(tool_client, tools=TOOLS, n=2).json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    for choice in choices:
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["reasoning"] == "The user wants the weather."
        assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert (
        choices[0]["message"]["tool_calls"][0]["id"] != choices[1]["message"]["tool_calls"][0]["id"]
    )


def test_logprobs_stream_while_the_parsers_hold_text(tool_client: TestClient) -> None:
    events = sse_events(chat(tool_client, tools=TOOLS, stream=True, logprobs=True).text)
    choices = [event["choices"][0] for event in events if event["choices"]][1:]
    # one character, one token per step: every token's logprob is sent, held text or not
    tokens = [t["token"] for c in choices for t in (c["logprobs"] or {}).get("content", [])]
    assert "".join(tokens) == THOUGHT + "Checking.\n" + CALL
    assert any(c["delta"] == {} and c["logprobs"] for c in choices)


def test_include_reasoning_false(tool_client: TestClient) -> None:
    message = chat(tool_client, include_reasoning=False).json()["choices"][0]["message"]
    assert "reasoning" not in message and message["content"].startswith("Checking.")
    events = sse_events(chat(tool_client, include_reasoning=False, stream=True).text)
    deltas = [event["choices"][0]["delta"] for event in events if event["choices"]]
    assert not any("reasoning" in delta for delta in deltas)
    assert "".join(d.get("content", "") for d in deltas) == message["content"]
    # generation ended inside the (dropped) reasoning: null content, as when it is sent
    cut = chat(tool_client, include_reasoning=False, max_tokens=12).json()["choices"][0]
    assert cut["message"]["content"] is None and cut["finish_reason"] == "length"


def test_a_message_of_only_calls_has_null_content() -> None:
    for client in client_for(CALL + "\n", BOTH):
        message = chat(client, tools=TOOLS).json()["choices"][0]["message"]
        assert message["content"] is None and len(message["tool_calls"]) == 1


def test_a_call_cut_by_max_tokens_stays_text_and_length() -> None:
    for client in client_for(CALL, BOTH):
        [choice] = chat(client, tools=TOOLS, max_tokens=20).json()["choices"]
        assert choice["finish_reason"] == "length"
        assert choice["message"]["content"] == CALL[:20]
        assert choice["message"]["tool_calls"] == []


def test_without_parsers_calls_are_text_and_auto_needs_the_flags() -> None:
    for client in client_for(THOUGHT + CALL, ServerSettings()):
        # absent tool_choice: the tools only reach the template
        [choice] = chat(client, tools=TOOLS).json()["choices"]
        assert choice["message"] == {
            "role": "assistant",
            "content": THOUGHT + CALL,
            "tool_calls": [],
        }
        # an explicit "auto" cannot be honoured: a 400, as in vLLM
        assert_error(chat(client, tools=TOOLS, tool_choice="auto"), 400, "tool_choice")


def test_a_stream_cut_by_shutdown_sends_what_the_parsers_held() -> None:
    engine = FakeAsyncLLM(script="<b>bold</b>")
    engine.hold()  # one step ("<"), then nothing until the shutdown below

    async def scenario() -> str:
        app = build_app(engine, BOTH)
        call = AsgiCall(
            app, "/v1/chat/completions", {"messages": CHAT, "tools": TOOLS, "stream": True}
        )
        task = call.start()
        await wait_until(lambda: bool(get_state(app).inflight))
        await asyncio.sleep(0.05)
        await get_state(app).abort_all()
        await asyncio.wait_for(task, 5)
        return call.text

    events = sse_events(asyncio.run(scenario()))
    last = events[-1]["choices"][0]
    # "<" may start "<think>" or "<tool_call>": held by both parsers until the abort
    deltas = [event["choices"][0]["delta"] for event in events]
    assert "".join(d.get("content", "") for d in deltas) == "<"
    assert last["finish_reason"] == "abort"


NAMED = {"type": "function", "function": {"name": "get_weather"}}
FORCED_CASES = [
    # (tool_choice, what the constrained model writes, the calls expected)
    (
        "required",
        '[{"name": "get_weather", "parameters": {"city": "Paris"}}]',
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "required",
        '[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
        '{"name": "get_weather", "parameters": {"city": "Rome"}}]',
        [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})],
    ),
    (NAMED, '{"city": "Paris"}', [("get_weather", {"city": "Paris"})]),
]


@pytest.mark.parametrize("tool_choice,script,expected", FORCED_CASES)
@pytest.mark.parametrize("settings", [BOTH, ServerSettings()], ids=["parsers", "no-parsers"])
@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_choice_reads_the_calls_from_the_json(
    tool_choice: Any, script: str, expected: list, settings: ServerSettings, stream: bool
) -> None:
    """``required`` / a named function constrain the output to the calls' JSON (the fake
    engine writes that JSON); with or without a tool parser, even with a reasoning parser."""
    for client in client_for(script, settings):
        response = chat(client, tools=TOOLS, tool_choice=tool_choice, stream=stream)
        assert response.status_code == 200, response.text
        calls, content, finish = calls_content_finish(response, stream)
        assert [
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls
        ] == expected
        named = isinstance(tool_choice, dict)
        assert content == "" and finish == ("stop" if named else "tool_calls")
        assert all(c["id"].startswith("call_") for c in calls)


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_choice_cut_short(stream: bool) -> None:
    """JSON cut off by max_tokens after a call started: the call keeps the arguments written
    so far (finish_reason length), streamed or not; before: the text comes back as written."""
    cases = [
        (NAMED, '{"city": "Par', "", [("get_weather", '{"city": "Par')]),
        ("required", '[{"name": "get_weather", "parameters": {"ci', "", [("get_weather", '{"ci')]),
        ("required", '[{"name": "get_wea', '[{"name": "get_wea', []),
    ]
    for tool_choice, script, content, calls in cases:
        for client in client_for(script + "...", ServerSettings()):
            # the fake engine writes a character per token: cut right after ``script``
            response = chat(
                client, tools=TOOLS, tool_choice=tool_choice, stream=stream, max_tokens=len(script)
            )
            got_calls, got_content, finish = calls_content_finish(response, stream)
            assert finish == "length"
            assert got_content == content
            assert [(c["function"]["name"], c["function"]["arguments"]) for c in got_calls] == calls


def test_the_reasoning_parser_alone() -> None:
    settings = ServerSettings(reasoning_parser="deepseek_r1")
    for client in client_for("2+2 is 4.</think>The answer is 4.", settings):
        message = chat(client).json()["choices"][0]["message"]
        assert (message["reasoning"], message["content"]) == ("2+2 is 4.", "The answer is 4.")
        # truncated reasoning: no content at all
        message = chat(client, max_tokens=5).json()["choices"][0]["message"]
        assert (message["reasoning"], message["content"]) == ("2+2 i", None)


@pytest.mark.parametrize(("parser", "skip"), [("hermes", True), ("mistral", False)])
def test_a_parser_that_reads_special_tokens_gets_them(parser: str, skip: bool) -> None:
    settings = ServerSettings(enable_auto_tool_choice=True, tool_call_parser=parser)
    engine = FakeAsyncLLM(script="x")
    with TestClient(build_app(engine, settings)) as client:
        chat(client, tools=TOOLS)
        chat(client)  # no tools: no tool parsing, special tokens skipped as usual
    # hermes' tags are ordinary text; mistral's [TOOL_CALLS] is a special token
    assert [request[2].skip_special_tokens for request in engine.requests] == [skip, True]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (ServerSettings(reasoning_parser="nope"), "unknown reasoning parser 'nope'"),
        (ServerSettings(enable_auto_tool_choice=True, tool_call_parser="x"), "known: .*hermes"),
        (ServerSettings(enable_auto_tool_choice=True), "needs --tool-call-parser"),
    ],
)
def test_bad_parser_settings_fail_at_build(settings: ServerSettings, message: str) -> None:
    with pytest.raises((UnknownNameError, ValueError), match=message):
        build_app(FakeAsyncLLM(), settings)


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"tools": [{"type": "function"}]}, "tools.0.function", "non-empty string 'name'"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools.0.type", "must be 'function'"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "tools.0.function.parameters",
            "JSON Schema object",
        ),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "got 'sometimes'"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "'nope', which is not in tools",
        ),
        ({"tool_choice": "auto"}, "tool_choice", "only allowed when tools are given"),
    ],
)
def test_malformed_tools_and_tool_choice_are_named(
    tool_client: TestClient, fields: dict[str, Any], param: str, message: str
) -> None:
    error = assert_error(chat(tool_client, **fields), 400, param)
    assert message in error["message"]


def test_mistral_requests_get_ids_its_template_accepts() -> None:
    settings = ServerSettings(enable_auto_tool_choice=True, tool_call_parser="mistral")
    for client in client_for('[TOOL_CALLS][{"name": "get_weather", "arguments": {}}]', settings):
        [tool_call] = chat(client, tools=TOOLS).json()["choices"][0]["message"]["tool_calls"]
        assert len(tool_call["id"]) == 9 and tool_call["id"].isalnum()


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    two = CALL + "\n" + CALL.replace("Paris", "Rome")
    for client in client_for(two, BOTH):
        calls = chat(client, tools=TOOLS).json()["choices"][0]["message"]["tool_calls"]
        assert len(calls) == 2
        for stream in (False, True):
            response = chat(client, tools=TOOLS, parallel_tool_calls=False, stream=stream)
            if stream:
                events = sse_events(response.text)
                choices = [event["choices"][0] for event in events if event["choices"]]
                calls = streamed_calls([choice["delta"] for choice in choices])
                assert choices[-1]["finish_reason"] == "tool_calls"
            else:
                calls = response.json()["choices"][0]["message"]["tool_calls"]
            assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}]
