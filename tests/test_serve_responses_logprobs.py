"""Output logprobs on ``/v1/responses`` (``include: ["message.output_text.logprobs"]`` and
``top_logprobs``), driven by the official ``openai`` client over the fake engine
(tests/fake_engine.py: a character per step, each sampled token at logprob -0.5 with
alternatives "A", "B", ... at -2, -3, ...). The greedy comparison with the chat route on a real
model is in tests/test_serve_responses.py (it shares that file's server).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from fake_engine import FakeAsyncLLM
from fastapi.testclient import TestClient
from test_serve_responses import CALL, MODEL, PARSERS, THOUGHT, WEATHER, Server, serve
from test_serve_responses_background import finished

from chassis.core.outputs import RequestOutput, merge_delta_outputs
from chassis.serve.app import build_app
from chassis.serve.chat_parsing import ChoiceDelta
from chassis.serve.protocol import ChatLogprobToken
from chassis.serve.responses_logprobs import LogprobRouter, token_units
from chassis.serve.responses_store import EVENT_COPIES_OF_LOGPROBS, ResponseStore, StoredResponse
from chassis.serve.settings import ServerSettings
from chassis.serve.tool_parser import ToolCallFragment

openai = pytest.importorskip("openai")

LOGPROBS = ["message.output_text.logprobs"]
TEXT = "Hello there!"


@pytest.fixture
def server() -> Iterator[Server]:
    yield from serve(TEXT)


def entries(logprobs: list[Any] | None) -> list[dict[str, Any]]:
    """Logprob entries (SDK models or dicts) as dicts."""
    return [e if isinstance(e, dict) else e.model_dump() for e in logprobs or []]


def chat_logprobs(server: Server, top: int) -> list[dict[str, Any]]:
    """The chat route's logprobs for the same conversation ("Hi")."""
    chat = server.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], logprobs=True, top_logprobs=top
    )
    assert chat.choices[0].logprobs is not None
    return entries(chat.choices[0].logprobs.content)


def part(response: Any) -> Any:
    """The ``output_text`` part of a response's message."""
    message = next(item for item in response.output if item.type == "message")
    return message.content[0]


def test_logprobs_are_the_chat_routes_streamed_or_not(server: Server) -> None:
    expected = chat_logprobs(server, 2)
    assert "".join(e["token"] for e in expected) == TEXT
    assert expected[0]["top_logprobs"][0] == {"token": "H", "logprob": -0.5, "bytes": [72]}
    response = server.client.responses.create(
        model=MODEL, input="Hi", include=LOGPROBS, top_logprobs=2
    )
    assert part(response).text == TEXT and entries(part(response).logprobs) == expected
    assert server.engine.requests[-1][2].logprobs == 2  # what the engine was asked

    events = list(
        server.client.responses.create(
            model=MODEL, input="Hi", include=LOGPROBS, top_logprobs=2, stream=True
        )
    )
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert [entries(e.logprobs) for e in deltas] == [[entry] for entry in expected]
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert entries(done.logprobs) == expected
    (part_done,) = [e for e in events if e.type == "response.content_part.done"]
    assert entries(part_done.part.logprobs) == expected
    assert entries(part(events[-1].response).logprobs) == expected

    # top_logprobs 0 (the default): the sampled tokens alone
    bare = server.client.responses.create(model=MODEL, input="Hi", include=LOGPROBS)
    assert entries(part(bare).logprobs) == chat_logprobs(server, 0)
    assert all(e["top_logprobs"] == [] for e in entries(part(bare).logprobs))


def test_without_include_there_are_no_logprobs(server: Server) -> None:
    # as OpenAI: top_logprobs alone adds nothing, and the engine computes none
    response = server.client.responses.create(model=MODEL, input="Hi", top_logprobs=3)
    assert part(response).text == TEXT and part(response).logprobs == []
    assert server.engine.requests[-1][2].logprobs is None
    events = list(server.client.responses.create(model=MODEL, input="Hi", stream=True))
    assert all(e.logprobs == [] for e in events if e.type == "response.output_text.delta")


