"""``AsyncLLM`` with the engine core in a child process: streaming, n, abort, engine death."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from dataclasses import replace

import pytest
from engines import tiny_async_llm

from chassis.core.errors import EngineDeadError, RequestFailedError
from chassis.core.request import RequestError
from chassis.core.sampling_params import SamplingParams


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async-scheduling"])
def engine(tiny_llama_dir, request):
    llm = tiny_async_llm(tiny_llama_dir, async_scheduling=request.param)
    yield llm
    llm.shutdown_sync()


async def collect(engine, prompt, params, request_id, delta=True):
    outs = []
    async for out in engine.generate(prompt, params, request_id, delta=delta):
        outs.append(out)
    return outs


def test_streams_deltas_that_add_up(engine):
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)

    async def main():
        deltas = await collect(engine, "Hello there", params, "a")
        full = await collect(engine, "Hello there", params, "b", delta=False)
        return deltas, full

    deltas, full = asyncio.run(main())
    assert deltas[-1].finished and full[-1].finished
    tokens = [t for d in deltas for t in d.outputs[0].token_ids]
    assert tokens == full[-1].outputs[0].token_ids and len(tokens) == 10
    assert "".join(d.outputs[0].text for d in deltas) == full[-1].outputs[0].text
    assert full[-1].outputs[0].finish_reason == "length"


def test_a_consumer_that_falls_behind_gets_merged_deltas(engine):
    """Outputs that queued up while the consumer was busy arrive as one delta (fewer stream
    events), which adds up to the same tokens, text and logprobs as one-token deltas."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2, n=2)

    async def slow(request_id):
        outs = []
        async for out in engine.generate("Hello there", params, request_id):
            outs.append(out)
            await asyncio.sleep(0.3)  # several engine steps pass meanwhile
        return outs

    async def main():
        return await slow("slow"), await collect(engine, "Hello there", params, "fast")

    slow_outs, fast_outs = asyncio.run(main())
    assert slow_outs[-1].finished and len(slow_outs) < 12
    assert any(len(c.token_ids) > 1 for out in slow_outs for c in out.outputs)
    for index in (0, 1):
        parts = {
            name: [c for out in outs for c in out.outputs if c.index == index]
            for name, outs in (("slow", slow_outs), ("fast", fast_outs))
        }
        tokens = {name: [t for c in cs for t in c.token_ids] for name, cs in parts.items()}
        assert tokens["slow"] == tokens["fast"] and len(tokens["slow"]) == 12
        texts = {name: "".join(c.text for c in cs) for name, cs in parts.items()}
        assert texts["slow"] == texts["fast"]
        logprobs = [lp for c in parts["slow"] for lp in c.logprobs]
        assert [next(iter(lp)) for lp in logprobs] == tokens["slow"]
        assert parts["slow"][-1].finish_reason == "length"


def test_outputs_queued_before_an_abort_are_still_delivered(engine):
    """An abort (or engine death) behind queued deltas ends the stream after them: the
    merged tokens are yielded first, then the error is raised."""
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def main():
        stream = engine.generate("Hello there", params, "queued-abort")
        await stream.__anext__()
        queue = engine._queues["queued-abort"]
        for _ in range(1000):  # let a few steps' outputs queue up
            if queue.qsize() >= 3:
                break
            await asyncio.sleep(0.005)
        queued = queue.qsize()
        await engine.abort("queued-abort")  # no await inside: nothing else is delivered
        received = []
        with pytest.raises(asyncio.CancelledError):
            async for out in stream:
                received.append(out)
        return queued, received

    queued, received = asyncio.run(main())
    assert queued >= 3
    (merged,) = received
    assert len(merged.outputs[0].token_ids) == queued and not merged.finished


def test_outputs_queued_before_a_request_failure_are_still_delivered(engine):
    """A failure of the request alone (the engine core's output with an ``error``) behind
    queued deltas ends the stream as an abort does: the merged tokens first, then
    ``RequestFailedError``."""
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def main():
        stream = engine.generate("Hello there", params, "queued-failure", delta=True)
        first = await stream.__anext__()
        queue = engine._queues["queued-failure"]
        for _ in range(1000):  # let a few steps' outputs queue up
            if queue.qsize() >= 3:
                break
            await asyncio.sleep(0.005)
        queued = [t for out in list(queue._queue) for t in out.outputs[0].token_ids]
        error = RequestError(message="why", client_error=True)
        (c,) = first.outputs
        failed = [replace(c, text="", token_ids=[], finish_reason="abort", error=error)]
        queue.put_nowait(replace(first, outputs=failed, finished=True))  # no await before
        received = []
        with pytest.raises(RequestFailedError, match="why"):
            async for out in stream:
                received.append(out)
        return queued, received

    queued, received = asyncio.run(main())
    assert len(queued) >= 3
    (merged,) = received
    assert merged.outputs[0].token_ids == queued and not merged.finished


def test_concurrent_requests_and_n(engine):
    params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, n=3, seed=7)

    async def main():
        return await asyncio.gather(
            *[collect(engine, f"prompt {i}", params, f"n{i}", delta=False) for i in range(4)]
        )

    results = asyncio.run(main())
    for outs in results:
        final = outs[-1]
        assert final.finished and sorted(o.index for o in final.outputs) == [0, 1, 2]
        assert all(len(o.token_ids) == 6 for o in final.outputs)
    # Seeds make each request reproducible: the same prompt and seed give the same completions.
    again = asyncio.run(collect(engine, "prompt 0", params, "again", delta=False))[-1]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in results[0][-1].outputs]


