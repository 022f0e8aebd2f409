"""Disconnects, engine death and shutdown: requests are aborted, errors are 503, the server exits.

The in-process tests drive the ASGI app directly, so the client's disconnect is an explicit
``http.disconnect`` message; the subprocess tests run the real uvicorn server
(``chassis.serve.server.run_server``) around the fake engine and send it real signals.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_engine import FakeAsyncLLM
from fastapi.testclient import TestClient

from chassis.serve.app import build_app, get_state
from chassis.serve.http_protocol import HttpToolsProtocol

TESTS_DIR = Path(__file__).parent
CHAT = [{"role": "user", "content": "hi"}]


class AsgiCall:
    """One HTTP request sent straight to an ASGI app, with a client that can hang up."""

    def __init__(self, app: Any, path: str, body: dict[str, Any]) -> None:
        self.app = app
        self.body = json.dumps(body).encode()
        self.path = path
        self.hang_up = asyncio.Event()
        self.messages: list[dict[str, Any]] = []
        self.got_body = asyncio.Event()
        self._sent = False

    async def receive(self) -> dict[str, Any]:
        if not self._sent:
            self._sent = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.hang_up.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.messages.append(message)
        if message["type"] == "http.response.body" and message.get("body"):
            self.got_body.set()

    def start(self) -> asyncio.Task[None]:
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": self.path,
            "raw_path": self.path.encode(),
            "root_path": "",
            "query_string": b"",
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(self.body)).encode()),
            ],
            "client": ("127.0.0.1", 50000),
            "server": ("127.0.0.1", 8000),
        }
        return asyncio.ensure_future(self.app(scope, self.receive, self.send))

    @property
    def status(self) -> int | None:
        for m in self.messages:
            if m["type"] == "http.response.start":
                return m["status"]
        return None

    @property
    def text(self) -> str:
        return b"".join(
            m.get("body", b"") for m in self.messages if m["type"] == "http.response.body"
        ).decode()


async def wait_until(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


# -- client disconnects -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "x", "max_tokens": 50}),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 50}),
        ("/v1/completions", {"prompt": ["x", "y"], "max_tokens": 50}),
    ],
)
def test_disconnect_aborts_non_streaming_request(path: str, body: dict[str, Any]) -> None:
    engine = FakeAsyncLLM()
    engine.hold()  # every request stalls after its first output

    async def scenario() -> None:
        app = build_app(engine)
        call = AsgiCall(app, path, body)
        task = call.start()
        num_prompts = len(body["prompt"]) if isinstance(body.get("prompt"), list) else 1
        await wait_until(lambda: len(engine.requests) == num_prompts)
        await asyncio.sleep(0.05)
        assert engine.running
        call.hang_up.set()
        await asyncio.wait_for(task, 5)
        assert not engine.running
        assert sorted(engine.aborted) == sorted(r[0] for r in engine.requests)
        assert not get_state(app).inflight

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "x", "max_tokens": 50, "stream": True}),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 50, "stream": True}),
        ("/v1/completions", {"prompt": ["x", "y"], "max_tokens": 50, "stream": True}),
    ],
)
def test_disconnect_aborts_streaming_request(path: str, body: dict[str, Any]) -> None:
    engine = FakeAsyncLLM()
    engine.hold()

    async def scenario() -> None:
        app = build_app(engine)
        call = AsgiCall(app, path, body)
        task = call.start()
        await asyncio.wait_for(call.got_body.wait(), 5)
        assert call.status == 200 and engine.running
        call.hang_up.set()
        await asyncio.wait_for(task, 5)
        assert not engine.running
        assert sorted(engine.aborted) == sorted(r[0] for r in engine.requests)
        assert not get_state(app).inflight
        assert "[DONE]" not in call.text  # the stream was cut, not finished

    asyncio.run(scenario())


def test_finished_requests_are_not_aborted() -> None:
    engine = FakeAsyncLLM()
    with TestClient(build_app(engine)) as client:
        client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True})
    assert engine.aborted == [] and len(engine.finished) == 2


# -- engine death -------------------------------------------------------------------------------


def test_engine_death_fails_requests_with_503() -> None:
    engine = FakeAsyncLLM()
    engine.die_after_steps = 3
    with TestClient(build_app(engine)) as client:
        response = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 10})
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "engine_dead"
        # later requests are refused up front, health says so
        for path, body in (
            ("/v1/completions", {"prompt": "x"}),
            ("/v1/chat/completions", {"messages": CHAT}),
        ):
            response = client.post(path, json=body)
            assert response.status_code == 503 and response.json()["error"]["code"] == "engine_dead"
        assert client.get("/health").status_code == 503


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "x", "max_tokens": 10, "stream": True}),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 10, "stream": True}),
    ],
)
def test_engine_death_mid_stream_is_an_error_event(path: str, body: dict[str, Any]) -> None:
    engine = FakeAsyncLLM()
    engine.die_after_steps = 3
    with TestClient(build_app(engine)) as client:
        response = client.post(path, json=body)
    assert response.status_code == 200  # headers went out before the engine died
    blocks = response.text.split("\n\n")
    assert blocks[-2] == "data: [DONE]"
    error = json.loads(blocks[-3][len("data: ") :])["error"]
    assert error["code"] == "engine_dead" and error["type"] == "service_unavailable_error"


def test_engine_death_before_first_output_of_a_stream_is_503() -> None:
    engine = FakeAsyncLLM()
    engine.die_after_steps = 1
    with TestClient(build_app(engine)) as client:
        response = client.post(
            "/v1/completions", json={"prompt": "x", "max_tokens": 10, "stream": True}
        )
    assert response.status_code == 503


# -- shutdown -----------------------------------------------------------------------------------


@pytest.mark.parametrize("abort_mode", ["cancel", "finish"])
@pytest.mark.parametrize("stream", [False, True])
def test_abort_all_ends_in_flight_requests_with_abort(abort_mode: str, stream: bool) -> None:
    engine = FakeAsyncLLM(abort_mode=abort_mode)
    engine.hold()

    async def scenario() -> None:
        app = build_app(engine)
        call = AsgiCall(
            app, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 50, "stream": stream}
        )
        task = call.start()
        await wait_until(lambda: bool(get_state(app).inflight))
        await asyncio.sleep(0.05)
        state = get_state(app)
        state.shutting_down = True
        await state.abort_all()
        await asyncio.wait_for(task, 5)
        assert call.status == 200
        if stream:
            assert call.text.endswith("data: [DONE]\n\n")
            last = json.loads(call.text.split("\n\n")[-3][len("data: ") :])
            assert last["choices"][0]["finish_reason"] == "abort"
        else:
            body = json.loads(call.text)
            assert body["choices"][0]["finish_reason"] == "abort"
            assert body["choices"][0]["message"]["content"] == "a"
        assert engine.abort_calls == [engine.requests[0][0]]
        assert not engine.running

    asyncio.run(scenario())


def test_lifespan_end_refuses_requests_and_shuts_engine_down() -> None:
    engine = FakeAsyncLLM()
    app = build_app(engine)
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
    assert engine.shutdown_calls == 1
    assert get_state(app).shutting_down
    with TestClient(app) as client:  # a state that is shutting down answers 503
        assert client.get("/health").status_code == 503
        response = client.post("/v1/completions", json={"prompt": "x"})
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "shutting_down"


# -- the real server in a subprocess ---------------------------------------------------------

_SERVER_SCRIPT = textwrap.dedent(
    """
    import logging, sys
    sys.path.insert(0, {tests_dir!r})
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    from fake_engine import FakeAsyncLLM
    from chassis.serve.app import build_app
    from chassis.serve.server import run_server
    from chassis.serve.settings import ServerSettings

    class Engine(FakeAsyncLLM):
        async def shutdown(self):
            print("ENGINE-SHUTDOWN", flush=True)

    engine = Engine()
    engine.die_after_steps = {die_after_steps}
    engine.hold() if {hold} else None
    settings = ServerSettings(port={port}, shutdown_timeout_s=5, access_log=False)
    code = run_server(build_app(engine, settings), settings)
    print("EXIT", code, flush=True)
    sys.exit(code)
    """
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_server(*, die_after_steps: int | None = None, hold: bool = False):
    port = _free_port()
    script = _SERVER_SCRIPT.format(
        tests_dir=str(TESTS_DIR), port=port, die_after_steps=die_after_steps, hold=hold
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"server exited early:\n{proc.stdout.read()}")  # type: ignore[union-attr]
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("server did not become healthy")
        time.sleep(0.2)


def test_sigterm_aborts_streams_and_exits() -> None:
    proc, base = _start_server(hold=True)
    try:
        events = []
        with httpx.stream(
            "POST",
            base + "/v1/chat/completions",
            json={"messages": CHAT, "max_tokens": 100, "stream": True},
            timeout=30,
        ) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line:
                    continue
                events.append(line)
                if len(events) == 2:  # the role chunk and the first token: now held
                    proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][len("data: ") :])
    assert last["choices"][0]["finish_reason"] == "abort"
    assert "ready on http://127.0.0.1:" in output
    assert "received SIGTERM: shutting down" in output
    assert "ENGINE-SHUTDOWN" in output
    # uvicorn re-raises the signal after a graceful shutdown: terminated by SIGTERM
    assert proc.returncode in (-signal.SIGTERM, 0), output


def test_engine_death_stops_the_server_with_status_1() -> None:
    proc, base = _start_server(die_after_steps=2)
    try:
        response = httpx.post(
            base + "/v1/completions", json={"prompt": "x", "max_tokens": 10}, timeout=30
        )
        assert response.status_code == 503
        output, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, output
    assert "the engine core died" in output and "EXIT 1" in output


def _send_endless_head(base: str) -> tuple[bytes, bytes]:
    """Trickle an unfinished request head (8 KiB at a time, up to 4 MB) until the server
    answers; return its status line and body (raises if it never answers)."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: ")
        try:
            for _ in range(512):
                sock.sendall(b"a" * 8192)
                time.sleep(0.002)
        except OSError:  # the server closed the connection: its answer is in our buffer
            pass
        response = b""
        with contextlib.suppress(OSError):
            while chunk := sock.recv(65536):
                response += chunk
    assert response, "the server sent nothing and did not close"
    head, _, body = response.partition(b"\r\n\r\n")
    return head.split(b"\r\n")[0], body


