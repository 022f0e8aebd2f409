"""The bounded event log of a streamed background response (serve/responses_events.py), and
output logprobs routed per token when one engine output holds several tokens
(serve/responses_logprobs.py): the log alone, over the fake engine, and on a real model
(the tiny Llama in an in-process ``AsyncLLM``, with the ``qwen3`` reasoning parser).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_engine import FakeAsyncLLM
from fastapi.testclient import TestClient
from test_serve_responses import MODEL, Server, serve
from test_serve_responses_background import finished, wait_for

from chassis.core.async_llm import AsyncLLM
from chassis.core.config import EngineConfig
from chassis.core.outputs import RequestOutput, merge_delta_outputs
from chassis.core.sampling_params import SamplingParams
from chassis.core.structured_output import StructuredOutputsParams
from chassis.serve.app import build_app
from chassis.serve.responses_background import BackgroundResponses, BackgroundRun
from chassis.serve.responses_events import (
    DEFAULT_MAX_EVENTS_PER_RESPONSE,
    EVENTS_PER_RESPONSE_ENV,
    EventLog,
    EventsBeyondEnd,
    EventsDropped,
    events_per_response_from_env,
)
from chassis.serve.responses_protocol import ResponseObject
from chassis.serve.responses_store import ResponseStore
from chassis.serve.settings import ServerSettings

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.timeout(300)  # a hang guard: the waits poll without limit

LOGPROBS: Any = ["message.output_text.logprobs"]


# -- the log alone -----------------------------------------------------------------------------


def test_the_log_keeps_the_newest_events_by_sequence_number() -> None:
    log = EventLog(3)
    for k in range(5):
        log.append(f"e{k}")
    assert (len(log), log.first, log.end) == (3, 2, 5)
    assert list(log) == ["e2", "e3", "e4"] and log.get(3) == "e3"
    assert log.after(1) == ["e2", "e3", "e4"] and log.after(3) == ["e4"] and log.after(4) == []
    log.check_resume(1)  # events 2.. are all kept
    # beyond the last event: a follower of a running response may wait for it, but in a
    # finished response's log (after) it can never come
    log.check_resume(9)
    with pytest.raises(EventsBeyondEnd, match=r"starting_after 9 is beyond.*last one sent is 4"):
        log.after(9)
    with pytest.raises(EventsBeyondEnd, match="none was sent yet"):
        EventLog(3).after(0)
    with pytest.raises(EventsDropped, match="before sequence number 2 were dropped") as info:
        log.after(0)
    assert info.value.first == 2
    assert "keeps the last 3 events" in str(info.value) and "starting_after 1 or more" in str(
        info.value
    )
    with pytest.raises(EventsDropped):
        log.after(-1)
    with pytest.raises(EventsDropped):
        log.get(1)
    with pytest.raises(IndexError):
        log.get(5)
    with pytest.raises(ValueError, match="1 event or more"):
        EventLog(0)


def test_the_bound_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(EVENTS_PER_RESPONSE_ENV, raising=False)
    assert events_per_response_from_env() == DEFAULT_MAX_EVENTS_PER_RESPONSE
    assert ResponseStore().new_event_log().max_events == DEFAULT_MAX_EVENTS_PER_RESPONSE
    monkeypatch.setenv(EVENTS_PER_RESPONSE_ENV, "7")
    assert ResponseStore().new_event_log().max_events == 7
    for bad in ("0", "-3", "many"):
        monkeypatch.setenv(EVENTS_PER_RESPONSE_ENV, bad)
        with pytest.raises(ValueError, match=EVENTS_PER_RESPONSE_ENV):
            events_per_response_from_env()
        with pytest.raises(ValueError, match=EVENTS_PER_RESPONSE_ENV):
            build_app(FakeAsyncLLM(), ServerSettings())  # stops start-up


def test_a_live_follower_that_falls_behind_gets_every_event() -> None:
    """The bound is for resuming: a connected follower reading more slowly than the run
    makes events loses none (the log keeps what it has yet to read, beyond the bound, and
    drops it once read)."""

    async def main() -> None:
        snapshot = lambda: ResponseObject(id="r", status="queued", model="m")  # noqa: E731
        log = EventLog(2)
        run = BackgroundRun("r", snapshot, log, [])
        runs = BackgroundResponses()
        gate = asyncio.Event()

        async def work(run: BackgroundRun) -> None:
            run.add_event("a")
            await gate.wait()
            for event in ("b", "c", "d", "e"):  # four at once, the follower still on "a"
                run.add_event(event)

        runs.start(run, work)
        follower = run.follow(-1)
        assert await follower.__anext__() == "a"
        gate.set()
        while not run.done:
            await asyncio.sleep(0)
        assert (log.first, len(log)) == (1, 4)  # "b".."e" held for the follower
        # a resume is still checked against the bound, not against what a follower holds
        with pytest.raises(EventsDropped):
            log.check_resume(-1)
        assert [event async for event in follower] == ["b", "c", "d", "e"]
        assert (log.first, len(log)) == (3, 2)  # read: back to the bound
        assert [event async for event in run.follow(2)] == ["d", "e"]

    asyncio.run(main())


def test_a_follower_too_far_behind_ends_with_an_error_event_and_the_log_stays_bounded() -> None:
    """A follower that stops reading (its connection open) holds the log up to twice its
    bound, no more: past that its events go, and its stream ends with an ``error`` event
    (``events_dropped``) saying where a resume may start; other followers are unaffected."""

    async def main() -> None:
        snapshot = lambda: ResponseObject(id="r", status="queued", model="m")  # noqa: E731
        log = EventLog(2)
        assert log.max_kept == 4
        run = BackgroundRun("r", snapshot, log, [])
        run.add_event("e0")
        stalled = run.follow(-1)
        assert await stalled.__anext__() == "e0"  # then it reads nothing for a while
        for k in range(1, 8):
            run.add_event(f"e{k}")
            assert len(log) <= log.max_kept
        assert (log.first, len(log)) == (4, 4)  # e1..e3 dropped though e1 was held
        current = run.follow(5)  # a follower that keeps up is not affected
        run.finished()
        assert [event async for event in current] == ["e6", "e7"]
        rest = [event async for event in stalled]
        assert len(rest) == 1 and rest[0].startswith("event: error\n"), rest
        error = json.loads(rest[0].split("data: ", 1)[1])
        assert error["type"] == "error" and error["code"] == "events_dropped"
        assert error["sequence_number"] == 1  # the event it was to read next, never sent
        assert "fell more than 4 events behind" in error["message"]
        assert "resume with starting_after 3 or more" in error["message"]
        assert (log.first, len(log)) == (6, 2)  # released: back to the bound
        # a resume starts from the oldest event kept then (the 400 says which)
        with pytest.raises(EventsDropped, match="resume with starting_after 5 or more"):
            run.follow(3)
        assert [event async for event in run.follow(5)] == ["e6", "e7"]

    asyncio.run(main())


def test_a_follower_holds_its_place_from_the_call_not_its_first_read() -> None:
    async def main() -> None:
        snapshot = lambda: ResponseObject(id="r", status="queued", model="m")  # noqa: E731
        log = EventLog(2)
        run = BackgroundRun("r", snapshot, log, [])
        follower = run.follow(-1)  # made (as a route makes it), not read yet
        for event in ("a", "b", "c"):
            run.add_event(event)
        run.finished()
        assert [event async for event in follower] == ["a", "b", "c"]
        assert (log.first, len(log)) == (1, 2)
        # a resume from before the log is refused when the follower is made
        with pytest.raises(EventsDropped, match="before sequence number 1"):
            run.follow(-1)

    asyncio.run(main())


def test_an_abandoned_follower_releases_its_place() -> None:
    async def main() -> None:
        snapshot = lambda: ResponseObject(id="r", status="queued", model="m")  # noqa: E731
        log = EventLog(2)
        run = BackgroundRun("r", snapshot, log, [])
        run.add_event("a")
        follower = run.follow(-1)
        assert await follower.__anext__() == "a"
        for event in ("b", "c", "d"):
            run.add_event(event)
        assert (log.first, len(log)) == (1, 3)
        await follower.aclose()  # the client disconnected
        assert (log.first, len(log)) == (2, 2)
        unread = [run.follow(1)]  # a stream the server never started reading
        run.add_event("e")
        assert (log.first, len(log)) == (2, 3)
        # collected in another thread: the log is not touched there, but on the loop
        collector = threading.Thread(target=lambda: unread.clear())
        collector.start()
        collector.join()
        assert (log.first, len(log)) == (2, 3)
        await asyncio.sleep(0)
        assert (log.first, len(log)) == (3, 2)

    asyncio.run(main())


# -- over the fake engine ----------------------------------------------------------------------


@pytest.fixture
def server() -> Iterator[Server]:
    yield from serve("Hello there!")


def sse_events(text: str) -> list[str]:
    """A response body of SSE events, split into the events as the server wrote them."""
    return [f"{chunk}\n\n" for chunk in text.split("\n\n") if chunk]


def test_a_long_running_response_keeps_its_newest_events_only(server: Server) -> None:
    store = ResponseStore(max_events_per_response=8)
    server.http.app.state.responses_store = store  # type: ignore[attr-defined]
    server.engine.hold(after=7)  # created, queued, in_progress, added, part added, 7 deltas
    with server.client.responses.create(
        model=MODEL, input="Hi", background=True, stream=True
    ) as stream:
        response_id = next(iter(stream)).response.id
    runs = server.http.app.state.responses_background  # type: ignore[attr-defined]
    run = wait_for(
        lambda: (r := runs.get(response_id)) and r.events is not None and r.events.end == 12 and r
    )
    assert (len(run.events), run.events.first) == (8, 4)
    # running: a resume from before the log is a 400 naming starting_after; after, it works
    url = f"/v1/responses/{response_id}"
    refused = server.http.get(url, params={"stream": "true", "starting_after": "2"})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "starting_after" and error["type"] == "invalid_request_error"
    assert "events before sequence number 4 were dropped" in error["message"]
    server.engine.release()
    finished(server, response_id)
    stored = store.get(response_id)
    assert stored is not None and stored.events is not None and len(stored.events) == 8
    total = stored.events.end
    assert total > 20 and store.num_events == 8  # what the store holds: the log's bound
    replayed = list(
        server.client.responses.retrieve(response_id, stream=True, starting_after=total - 9)
    )
    assert [e.sequence_number for e in replayed] == list(range(total - 8, total))
    assert replayed[-1].type == "response.completed"
    assert replayed[-1].response.output_text == "Hello there!"
    raw = server.http.get(url, params={"stream": "true", "starting_after": str(total - 9)})
    assert sse_events(raw.text) == list(stored.events)
    for after in (-1, total - 10):
        refused = server.http.get(url, params={"stream": "true", "starting_after": str(after)})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "starting_after"
        assert (
            f"before sequence number {total - 8} were dropped" in refused.json()["error"]["message"]
        )
    # the response itself is whole
    assert server.client.responses.retrieve(response_id).output_text == "Hello there!"


# -- a real model ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real(tiny_llama_dir: Path) -> Iterator[tuple[TestClient, Any]]:
    engine = AsyncLLM.from_engine_config(
        EngineConfig(
            model=str(tiny_llama_dir),
            dtype="float32",
            served_model_name="tiny",
            max_model_len=256,
            num_kv_blocks=64,
        )
    )
    settings = ServerSettings(reasoning_parser="qwen3", shutdown_engine_on_exit=False)
    with TestClient(build_app(engine, settings)) as http:
        client = openai.OpenAI(
            base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0
        )
        yield http, client
    engine.shutdown_sync()


def test_a_real_background_stream_keeps_its_newest_events(real: tuple[TestClient, Any]) -> None:
    http, client = real
    store = ResponseStore(max_events_per_response=16)
    http.app.state.responses_store = store  # type: ignore[attr-defined]
    fields: Any = {"model": "tiny", "input": "Count.", "max_output_tokens": 30, "temperature": 0}
    fields["extra_body"] = {"ignore_eos": True}
    with client.responses.create(**fields, background=True, stream=True) as stream:
        first = list(itertools.islice(stream, 4))  # then the client leaves; the run goes on
    response_id = first[0].response.id
    final = finished(_Client(client), response_id)  # type: ignore[arg-type]
    stored = store.get(response_id)
    assert stored is not None and stored.events is not None
    # up to 30 deltas and 8 events around them: a loaded machine merges tokens into fewer
    # deltas (24 were seen), so ask only for more events than the log keeps, by enough that
    # starting_after=3 below was dropped
    total = stored.events.end
    assert total > 16 + 4
    # memory after completion: the log's bound, within the store's bound on events in all
    assert (len(stored.events), stored.events.first) == (16, total - 16)
    assert store.num_events == 16
    rest = list(client.responses.retrieve(response_id, stream=True, starting_after=total - 17))
    assert [e.sequence_number for e in rest] == list(range(total - 16, total))
    assert rest[-1].type == "response.incomplete"  # ended by max_output_tokens
    plain = client.responses.create(**fields)
    assert rest[-1].response.output_text == final.output_text == plain.output_text
    with pytest.raises(openai.BadRequestError) as info:
        list(client.responses.retrieve(response_id, stream=True, starting_after=3))
    error: Any = info.value.body
    assert error["param"] == "starting_after"
    assert f"before sequence number {total - 16} were dropped" in error["message"]


class _Client:
    """What :func:`finished` reads of a test server: its ``openai`` client."""

    def __init__(self, client: Any) -> None:
        self.client = client


def steered_and_merged(engine: Any, regex: str) -> Any:
    """``engine.generate`` with its output forced to match ``regex`` (added to the request's
    sampling params here, not in the API request: a constrained request is not parsed for
    reasoning) and seen by a reader that fell behind after the first output: the first
    output, then every later one merged into one (``AsyncLLM``'s own merge)."""
    generate = engine.generate

    async def merged(prompt: Any, params: SamplingParams, *args: Any, **kwargs: Any) -> Any:
        params = params.clone(structured_outputs=StructuredOutputsParams(regex=regex))
        async with contextlib.aclosing(generate(prompt, params, *args, **kwargs)) as stream:
            rest: RequestOutput | None = None
            first = True
            async for output in stream:
                if first:
                    first = False
                    yield output
                    continue
                rest = output if rest is None else merge_delta_outputs(rest, output)
            if rest is not None:
                yield rest

    return merged


def test_a_multi_token_output_gives_the_message_only_its_own_tokens_logprobs(
    real: tuple[TestClient, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The text is forced (a regex) to be a thought, then the message; the engine's outputs
    after the first come as one, whose tokens are the thought's end, the tag and the whole
    message: the message's logprob tokens join to exactly its text, streamed or not, and the
    streamed deltas' logprobs are the non-streamed ones."""
    http, client = real
    engine = http.app.state.chassis.engine  # type: ignore[attr-defined]
    forced = "<think>\nLet me see.\n</think>\n\nParis is the capital."
    monkeypatch.setattr(engine, "generate", steered_and_merged(engine, forced.replace(".", r"\.")))
    fields: Any = {"model": "tiny", "input": "Capital?", "max_output_tokens": 60}
    fields.update(temperature=0, include=LOGPROBS, top_logprobs=2)

    def check(response: Any) -> list[dict[str, Any]]:
        assert [item.type for item in response.output] == ["reasoning", "message"]
        assert response.output[0].content[0].text.strip() == "Let me see."
        part = response.output[1].content[0]
        assert part.text == "Paris is the capital."
        got = [e.model_dump() for e in part.logprobs]
        # the message's own tokens, then the end-of-sequence token (no text) after them
        assert "".join(e["token"] for e in got[:-1]) == part.text
        assert got[-1]["token"] == "<|im_end|>"
        assert all(len(e["top_logprobs"]) == 2 for e in got)
        return got

    plain = check(client.responses.create(**fields))
    events = list(client.responses.create(**fields, stream=True))
    streamed = check(events[-1].response)
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(d.delta for d in deltas) == "Paris is the capital."
    for delta in deltas:  # each delta carries its own text's tokens (the EOS token: none)
        tokens = [e.token for e in delta.logprobs if e.token != "<|im_end|>"]
        assert "".join(tokens) == delta.delta
    assert [e.model_dump() for d in deltas for e in d.logprobs] == streamed
    assert [e["token"] for e in streamed] == [e["token"] for e in plain]
    assert [e["logprob"] for e in streamed] == pytest.approx(
        [e["logprob"] for e in plain], abs=1e-4
    )
