"""Background responses (``background: true``), their cancellation and the resumable stream
of ``/v1/responses``, driven by the official ``openai`` client over the fake engine
(tests/fake_engine.py: ``hold()`` pauses a request after its first output, which keeps a
background response in progress for as long as a test needs). The real-model checks (a
cancel that frees the engine's KV blocks, a stream resumed after a disconnect) are in
tests/test_serve_responses.py, beside its running server.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fake_engine import FakeAsyncLLM, FakeInputProcessor
from fastapi.testclient import TestClient
from test_serve_responses import CALL, MODEL, PARSERS, THOUGHT, WEATHER, Server, serve

from chassis.serve.app import build_app
from chassis.serve.responses_background import (
    BackgroundResponses,
    BackgroundRun,
    background_responses,
)
from chassis.serve.responses_events import EventLog
from chassis.serve.responses_protocol import ResponseObject
from chassis.serve.responses_store import ResponseStore, response_store
from chassis.serve.settings import ServerSettings

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.timeout(120)  # a hang guard: the waits below poll without limit


@pytest.fixture
def server() -> Iterator[Server]:
    yield from serve("Hello there!")


def wait_for(check: Callable[[], Any]) -> Any:
    """Poll ``check`` until it returns something true (the module's timeout guards it)."""
    while not (value := check()):
        time.sleep(0.01)
    return value


def finished(server: Server, response_id: str) -> Any:
    """The response once it is no longer queued or in progress."""
    return wait_for(
        lambda: (
            (r := server.client.responses.retrieve(response_id)).status
            not in ("queued", "in_progress")
            and r
        )
    )


def test_a_background_response_returns_at_once_and_ends_like_a_plain_one(server: Server) -> None:
    server.engine.hold()
    queued = server.client.responses.create(model=MODEL, input="Hi", background=True)
    assert queued.status == "queued" and queued.background is True and queued.output == []
    # made on: in progress, with the output so far (the fake engine holds after one step)
    running = wait_for(
        lambda: (r := server.client.responses.retrieve(queued.id)).output_text == "H" and r
    )
    assert running.status == "in_progress" and running.output[0].status == "in_progress"
    server.engine.release()
    done = finished(server, queued.id)
    plain = server.client.responses.create(model=MODEL, input="Hi")
    assert done.status == "completed" and done.output_text == plain.output_text == "Hello there!"
    assert done.usage.output_tokens == plain.usage.output_tokens
    assert done.background is True and plain.background is False
    # the engine was sent the same prompt both times
    assert server.engine.requests[0][1] == server.engine.requests[1][1]
    # a finished background response continues a conversation like any other
    follow = server.client.responses.create(model=MODEL, input="More", previous_response_id=done.id)
    assert follow.status == "completed"


def test_cancel_aborts_the_engine_request(server: Server) -> None:
    server.engine.hold()
    response = server.client.responses.create(model=MODEL, input="Hi", background=True)
    wait_for(lambda: server.client.responses.retrieve(response.id).output_text == "H")
    assert server.engine.running == {response.id}

    cancelled = server.client.responses.cancel(response.id)
    assert cancelled.status == "cancelled" and cancelled.output_text == "H"
    assert cancelled.output[-1].status == "incomplete"
    # the engine stream was closed: the request is gone from the engine, not just relabelled
    assert server.engine.running == set() and server.engine.aborted == [response.id]
    assert server.engine.finished == []
    server.engine.release()
    # idempotent, and the stored response stays cancelled
    again = server.client.responses.cancel(response.id)
    assert again.model_dump() == cancelled.model_dump()
    assert server.client.responses.retrieve(response.id).status == "cancelled"


@pytest.mark.parametrize(
    ("cut", "reasoning", "message"),
    [
        # cut inside the end tag of the reasoning: "</thi" was held back as its prefix
        (THOUGHT.index("</think>") + 5, "The user wants the weather.\n</thi", None),
        # cut inside a tool call's start tag: "<tool_c" was held back as its prefix
        (
            len(THOUGHT) + len("Checking.\n<tool_c"),
            "The user wants the weather.",
            "Checking.\n<tool_c",
        ),
    ],
)
def test_a_cancelled_response_keeps_what_the_parsers_held_back(
    cut: int, reasoning: str | None, message: str | None
) -> None:
    # the parsers hold back a possible tag's prefix until more text shows what it is; on
    # cancel that text was still generated, and the stored response shows it as a parse of
    # the whole text so far would (the same split as a plain response of that text)
    script = THOUGHT + "Checking.\n" + CALL
    for server in serve(script, PARSERS):
        server.engine.hold(after=cut)
        created = server.client.responses.create(
            model=MODEL, input="Weather?", tools=[WEATHER], background=True, stream=True
        )
        events = iter(created)
        # (the fake engine counts its steps; it holds after the cut)
        wait_for(lambda engine=server.engine: engine._steps >= cut and engine.running)
        cancelled = server.client.responses.cancel(next(events).response.id)
        server.engine.release()
        assert cancelled.status == "cancelled"
        texts = {item.type: item.content[0].text for item in cancelled.output}
        assert texts.get("reasoning") == reasoning and texts.get("message") == message
        assert cancelled.output[-1].status == "incomplete"
        # the stored response says the same, and the followers got the held text as deltas
        stored = server.client.responses.retrieve(cancelled.id)
        assert stored.model_dump() == cancelled.model_dump()
        rest = list(events)
        assert rest[-1].type == "response.incomplete"
        assert rest[-1].response.model_dump() == cancelled.model_dump()
        for kind, text in (("reasoning", reasoning), ("output", message)):
            deltas = [e.delta for e in rest if e.type == f"response.{kind}_text.delta"]
            assert "".join(deltas) == (text or "")
        assert server.engine.aborted == [cancelled.id]


def test_cancel_answers_the_cancelled_response_even_when_the_store_dropped_it(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the store may drop the cancelled response before the cancel call reads it back (a full
    # store, another response finishing meanwhile): the answer is still the final response
    server.engine.hold()
    response = server.client.responses.create(model=MODEL, input="Hi", background=True)
    wait_for(lambda: server.client.responses.retrieve(response.id).output_text == "H")
    store = server.http.app.state.responses_store  # type: ignore[attr-defined]
    monkeypatch.setattr(store, "put", lambda response_id, stored: None)
    cancelled = server.client.responses.cancel(response.id)
    assert cancelled.status == "cancelled" and cancelled.output_text == "H"
    assert cancelled.output[-1].status == "incomplete"
    server.engine.release()


def test_a_run_cancelled_before_its_task_starts_still_ends() -> None:
    # a task cancelled before its first step would run none of its code: the run is told
    # through cancel_requested instead, and its work ends it (storing the cancelled response)
    async def main() -> list[str]:
        runs = BackgroundResponses()
        seen: list[str] = []

        async def work(run: BackgroundRun) -> None:
            seen.append("cancel requested" if run.cancel_requested else "ran")

        run = BackgroundRun(
            "r", lambda: ResponseObject(id="r", status="queued", model="m"), None, []
        )
        runs.start(run, work)
        assert await runs.cancel("r") and not await runs.cancel("r")
        assert run.done and len(runs) == 0
        return seen

    assert asyncio.run(main()) == ["cancel requested"]


def test_cancelling_what_is_not_a_running_background_response(server: Server) -> None:
    plain = server.client.responses.create(model=MODEL, input="Hi")
    with pytest.raises(openai.BadRequestError) as info:
        server.client.responses.cancel(plain.id)
    assert "background" in info.value.body["message"]
    done = server.client.responses.create(model=MODEL, input="Hi", background=True)
    finished(server, done.id)
    with pytest.raises(openai.BadRequestError) as info:
        server.client.responses.cancel(done.id)
    assert "completed" in info.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        server.client.responses.cancel("resp_unknown")
    response = server.http.post("/v1/responses/resp_unknown/cancel")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "response_not_found"


def test_background_needs_store(server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        server.client.responses.create(model=MODEL, input="Hi", background=True, store=False)
    assert info.value.body["param"] == "background"
    assert server.engine.requests == []


def test_a_running_response_cannot_be_continued_yet(server: Server) -> None:
    server.engine.hold()
    response = server.client.responses.create(model=MODEL, input="Hi", background=True)
    with pytest.raises(openai.BadRequestError) as info:
        server.client.responses.create(model=MODEL, input="More", previous_response_id=response.id)
    assert info.value.body["param"] == "previous_response_id"
    server.engine.release()
    finished(server, response.id)


def test_delete_cancels_a_running_response(server: Server) -> None:
    server.engine.hold()
    response = server.client.responses.create(model=MODEL, input="Hi", background=True)
    wait_for(lambda: server.engine.running)
    server.client.responses.delete(response.id)
    assert server.engine.running == set() and server.engine.aborted == [response.id]
    with pytest.raises(openai.NotFoundError):
        server.client.responses.retrieve(response.id)


def test_delete_of_a_running_response_succeeds_when_the_store_dropped_it(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the cancelled response may leave the store before DELETE removes it (a full store):
    # the response existed, so the deletion is no 404
    server.engine.hold()
    response = server.client.responses.create(model=MODEL, input="Hi", background=True)
    wait_for(lambda: server.engine.running)
    store = server.http.app.state.responses_store  # type: ignore[attr-defined]
    monkeypatch.setattr(store, "put", lambda response_id, stored: None)
    deleted = server.http.delete(f"/v1/responses/{response.id}")
    assert deleted.status_code == 200, deleted.text
    assert deleted.json() == {"id": response.id, "object": "response.deleted", "deleted": True}
    assert server.engine.running == set() and server.engine.aborted == [response.id]
    server.engine.release()


def test_shutdown_cancels_background_responses() -> None:
    engine = FakeAsyncLLM(script="Hello there!")
    engine.hold()
    app = build_app(engine, ServerSettings())
    with TestClient(app) as http:
        response = http.post(
            "/v1/responses", json={"model": MODEL, "input": "Hi", "background": True}
        ).json()
        wait_for(lambda: engine.running)
    # the lifespan's end aborted the engine request and stored the response cancelled
    assert engine.running == set() and engine.finished == []
    stored = app.state.responses_store.get(response["id"])
    assert stored is not None and stored.response["status"] == "cancelled"
    assert len(app.state.responses_background) == 0


def test_an_engine_failure_fails_the_background_response(server: Server) -> None:
    server.engine.die_after_steps = 3
    response = server.client.responses.create(model=MODEL, input="Hi", background=True)
    failed = finished(server, response.id)
    assert failed.status == "failed" and failed.error.code == "server_error"
    assert failed.output_text == "He"


@pytest.mark.parametrize(
    "fields",
    [
        {"max_output_tokens": 10_000},  # prompt plus output over the context
        {"input": "word " * 100},  # the prompt alone over the context (256 tokens)
    ],
)
def test_what_the_engine_refuses_is_the_same_400_in_the_background(
    server: Server, fields: dict[str, Any]
) -> None:
    # the engine checks a request when it starts, which for a background response is after
    # the answer: the server runs the engine's checks first, so nothing is queued or stored
    body = {"model": MODEL, "input": "Hi", **fields}
    plain = server.http.post("/v1/responses", json=body)
    assert plain.status_code == 400, plain.text
    for stream in (False, True):
        refused = server.http.post(
            "/v1/responses", json={**body, "background": True, "stream": stream}
        )
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"] == plain.json()["error"]
    assert server.engine.checked == 2
    assert server.engine.requests == []  # nothing was queued
    app = server.http.app
    assert len(response_store(app)) == 0 and len(background_responses(app)) == 0


def _nested_schema(levels: int) -> dict[str, Any]:
    """An object schema whose subschemas nest ``levels`` deep (a string at the bottom)."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels - 1):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_a_constraint_the_engine_refuses_is_a_400_before_queueing(server: Server) -> None:
    # over the subschema nesting limit (core/structured_nesting.py), though its JSON text is
    # within the text limit: only the engine's backend check refuses it, when the request
    # starts; a background response checks it before it answers
    server.engine.input_processor = FakeInputProcessor(server.engine.config)  # type: ignore[attr-defined]
    too_deep = {"format": {"type": "json_schema", "name": "deep", "schema": _nested_schema(34)}}
    plain = server.http.post(
        "/v1/responses", json={"model": MODEL, "input": "Hi", "text": too_deep}
    )
    assert plain.status_code == 400, plain.text
    for stream in (False, True):
        body = {"model": MODEL, "input": "Hi", "text": too_deep, "background": True}
        queued = server.http.post("/v1/responses", json={**body, "stream": stream})
        assert queued.status_code == 400, queued.text
        assert queued.json()["error"] == plain.json()["error"]
    assert "nested too deeply" in plain.json()["error"]["message"]
    assert server.engine.requests == []  # nothing was queued
    # a schema within the limit still runs in the background
    fine = {"format": {"type": "json_schema", "name": "ok", "schema": _nested_schema(3)}}
    ok = server.client.responses.create(model=MODEL, input="Hi", text=fine, background=True)
    assert ok.status == "queued"
    assert finished(server, ok.id).status == "completed"


# -- streaming -----------------------------------------------------------------------------------


def test_a_streamed_background_response_resumes_from_any_sequence_number(server: Server) -> None:
    events = list(
        server.client.responses.create(model=MODEL, input="Hi", background=True, stream=True)
    )
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.queued", "response.in_progress"]
    assert events[0].response.status == "queued" and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.output_text == "Hello there!" and final.background is True
    response_id = final.id
    assert server.client.responses.retrieve(response_id).output_text == "Hello there!"

    for after in (0, 4, len(events) - 2, len(events) - 1):
        resumed = list(
            server.client.responses.retrieve(response_id, stream=True, starting_after=after)
        )
        assert [e.model_dump() for e in resumed] == [e.model_dump() for e in events[after + 1 :]]
    whole = list(server.client.responses.retrieve(response_id, stream=True))
    assert len(whole) == len(events)
    # include is checked on a streamed retrieve too: values that add nothing change nothing
    included = list(
        server.client.responses.retrieve(
            response_id, stream=True, starting_after=4, include=["file_search_call.results"]
        )
    )
    assert [e.model_dump() for e in included] == [e.model_dump() for e in events[5:]]
    with pytest.raises(openai.BadRequestError) as info:
        server.client.responses.retrieve(
            response_id, stream=True, include=["reasoning.encrypted_content"]
        )
    assert info.value.body["param"] == "include"


def test_what_cannot_be_streamed_again(server: Server) -> None:
    plain = server.client.responses.create(model=MODEL, input="Hi")
    background = server.client.responses.create(model=MODEL, input="Hi", background=True)
    finished(server, background.id)
    for response_id in (plain.id, background.id):  # neither was created with stream
        response = server.http.get(f"/v1/responses/{response_id}", params={"stream": "true"})
        assert response.status_code == 400 and response.json()["error"]["param"] == "stream"
    streamed = list(
        server.client.responses.create(model=MODEL, input="Hi", background=True, stream=True)
    )
    response_id = streamed[-1].response.id
    for params, param in [
        ({"stream": "true", "starting_after": "-2"}, "starting_after"),
        ({"stream": "true", "starting_after": "x"}, "starting_after"),
        ({"starting_after": "1"}, "starting_after"),
    ]:
        response = server.http.get(f"/v1/responses/{response_id}", params=params)
        assert response.status_code == 400, response.text
        # (a value that is no integer is named as the server's validation names it:
        # query.starting_after)
        assert response.json()["error"]["param"].endswith(param)
    # -1 (what the message offers) is every event, as no starting_after
    every = server.http.get(f"/v1/responses/{response_id}", params={"stream": "true"})
    minus_one = server.http.get(
        f"/v1/responses/{response_id}", params={"stream": "true", "starting_after": "-1"}
    )
    assert minus_one.status_code == 200 and minus_one.text == every.text != ""
    below = server.http.get(
        f"/v1/responses/{response_id}", params={"stream": "true", "starting_after": "-2"}
    )
    assert "-1 for every event" in below.json()["error"]["message"]
    past_the_end = server.http.get(
        f"/v1/responses/{response_id}", params={"stream": "true", "starting_after": "999"}
    )
    # beyond the last event: no client was sent it, so a 400 naming it (not an empty stream)
    assert past_the_end.status_code == 400, past_the_end.text
    refusal = past_the_end.json()["error"]
    assert refusal["param"] == "starting_after"
    assert f"the last one sent is {len(streamed) - 1}" in refusal["message"]
    # after the last event itself: nothing more, an empty stream
    last = server.http.get(
        f"/v1/responses/{response_id}",
        params={"stream": "true", "starting_after": str(len(streamed) - 1)},
    )
    assert last.status_code == 200 and last.text == ""
    missing = server.http.get("/v1/responses/resp_unknown", params={"stream": "true"})
    assert missing.status_code == 404


def test_the_store_bounds_the_stream_events_it_keeps(server: Server) -> None:
    # every delta is an event (a few hundred bytes): the store keeps at most max_events of them
    # in all, dropping the least recently used responses' logs first (the responses stay)
    store = ResponseStore(max_events=40)
    server.http.app.state.responses_store = store  # type: ignore[attr-defined]

    def streamed() -> tuple[str, int]:
        events = list(
            server.client.responses.create(model=MODEL, input="Hi", background=True, stream=True)
        )
        return events[-1].response.id, len(events)

    first, count = streamed()
    assert 20 < count <= 40 and store.num_events == count
    second, _ = streamed()  # 2 * count > 40: the first one's log goes
    assert store.num_events == count and store.get(first).events_dropped  # type: ignore[union-attr]
    response = server.http.get(f"/v1/responses/{first}", params={"stream": "true"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "stream"
    assert "no longer kept" in response.json()["error"]["message"]
    assert server.client.responses.retrieve(first).output_text == "Hello there!"
    assert len(list(server.client.responses.retrieve(second, stream=True))) == count
    # reading the first one made it the most recent: the second one's log is next to go
    server.client.responses.retrieve(first)
    third, _ = streamed()
    assert store.get(second).events is None and store.get(third).events is not None  # type: ignore[union-attr]
    assert server.client.responses.delete(third) is None and store.num_events == 0
    # a log longer than the whole bound is not kept at all
    store.max_events = 5
    alone, _ = streamed()
    assert store.num_events == 0 and store.get(alone).events_dropped  # type: ignore[union-attr]


def test_followers_get_the_events_as_they_come() -> None:
    async def main() -> None:
        snapshot = lambda: ResponseObject(id="r", status="queued", model="m")  # noqa: E731
        run = BackgroundRun("r", snapshot, EventLog(), [])
        runs = BackgroundResponses()
        gate = asyncio.Event()

        async def work(run: BackgroundRun) -> None:
            run.add_event("a")
            await gate.wait()
            run.add_event("b")
            run.add_event("c")

        runs.start(run, work)
        seen: list[str] = []

        async def follow(after: int) -> None:
            async for event in run.follow(after):
                seen.append(event)

        early = asyncio.ensure_future(follow(-1))
        late = asyncio.ensure_future(follow(1))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert seen == ["a"] and runs.get("r") is run
        gate.set()
        await asyncio.gather(early, late)
        assert sorted(seen) == ["a", "b", "c", "c"]
        assert run.done and runs.get("r") is None

    asyncio.run(main())