def test_stored_logprobs_come_back_with_include(server: Server) -> None:
    expected = chat_logprobs(server, 1)
    background = server.client.responses.create(
        model=MODEL, input="Hi", include=LOGPROBS, top_logprobs=1, background=True
    )
    finished(server, background.id)
    included = server.client.responses.retrieve(background.id, include=LOGPROBS)  # type: ignore[arg-type]
    assert entries(part(included).logprobs) == expected
    # without include the parts' logprobs are empty, as OpenAI answers
    assert part(server.client.responses.retrieve(background.id)).logprobs == []
    raw = server.http.get(f"/v1/responses/{background.id}", params={"include": LOGPROBS[0]})
    assert entries(raw.json()["output"][0]["content"][0]["logprobs"]) == expected

    # the next turn lists this response's message among its input items, with the same rule
    follow = server.client.responses.create(
        model=MODEL, input="Again", previous_response_id=background.id
    )
    listed = server.client.responses.input_items.list(follow.id, include=LOGPROBS, order="asc")  # type: ignore[arg-type]
    assert entries(listed.data[1].content[0].logprobs) == expected  # type: ignore[union-attr]
    plain = server.client.responses.input_items.list(follow.id, order="asc")
    assert plain.data[1].content[0].logprobs == []  # type: ignore[union-attr]

    # a background stream replays its deltas' logprobs
    streamed = list(
        server.client.responses.create(
            model=MODEL, input="Hi", include=LOGPROBS, top_logprobs=1, background=True, stream=True
        )
    )
    response_id = streamed[0].response.id
    replayed = list(server.client.responses.retrieve(response_id, stream=True, starting_after=3))
    assert [e.model_dump() for e in replayed] == [e.model_dump() for e in streamed[4:]]
    deltas = [e for e in replayed if e.type == "response.output_text.delta"]
    assert [entry for e in deltas for entry in entries(e.logprobs)] == expected


def test_stored_logprobs_are_bounded_in_all(server: Server) -> None:
    """The store keeps at most ``max_logprobs`` logprob entries (alternatives included) in
    all, dropping the least recently used responses; a response's output items are kept
    once, shared by the response and its conversation."""
    store = ResponseStore(max_logprobs=50)
    server.http.app.state.responses_store = store
    first = server.client.responses.create(
        model=MODEL, input="Hi", include=LOGPROBS, top_logprobs=2
    )
    stored = store.get(first.id)
    assert stored is not None
    expected = sum(1 + len(e["top_logprobs"]) for e in entries(part(first).logprobs))
    assert 25 < stored.num_logprobs == expected <= 50
    assert stored.conversation[-1] is stored.response["output"][0]
    plain = server.client.responses.create(model=MODEL, input="Hi")  # no logprobs: kept
    second = server.client.responses.create(
        model=MODEL, input="Hi", include=LOGPROBS, top_logprobs=2
    )
    with pytest.raises(openai.NotFoundError):
        server.client.responses.retrieve(first.id)
    assert server.client.responses.retrieve(plain.id).id == plain.id
    kept = server.client.responses.retrieve(second.id, include=LOGPROBS)  # type: ignore[arg-type]
    assert entries(part(kept).logprobs) == entries(part(second).logprobs)


def test_a_streamed_background_response_counts_its_event_logs_logprobs(server: Server) -> None:
    store = ResponseStore()
    server.http.app.state.responses_store = store
    streamed = list(
        server.client.responses.create(
            model=MODEL, input="Hi", include=LOGPROBS, top_logprobs=2, background=True, stream=True
        )
    )
    response_id = streamed[0].response.id
    finished(server, response_id)
    stored = store.get(response_id)
    assert stored is not None and stored.events is not None
    own = sum(1 + len(e["top_logprobs"]) for e in entries(part(streamed[-1].response).logprobs))
    in_events = 0
    for event in stored.events:
        payload = json.loads(event.split("data: ", 1)[1])
        found = [payload.get("logprobs"), payload.get("part", {}).get("logprobs")]
        for holder in (payload.get("item"), *(payload.get("response", {}).get("output") or [])):
            for content in (holder or {}).get("content") or []:
                found.append(content.get("logprobs"))
        in_events += sum(1 + len(e.get("top_logprobs") or []) for lp in found for e in lp or [])
    assert in_events == EVENT_COPIES_OF_LOGPROBS * own > 0
    assert stored.num_logprobs == own + in_events
    store.max_events = 0  # its log dropped: its own logprobs remain counted
    store.put("other", StoredResponse({"id": "other"}, []))
    dropped = store.get(response_id)
    assert dropped is not None and dropped.events is None and dropped.num_logprobs == own


