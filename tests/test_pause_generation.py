"""Pausing generation (vLLM's ``pause_generation`` / ``resume_generation``, and ``sleep``'s
``mode``): what happens to the unfinished requests (``abort`` ends them, ``wait`` lets
them finish, ``keep`` freezes them), that requests made while paused are held and run
after ``resume`` with the tokens they would have had, and the refusals. Through the engine
core (stepped by hand), ``AsyncLLM`` (engine core in its own process) and the development
routes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from engines import tiny_async_llm
from fastapi.testclient import TestClient

from chassis import LLM, SamplingParams
from chassis.core.async_llm import AsyncLLM
from chassis.core.engine_core import EngineCore
from chassis.core.errors import EngineBusyError, EngineSleepingError
from chassis.core.request import FinishReason
from chassis.serve.app import build_app
from chassis.serve.settings import ServerSettings

pytestmark = pytest.mark.timeout(300)

PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ENGINE = {"max_model_len": 256, "num_kv_blocks": 64, "enable_sleep_mode": True}


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> Iterator[LLM]:
    engine = LLM(str(tiny_llama_dir), dtype="float32", **ENGINE)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def reference(llm: LLM) -> dict[str, list[int]]:
    """Each prompt's greedy tokens, run without any pause."""
    outputs = llm.generate(PROMPTS, GREEDY)
    return {p: list(o.outputs[0].token_ids) for p, o in zip(PROMPTS, outputs, strict=True)}


@pytest.fixture
def core(llm: LLM, reference) -> Iterator[EngineCore]:
    """The module's engine core, left resumed, awake and idle whatever the test did."""
    engine = llm.engine
    yield engine
    engine.resume()
    if engine.is_sleeping():
        engine.wake_up()
    engine.abort_requests([f"r{i}" for i in range(len(PROMPTS))])
    while engine.has_unfinished():
        engine.step()


class _Run:
    """Requests added to an engine core by hand, and what its steps gave them."""

    def __init__(self, llm: LLM) -> None:
        self.llm, self.core = llm, llm.engine
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, str | None] = {}
        self.errors: dict[str, object] = {}

    def add(self, index: int) -> None:
        (request,) = self.llm.input_processor.process(PROMPTS[index], GREEDY, f"r{index}")
        self.core.add_request(request)

    def step(self) -> int:
        outputs = self.core.step().outputs
        for out in outputs:
            self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                self.finish[out.request_id] = FinishReason(out.finish_reason).value
            if out.error is not None:
                self.errors[out.request_id] = out.error
        return len(outputs)

    def drain(self) -> None:
        while self.core.has_unfinished():
            self.step()


def test_abort_ends_the_unfinished_and_holds_the_new(llm: LLM, core: EngineCore, reference):
    run = _Run(llm)
    run.add(0)
    run.add(1)
    run.step()
    assert core.pause("abort") is True and core.is_paused()
    run.add(2)  # held: not in the scheduler
    run.drain()
    assert run.finish == {"r0": "abort", "r1": "abort"}
    assert "r2" not in run.tokens and not core.scheduler.has_unfinished()
    core.resume()
    assert not core.is_paused()
    run.drain()
    assert run.tokens["r2"] == reference[PROMPTS[2]] and run.finish["r2"] == "length"


def test_wait_lets_the_unfinished_finish(llm: LLM, core: EngineCore, reference):
    run = _Run(llm)
    run.add(0)
    run.step()
    assert core.pause("wait") is False and not core.pause_drained()
    run.add(1)  # held until resume
    run.drain()
    assert core.pause_drained()
    assert run.tokens["r0"] == reference[PROMPTS[0]] and "r1" not in run.tokens
    core.resume()
    run.drain()
    assert run.tokens["r1"] == reference[PROMPTS[1]]


def test_keep_freezes_them_until_resume(llm: LLM, core: EngineCore, reference):
    run = _Run(llm)
    run.add(0)
    run.add(1)
    run.step()
    run.step()
    assert core.pause("keep") is True
    assert not core.has_unfinished() and core.scheduler.has_unfinished()
    assert run.step() == 0  # a step runs nothing
    core.resume()
    run.drain()
    assert run.tokens == {"r0": reference[PROMPTS[0]], "r1": reference[PROMPTS[1]]}


def test_a_held_request_aborted_by_its_client_is_dropped(llm: LLM, core: EngineCore):
    run = _Run(llm)
    core.pause("abort")
    run.add(0)
    core.abort_requests(["r0"])
    core.resume()
    run.drain()
    assert run.tokens == {}


