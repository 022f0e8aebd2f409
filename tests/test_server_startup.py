"""``chassis serve`` start-up and stop as an operator meets them (real processes).

The port is taken before the model loads; settings the engine core finds impossible are a
one-line error (exit 2) like every other bad setting; Ctrl-C to the whole process group (a
terminal) stops the server cleanly, engine core included.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
from server_process import free_port, start_server


def _serve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "chassis.serve.cli", "serve", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_a_port_in_use_fails_before_the_model_loads(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # The model does not exist either: binding first means the port is what fails.
        result = _serve(str(tmp_path / "no-such-model"), "--port", str(port))
    assert result.returncode == 2, result.stderr
    assert f"cannot listen on http://127.0.0.1:{port}" in result.stderr
    assert "no-such-model" not in result.stderr
    assert "Traceback" not in result.stderr


def test_settings_the_engine_core_rejects_are_a_one_line_error(
    tiny_llama_dir: Path,
) -> None:
    # one KV block cannot hold one sequence of 256 tokens: found while the engine core starts
    result = _serve(
        str(tiny_llama_dir),
        "--port",
        str(free_port()),
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--num-kv-blocks",
        "1",
    )
    assert result.returncode == 2, result.stderr
    assert "cannot start the engine:" in result.stderr
    assert "--max-model-len 256" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_chat_template_that_cannot_work_is_a_one_line_error(tmp_path: Path) -> None:
    # found from the flag alone, before the model loads (the model does not exist either)
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}\n{{ m['content'] }\n{% endfor %}\n")
    not_text = tmp_path / "binary.jinja"
    not_text.write_bytes(b"\xff\xfe{{ messages }}")
    inline = "{{ bos_token }}{% if %}"
    for template, says in (
        (str(broken), f"--chat-template: '{broken}' is not a valid Jinja template: line 2: "),
        (inline, "--chat-template: the inline template is not a valid Jinja template: line 1: "),
        (str(not_text), f"--chat-template '{not_text}' cannot be read: "),
    ):
        result = _serve(
            str(tmp_path / "no-such-model"),
            "--port",
            str(free_port()),
            "--chat-template",
            template,
        )
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and says in lines[0], result.stderr


def test_ctrl_c_to_the_process_group_stops_the_server_cleanly(
    tiny_llama_dir: Path,
    tmp_path: Path,
) -> None:
    server = start_server(tiny_llama_dir, tmp_path)
    try:
        engine_core = server.engine_core()
        assert engine_core.name() == "chassis-engine"  # what ps and pgrep show
        os.killpg(server.proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        server.proc.wait(timeout=60)
        output = server.output()
        assert server.proc.returncode in (130, -signal.SIGINT), output
        assert "Traceback" not in output and "engine core crashed" not in output, output
        assert "the engine core died" not in output, output
        deadline = time.monotonic() + 10
        while engine_core.is_running() and engine_core.status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the engine core outlived the server"
            time.sleep(0.1)
    finally:
        server.kill()
