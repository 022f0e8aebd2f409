"""vLLM's server options ``--response-role``, ``--enable-request-id-headers``,
``--enable-server-load-tracking`` (``GET /load``), ``--enable-force-include-usage``,
``--exclude-tools-when-tool-choice-none`` and ``--middleware``, over the test double of the
engine."""

from __future__ import annotations

import asyncio
import json
import re
import sys
import types

import httpx
import pytest
from fake_engine import CHAT_TEMPLATE, FakeAsyncLLM
from fastapi.testclient import TestClient

from chassis.serve.app import build_app
from chassis.serve.cli import build_parser
from chassis.serve.cli_serve import settings_from_args
from chassis.serve.settings import ServerSettings

MESSAGES = [{"role": "user", "content": "hi"}]


def test_the_flags_reach_the_settings() -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "--response-role",
            "bot",
            "--enable-request-id-headers",
            "--enable-server-load-tracking",
        ]
    )
    settings = settings_from_args(args)
    assert settings.response_role == "bot"
    assert settings.enable_request_id_headers and settings.enable_server_load_tracking
    defaults = settings_from_args(build_parser().parse_args(["serve"]))
    assert defaults.response_role == "assistant"
    assert not defaults.enable_request_id_headers and not defaults.enable_server_load_tracking


def test_response_role_names_the_answer_or_the_continued_message() -> None:
    with TestClient(build_app(FakeAsyncLLM(), ServerSettings(response_role="bot"))) as client:
        body = {"messages": MESSAGES, "max_tokens": 3}
        answer = client.post("/v1/chat/completions", json=body).json()
        assert answer["choices"][0]["message"]["role"] == "bot"
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            first = next(line for line in r.iter_lines() if line.startswith("data: "))
        assert '"role":"bot"' in first.replace(" ", "")
        # no generation prompt: the model continues the last message, whose role it keeps
        # (and echo repeats that message, as vLLM)
        continued = {
            "messages": [*MESSAGES, {"role": "assistant", "content": "Once"}],
            "add_generation_prompt": False,
            "continue_final_message": True,
            "echo": True,
            "max_tokens": 3,
        }
        message = client.post("/v1/chat/completions", json=continued).json()["choices"][0]
        assert message["message"]["role"] == "assistant"
        assert message["message"]["content"].startswith("Once")


def test_request_id_headers_echo_the_client_s_id_or_make_one() -> None:
    settings = ServerSettings(enable_request_id_headers=True, api_key="k")
    with TestClient(build_app(FakeAsyncLLM(), settings)) as client:
        auth = {"Authorization": "Bearer k"}
        mine = client.get("/v1/models", headers={**auth, "X-Request-Id": "trace-42"})
        assert mine.headers["x-request-id"] == "trace-42"
        made = [client.get("/v1/models", headers=auth).headers["x-request-id"] for _ in range(2)]
        assert all(re.fullmatch("[0-9a-f]{32}", m) for m in made) and made[0] != made[1]
        refused = client.get("/v1/models", headers={"X-Request-Id": "no-key"})
        assert refused.status_code == 401 and refused.headers["x-request-id"] == "no-key"
        streamed = {"prompt": "x", "max_tokens": 2, "stream": True}
        with client.stream("POST", "/v1/completions", json=streamed, headers=auth) as r:
            assert r.headers["x-request-id"]
    with TestClient(build_app(FakeAsyncLLM(), ServerSettings())) as client:
        assert "x-request-id" not in client.get("/v1/models").headers


def test_load_counts_the_requests_being_served() -> None:
    engine = FakeAsyncLLM()
    app = build_app(engine, ServerSettings(enable_server_load_tracking=True))

    async def main() -> list[int]:
        transport = httpx.ASGITransport(app=app)
        seen: list[int] = []
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:

            async def load() -> int:
                response = await client.get("/load")
                assert response.status_code == 200
                return response.json()["server_load"]

            seen.append(await load())
            engine.hold()  # every request pauses after its first step
            body = {"prompt": "x", "max_tokens": 5}
            tasks = [
                asyncio.create_task(client.post("/v1/completions", json=body)),
                asyncio.create_task(client.post("/invocations", json=body)),
            ]
            for _ in range(200):
                await asyncio.sleep(0.01)
                if len(engine.running) == 2:
                    break
            seen.append(await load())
            await client.get("/v1/models")  # not an engine route: no load
            engine.release()
            responses = await asyncio.gather(*tasks)
            assert [r.status_code for r in responses] == [200, 200]
            seen.append(await load())
        return seen

    async def run() -> list[int]:
        async with app.router.lifespan_context(app):
            return await main()

    assert asyncio.run(run()) == [0, 2, 0]


