"""``/v1/responses`` (OpenAI's Responses API), driven by the official ``openai`` client.

Most tests run the app in-process over the fake engine (tests/fake_engine.py: it records the
prompt ids it is sent, and with ``script`` writes that text a character per step), which
shows what the route sends the engine: the same prompt as ``/v1/chat/completions`` for the
same messages, the earlier turns for ``previous_response_id``, the structured-output
constraint of ``text.format`` and forced tool calls. The last test runs a real ``chassis
serve`` on a tiny random Llama and compares greedy text with the chat route's.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_engine import FakeAsyncLLM
from fastapi.testclient import TestClient
from server_process import ServerProcess, running_server

from chassis.serve.app import build_app
from chassis.serve.responses_store import ResponseStore, StoredResponse
from chassis.serve.settings import ServerSettings

openai = pytest.importorskip("openai")

MODEL = "fake-model"
THOUGHT = "<think>\nThe user wants the weather.\n</think>\n\n"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
PARSERS = ServerSettings(
    enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3"
)


class Server:
    """An app over a fake engine, with the HTTP client and the ``openai`` client on it."""

    def __init__(self, http: TestClient, engine: FakeAsyncLLM) -> None:
        self.http = http
        self.engine = engine
        self.client = openai.OpenAI(
            base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0
        )

    @property
    def last_prompt(self) -> list[int]:
        """The prompt ids of the engine's latest request."""
        return self.engine.requests[-1][1]

    def chat_prompt(self, messages: list[dict[str, Any]], **fields: Any) -> list[int]:
        """The prompt ids ``/v1/chat/completions`` renders for ``messages``."""
        body = {"messages": messages, **fields}
        response = self.http.post("/tokenize", json=body)
        assert response.status_code == 200, response.text
        return response.json()["tokens"]


def serve(script: str | None, settings: ServerSettings | None = None) -> Iterator[Server]:
    engine = FakeAsyncLLM(script=script)
    with TestClient(build_app(engine, settings or ServerSettings())) as http:
        yield Server(http, engine)


@pytest.fixture
def server() -> Iterator[Server]:
    yield from serve("Hello there!")


@pytest.fixture
def tool_server() -> Iterator[Server]:
    yield from serve(THOUGHT + "Checking.\n" + CALL, PARSERS)


def without_ids(items: list[Any]) -> list[dict[str, Any]]:
    """Output items as plain dicts without their random ids (the SDK's parsed extras
    dropped), to compare two responses' outputs."""
    keep = ("type", "role", "status", "content", "name", "arguments", "summary")
    out = []
    for item in items:
        data = item.model_dump(exclude_none=True)
        entry = {k: data[k] for k in keep if k in data}
        if "content" in entry:
            entry["content"] = [{"type": p["type"], "text": p["text"]} for p in entry["content"]]
        out.append(entry)
    return out


# -- one turn ------------------------------------------------------------------------------------


def test_a_response_is_the_chat_completion_of_the_same_messages(server: Server) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Answer in English."},
        {"role": "user", "content": "Say hello."},
    ]
    chat = server.client.chat.completions.create(model=MODEL, messages=messages)
    chat_prompt = server.last_prompt
    response = server.client.responses.create(
        model=MODEL,
        instructions="Be brief.",
        input=[
            {"role": "developer", "content": "Answer in English."},  # as chat: not system
            {"role": "user", "content": [{"type": "input_text", "text": "Say hello."}]},
        ],
        temperature=0.5,
        top_p=0.9,
        metadata={"k": "v"},
        extra_body={"top_k": 7, "seed": 3},
    )
    assert server.last_prompt == chat_prompt == server.chat_prompt(messages)
    params = server.engine.requests[-1][2]
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (0.5, 0.9, 7, 3)

    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "completed" and response.incomplete_details is None
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.status == "completed"
    assert [(p.type, p.text, p.annotations) for p in message.content] == [
        ("output_text", "Hello there!", [])
    ]
    assert response.output_text == chat.choices[0].message.content == "Hello there!"
    usage = response.usage
    assert usage.input_tokens == chat.usage.prompt_tokens == len(chat_prompt)
    assert usage.output_tokens == chat.usage.completion_tokens == len("Hello there!")
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens == 0
    assert usage.output_tokens_details.reasoning_tokens == 0
    # the request's settings are echoed
    assert response.instructions == "Be brief." and response.metadata == {"k": "v"}
    assert (response.temperature, response.top_p, response.model) == (0.5, 0.9, MODEL)
    assert response.tools == [] and response.tool_choice == "auto"
    assert response.store is True and response.parallel_tool_calls is True