def _connect(base: str) -> socket.socket:
    host, port = base.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


@pytest.fixture(scope="module")
def plain_server() -> Iterator[str]:
    """One server (no engine death, nothing held) for the tests that only send it bad HTTP
    and check it still answers afterwards; yields its base URL."""
    proc, base = _start_server()
    try:
        yield base
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)


def test_an_endless_chunked_trailer_is_cut_off_and_h2c_upgrades_refused(plain_server: str) -> None:
    base = plain_server
    # A chunked body whose trailer never ends: httptools would buffer it without limit.
    with _connect(base) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            b"\r\nTransfer-Encoding: chunked\r\n\r\n1\r\n{\r\n0\r\nX-Trailer: "
        )
        sent = 0
        with contextlib.suppress(OSError):
            while sent < 4_000_000:
                sock.sendall(b"a" * 8192)
                sent += 8192
                time.sleep(0.001)
        assert sent < 1_000_000, "the server kept reading an endless trailer"
    # What curl --http2 sends over plain HTTP: the body would be lost, so a clear 400.
    body = b'{"prompt": "x", "max_tokens": 1}'
    with _connect(base) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, "
            b"HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAoAAAAAIAAAAA"
            b"\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )
        response = b""
        with contextlib.suppress(OSError):
            while chunk := sock.recv(65536):
                response += chunk
    head, _, payload = response.partition(b"\r\n\r\n")
    if HttpToolsProtocol is not None:
        assert head.startswith(b"HTTP/1.1 400"), response
        assert json.loads(payload)["error"]["code"] == "upgrade_not_supported"
    assert httpx.get(base + "/health", timeout=10).status_code == 200


