"""Which HTTP implementation and event loop the server runs (serve/http_protocol.py,
serve/server.py); the bound itself is exercised on a real server in
test_server_lifecycle.py::test_oversized_headers_are_refused_by_the_real_server."""

from __future__ import annotations

import json

import pytest

from chassis.serve import http_protocol
from chassis.serve.server import event_loop_factory


def test_httptools_is_used_with_the_head_bound_when_installed() -> None:
    pytest.importorskip("httptools")
    config = http_protocol.http_config(4096)
    assert issubclass(config["http"], http_protocol.BoundedHttpToolsProtocol)
    assert config["http"].max_head_bytes == 4096
    assert "h11_max_incomplete_event_size" not in config


def test_h11_with_its_bound_without_httptools(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http_protocol, "HttpToolsProtocol", None)
    assert http_protocol.http_config(4096) == {
        "http": "h11",
        "h11_max_incomplete_event_size": 4096,
    }


def test_the_refusal_is_a_complete_openai_shaped_431() -> None:
    raw = http_protocol.head_too_large_response(4096)
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"HTTP/1.1 431 Request Header Fields Too Large"
    assert b"connection: close" in lines
    assert f"content-length: {len(body)}".encode() in lines
    error = json.loads(body)["error"]
    assert error["code"] == "request_headers_too_large"
    assert "4096" in error["message"]


def test_uvloop_is_the_event_loop_when_installed() -> None:
    uvloop = pytest.importorskip("uvloop")
    assert event_loop_factory() is uvloop.new_event_loop


def test_bind_sockets_listens_on_every_address_of_the_host() -> None:
    import socket

    from chassis.serve.server import bind_sockets

    sockets = bind_sockets("localhost", 0)
    try:
        ports = {s.getsockname()[1] for s in sockets}
        assert len(ports) == 1  # port 0: one free port for every address
        families = {s.family for s in sockets}
        assert socket.AF_INET in families  # localhost's 127.0.0.1 is served
        port = ports.pop()
        # listening already: a second server (still loading, or not) cannot take the port
        with pytest.raises(OSError):
            bind_sockets("127.0.0.1", port)
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # accepted into the backlog while nothing serves yet
    finally:
        for sock in sockets:
            sock.close()
