"""``chassis bench serve`` against a server it cannot use says why in one line and exits 1:
a server with an API key and none given (it raised ``KeyError: 'data'`` with a
traceback), an unreachable server, a model list without a model."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest

from chassis.serve.bench_serve import ServerUnusableError, run, served_model
from chassis.serve.cli import build_parser


def _models(status: int, body: str) -> str:
    async def go() -> str:
        transport = httpx.MockTransport(lambda request: httpx.Response(status, text=body))
        async with httpx.AsyncClient(base_url="http://server", transport=transport) as client:
            return await served_model(client, {})

    return asyncio.run(go())


def test_the_first_listed_model_is_used() -> None:
    assert _models(200, '{"object": "list", "data": [{"id": "m1"}, {"id": "m2"}]}') == "m1"


def test_a_refused_key_says_to_pass_it() -> None:
    body = '{"error": {"message": "missing or invalid API key", "code": "invalid_api_key"}}'
    with pytest.raises(
        ServerUnusableError, match=r"HTTP 401 \(pass the server's key with --api-key\)"
    ):
        _models(401, body)


@pytest.mark.parametrize("body", ['{"data": []}', "not json", '{"object": "list"}'])
def test_a_list_without_a_model_says_to_pass_one(body: str) -> None:
    with pytest.raises(ServerUnusableError, match="listed no model"):
        _models(200, body)


def test_an_unreachable_server_is_one_line_and_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as probe:  # a local port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    args = build_parser().parse_args(
        ["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "1"]
    )
    assert run(args) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"chassis bench serve: cannot reach http://127.0.0.1:{port}"), err
    assert "Traceback" not in err