def test_load_is_not_served_without_the_flag() -> None:
    with TestClient(build_app(FakeAsyncLLM(), ServerSettings())) as client:
        assert client.get("/load").status_code == 404


def test_load_needs_the_api_key() -> None:
    settings = ServerSettings(enable_server_load_tracking=True, api_key="k")
    with TestClient(build_app(FakeAsyncLLM(), settings)) as client:
        assert client.get("/load").status_code == 401
        auth = {"Authorization": "Bearer k"}
        assert client.get("/load", headers=auth).json() == {"server_load": 0}


def _stream_events(client: TestClient, path: str, body: dict) -> list[dict]:
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_force_include_usage_ends_every_stream_with_usage() -> None:
    chat = {"messages": MESSAGES, "max_tokens": 3}
    completion = {"prompt": "x", "max_tokens": 3}
    settings = ServerSettings(enable_force_include_usage=True)
    with TestClient(build_app(FakeAsyncLLM(), settings)) as client:
        for path, body in (("/v1/chat/completions", chat), ("/v1/completions", completion)):
            events = _stream_events(client, path, body)
            assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3
            assert all(e.get("usage") is None for e in events[:-1])  # not on every chunk
            # a request's continuous_usage_stats still puts it on every chunk
            options = {"stream_options": {"continuous_usage_stats": True}}
            events = _stream_events(client, path, {**body, **options})
            assert all(e.get("usage") is not None for e in events)
    with TestClient(build_app(FakeAsyncLLM(), ServerSettings())) as client:
        events = _stream_events(client, "/v1/completions", completion)
        assert all(e.get("usage") is None for e in events)


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("exclude", [False, True])
def test_tools_leave_the_prompt_of_tool_choice_none_only_when_asked(exclude: bool) -> None:
    engine = FakeAsyncLLM(chat_template="{% if tools %}TOOLS{% endif %}" + CHAT_TEMPLATE)
    settings = ServerSettings(exclude_tools_when_tool_choice_none=exclude)
    with TestClient(build_app(engine, settings)) as client:
        lengths = {}
        for choice in ("auto", "none"):
            body = {"messages": MESSAGES, "max_tokens": 1, "tools": TOOLS, "tool_choice": choice}
            if choice == "auto":
                body.pop("tool_choice")  # 'auto' needs --enable-auto-tool-choice; the default
            assert client.post("/v1/chat/completions", json=body).status_code == 200
            lengths[choice] = len(engine.requests[-1][1])
        plain = {"messages": MESSAGES, "max_tokens": 1}
        assert client.post("/v1/chat/completions", json=plain).status_code == 200
        without_tools = len(engine.requests[-1][1])
    assert lengths["auto"] > without_tools
    assert lengths["none"] == (without_tools if exclude else lengths["auto"])


class HeaderMiddleware:
    """An ASGI middleware class, as --middleware names one."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        async def send_marked(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message["headers"], (b"x-class", b"1")]}
            await send(message)

        await self.app(scope, receive, send_marked)


async def header_function(request, call_next):
    response = await call_next(request)
    response.headers["x-function"] = "1"
    return response


not_middleware = 42


@pytest.fixture
def middleware_module(monkeypatch: pytest.MonkeyPatch) -> str:
    module = types.ModuleType("chassis_test_middleware")
    module.HeaderMiddleware = HeaderMiddleware
    module.header_function = header_function
    module.not_middleware = not_middleware
    monkeypatch.setitem(sys.modules, "chassis_test_middleware", module)
    return "chassis_test_middleware"


def test_middleware_classes_and_functions_wrap_every_response(middleware_module: str) -> None:
    paths = [f"{middleware_module}.HeaderMiddleware", f"{middleware_module}:header_function"]
    settings = ServerSettings(middleware=paths, api_key="k")
    with TestClient(build_app(FakeAsyncLLM(), settings)) as client:
        for response in (client.get("/v1/models"), client.get("/health")):  # 401 and 200
            assert response.headers["x-class"] == "1" and response.headers["x-function"] == "1"


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("nodots", "give an import path"),
        ("no_such_module_xyz.Thing", "cannot import 'no_such_module_xyz'"),
        ("chassis_test_middleware.Missing", "has no 'Missing'"),
        (
            "chassis_test_middleware.not_middleware",
            "names a 'int' object: it must be an ASGI middleware",
        ),
    ],
)
def test_middleware_that_cannot_be_used_stops_start_up(
    middleware_module: str, path: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        build_app(FakeAsyncLLM(), ServerSettings(middleware=[path]))
    args = build_parser().parse_args(["serve", "--middleware", path, "--middleware", "a.b"])
    assert settings_from_args(args).middleware == [path, "a.b"]