def test_max_output_tokens_makes_the_response_incomplete(server: Server) -> None:
    response = server.client.responses.create(model=MODEL, input="Hi", max_output_tokens=4)
    assert server.engine.requests[-1][2].max_tokens == 4
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == "Hell" and response.output[0].status == "incomplete"
    assert response.usage.output_tokens == 4

    events = list(
        server.client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, stream=True)
    )
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.output_text == "Hell"


def test_streamed_events_add_up_to_the_response(server: Server) -> None:
    whole = server.client.responses.create(model=MODEL, input="Hi")
    events = list(server.client.responses.create(model=MODEL, input="Hi", stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) == len("Hello there!")  # one per step, as generated
    item_id = events[2].item.id
    assert {e.item_id for e in events if hasattr(e, "item_id")} == {item_id}
    final = events[-1].response
    assert "".join(deltas) == events[-4].text == final.output_text == whole.output_text
    assert final.id == events[0].response.id and final.output[0].id == item_id
    assert without_ids(final.output) == without_ids(whole.output)
    assert final.usage.output_tokens == whole.usage.output_tokens

    # the SDK's stream helper puts the same response together
    with server.client.responses.stream(model=MODEL, input="Hi") as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        helped = stream.get_final_response()
    assert text == helped.output_text == whole.output_text


# -- tools and reasoning ----------------------------------------------------------------------


def test_reasoning_and_tool_calls_become_items(tool_server: Server) -> None:
    client = tool_server.client
    response = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER])
    assert [item.type for item in response.output] == ["reasoning", "message", "function_call"]
    reasoning, message, call = response.output
    assert reasoning.id.startswith("rs_") and reasoning.summary == []
    assert [(p.type, p.text) for p in reasoning.content] == [
        ("reasoning_text", "The user wants the weather.")
    ]
    assert message.id.startswith("msg_") and response.output_text == "Checking."
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert response.status == "completed"
    reasoning_tokens = response.usage.output_tokens_details.reasoning_tokens
    assert reasoning_tokens == len("The user wants the weather.")  # a byte per token
    assert [t.name for t in response.tools] == ["get_weather"]
    # the chat template got the tools in the chat shape, as the chat route sends them
    chat_tools = [
        {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
    ]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    assert tool_server.last_prompt == tool_server.chat_prompt(messages, tools=chat_tools)

    events = list(
        client.responses.create(
            model=MODEL, input="Weather in Paris?", tools=[WEATHER], stream=True
        )
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert events[-1].type == "response.completed"
    assert without_ids(final.output) == without_ids(response.output)
    reasoning_deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(reasoning_deltas) == "The user wants the weather."
    arguments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(arguments) > 5  # streamed as written
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert "".join(arguments) == done.arguments == final.output[2].arguments
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["reasoning", "message", "function_call"]

    with client.responses.stream(model=MODEL, input="Weather?", tools=[WEATHER]) as stream:
        helped = stream.get_final_response()
    assert without_ids(helped.output) == without_ids(response.output)


def test_whitespace_before_a_call_is_no_message_streamed_or_not() -> None:
    for server in serve("\n\n" + CALL, PARSERS):
        kwargs = {"model": MODEL, "input": "Weather?", "tools": [WEATHER]}
        response = server.client.responses.create(**kwargs)
        assert [item.type for item in response.output] == ["function_call"]
        events = list(server.client.responses.create(stream=True, **kwargs))
        added = [e.item.type for e in events if e.type == "response.output_item.added"]
        assert added == ["function_call"]
        assert without_ids(events[-1].response.output) == without_ids(response.output)


def test_function_call_output_continues_the_conversation(tool_server: Server) -> None:
    client = tool_server.client
    first = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER])
    call = first.output[2]
    second = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "22 C"}],
        tools=[WEATHER],
    )
    assert second.previous_response_id == first.id
    # the same prompt as a chat request carrying the whole exchange
    chat_tools = [
        {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
    ]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "The user wants the weather.",
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "22 C"},
    ]
    assert tool_server.last_prompt == tool_server.chat_prompt(messages, tools=chat_tools)

    # the same conversation sent whole (the first response's output items as input)
    items = [{"role": "user", "content": "Weather in Paris?"}]
    items += [item.model_dump(exclude_none=True) for item in first.output]
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": "22 C"})
    client.responses.create(model=MODEL, input=items, tools=[WEATHER], store=False)
    assert tool_server.last_prompt == tool_server.chat_prompt(messages, tools=chat_tools)


