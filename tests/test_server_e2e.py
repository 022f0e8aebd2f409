"""End to end: a real ``chassis serve`` process on a tiny random Llama, driven by the official
``openai`` client over real HTTP.

One server (module scope) serves every test; its teardown sends SIGTERM and checks a clean
exit. The model is random, so tests check structure and consistency (greedy runs agree,
streamed text equals the non-streamed text), not words.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fixtures_models import tiny_llama_dir  # noqa: F401

openai = pytest.importorskip("openai")

API_KEY = "e2e-key"
MAX_MODEL_LEN = 256
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    def __init__(self, proc: subprocess.Popen, base: str, log: Path, model: str) -> None:
        self.proc = proc
        self.base = base
        self.log = log
        self.model = model

    def client(self, api_key: str = API_KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key=api_key, max_retries=0)

    def metric(self, name: str) -> float:
        text = httpx.get(
            self.base + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}
        ).text
        for line in text.splitlines():
            if line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{name} not in /metrics")


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:  # noqa: F811
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    cmd = [
        sys.executable,
        "-m",
        "chassis.serve.cli",
        "serve",
        str(tiny_llama_dir),
        "--served-model-name",
        "tiny",
        "--port",
        str(port),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--num-kv-blocks",
        "64",
        "--enforce-eager",
        "--dtype",
        "float32",
        "--disable-access-log",
    ]
    env = {**os.environ, "CHASSIS_API_KEY": API_KEY}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    try:
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"chassis serve exited early:\n{log.read_text()}")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"chassis serve not healthy in time:\n{log.read_text()}")
            time.sleep(0.5)
        yield Server(proc, base, log, "tiny")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                raise AssertionError(f"no exit after SIGTERM:\n{log.read_text()}") from None
    output = log.read_text()
    assert f"ready on {base}" in output
    assert "received SIGTERM" in output
    assert "Traceback" not in output, output


def test_models_and_auth(server: Server) -> None:
    assert [m.id for m in server.client().models.list()] == ["tiny"]
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").models.list()
    assert httpx.get(server.base + "/health").status_code == 200  # no key needed


def test_greedy_completion_is_deterministic_and_streams_the_same(server: Server) -> None:
    client = server.client()
    kwargs = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 8}
    first = client.completions.create(temperature=0, **kwargs)
    second = client.completions.create(temperature=0, **kwargs)
    assert first.choices[0].text == second.choices[0].text
    assert first.choices[0].finish_reason in ("length", "stop")
    assert first.usage.completion_tokens <= 8 and first.usage.prompt_tokens > 0
    streamed = "".join(
        chunk.choices[0].text
        for chunk in client.completions.create(temperature=0, stream=True, **kwargs)
        if chunk.choices
    )
    assert streamed == first.choices[0].text


def test_completion_batch_n_logprobs(server: Server) -> None:
    response = server.client().completions.create(
        model="tiny", prompt=["a", "b"], n=2, max_tokens=3, logprobs=2, seed=7
    )
    assert sorted(c.index for c in response.choices) == [0, 1, 2, 3]
    for choice in response.choices:
        logprobs = choice.logprobs
        assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs)
        assert all(lp <= 0 for lp in logprobs.token_logprobs)


def test_prompt_logprobs(server: Server) -> None:
    response = server.client().completions.create(
        model="tiny", prompt="Hello big world", max_tokens=1, extra_body={"prompt_logprobs": 1}
    )
    prompt_logprobs = response.choices[0].model_extra["prompt_logprobs"]
    assert len(prompt_logprobs) == response.usage.prompt_tokens
    assert prompt_logprobs[0] is None
    for position in prompt_logprobs[1:]:
        assert all(entry["logprob"] <= 0 for entry in position.values())


def test_chat_non_streaming_and_streaming_agree(server: Server) -> None:
    client = server.client()
    full = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=10, temperature=0)
    message = full.choices[0].message
    assert message.role == "assistant" and isinstance(message.content, str)
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=CHAT,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == (
        full.usage.completion_tokens
    )
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_n_and_top_logprobs(server: Server) -> None:
    response = server.client().chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=4, n=2, logprobs=True, top_logprobs=3
    )
    assert [c.index for c in response.choices] == [0, 1]
    for choice in response.choices:
        for token in choice.logprobs.content:
            assert len(token.top_logprobs) == 3


def test_errors(server: Server) -> None:
    client = server.client()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=1, temperature=-1)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="hello " * 400, max_tokens=1)
    assert "context length" in str(info.value)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=MAX_MODEL_LEN)


def test_tokenize_detokenize_roundtrip(server: Server) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    tokens = httpx.post(
        server.base + "/tokenize",
        json={"prompt": "Hello world", "add_special_tokens": False},
        headers=headers,
    ).json()["tokens"]
    text = httpx.post(server.base + "/detokenize", json={"tokens": tokens}, headers=headers).json()[
        "prompt"
    ]
    assert text == "Hello world"


def test_disconnect_mid_stream_frees_the_request(server: Server) -> None:
    body = {
        "model": "tiny",
        "prompt": "count",
        "max_tokens": MAX_MODEL_LEN - 10,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {API_KEY}"}
    generated_before = server.metric("chassis:generation_tokens_total")
    with httpx.stream(
        "POST", server.base + "/v1/completions", json=body, headers=headers, timeout=60
    ) as response:
        seen = 0
        for line in response.iter_lines():
            if line.startswith("data: {"):
                json.loads(line[len("data: ") :])
                seen += 1
                if seen == 3:
                    break  # leaving the block closes the connection mid-stream
    # the engine drops the request well before it could have generated 246 tokens
    deadline = time.monotonic() + 5
    while server.metric("chassis:num_requests_running") != 0:
        assert time.monotonic() < deadline, "the aborted request is still running"
        time.sleep(0.1)
    assert server.metric("chassis:kv_cache_usage_perc") == 0.0
    generated = server.metric("chassis:generation_tokens_total") - generated_before
    assert generated < 100, f"{generated} tokens generated: the request was not aborted"


def test_metrics_count_requests(server: Server) -> None:
    before = server.metric("chassis:generation_tokens_total")
    server.client().completions.create(
        model="tiny", prompt="x", max_tokens=4, extra_body={"ignore_eos": True}
    )
    assert server.metric("chassis:generation_tokens_total") == before + 4
