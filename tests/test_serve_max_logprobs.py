"""``--max-logprobs`` on the generating routes: a request asking for more alternatives is a
400 naming the field the client sent (``param`` set), one rule for all of them
(:func:`chassis.core.input_processor.logprobs_over_limit`)."""

from __future__ import annotations

from typing import Any

import pytest
from fake_engine import FakeAsyncLLM
from fastapi.testclient import TestClient

from chassis.serve.app import build_app
from chassis.serve.settings import ServerSettings

MODEL = "fake-model"
LIMIT = 5


def _post(route: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    engine = FakeAsyncLLM(script="Hello there!", max_logprobs=LIMIT)
    with TestClient(build_app(engine, ServerSettings())) as http:
        answer = http.post(route, json={"model": MODEL, **body})
        return answer.status_code, answer.json()


CHAT = {"messages": [{"role": "user", "content": "Hi"}]}


@pytest.mark.parametrize(
    ("route", "body", "field"),
    [
        ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 6}, "top_logprobs"),
        ("/v1/chat/completions", {**CHAT, "prompt_logprobs": 6}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "Hi", "logprobs": 6}, "logprobs"),
        ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": 6}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "Hi", "logprobs": 6, "echo": True}, "logprobs"),
        (
            "/v1/responses",
            {"input": "Hi", "top_logprobs": 6, "include": ["message.output_text.logprobs"]},
            "top_logprobs",
        ),
    ],
)
def test_over_the_limit_is_a_400_naming_the_field_sent(
    route: str, body: dict[str, Any], field: str
) -> None:
    status, answer = _post(route, body)
    error = answer["error"]
    assert status == 400, answer
    assert error["param"] == field, error
    assert error["message"] == (
        f"{field}=6 exceeds the server's limit of {LIMIT} (--max-logprobs)"
    ), error


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": LIMIT}),
        ("/v1/completions", {"prompt": "Hi", "logprobs": LIMIT, "echo": True}),
    ],
)
def test_the_limit_itself_is_served(route: str, body: dict[str, Any]) -> None:
    status, answer = _post(route, body)
    assert status == 200, answer


@pytest.mark.parametrize("top", [-1, 21, 50])
def test_chat_top_logprobs_outside_openais_range_names_top_logprobs(top: int) -> None:
    """OpenAI's range for chat's ``top_logprobs`` is 0 to 20; outside it the 400 names the
    field the client sent, not the engine's ``logprobs`` (which chat has as a boolean)."""
    status, answer = _post("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": top})
    error = answer["error"]
    assert status == 400, answer
    assert error["param"] == "top_logprobs", error
    assert error["message"].startswith("top_logprobs must be in [0, 20]"), error
