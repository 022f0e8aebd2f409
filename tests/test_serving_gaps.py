"""vLLM's behaviour where chassis's server used to differ: ``echo`` on chat completions, and
``truncate_prompt_tokens`` above the context (a 400) or ``-1`` (the last ``max_model_len``
tokens), on the routes against the fake engine (tests/fake_engine.py, context 256).

The input processor's side of truncation is in tests/test_input_output_processing.py, the
pooling side in tests/test_embeddings.py, a real server's in tests/test_server_e2e.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fake_engine import FakeAsyncLLM
from fastapi.testclient import TestClient
from fixtures_server import *  # noqa: F403
from test_server_chat_parsing import BOTH, CALL, THOUGHT, TOOLS, streamed_calls
from test_server_routes import assert_error, sse_events

from chassis.serve.app import build_app
from chassis.serve.errors import APIError
from chassis.serve.openai_embeddings import EmbeddingRequest

PREFIX = "The answer: "
#: an assistant message the model continues (vLLM's way to prefill a response)
CONTINUED = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": PREFIX}]
ECHO = {
    "messages": CONTINUED,
    "add_generation_prompt": False,
    "continue_final_message": True,
    "echo": True,
}


def chat(client: TestClient, **fields: Any) -> Any:
    response = client.post("/v1/chat/completions", json=fields)
    assert response.status_code == 200, response.text
    return response


def contents(response: Any) -> list[str | None]:
    return [c["message"]["content"] for c in response.json()["choices"]]


def streamed_contents(events: list[dict[str, Any]], n: int) -> list[str]:
    """Each choice's streamed content, put together."""
    out = [""] * n
    for event in events:
        for choice in event["choices"]:
            out[choice["index"]] += choice["delta"].get("content") or ""
    return out


# -- echo on chat -----------------------------------------------------------------------------


def test_chat_echo_starts_each_choice_with_the_continued_message(client: TestClient) -> None:
    response = chat(client, **ECHO, max_tokens=3, n=2)
    # the fake's choice i writes the letters from the i-th on
    assert contents(response) == [PREFIX + "abc", PREFIX + "bcd"]
    usage = response.json()["usage"]
    assert usage["completion_tokens"] == 6  # the echo is not generated
    without = chat(client, **(ECHO | {"echo": False}), max_tokens=3)
    assert contents(without) == ["abc"]


def test_chat_echo_only_repeats_a_message_of_the_responses_role(client: TestClient) -> None:
    # a user message last: the response's role (assistant) differs, nothing is echoed
    user_last = chat(client, messages=CONTINUED[:1], echo=True, max_tokens=2)
    assert contents(user_last) == ["ab"]
    # an assistant message last and a new assistant turn after it: echoed (vLLM's rule is
    # the role alone)
    assistant_last = chat(client, messages=CONTINUED, echo=True, max_tokens=2)
    assert contents(assistant_last) == [PREFIX + "ab"]
    # text parts are joined by newlines, as the template sees them
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    messages = [CONTINUED[0], {"role": "assistant", "content": parts}]
    body = ECHO | {"messages": messages}
    assert contents(chat(client, **body, max_tokens=1)) == ["one\ntwoa"]
    # an assistant message without content (only tool calls) echoes nothing
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [CONTINUED[0], {"role": "assistant", "content": None, "tool_calls": [call]}]
    assert contents(chat(client, messages=messages, echo=True, max_tokens=1)) == ["a"]


@pytest.mark.parametrize("return_token_ids", [False, True])
def test_chat_echo_streams_first_in_its_own_chunk(
    client: TestClient, return_token_ids: bool
) -> None:
    body = ECHO | {"max_tokens": 3, "n": 2, "return_token_ids": return_token_ids}
    whole = contents(chat(client, **body))
    usage = {"include_usage": True, "continuous_usage_stats": True}
    events = sse_events(chat(client, **body, stream=True, stream_options=usage).text)
    # one choice per chunk (vLLM's): the role chunks, then the echo chunks, before any
    # generated text
    role, role1, echo, echo1, *rest = events
    roles, echoes = [role, role1], [echo, echo1]
    assert [c["choices"] for c in roles] == [
        [{**role["choices"][0], "index": i, "delta": {"role": "assistant", "content": ""}}]
        for i in range(2)
    ]
    assert ("prompt_token_ids" in role) == return_token_ids
    assert "prompt_token_ids" not in role1
    assert [[(c["index"], c["delta"]) for c in e["choices"]] for e in echoes] == [
        [(0, {"content": PREFIX})],
        [(1, {"content": PREFIX})],
    ]
    assert all(
        c["finish_reason"] is None and "token_ids" not in c for e in echoes for c in e["choices"]
    )
    assert all("prompt_token_ids" not in e for e in echoes)
    assert all(e["usage"]["completion_tokens"] == 0 for e in echoes)
    assert echo["usage"]["prompt_tokens"] == role["usage"]["prompt_tokens"] > 0
    assert all(PREFIX not in (c["delta"].get("content") or "") for e in rest for c in e["choices"])
    assert streamed_contents(events, 2) == whole


def test_chat_echo_of_nothing_sends_no_echo_chunk(client: TestClient) -> None:
    body = {"messages": CONTINUED[:1], "echo": True, "max_tokens": 2, "stream": True}
    events = sse_events(chat(client, **body).text)
    assert events[1]["choices"][0]["delta"] == {"content": "a"}


