"""Engine-core death under a real ``chassis serve`` (tiny random Llama): SIGKILL the child.

The server must fail what is in flight (an error event in an open stream, 503 for a waiting
non-streaming request), answer 503 on ``/health`` while it is still up, and exit by itself
with status 1, leaving no process of its tree behind (engine core, multiprocessing's
resource tracker).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from fixtures_process_start import run_at_process_start
from server_process import ServerProcess, start_server

psutil = pytest.importorskip("psutil")

pytestmark = pytest.mark.timeout(180)

MAX_MODEL_LEN = 512
# the server must notice the death and exit within this many seconds of the SIGKILL
EXIT_WITHIN_S = 15.0


#: every engine step waits 30 ms first, so a 448-token stream lasts 13 s or more: on a loaded
#: machine (the suite's two workers) the stream once finished before a second request joined
SLOW_STEPS = """\
import time

import chassis.core.engine_core as engine_core

_step = engine_core.EngineCore.step


def step(self):
    time.sleep(0.03)
    return _step(self)


engine_core.EngineCore.step = step
"""


@pytest.fixture
def server(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[ServerProcess]:
    run_at_process_start(SLOW_STEPS, tmp_path, monkeypatch)
    server = start_server(tiny_llama_dir, tmp_path, max_model_len=MAX_MODEL_LEN, num_kv_blocks=256)
    try:
        yield server
    finally:
        if server.proc.poll() is None:  # the test failed before the server exited
            server.kill()


def _still_alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    """Those of ``processes`` that still run (a zombie waiting for its reaper is gone)."""
    alive = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
        except psutil.NoSuchProcess:
            pass
    return alive


def _data_events(lines: Iterator[str], count: int | None = None) -> list[str]:
    """The payloads of the next ``count`` SSE events (all of them when ``None``)."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            events.append(line[len("data: ") :])
            if count is not None and len(events) == count:
                break
    return events