def test_forced_tool_choice_constrains_the_output() -> None:
    for server in serve('{"city": "Paris"}'):
        response = server.client.responses.create(
            model=MODEL,
            input="Weather?",
            tools=[WEATHER],
            tool_choice={"type": "function", "name": "get_weather"},
        )
        constraint = server.engine.requests[-1][2].structured_outputs
        assert json.loads(constraint.json) == {**WEATHER["parameters"]}
        [call] = response.output
        assert call.type == "function_call" and call.name == "get_weather"
        assert json.loads(call.arguments) == {"city": "Paris"}
        assert response.tool_choice.name == "get_weather"


def test_text_format_maps_to_structured_outputs(server: Server) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}
    response = server.client.responses.create(model=MODEL, input="x", text={"format": fmt})
    assert json.loads(server.engine.requests[-1][2].structured_outputs.json) == schema
    assert response.text.format.type == "json_schema" and response.text.format.name == "thing"
    server.client.responses.create(model=MODEL, input="x", text={"format": {"type": "json_object"}})
    assert server.engine.requests[-1][2].structured_outputs.json_object
    server.client.responses.create(model=MODEL, input="x", text={"format": {"type": "text"}})
    assert server.engine.requests[-1][2].structured_outputs is None


# -- the store -----------------------------------------------------------------------------------


def test_previous_response_id_continues_and_retrieve_returns_it(server: Server) -> None:
    client = server.client
    first = client.responses.create(model=MODEL, input="Say hello.", instructions="Be brief.")
    first_prompt = server.last_prompt
    second = client.responses.create(model=MODEL, input="Again.", previous_response_id=first.id)
    # the earlier turn is in the prompt; its instructions are not carried over (OpenAI's rule)
    messages = [
        {"role": "user", "content": "Say hello."},
        {"role": "assistant", "content": "Hello there!"},
        {"role": "user", "content": "Again."},
    ]
    assert server.last_prompt == server.chat_prompt(messages)
    without_system = server.chat_prompt(messages[:1])
    assert len(first_prompt) > len(without_system)  # the instructions were in the first
    grown = len(server.chat_prompt(messages)) - len(without_system)
    assert second.usage.input_tokens == len(without_system) + grown
    assert second.instructions is None

    third = client.responses.create(
        model=MODEL, input="Once more.", previous_response_id=second.id, instructions="Shout."
    )
    messages = [{"role": "system", "content": "Shout."}, *messages]
    messages += [
        {"role": "assistant", "content": "Hello there!"},
        {"role": "user", "content": "Once more."},
    ]
    assert server.last_prompt == server.chat_prompt(messages)
    assert third.usage.input_tokens == len(server.last_prompt)

    got = client.responses.retrieve(first.id)
    assert got.model_dump() == first.model_dump()
    streamed = list(client.responses.create(model=MODEL, input="Hi", stream=True))
    assert client.responses.retrieve(streamed[-1].response.id).output_text == "Hello there!"

    replay = server.http.get(f"/v1/responses/{first.id}", params={"stream": "true"})
    assert replay.status_code == 400 and replay.json()["error"]["param"] == "stream"

    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_store_false_keeps_nothing(server: Server) -> None:
    response = server.client.responses.create(model=MODEL, input="Hi", store=False)
    assert response.store is False
    missing = server.http.get(f"/v1/responses/{response.id}")
    assert missing.status_code == 404
    assert missing.json()["error"]["param"] == "response_id"
    body = {"input": "more", "previous_response_id": response.id}
    unknown = server.http.post("/v1/responses", json=body)
    assert unknown.status_code == 404
    error = unknown.json()["error"]
    assert error["param"] == "previous_response_id" and error["type"] == "not_found_error"
    assert response.id in error["message"]