def test_sleep_modes(llm: LLM, core: EngineCore, reference):
    run = _Run(llm)
    run.add(0)
    run.step()
    with pytest.raises(EngineBusyError, match="mode 'keep' while 1 request"):
        llm.sleep(1, "keep")
    with pytest.raises(ValueError, match="mode must be"):
        llm.sleep(1, "drain")
    assert not llm.is_sleeping()

    # wait: the sleep runs in the step that finishes the last request; a request made
    # meanwhile is held, then refused as made while asleep
    assert core.sleep(1, "wait") == [] and core.sleep_progress()[0] is True
    run.add(1)
    run.drain()
    assert run.tokens["r0"] == reference[PROMPTS[0]]
    assert llm.is_sleeping() and core.sleep_progress() == [False, ["kv_cache", "weights"], None]
    assert run.finish["r1"] == "abort" and run.errors["r1"].engine_sleeping
    with pytest.raises(EngineSleepingError):
        llm.generate(PROMPTS[0], GREEDY)
    llm.wake_up()

    # abort (the default): ended, then asleep
    run = _Run(llm)
    run.add(2)
    run.step()
    llm.sleep(2)
    assert llm.is_sleeping()
    run.drain()
    assert run.finish == {"r2": "abort"}
    llm.wake_up()
    assert [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)] == [
        reference[p] for p in PROMPTS
    ]


def test_a_sleep_waiting_behind_frozen_requests_is_refused(llm: LLM, core: EngineCore):
    run = _Run(llm)
    run.add(0)
    run.step()
    core.pause("keep")
    with pytest.raises(EngineBusyError, match="paused with mode 'keep'"):
        core.sleep(1, "wait")
    assert not core.is_sleeping()


def test_wake_up_cancels_a_sleep_still_waiting(llm: LLM, core: EngineCore, reference):
    """Woken before its requests finished, a ``sleep(mode="wait")`` never runs; the request
    it held runs after the first one with its usual tokens."""
    run = _Run(llm)
    run.add(0)
    run.step()
    assert core.sleep(1, "wait") == []
    run.add(1)  # held by the waiting sleep
    assert core.wake_up() == [] and core.sleep_progress() == [False, [], None]
    assert not core.is_paused()
    run.drain()
    assert not core.is_sleeping()
    assert run.tokens == {"r0": reference[PROMPTS[0]], "r1": reference[PROMPTS[1]]}


def test_keep_is_refused_while_a_wait_waits(llm: LLM, core: EngineCore, reference):
    """Frozen, the requests a waiting pause or sleep waits for would never finish."""
    run = _Run(llm)
    run.add(0)
    run.step()
    assert core.pause("wait") is False
    with pytest.raises(EngineBusyError, match="a pause with mode 'wait' is waiting"):
        core.pause("keep")
    run.drain()
    assert core.pause_drained() and run.tokens["r0"] == reference[PROMPTS[0]]
    core.pause("keep")  # drained: nothing left to wait for
    core.resume()
    run = _Run(llm)
    run.add(1)
    run.step()
    core.sleep(1, "wait")
    with pytest.raises(EngineBusyError, match="a sleep with mode 'wait' is waiting"):
        core.pause("keep")
    run.drain()
    assert core.is_sleeping() and run.tokens["r1"] == reference[PROMPTS[1]]


def test_async_scheduling_plans_in_flight_are_collected(tiny_llama_dir) -> None:
    """With ``--async-scheduling`` a plan is in flight after each step: ``keep`` collects
    it (its tokens are not lost) and ``abort`` collects it before ending the requests."""
    ahead = LLM(str(tiny_llama_dir), dtype="float32", async_scheduling=True, **ENGINE)
    try:
        expected = [list(o.outputs[0].token_ids) for o in ahead.generate(PROMPTS[:2], GREEDY)]
        core = ahead.engine
        run = _Run(ahead)
        run.add(0)
        run.add(1)
        run.step()
        run.step()
        assert core._in_flight is not None
        core.pause("keep")
        assert core._in_flight is None
        run.step()  # sends what the collected plan produced
        core.resume()
        run.drain()
        assert [run.tokens["r0"], run.tokens["r1"]] == expected
        run = _Run(ahead)
        run.add(2)
        run.step()
        run.step()
        core.pause("abort")
        run.drain()
        assert run.finish == {"r2": "abort"} and not core.scheduler.has_unfinished()
        core.resume()
    finally:
        ahead.shutdown()