def test_bad_input_raises_before_streaming(engine):
    async def main():
        with pytest.raises(ValueError, match="maximum context length"):
            await collect(engine, "hi", SamplingParams(max_tokens=10_000), "bad")

    asyncio.run(main())


def test_check_request_refuses_what_generate_refuses_and_submits_nothing(engine):
    refused = [
        ("hi", SamplingParams(max_tokens=10_000), {}),
        ("word " * 300, SamplingParams(max_tokens=4), {}),
        ("hi", SamplingParams(stop_token_ids=[1_000_000]), {}),
        ("hi", SamplingParams(), {"priority": 1}),
        ("hi", SamplingParams(), {"cache_salt": ""}),
    ]

    async def main():
        for prompt, params, extra in refused:
            with pytest.raises(ValueError) as by_generate:
                stream = engine.generate(prompt, params, "refused", **extra)
                await stream.__anext__()
            with pytest.raises(ValueError) as by_check:
                await engine.check_request(prompt, params, **extra)
            assert str(by_check.value) == str(by_generate.value)
        assert await engine.check_request("hi", SamplingParams(max_tokens=4)) is None
        return engine.stats()

    stats = asyncio.run(main())
    assert stats.num_running == 0 and stats.num_waiting == 0


def test_closing_the_stream_aborts_and_frees_blocks(engine):
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def main():
        stream = engine.generate("A long generation", params, "gone")
        await stream.__anext__()
        await stream.aclose()
        # The abort reaches the engine core; its next stats snapshot shows no running request.
        for _ in range(100):
            await asyncio.sleep(0.05)
            stats = engine.stats()
            if stats.num_running == 0 and stats.kv_cache_usage == 0.0:
                return stats
        return engine.stats()

    stats = asyncio.run(main())
    assert stats.num_running == 0
    assert stats.kv_cache_usage == 0.0


def test_killing_the_engine_core_fails_pending_requests(tiny_llama_dir):
    engine = tiny_async_llm(tiny_llama_dir)
    params = SamplingParams(temperature=0.0, max_tokens=250, ignore_eos=True)

    async def main():
        died = asyncio.Event()
        engine.add_dead_callback(died.set)
        stream = engine.generate("Keep going", params, "victim")
        await stream.__anext__()
        os.kill(engine.client.process.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        await asyncio.wait_for(died.wait(), 10)
        with pytest.raises(EngineDeadError):
            await engine.check_health()
        with pytest.raises(EngineDeadError):
            await collect(engine, "after death", params, "late")

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        engine.shutdown_sync()
    assert not engine.client.process.is_alive()


def test_an_engine_core_exception_fails_cleanly_and_shutdown_returns(tiny_llama_dir):
    """The engine core raising (here: a message it cannot decode, the one way to make it
    raise from outside) kills the engine; clients get the exception without the engine's
    traceback (that stays in its log), and shutdown returns (it hung on the open socket)."""
    from chassis.core.engine_core_proc import ADD

    engine = tiny_async_llm(tiny_llama_dir)

    async def main() -> str:
        died = asyncio.Event()
        engine.add_dead_callback(died.set)
        engine.client._send(ADD, b"not msgpack")
        await asyncio.wait_for(died.wait(), 30)
        with pytest.raises(EngineDeadError) as info:
            await engine.check_health()
        return str(info.value)

    try:
        message = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        done = threading.Thread(target=engine.shutdown_sync)
        done.start()
        done.join(30)
    assert not done.is_alive(), "shutdown hung after the engine core failed"
    assert "engine core failed" in message and "Error" in message, message
    # the type only: the message of a crash may hold internals (here the decoder's)
    assert message.endswith(
        "ValidationError in the engine core; its message and traceback are in the server log"
    ), message
    assert "Expected" not in message, message
    assert "Traceback" not in message and ".py" not in message, message


def test_clients_get_a_crash_s_type_or_a_message_written_for_them() -> None:
    from chassis.core.engine_core_proc import crash_message_for_clients
    from chassis.core.errors import RankExitedError
    from chassis.core.tp_watchdog import StepTimeoutError

    secret = RuntimeError('boom at /srv/x.py\nTraceback (most recent call last):\n  File "y"')
    assert crash_message_for_clients(secret) == (
        "RuntimeError in the engine core; its message and traceback are in the server log"
    )
    timeout = StepTimeoutError("step 'execute' did not complete within 2 s", "stacks...")
    assert crash_message_for_clients(timeout) == "step 'execute' did not complete within 2 s"
    try:  # the summary also when the timeout is the cause of what the loop raised
        try:
            raise timeout
        except StepTimeoutError as cause:
            raise RuntimeError("shutting the group down failed") from cause
    except RuntimeError as wrapped:
        assert crash_message_for_clients(wrapped) == str(timeout)
    exited = RankExitedError("tensor-parallel rank 1 exited with code -9 during 'execute'")
    assert crash_message_for_clients(exited) == str(exited)
