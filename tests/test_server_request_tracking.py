"""vLLM's server options ``--response-role``, ``--enable-request-id-headers`` and
``--enable-server-load-tracking`` (``GET /load``), over the test double of the engine."""

from __future__ import annotations

import asyncio
import re

import httpx
from fake_engine import FakeAsyncLLM
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
