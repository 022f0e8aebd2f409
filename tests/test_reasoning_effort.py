"""OpenAI's ``reasoning_effort`` (chat) and ``reasoning.effort`` (Responses API): the chat
template's ``reasoning_effort`` variable, as gpt-oss's template reads it."""

from __future__ import annotations

import pytest
from fake_engine import CHAT_TEMPLATE, FakeAsyncLLM
from fastapi.testclient import TestClient

from chassis.serve.app import build_app
from chassis.serve.settings import ServerSettings

TEMPLATE = "{% if reasoning_effort is defined %}Reasoning: {{ reasoning_effort }}\n{% endif %}"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def engine() -> FakeAsyncLLM:
    return FakeAsyncLLM(chat_template=TEMPLATE + CHAT_TEMPLATE)


def _rendered(engine: FakeAsyncLLM) -> str:
    return engine.tokenizer.decode(engine.requests[-1][1])


def test_chat_reasoning_effort_reaches_the_template(engine: FakeAsyncLLM) -> None:
    with TestClient(build_app(engine, ServerSettings())) as client:
        body = {"messages": MESSAGES, "max_tokens": 1}
        assert client.post("/v1/chat/completions", json=body).status_code == 200
        assert "Reasoning:" not in _rendered(engine)
        for effort in ("low", "high"):
            sent = {**body, "reasoning_effort": effort}
            assert client.post("/v1/chat/completions", json=sent).status_code == 200
            assert f"Reasoning: {effort}\n" in _rendered(engine)
        # the request's own template kwargs win
        both = {
            **body,
            "reasoning_effort": "low",
            "chat_template_kwargs": {"reasoning_effort": "x"},
        }
        assert client.post("/v1/chat/completions", json=both).status_code == 200
        assert "Reasoning: x\n" in _rendered(engine)
        bad = client.post("/v1/chat/completions", json={**body, "reasoning_effort": "max"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning_effort"


def test_responses_reasoning_effort_reaches_the_template(engine: FakeAsyncLLM) -> None:
    with TestClient(build_app(engine, ServerSettings())) as client:
        body = {"input": "hi", "max_output_tokens": 1, "reasoning": {"effort": "medium"}}
        answer = client.post("/v1/responses", json=body)
        assert answer.status_code == 200, answer.text
        assert "Reasoning: medium\n" in _rendered(engine)
        assert answer.json()["reasoning"]["effort"] == "medium"  # echoed
        bad = client.post("/v1/responses", json={**body, "reasoning": {"effort": 3}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning.effort"
