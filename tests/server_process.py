"""A real ``chassis serve`` subprocess for end-to-end tests (shared by tests/test_server_*.py).

:func:`start_server` launches ``python -m chassis.serve.cli serve MODEL ...`` on a free port,
with its output in a log file, and waits until ``/health`` answers 200;
:func:`running_server` is the context-manager form that stops it with SIGTERM afterwards and
checks the exit was clean. :class:`ServerProcess` has helpers to read ``/metrics``, wait until
the engine is idle (no running request, no KV block in use) and find the engine-core child
process.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path

import httpx

API_KEY = "e2e-key"


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """One running ``chassis serve`` process serving ``model`` at ``base`` (``http://host:port``)."""

    def __init__(
        self,
        proc: subprocess.Popen[bytes],
        base: str,
        log: Path,
        model: str,
        api_key: str,
        listen: str | None = None,
    ) -> None:
        self.proc = proc
        self.base = base
        #: where the server says it is ready (``base`` unless it listens elsewhere, e.g. a
        #: Unix socket)
        self.listen = listen or base
        self.log = log
        self.model = model
        self.api_key = api_key

    @property
    def headers(self) -> dict[str, str]:
        """The ``Authorization`` header every route but ``/health`` needs."""
        return {"Authorization": f"Bearer {self.api_key}"}

    def output(self) -> str:
        """Everything the server printed so far."""
        return self.log.read_text()

    def client(self, api_key: str | None = None):  # -> openai.OpenAI
        """An official ``openai`` client for this server (no retries)."""
        import openai

        return openai.OpenAI(
            base_url=self.base + "/v1", api_key=api_key or self.api_key, max_retries=0
        )

    def async_client(self, **kwargs):  # -> openai.AsyncOpenAI
        """An official ``openai.AsyncOpenAI`` client for this server (no retries)."""
        import openai

        kwargs.setdefault("max_retries", 0)
        return openai.AsyncOpenAI(base_url=self.base + "/v1", api_key=self.api_key, **kwargs)

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as ``{series: value}``, the ``model_name`` and ``engine`` labels left
        out of the key (the values of a series' engines summed: one engine here).

        A series with no other label is keyed by its name
        (``"chassis:num_requests_running"``); one with other labels keeps them
        (``'chassis:request_success_total{finished_reason="length"}'``).
        """
        text = httpx.get(self.base + "/metrics", headers=self.headers, timeout=10).text
        values: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("#") or "{" not in line:
                continue
            name, rest = line.split("{", 1)
            labels, value = rest.rsplit("} ", 1)
            others = [
                label
                for label in labels.split(",")
                if not label.startswith(("model_name=", "engine="))
            ]
            key = f"{name}{{{','.join(others)}}}" if others else name
            values[key] = values.get(key, 0.0) + float(value)
        return values

    def metric(self, name: str) -> float:
        """One series of :meth:`metrics` (fails the test when absent)."""
        values = self.metrics()
        if name not in values:
            raise AssertionError(f"{name} not in /metrics: {sorted(values)}")
        return values[name]

    def wait_idle(self, timeout: float = 5.0) -> dict[str, float]:
        """Wait until no request runs or waits and no KV block is in use; return the metrics.

        Fails the test with the last values seen when that does not happen in ``timeout`` s
        (a leaked request or leaked KV blocks).
        """
        deadline = time.monotonic() + timeout
        while True:
            values = self.metrics()
            busy = {
                key: values.get(key)
                for key in (
                    "chassis:num_requests_running",
                    "chassis:num_requests_waiting",
                    "chassis:kv_cache_usage_perc",
                )
                if values.get(key) != 0.0
            }
            if not busy:
                return values
            if time.monotonic() > deadline:
                raise AssertionError(f"engine not idle after {timeout} s: {busy}")
            time.sleep(0.1)

    def engine_core(self):  # -> psutil.Process
        """The engine-core child process (spawned by ``multiprocessing``; not its resource
        tracker)."""
        import psutil

        for child in psutil.Process(self.proc.pid).children(recursive=True):
            cmdline = " ".join(child.cmdline())
            if "spawn_main" in cmdline:
                return child
        raise AssertionError(f"no engine-core child of server pid {self.proc.pid}")

    def stop(self, timeout: float = 60.0) -> str:
        """SIGTERM, wait for the exit and check it was clean; return the server's output."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"no exit after SIGTERM:\n{self.output()}") from None
        output = self.output()
        # uvicorn re-raises the signal after a graceful shutdown (docs/serving.md)
        assert self.proc.returncode in (0, -signal.SIGTERM), (
            f"exit status {self.proc.returncode}:\n{output}"
        )
        assert f"ready on {self.listen}" in output
        assert "received SIGTERM" in output
        assert "Traceback" not in output, output
        return output

    def kill(self) -> None:
        """SIGKILL the server and its whole process tree (cleanup after a failed test)."""
        children = []
        with suppress(Exception):
            import psutil

            children = psutil.Process(self.proc.pid).children(recursive=True)
        for process in children:
            with suppress(Exception):
                process.kill()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def start_server(
    model_dir: Path | str,
    log_dir: Path,
    extra_args: Sequence[str] = (),
    *,
    served_model_name: str = "tiny",
    max_model_len: int = 256,
    num_kv_blocks: int | None = 64,
    api_key: str = API_KEY,
    startup_timeout: float = 180.0,
    scheme: str = "http",
    health_client: httpx.Client | None = None,
    listen: str | None = None,
) -> ServerProcess:
    """Start ``chassis serve model_dir`` (float32, eager, no access log) and wait until healthy.

    ``extra_args`` are appended to the command line. The output goes to
    ``log_dir/serve.log``; a server that exits or is not healthy in ``startup_timeout``
    seconds fails the test with that output. A server reached otherwise than plain HTTP on
    its port (HTTPS, a Unix socket) needs ``scheme``, the ``health_client`` that polls
    ``/health`` and, when it listens elsewhere than ``scheme://127.0.0.1:port``, ``listen``
    (as its "ready on" line says).
    """
    port = free_port()
    log = Path(log_dir) / "serve.log"
    cmd = [
        sys.executable,
        "-m",
        "chassis.serve.cli",
        "serve",
        str(model_dir),
        "--served-model-name",
        served_model_name,
        "--port",
        str(port),
        "--max-model-len",
        str(max_model_len),
        "--enforce-eager",
        "--dtype",
        "float32",
        "--disable-access-log",
    ]
    if num_kv_blocks is not None:
        cmd += ["--num-kv-blocks", str(num_kv_blocks)]
    cmd += list(extra_args)
    env = {**os.environ, "CHASSIS_API_KEY": api_key}
    with open(log, "w") as out:
        # its own process group: a test may signal the whole group, as a terminal's Ctrl-C does
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    base = f"{scheme}://127.0.0.1:{port}"
    server = ServerProcess(proc, base, log, served_model_name, api_key, listen)
    get = health_client.get if health_client is not None else httpx.get
    deadline = time.monotonic() + startup_timeout
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"chassis serve exited early:\n{server.output()}")
        try:
            if get(server.base + "/health", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            server.kill()
            raise AssertionError(f"chassis serve not healthy in time:\n{server.output()}")
        time.sleep(0.25)


@contextmanager
def running_server(model_dir: Path | str, log_dir: Path, **kwargs) -> Iterator[ServerProcess]:
    """:func:`start_server`, then a clean SIGTERM shutdown (checked) when the block ends.

    When the block raises, the server is stopped all the same and the block's error wins.
    """
    server = start_server(model_dir, log_dir, **kwargs)
    try:
        yield server
    except BaseException:
        if server.proc.poll() is None:
            server.proc.send_signal(signal.SIGTERM)
            try:
                server.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
        raise
    server.stop()