def test_bad_modes_are_refused(core: EngineCore):
    for bad in ("drain", "", None, 1):
        with pytest.raises(ValueError, match="mode must be 'abort'"):
            core.pause(bad)  # type: ignore[arg-type]
    assert not core.is_paused()


# -- AsyncLLM and the routes ------------------------------------------------------------------


@pytest.fixture(scope="module")
def async_engine(tiny_llama_dir) -> Iterator[AsyncLLM]:
    engine = tiny_async_llm(tiny_llama_dir, enable_sleep_mode=True)
    yield engine
    engine.shutdown_sync()


async def _collect(engine: AsyncLLM, prompt: str, request_id: str, params=GREEDY):
    tokens: list[int] = []
    finish = None
    async for out in engine.generate(prompt, params, request_id):
        tokens += out.outputs[0].token_ids
        finish = out.outputs[0].finish_reason
    return tokens, finish


async def _started(engine: AsyncLLM, prompt: str, request_id: str, params: SamplingParams):
    """A task collecting the request's tokens and finish reason, once it has its first."""
    stream = engine.generate(prompt, params, request_id)
    first = await stream.__anext__()

    async def rest() -> tuple[list[int], str | None]:
        tokens, finish = list(first.outputs[0].token_ids), first.outputs[0].finish_reason
        async for out in stream:
            tokens += out.outputs[0].token_ids
            finish = out.outputs[0].finish_reason
        return tokens, finish

    return asyncio.create_task(rest())


def test_async_llm_pauses_and_resumes(async_engine: AsyncLLM, reference) -> None:
    #: (the prompts and these fill most of max_model_len: the stream is still running when
    #: the pause comes)
    long = SamplingParams(temperature=0.0, max_tokens=230, ignore_eos=True)

    async def main() -> None:
        # wait: returns once the running request has finished, with all its tokens
        running = await _started(async_engine, PROMPTS[0], "a1", long)
        await async_engine.pause_generation(mode="wait")
        tokens, finish = await running
        assert len(tokens) == 230 and finish == "length"
        assert await async_engine.is_paused()
        # a request made while paused waits for resume, then gets its usual tokens
        held = asyncio.create_task(_collect(async_engine, PROMPTS[1], "a2"))
        await asyncio.sleep(0.5)
        assert not held.done()
        await async_engine.resume_generation()
        assert await held == (reference[PROMPTS[1]], "length")
        assert not await async_engine.is_paused()

        # abort: a running stream ends with finish reason abort
        running = await _started(async_engine, PROMPTS[0], "a3", long)
        await async_engine.pause_generation()
        tokens, finish = await running
        assert finish == "abort" and len(tokens) < 230
        await async_engine.resume_generation()

        # sleep(mode="wait") returns once the running request finished and the engine sleeps
        running = await _started(async_engine, PROMPTS[2], "a4", long)
        await async_engine.sleep(1, mode="wait")
        tokens, finish = await running
        assert len(tokens) == 230 and finish == "length"
        assert await async_engine.is_sleeping()
        await async_engine.wake_up()
        assert await _collect(async_engine, PROMPTS[1], "a5") == (reference[PROMPTS[1]], "length")
        with pytest.raises(ValueError, match="mode must be"):
            await async_engine.pause_generation(mode="later")

    asyncio.run(asyncio.wait_for(main(), 120))


def test_the_pause_routes(async_engine: AsyncLLM) -> None:
    settings = ServerSettings(server_dev_mode=True, shutdown_engine_on_exit=False)
    with TestClient(build_app(async_engine, settings)) as client:
        assert client.get("/is_paused").json() == {"is_paused": False}
        for route, query, param in (
            ("/pause", "?mode=later", "mode"),
            ("/pause", "?clear_cache=maybe", "clear_cache"),
            ("/sleep", "?mode=later", "mode"),
        ):
            response = client.post(route + query)
            assert response.status_code == 400 and response.json()["error"]["param"] == param
        assert client.post("/pause?mode=wait&clear_cache=false").json() == {"status": "paused"}
        assert client.get("/is_paused").json() == {"is_paused": True}
        assert client.post("/resume").json() == {"status": "resumed"}
        assert client.get("/is_paused").json() == {"is_paused": False}
        body = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
        assert client.post("/v1/completions", json=body).status_code == 200
        assert client.post("/sleep?level=1&mode=keep").status_code == 200  # nothing running
        assert client.post("/wake_up").status_code == 200
    with TestClient(build_app(async_engine, ServerSettings(shutdown_engine_on_exit=False))) as c:
        assert c.post("/pause").status_code == 404  # development mode only