def test_the_store_drops_the_least_recently_used() -> None:
    store = ResponseStore(max_responses=2)
    for name in ("a", "b"):
        store.put(name, StoredResponse({"id": name}, []))
    assert store.get("a") is not None  # now the most recently used
    store.put("c", StoredResponse({"id": "c"}, []))
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2
    with pytest.raises(ValueError, match="room"):
        ResponseStore(0)


def test_a_bad_store_size_stops_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHASSIS_RESPONSES_STORE_SIZE", "0")
    with pytest.raises(ValueError, match="CHASSIS_RESPONSES_STORE_SIZE"):
        build_app(FakeAsyncLLM(), ServerSettings())
    monkeypatch.setenv("CHASSIS_RESPONSES_STORE_SIZE", "3")
    assert build_app(FakeAsyncLLM(), ServerSettings()).state.responses_store.max_responses == 3


def test_the_app_store_is_bounded(server: Server) -> None:
    server.http.app.state.responses_store = ResponseStore(max_responses=1)
    first = server.client.responses.create(model=MODEL, input="a")
    server.client.responses.create(model=MODEL, input="b")
    with pytest.raises(openai.NotFoundError):
        server.client.responses.retrieve(first.id)


def test_retrieve_honours_include_as_create_does(server: Server) -> None:
    # the values about items this server never makes (built-in tools, images) add nothing:
    # accepted by create, retrieve and input_items alike, the response unchanged
    nothing = ["file_search_call.results", "message.input_image.image_url"]
    created = server.client.responses.create(model=MODEL, input="Hi", include=nothing)  # type: ignore[list-item]
    plain = server.client.responses.retrieve(created.id)
    included = server.client.responses.retrieve(created.id, include=nothing)  # type: ignore[arg-type]
    assert included.model_dump() == plain.model_dump() == created.model_dump()
    # what the server neither makes nor keeps is a 400 saying why, on each of them
    calls = (
        lambda value: server.client.responses.create(model=MODEL, input="Hi", include=[value]),
        lambda value: server.client.responses.retrieve(created.id, include=[value]),
        lambda value: server.client.responses.input_items.list(created.id, include=[value]),
    )
    for value, why in [("reasoning.encrypted_content", "encrypt")]:
        for call in calls:
            with pytest.raises(openai.BadRequestError) as info:
                call(value)
            error = info.value.body
            assert error["param"] == "include" and why in error["message"], error
    # an unknown value is a 400 in OpenAI's shape listing the values, however it is sent
    url = f"/v1/responses/{created.id}"
    for params in ({"include": "bogus"}, {"include[]": "bogus"}):
        reply = server.http.get(url, params=params)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == "include"
        assert "'bogus'" in error["message"] and "message.output_text.logprobs" in error["message"]
    reply = server.http.post(
        "/v1/responses", json={"model": MODEL, "input": "Hi", "include": ["x"]}
    )
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "include"
    # checked before the id is looked up, as input_items does
    reply = server.http.get("/v1/responses/resp_unknown", params={"include": "bogus"})
    assert reply.status_code == 400


# -- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"background": True, "store": False}, "background"),
        ({"truncation": "auto"}, "truncation"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools.0.name"),
        ({"tools": [WEATHER], "tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": -1, "include": ["message.output_text.logprobs"]}, "top_logprobs"),
        ({"n": 2}, "n"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"text": {"format": {"type": "xml"}}}, "text.format"),
        ({"input": []}, "input"),
        (
            # (the fake engine takes no images; tests/test_responses_images.py: real ones)
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input.0.content.0",
        ),
        ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
        ({"input": [{"role": ["user"], "content": "x"}]}, "input.0.role"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.0.call_id"),
        ({"temperature": -1}, "temperature"),
        ({"max_output_tokens": 10_000}, None),
        # OpenAI's requirements: a json_schema format names its schema, an output answers a call
        ({"text": {"format": {"type": "json_schema"}}}, "text.format"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
        (
            {"input": [{"type": "function_call_output", "call_id": "call_9", "output": "1"}]},
            "input.0.call_id",
        ),
    ],
)
def test_what_is_not_supported_is_a_400_naming_the_field(
    server: Server, fields: dict[str, Any], param: str | None
) -> None:
    body = {"model": MODEL, "input": "Hi", **fields}
    response = server.http.post("/v1/responses", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param
    assert server.engine.requests == []


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        # Responses' tool_choice is flat: no mention of the chat shape's 'function' level
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "'name': ...}"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": 5}}},
            "text.format.schema ",
        ),
    ],
)
def test_400s_describe_the_responses_shapes(
    server: Server, fields: dict[str, Any], expected: str
) -> None:
    response = server.http.post("/v1/responses", json={"model": MODEL, "input": "Hi", **fields})
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert expected in message and "json_schema.schema" not in message
    assert "'function': {" not in message