def _wait_running(server: ServerProcess, count: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while server.metric("chassis:num_requests_running") < count:
        assert time.monotonic() < deadline, f"{count} requests never ran together"
        time.sleep(0.01)


@pytest.mark.slow
def test_sigkill_of_the_engine_core_fails_requests_and_stops_the_server(
    server: ServerProcess,
) -> None:
    core = server.engine_core()
    tree = psutil.Process(server.proc.pid).children(recursive=True)
    assert core in tree
    body = {
        "model": "tiny",
        "prompt": "tell me everything",
        "max_tokens": MAX_MODEL_LEN - 64,
        "ignore_eos": True,
    }
    with (
        ThreadPoolExecutor(1) as pool,
        httpx.stream(
            "POST",
            server.base + "/v1/completions",
            json={**body, "stream": True},
            headers=server.headers,
            timeout=30,
        ) as stream,
    ):
        assert stream.status_code == 200
        lines = stream.iter_lines()
        first = _data_events(lines, 3)  # the stream is under way
        waiting = pool.submit(
            httpx.post,
            server.base + "/v1/completions",
            json=body,
            headers=server.headers,
            timeout=30,
        )
        _wait_running(server, 2)  # the non-streaming request runs too

        core.kill()  # SIGKILL: no goodbye message from the engine core
        killed_at = time.monotonic()

        rest = _data_events(lines)
        response = waiting.result(timeout=30)

    # the open stream ended with an error event, then [DONE]; it never finished normally
    assert rest[-1] == "[DONE]", rest[-3:]
    chunks = [json.loads(e) for e in first + rest[:-1]]
    error = chunks[-1]
    assert set(error) == {"error"}, error
    assert error["error"]["code"] == "engine_dead", error
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    # the waiting non-streaming request got a 503
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "engine_dead"

    # while the server is still up, /health and new requests say 503
    try:
        health = httpx.get(server.base + "/health", timeout=2)
        assert health.status_code == 503, health.text
        late = httpx.post(
            server.base + "/v1/completions", json=body, headers=server.headers, timeout=2
        )
        assert late.status_code == 503, late.text
    except httpx.TransportError:
        pass  # already gone: also fine

    try:
        server.proc.wait(timeout=EXIT_WITHIN_S - (time.monotonic() - killed_at))
    except Exception:
        raise AssertionError(
            f"the server did not exit within {EXIT_WITHIN_S} s of the engine's death:\n"
            f"{server.output()}"
        ) from None
    output = server.output()
    assert server.proc.returncode == 1, output
    assert "the engine core died" in output, output
    # nothing of the server's process tree survives it
    _, alive = psutil.wait_procs(tree, timeout=5)
    assert not _still_alive(alive), [(p.pid, p.cmdline()) for p in _still_alive(alive)]


#: run first by the server's processes (their sitecustomize): the engine core's step raises
#: an error whose text has internals a client must not see
CRASHING_STEP = """\
import chassis.core.engine_core as engine_core

def step(self):
    raise RuntimeError(
        "kernel failed at /opt/site/secret_kernels.cu:42\\n"
        'Traceback (most recent call last):\\n  File "/opt/site/worker.py", line 7'
    )

engine_core.EngineCore.step = step
"""


@pytest.mark.slow
def test_an_engine_core_crash_tells_clients_its_type_and_the_log_all_of_it(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_at_process_start(CRASHING_STEP, tmp_path, monkeypatch)
    server = start_server(tiny_llama_dir, tmp_path, max_model_len=MAX_MODEL_LEN)
    try:
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4}
        response = httpx.post(
            server.base + "/v1/completions", json=body, headers=server.headers, timeout=60
        )
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert error["code"] == "engine_dead" and error["type"] == "service_unavailable_error"
        assert error["message"] == (
            "the engine is not running: engine core failed: RuntimeError in the engine "
            "core; its message and traceback are in the server log"
        ), error
        server.proc.wait(timeout=EXIT_WITHIN_S)
        output = server.output()
        assert server.proc.returncode == 1, output
        # the operator's log has the whole error and where it was raised
        assert "engine core crashed" in output and "Traceback" in output, output
        assert "kernel failed at /opt/site/secret_kernels.cu:42" in output, output
    finally:
        if server.proc.poll() is None:
            server.kill()


#: run first by the server's processes (their sitecustomize): a grammar matcher raises an
#: error whose text has internals a client must not see; the request fails alone (a 500)
RAISING_MATCHER = """\
import chassis.builtin_plugins.structured_output.backend as backend


def allowed_tokens(self):
    raise RuntimeError(
        "matcher state 17 missing in /opt/site/secret_grammar.py\\n"
        'Traceback (most recent call last):\\n  File "/opt/site/matcher.py", line 3'
    )


backend.ChassisGrammarMatcher.allowed_tokens = allowed_tokens
"""


@pytest.mark.slow
def test_a_request_the_engine_fails_tells_its_client_the_type_and_the_log_all_of_it(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_at_process_start(RAISING_MATCHER, tmp_path, monkeypatch)
    server = start_server(tiny_llama_dir, tmp_path, max_model_len=MAX_MODEL_LEN)
    try:
        constrained = {"structured_outputs": {"regex": "[a-z]{4}"}}
        expected = (
            "structured output: computing its allowed tokens failed: RuntimeError in the "
            "engine core; its message and traceback are in the server log"
        )
        for stream in (False, True):
            body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "stream": stream}
            response = httpx.post(
                server.base + "/v1/completions",
                json={**body, **constrained},
                headers=server.headers,
                timeout=60,
            )
            # (a stream fails before its first chunk: the same 500, not an error event)
            assert response.status_code == 500, response.text
            error = response.json()["error"]
            assert error["code"] == "request_failed" and error["message"] == expected, error
        # the request failed alone: the engine serves on
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4}
        response = httpx.post(
            server.base + "/v1/completions", json=body, headers=server.headers, timeout=60
        )
        assert response.status_code == 200, response.text
        server.kill()
        output = server.output()
        # the operator's log has the whole error and where it was raised
        assert "structured output: request" in output and "Traceback" in output, output
        assert "matcher state 17 missing in /opt/site/secret_grammar.py" in output, output
    finally:
        if server.proc.poll() is None:
            server.kill()
