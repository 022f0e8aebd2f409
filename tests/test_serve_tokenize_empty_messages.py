"""``/tokenize`` with ``messages: []`` is the chat route's 400 ("messages must not be
empty"), not the chat template's refusal (which blamed the model's template)."""

from __future__ import annotations

from fake_engine import FakeAsyncLLM
from fastapi.testclient import TestClient

from chassis.serve.app import build_app
from chassis.serve.settings import ServerSettings


def test_empty_messages_are_refused_as_on_the_chat_route() -> None:
    with TestClient(build_app(FakeAsyncLLM(), ServerSettings())) as http:
        tokenize = http.post("/tokenize", json={"messages": []})
        chat = http.post("/v1/chat/completions", json={"messages": []})
    assert tokenize.status_code == chat.status_code == 400
    assert tokenize.json()["error"] == chat.json()["error"]
    assert tokenize.json()["error"]["message"] == "messages must not be empty"