def test_a_reasoning_item_without_text_parts_gives_no_reasoning(server: Server) -> None:
    items = [{"type": "reasoning", "content": 5, "summary": "x"}, {"role": "user", "content": "Hi"}]
    response = server.http.post("/v1/responses", json={"model": MODEL, "input": items})
    assert response.status_code == 200, response.text
    assert server.last_prompt == server.chat_prompt([{"role": "user", "content": "Hi"}])


def test_the_client_raises_bad_request(server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        server.client.responses.create(model=MODEL, input="Hi", background=True, store=False)
    assert info.value.body["param"] == "background"
    with pytest.raises(openai.NotFoundError):
        server.client.responses.create(model="other-model", input="Hi")


def test_an_engine_failure_mid_stream_is_an_error_event(server: Server) -> None:
    server.engine.die_after_steps = 3
    events = list(server.client.responses.create(model=MODEL, input="Hi", stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2].code == "engine_dead" and "not running" in events[-2].message
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.code == "server_error"
    assert failed.output_text == "He"  # what was streamed before the failure


def test_a_request_the_engine_fails_mid_stream_is_invalid_prompt_or_server_error(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the engine core ends one request alone (RequestFailedError after its first output): the
    # response's error code says whose fault, as a background response's does
    from chassis.core.errors import RequestFailedError
    from chassis.core.request import RequestError

    generate = server.engine.generate
    client_error = [True]

    async def failing(*args: Any, **kwargs: Any) -> Any:
        async for output in generate(*args, **kwargs):
            yield output
            raise RequestFailedError(RequestError(message="why", client_error=client_error[0]))

    monkeypatch.setattr(server.engine, "generate", failing)
    for client_error[0], code in ((True, "invalid_prompt"), (False, "server_error")):
        events = list(server.client.responses.create(model=MODEL, input="Hi", stream=True))
        assert [e.type for e in events[-2:]] == ["error", "response.failed"]
        assert events[-2].code == "request_failed" and events[-2].message == "why"
        failed = events[-1].response
        assert failed.status == "failed" and failed.error.code == code
        assert failed.error.message == "why" and failed.output_text == "H"


# -- a real model --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    with running_server(tiny_llama_dir, tmp_path_factory.mktemp("serve")) as server:
        yield server


def test_greedy_text_equals_the_chat_routes_on_a_real_model(real_server: ServerProcess) -> None:
    client = real_server.client()
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    chat = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, temperature=0
    )
    response = client.responses.create(
        model="tiny",
        instructions="You are terse.",
        input="What is the capital of France?",
        max_output_tokens=12,
        temperature=0,
    )
    text = chat.choices[0].message.content
    assert text and response.output_text == text
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    expected = "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    assert response.status == expected

    events = list(
        client.responses.create(
            model="tiny",
            instructions="You are terse.",
            input="What is the capital of France?",
            max_output_tokens=12,
            temperature=0,
            stream=True,
        )
    )
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == text == events[-1].response.output_text

    follow = client.responses.create(
        model="tiny", input="And of Spain?", previous_response_id=response.id, max_output_tokens=4
    )
    turns = [*messages[1:], {"role": "assistant", "content": text}]
    turns.append({"role": "user", "content": "And of Spain?"})
    ids = httpx_tokenize(real_server, turns)
    assert follow.usage.input_tokens == len(ids)


def test_greedy_logprobs_equal_the_chat_routes_on_a_real_model(
    real_server: ServerProcess,
) -> None:
    # each request its own cache salt: every prompt is computed whole, as the first was
    client = real_server.client()
    salts = iter(range(100))

    def fields() -> dict[str, Any]:
        return {"temperature": 0, "extra_body": {"cache_salt": f"logprobs-{next(salts)}"}}

    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=8,
        logprobs=True,
        top_logprobs=3,
        **fields(),
    )
    assert chat.choices[0].logprobs is not None and chat.choices[0].logprobs.content
    expected = [e.model_dump() for e in chat.choices[0].logprobs.content]
    include: Any = ["message.output_text.logprobs"]
    asked = {"model": "tiny", "input": "Name a colour.", "max_output_tokens": 8}
    asked.update(include=include, top_logprobs=3)

    def logprobs(response: Any) -> list[dict[str, Any]]:
        message = next(item for item in response.output if item.type == "message")
        return [e.model_dump() for e in message.content[0].logprobs]

    response = client.responses.create(**asked, **fields())
    assert response.output_text == chat.choices[0].message.content
    assert logprobs(response) == expected

    events = list(client.responses.create(**asked, stream=True, **fields()))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert [e.model_dump() for d in deltas for e in d.logprobs] == expected
    assert logprobs(events[-1].response) == expected

    background = client.responses.create(**asked, background=True, **fields())
    for _ in range(600):
        stored = client.responses.retrieve(background.id, include=include)
        if stored.status not in ("queued", "in_progress"):
            break
        time.sleep(0.05)
    assert logprobs(stored) == expected
    assert logprobs(client.responses.retrieve(background.id)) == []


def test_cancel_aborts_the_engine_request_on_a_real_model(real_server: ServerProcess) -> None:
    client = real_server.client()
    generated_before = real_server.metric("chassis:generation_tokens_total")
    response = client.responses.create(
        model="tiny",
        input="Count to a thousand.",
        max_output_tokens=200,
        background=True,
        extra_body={"ignore_eos": True},
    )
    assert response.status in ("queued", "in_progress")
    cancelled = client.responses.cancel(response.id)
    assert cancelled.status == "cancelled"
    # the engine dropped the request and freed its KV blocks, long before 200 tokens
    metrics = real_server.wait_idle()
    generated = metrics["chassis:generation_tokens_total"] - generated_before
    assert generated < 200, f"{generated} tokens generated: the request was not aborted"
    assert client.responses.retrieve(response.id).status == "cancelled"
    assert client.responses.cancel(response.id).status == "cancelled"


def test_a_background_stream_resumes_after_a_disconnect(real_server: ServerProcess) -> None:
    client = real_server.client()
    fields = {"model": "tiny", "input": "Hello", "max_output_tokens": 24, "temperature": 0}
    first: list[Any] = []
    with client.responses.create(**fields, background=True, stream=True) as stream:
        for event in stream:
            first.append(event)
            if len(first) == 4:
                break  # the connection closes; the response goes on in the server
    response_id = first[0].response.id
    rest = list(client.responses.retrieve(response_id, stream=True, starting_after=3))
    events = first + rest
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.status in ("completed", "incomplete") and final.background is True
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    plain = client.responses.create(**fields)
    assert "".join(deltas) == final.output_text == plain.output_text
    real_server.wait_idle()


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"max_output_tokens": 10_000}, "maximum context length"),
        ({"input": "word " * 300}, "maximum context length"),  # the prompt alone
        ({"stop_token_ids": [1_000_000]}, "out of the vocabulary"),
        ({"allowed_token_ids": [1_000_000]}, "allowed_token_ids"),
        ({"priority": 1}, "--scheduler priority"),
        ({"cache_salt": ""}, "cache_salt"),
    ],
)
def test_what_the_engine_refuses_is_a_400_before_a_background_response_on_a_real_model(
    real_server: ServerProcess, fields: dict[str, Any], says: str
) -> None:
    # the engine's input processor refuses these when the request starts; a background
    # response runs its checks before it answers: the same 400, nothing queued or stored
    import httpx

    url = real_server.base + "/v1/responses"
    body = {"model": "tiny", "input": "Hello", **fields}
    plain = httpx.post(url, json=body, headers=real_server.headers, timeout=30)
    assert plain.status_code == 400, plain.text
    assert says in plain.json()["error"]["message"], plain.text
    for stream in (False, True):
        background = {**body, "background": True, "stream": stream}
        refused = httpx.post(url, json=background, headers=real_server.headers, timeout=30)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"] == plain.json()["error"]
    real_server.wait_idle()


def httpx_tokenize(server: ServerProcess, messages: list[dict[str, Any]]) -> list[int]:
    import httpx

    response = httpx.post(
        f"{server.base}/tokenize", json={"messages": messages}, headers=server.headers
    )
    assert response.status_code == 200, response.text
    return response.json()["tokens"]