def test_chat_echo_with_beam_search(client: TestClient) -> None:
    body = ECHO | {"use_beam_search": True, "n": 2, "max_tokens": 2, "temperature": 0}
    assert all(
        c.startswith(PREFIX) and len(c) == len(PREFIX) + 2 for c in contents(chat(client, **body))
    )


# -- echo with the parsers --------------------------------------------------------------------

#: an echo that would be a call or reasoning if it were parsed: vLLM puts it before the
#: parsed content as it is
RAW = "<think>no</think> <tool_call>{}</tool_call> "
WITH_TOOLS = {
    "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": RAW},
    ],
    "add_generation_prompt": False,
    "continue_final_message": True,
    "echo": True,
    "tools": TOOLS,
}


def parsed_client(script: str) -> Iterator[TestClient]:
    with TestClient(build_app(FakeAsyncLLM(script=script), BOTH)) as c:
        yield c


@pytest.fixture
def tool_client() -> Iterator[TestClient]:
    yield from parsed_client(THOUGHT + "Checking.\n" + CALL)


def test_chat_echo_goes_before_the_parsed_content_unparsed(tool_client: TestClient) -> None:
    [choice] = chat(tool_client, **WITH_TOOLS).json()["choices"]
    message = choice["message"]
    assert message["content"] == RAW + "Checking."
    assert message["reasoning"] == "The user wants the weather."  # only the generated one
    [call] = message["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert choice["finish_reason"] == "tool_calls"


def test_streamed_echo_with_parsers_adds_up_to_the_message(tool_client: TestClient) -> None:
    whole = chat(tool_client, **WITH_TOOLS).json()["choices"][0]["message"]
    events = sse_events(chat(tool_client, **WITH_TOOLS, stream=True).text)
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert deltas[1] == {"content": RAW}  # right after the role chunk, as sent
    assert "".join(d.get("content") or "" for d in deltas) == whole["content"]
    assert "".join(d.get("reasoning") or "" for d in deltas) == whole["reasoning"]
    [call] = streamed_calls(deltas)
    assert call["function"] == whole["tool_calls"][0]["function"]


def test_chat_echo_before_a_message_of_calls_only() -> None:
    """A message of only calls has ``null`` content; with an echo the content is the echo
    (vLLM: ``echo + (content or "")``)."""
    for client in parsed_client(CALL):
        [choice] = chat(client, **WITH_TOOLS).json()["choices"]
        assert choice["message"]["content"] == RAW
        assert len(choice["message"]["tool_calls"]) == 1
        no_echo = chat(client, **(WITH_TOOLS | {"echo": False})).json()["choices"][0]
        assert no_echo["message"]["content"] is None


# -- truncate_prompt_tokens -------------------------------------------------------------------

TOO_LARGE = (
    "truncate_prompt_tokens value (257) is greater than max_model_len (256). Please, select a "
    "smaller truncation size."
)


@pytest.mark.parametrize("stream", [False, True])
def test_truncation_above_the_context_is_400(
    client: TestClient, engine: FakeAsyncLLM, stream: bool
) -> None:
    """vLLM refuses a value above max_model_len whatever the prompt's length (here two
    tokens), with this message; before anything is streamed or sent to the engine."""
    bodies = [
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": CONTINUED[:1]}),
        ("/v1/completions", {"prompt": "hi", "use_beam_search": True, "n": 2}),
    ]
    for route, body in bodies:
        if stream and body.get("use_beam_search"):
            continue  # (beam search is never streamed: a 400 of its own)
        fields = body | {"truncate_prompt_tokens": 257, "max_tokens": 2, "stream": stream}
        error = assert_error(client.post(route, json=fields), 400, "truncate_prompt_tokens")
        assert error["message"] == TOO_LARGE
    assert engine.requests == []


def test_truncation_up_to_the_context_and_minus_one_are_accepted(
    client: TestClient, engine: FakeAsyncLLM
) -> None:
    for value in (256, -1):
        body = {"prompt": "hi", "max_tokens": 2, "truncate_prompt_tokens": value}
        assert client.post("/v1/completions", json=body).status_code == 200
        body = {"messages": CONTINUED[:1], "max_tokens": 2, "truncate_prompt_tokens": value}
        assert client.post("/v1/chat/completions", json=body).status_code == 200
    # the engine gets the value as sent (its input processor reads -1 as max_model_len)
    assert [params.truncate_prompt_tokens for _, _, params, _ in engine.requests] == [
        256,
        256,
        -1,
        -1,
    ]


def test_embedding_truncation_above_the_context_is_400() -> None:
    """The embeddings route's check (a generating fake engine answers /v1/embeddings with a
    400 before it, so the request model is checked directly; tests/test_embeddings.py runs
    the engine's own check)."""
    with pytest.raises(APIError) as refused:
        EmbeddingRequest(input="hi", truncate_prompt_tokens=257).pooling_params(256)
    assert (refused.value.status, refused.value.param) == (400, "truncate_prompt_tokens")
    assert refused.value.message == TOO_LARGE
    for value in (256, -1):
        params = EmbeddingRequest(input="hi", truncate_prompt_tokens=value).pooling_params(256)
        assert params.truncate_prompt_tokens == value
    # no context length known (an engine without one): left to the engine
    assert EmbeddingRequest(input="hi", truncate_prompt_tokens=257).pooling_params() is not None
