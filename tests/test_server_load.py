"""Bounded load and client disconnects on a real ``chassis serve`` (tiny random Llama).

One server (module scope, ``--max-num-seqs 64``, KV cache large enough for every request at
once) serves the tests. After each, the engine must be idle within seconds: no request
running or waiting and ``chassis:kv_cache_usage_perc`` back to 0, i.e. no leaked request and
no leaked KV block, whether the clients finished or hung up.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_process import ServerProcess, running_server

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.timeout(240)

NUM_CLIENTS = 64
MAX_TOKENS = 200
MAX_MODEL_LEN = 512
# every request at once: 64 x ceil((prompt + 200) / 16 tokens per block) is under 1024
NUM_KV_BLOCKS = 1536


@pytest.fixture(scope="module")
def server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    with running_server(
        tiny_llama_dir,
        tmp_path_factory.mktemp("serve-load"),
        max_model_len=MAX_MODEL_LEN,
        num_kv_blocks=NUM_KV_BLOCKS,
        extra_args=["--max-num-seqs", str(NUM_CLIENTS)],
    ) as server:
        yield server


async def _stream_completion(client: Any, index: int) -> dict[str, Any]:
    """One streaming request (chat for odd ``index``, completions for even); what it got."""
    common = {
        "model": "tiny",
        "max_tokens": MAX_TOKENS,
        "temperature": 0.8,
        "seed": index,
        "stream": True,
        "stream_options": {"include_usage": True},
        "extra_body": {"ignore_eos": True},
    }
    text: list[str] = []
    finish: list[str | None] = []
    usage = None
    if index % 2:
        messages = [{"role": "user", "content": f"Client {index}: tell me a long story."}]
        stream = await client.chat.completions.create(messages=messages, **common)
        async for chunk in stream:
            for choice in chunk.choices:
                text.append(choice.delta.content or "")
                finish.append(choice.finish_reason)
            usage = chunk.usage or usage
    else:
        prompt = f"Client {index} says: once upon a time"
        stream = await client.completions.create(prompt=prompt, **common)
        async for chunk in stream:
            for choice in chunk.choices:
                text.append(choice.text)
                finish.append(choice.finish_reason)
            usage = chunk.usage or usage
    return {"text": "".join(text), "finish": [f for f in finish if f], "usage": usage}


async def _running(http: httpx.AsyncClient, server: ServerProcess) -> float:
    """``chassis:num_requests_running`` now."""
    text = (await http.get(server.base + "/metrics")).text
    for line in text.splitlines():
        if line.startswith("chassis:num_requests_running{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("chassis:num_requests_running not in /metrics")


async def _sample_running(server: ServerProcess, stop: asyncio.Event) -> float:
    """The largest ``chassis:num_requests_running`` seen while ``stop`` is unset."""
    peak = 0.0
    async with httpx.AsyncClient(headers=server.headers, timeout=10) as http:
        while not stop.is_set():
            peak = max(peak, await _running(http, server))
            await asyncio.sleep(0.2)
    return peak


@pytest.mark.slow
def test_64_concurrent_streams_complete_and_leak_nothing(server: ServerProcess) -> None:
    before = server.metrics()

    async def run() -> tuple[list[dict[str, Any]], float]:
        stop = asyncio.Event()
        sampler = asyncio.create_task(_sample_running(server, stop))
        async with server.async_client(timeout=120) as client:
            try:
                results = await asyncio.gather(
                    *(_stream_completion(client, i) for i in range(NUM_CLIENTS))
                )
            finally:
                stop.set()
        return results, await sampler

    start = time.monotonic()
    results, peak_running = asyncio.run(run())
    elapsed = time.monotonic() - start

    for index, result in enumerate(results):
        assert result["finish"] == ["length"], (index, result["finish"])
        assert result["usage"] is not None, index
        assert result["usage"].completion_tokens == MAX_TOKENS, (index, result["usage"])
        assert result["text"], index
    total = sum(r["usage"].completion_tokens for r in results)
    assert total == NUM_CLIENTS * MAX_TOKENS
    # the requests really ran side by side in the engine's batch
    assert peak_running >= NUM_CLIENTS // 2, f"peak running {peak_running}"

    after = server.wait_idle(timeout=5)
    generated = after["chassis:generation_tokens_total"] - before["chassis:generation_tokens_total"]
    assert generated == NUM_CLIENTS * MAX_TOKENS
    length_key = 'chassis:request_success_total{finished_reason="length"}'
    assert after[length_key] - before.get(length_key, 0.0) == NUM_CLIENTS
    assert after["chassis:num_preemptions_total"] == before["chassis:num_preemptions_total"]
    print(f"{NUM_CLIENTS} streams x {MAX_TOKENS} tokens in {elapsed:.1f} s")


def test_streaming_disconnects_mid_stream_free_the_requests(server: ServerProcess) -> None:
    """Eight streams; four hang up after three chunks, the others finish."""
    long_tokens = MAX_MODEL_LEN - 64  # far more than can be generated before the hang-up

    async def client_task(client: Any, index: int) -> str | None:
        hang_up = index % 2 == 0
        stream = await client.completions.create(
            model="tiny",
            prompt=f"stream {index}",
            max_tokens=long_tokens if hang_up else 16,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        seen = 0
        finish = None
        async for chunk in stream:
            seen += 1
            finish = chunk.choices[0].finish_reason if chunk.choices else finish
            if hang_up and seen == 3:
                await stream.close()  # closes the HTTP connection mid-stream
                return None
        return finish

    async def run() -> list[str | None]:
        async with server.async_client(timeout=60) as client:
            return await asyncio.gather(*(client_task(client, i) for i in range(8)))

    before = server.metric("chassis:generation_tokens_total")
    finishes = asyncio.run(run())
    assert finishes == [None, "length"] * 4
    server.wait_idle(timeout=5)
    generated = server.metric("chassis:generation_tokens_total") - before
    # the four finished streams made 64 tokens; the hung-up ones stopped far short of 448 each
    assert generated < 4 * 16 + 4 * long_tokens // 2, generated


def test_non_streaming_disconnect_frees_the_request(server: ServerProcess) -> None:
    """A non-streaming client hangs up as soon as its request runs; the server aborts it."""
    body = {
        "model": "tiny",
        "prompt": "a long answer",
        "max_tokens": MAX_MODEL_LEN - 64,
        "ignore_eos": True,
    }

    async def run() -> None:
        async with httpx.AsyncClient(headers=server.headers, timeout=60) as http:
            request = asyncio.create_task(http.post(server.base + "/v1/completions", json=body))
            deadline = time.monotonic() + 10
            while await _running(http, server) < 1:
                assert not request.done(), request.result().text
                assert time.monotonic() < deadline, "the request never ran"
                await asyncio.sleep(0.01)
            # cancelling an httpx request mid-response closes its connection
            request.cancel()
            with pytest.raises(asyncio.CancelledError):
                await request

    before = server.metric("chassis:generation_tokens_total")
    asyncio.run(run())
    server.wait_idle(timeout=5)
    generated = server.metric("chassis:generation_tokens_total") - before
    assert generated < body["max_tokens"], f"{generated} tokens: the request was not aborted"