def test_the_store_keeps_its_newest_response_whatever_its_logprobs() -> None:
    store = ResponseStore(max_logprobs=1)
    store.put("a", StoredResponse({"id": "a"}, [], num_logprobs=1))
    store.put("b", StoredResponse({"id": "b"}, [], num_logprobs=5))
    assert store.get("a") is None and store.get("b") is not None and len(store) == 1


def test_bad_logprob_requests_are_400s_naming_top_logprobs() -> None:
    engine = FakeAsyncLLM(script=TEXT, max_logprobs=2)
    with TestClient(build_app(engine, ServerSettings())) as http:
        client = openai.OpenAI(
            base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0
        )
        for fields in (
            {"top_logprobs": 21},
            {"top_logprobs": -1, "include": LOGPROBS},
            # over the server's --max-logprobs: a 400 before anything runs, background too
            {"top_logprobs": 3, "include": LOGPROBS},
            {"top_logprobs": 3, "include": LOGPROBS, "background": True},
            {"top_logprobs": 3, "include": LOGPROBS, "stream": True},
        ):
            with pytest.raises(openai.BadRequestError) as info:
                client.responses.create(model=MODEL, input="Hi", **fields)  # type: ignore[call-overload]
            error = info.value.body
            assert error["param"] == "top_logprobs" and error["message"], error
            assert info.value.response.json()["error"]["type"] == "invalid_request_error"
        assert engine.requests == []
        # within the limit it runs
        response = client.responses.create(
            model=MODEL, input="Hi", include=LOGPROBS, top_logprobs=2
        )
        assert len(part(response).logprobs) == len(TEXT)


@pytest.mark.parametrize("tail", ["", "\n" + CALL])
def test_only_the_message_texts_tokens_carry_logprobs(tail: str) -> None:
    # the reasoning, the call and their markup are other items' text: their tokens carry no
    # logprobs (OpenAI gives them for output_text only); the message's are its own tokens'
    for server in serve(THOUGHT + "Checking." + tail, PARSERS):
        kwargs: dict[str, Any] = {"model": MODEL, "input": "Hi", "include": LOGPROBS}
        kwargs["tools"] = [WEATHER]
        response = server.client.responses.create(**kwargs)
        assert [item.type for item in response.output][:2] == ["reasoning", "message"]
        text = part(response)
        tokens = [e["token"] for e in entries(text.logprobs)]
        assert "".join(tokens) == text.text == "Checking."
        events = list(server.client.responses.create(**kwargs, stream=True))
        assert entries(part(events[-1].response).logprobs) == entries(text.logprobs)
        deltas = [e for e in events if e.type == "response.output_text.delta"]
        assert [entry for e in deltas for entry in entries(e.logprobs)] == entries(text.logprobs)
        assert all("logprobs" not in e.model_dump() for e in events if "reasoning" in e.type)


def test_forced_tool_calls_have_no_logprobs_to_give() -> None:
    # the output is the call alone: no output_text, so nowhere for logprobs (as OpenAI)
    for server in serve('{"city": "Paris"}'):
        forced = {"type": "function", "name": "get_weather"}
        kwargs: dict[str, Any] = {"model": MODEL, "input": "Weather?", "include": LOGPROBS}
        kwargs.update(tools=[WEATHER], tool_choice=forced, top_logprobs=1)
        response = server.client.responses.create(**kwargs)
        assert [item.type for item in response.output] == ["function_call"]
        events = list(server.client.responses.create(**kwargs, stream=True))
        assert not [e for e in events if e.type.startswith("response.output_text")]
        assert [item.type for item in events[-1].response.output] == ["function_call"]


def entry(token: str) -> ChatLogprobToken:
    return ChatLogprobToken(token=token, logprob=-1.0, bytes=list(token.encode()))