def test_oversized_headers_are_refused_by_the_real_server(plain_server: str) -> None:
    base = plain_server
    ok = httpx.get(base + "/health", headers={"X-Pad": "a" * 1000}, timeout=10)
    assert ok.status_code == 200
    # over the 64 KiB default of --max-header-size: 100 kB arrives whole and the app
    # refuses it in OpenAI's shape
    big = httpx.get(base + "/health", headers={"X-Pad": "a" * 100_000}, timeout=10)
    assert big.status_code == 431
    assert big.json()["error"]["code"] == "request_headers_too_large"
    # 1 MB overflows the bound on an unfinished head first: the server answers and
    # closes, often before the client has finished sending (connection reset)
    try:
        huge = httpx.get(base + "/health", headers={"X-Pad": "a" * 1_000_000}, timeout=10)
        assert huge.status_code in (400, 431)
    except httpx.TransportError:
        pass
    # a head that never ends: refused once ~64 KiB of it has arrived, not buffered forever
    status_line, body = _send_endless_head(base)
    if HttpToolsProtocol is not None:
        assert status_line.startswith(b"HTTP/1.1 431"), status_line
        assert json.loads(body)["error"]["code"] == "request_headers_too_large"
    else:  # h11's own bound
        assert status_line.startswith(b"HTTP/1.1 400"), status_line
    assert httpx.get(base + "/health", timeout=10).status_code == 200
