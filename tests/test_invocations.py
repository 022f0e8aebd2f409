"""``POST /invocations`` (SageMaker's route: any API, picked by the body's keys) and ``/ping``,
over the test double of the engine (the pooling kinds run on real servers in
test_serve_embeddings.py and test_serve_classify.py)."""

from __future__ import annotations

from typing import Any

import pytest
from fake_engine import FakeAsyncLLM
from fastapi.testclient import TestClient
from fixtures_server import *  # noqa: F403

from chassis.serve.app import build_app
from chassis.serve.invocations import invocation_route
from chassis.serve.openai_chat import create_chat_completion
from chassis.serve.openai_classify import create_classify
from chassis.serve.openai_completions import create_completion
from chassis.serve.openai_embeddings import create_embedding
from chassis.serve.openai_score import create_score, do_rerank
from chassis.serve.settings import ServerSettings

VOLATILE = ("id", "created")


def _same_answer(got: dict[str, Any], expected: dict[str, Any]) -> None:
    assert {k: v for k, v in got.items() if k not in VOLATILE} == {
        k: v for k, v in expected.items() if k not in VOLATILE
    }


def test_a_chat_body_is_answered_as_chat_completions(client: TestClient) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    via = client.post("/invocations", json=body)
    assert via.status_code == 200, via.text
    assert via.json()["object"] == "chat.completion"
    _same_answer(via.json(), client.post("/v1/chat/completions", json=body).json())


def test_a_prompt_body_is_answered_as_completions_streamed_too(client: TestClient) -> None:
    body = {"prompt": "Hello", "max_tokens": 4}
    via = client.post("/invocations", json=body)
    assert via.status_code == 200 and via.json()["object"] == "text_completion"
    _same_answer(via.json(), client.post("/v1/completions", json=body).json())
    with client.stream("POST", "/invocations", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"input": "embed me"}, 400, "takes a chat completion request (with 'messages')"),
        ([1, 2], 400, "must be a JSON object"),
        ({"prompt": "x", "temperature": "hot"}, 400, "temperature"),
        ({"messages": "not a list"}, 400, "messages"),
    ],
)
def test_bodies_that_fit_no_route_or_are_invalid_for_theirs_are_400s(
    client: TestClient, body: Any, status: int, message: str
) -> None:
    response = client.post("/invocations", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"
    malformed = client.post(
        "/invocations", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert malformed.status_code == 400
    assert "malformed JSON" in malformed.json()["error"]["message"]


def test_the_route_is_picked_by_the_model_kind_and_the_keys() -> None:
    def handler(body: dict[str, Any], pooling: bool, classifier: bool = False) -> Any:
        route = invocation_route(body, pooling, classifier)
        return None if route is None else route[1]

    assert handler({"messages": [], "prompt": "x"}, False) is create_chat_completion
    assert handler({"prompt": "x"}, False) is create_completion
    assert handler({"input": "x"}, False) is None
    assert handler({"input": "x"}, True) is create_embedding
    assert handler({"messages": []}, True) is create_embedding
    assert handler({"input": "x"}, True, classifier=True) is create_classify
    assert handler({"text_1": "a", "text_2": "b"}, True, classifier=True) is create_score
    assert handler({"query": "a", "documents": ["b"]}, True, classifier=True) is do_rerank
    assert handler({"prompt": "x"}, True) is None


def test_ping_is_health_and_needs_no_key_where_invocations_does() -> None:
    engine = FakeAsyncLLM()
    with TestClient(build_app(engine, ServerSettings(api_key="k"))) as client:
        for method in ("GET", "POST"):
            assert client.request(method, "/ping").status_code == 200
        assert client.post("/invocations", json={"prompt": "x"}).status_code == 401
        auth = {"Authorization": "Bearer k"}
        ok = client.post("/invocations", json={"prompt": "x", "max_tokens": 2}, headers=auth)
        assert ok.status_code == 200
        engine.kill()
        assert client.get("/ping").status_code == 503