def test_the_router_gives_the_message_its_own_steps() -> None:
    # LogprobRouter alone, fed what the parsers report: one engine step per add_entries
    router = LogprobRouter(None, 0, False)  # type: ignore[arg-type]  # (no state: entries given)
    assert router.add_entries("<think>", [entry("<think>")]) == []
    assert router.route(ChoiceDelta()) == []  # markup: waits
    router.add_entries("Hm", [entry("Hm")])
    assert router.route(ChoiceDelta(reasoning="Hm")) == []  # reasoning: dropped
    # one output with the end of the reasoning, the tag and the message's start (several
    # tokens: merged deltas, a speculative step): each token goes where its text went
    router.add_entries(" ok</think>Hm", [entry(" ok"), entry("</think>"), entry("Hm")])
    taken = router.route(ChoiceDelta(reasoning=" ok", content="Hm"))
    assert [e.token for e in taken] == ["Hm"]
    # text held back (a possible tag) waits; the message text before it goes alone
    router.add_entries(" sure", [entry(" sure")])
    router.add_entries("<tool", [entry("<tool")])
    assert [e.token for e in router.route(ChoiceDelta(content=" sure"))] == [" sure"]
    router.add_entries("_call>", [entry("_call>")])
    assert router.route(ChoiceDelta(fragments=[ToolCallFragment(0, "", "f", "c")])) == []
    # a textless token after message text goes with it at once
    assert router.add_entries("", [entry("")]) == []  # (after a call: waits for text)
    router.add_entries("x", [entry("x")])
    assert [e.token for e in router.route(ChoiceDelta(content="x"))] == ["", "x"]
    assert [e.token for e in router.add_entries("", [entry("</s>")])] == ["</s>"]


def test_a_textless_token_after_held_back_message_text_goes_with_it() -> None:
    # "Hi <" then the end-of-sequence token: the parser holds "<" back (a possible tag),
    # so the token waits; when the finish releases "<" as message text, the token follows
    router = LogprobRouter(None, 0, False)  # type: ignore[arg-type]  # (no state: entries given)
    router.add_entries("Hi", [entry("Hi")])
    assert [e.token for e in router.route(ChoiceDelta(content="Hi"))] == ["Hi"]
    router.add_entries(" <", [entry(" <")])
    assert router.route(ChoiceDelta()) == []  # held back
    assert router.add_entries("", [entry("</s>")]) == []  # waits behind the held text
    assert [e.token for e in router.route(ChoiceDelta(content=" <"))] == [" <", "</s>"]


def merging(engine: FakeAsyncLLM, size: int) -> Any:
    """``engine.generate`` whose outputs come ``size`` at a time, merged as ``AsyncLLM``
    merges the outputs a reader fell behind on (several tokens per output)."""
    generate = engine.generate

    async def merged(*args: Any, **kwargs: Any) -> AsyncIterator[RequestOutput]:
        batch: RequestOutput | None = None
        count = 0
        async with contextlib.aclosing(generate(*args, **kwargs)) as stream:
            async for output in stream:
                batch = output if batch is None else merge_delta_outputs(batch, output)
                count += 1
                if count % size == 0:
                    yield batch
                    batch = None
        if batch is not None:
            yield batch

    return merged


@pytest.mark.parametrize("size", [2, 3, 5, 8])
def test_outputs_of_several_tokens_give_each_token_to_its_own_item(size: int) -> None:
    # outputs that straddle "</think>\n\n" and the message, and the message and the call:
    # only the message's tokens carry logprobs, streamed (each delta its own text's) or not
    for server in serve(THOUGHT + "Checking." + "\n" + CALL, PARSERS):
        server.engine.generate = merging(server.engine, size)  # type: ignore[method-assign]
        kwargs: dict[str, Any] = {"model": MODEL, "input": "Hi", "include": LOGPROBS}
        kwargs.update(tools=[WEATHER], top_logprobs=1)
        response = server.client.responses.create(**kwargs)
        assert [item.type for item in response.output] == ["reasoning", "message", "function_call"]
        text = part(response)
        assert "".join(e["token"] for e in entries(text.logprobs)) == text.text == "Checking."
        events = list(server.client.responses.create(**kwargs, stream=True))
        assert entries(part(events[-1].response).logprobs) == entries(text.logprobs)
        deltas = [e for e in events if e.type == "response.output_text.delta"]
        assert [entry for e in deltas for entry in entries(e.logprobs)] == entries(text.logprobs)
        for delta in deltas:
            assert "".join(e["token"] for e in entries(delta.logprobs)) == delta.delta


def test_an_output_whose_tokens_do_not_make_its_text_goes_whole() -> None:
    # the tokens' own texts tile the output's text: a unit per token, textless ones joining
    # the next (or last, as ""); otherwise (half a character each) the output is one unit
    eos = entry("</s>")
    units = token_units("ab", [entry("a"), eos, entry("b"), eos])
    assert [(text, [e.token for e in es]) for text, es in units] == [
        ("a", ["a"]),
        ("b", ["</s>", "b"]),
        ("", ["</s>"]),
    ]
    halves = [entry("\ufffd"), entry("\ufffd")]
    assert token_units("\u00e9", halves) == [("\u00e9", halves)]
    assert token_units("", []) == []
