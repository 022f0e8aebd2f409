"""A lone UTF-16 surrogate in a request's text (``"\\ud800"`` in the JSON, valid JSON that
no UTF-8 encoder takes) is a 400 naming the field, on every route that reads text; it was
a 500 from inside the tokenizer. Correct pairs (an emoji as ``json.dumps`` writes it) pass."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fake_engine import FakeAsyncLLM
from fastapi.testclient import TestClient

from chassis.serve.app import build_app
from chassis.serve.lone_surrogates import first_lone_surrogate
from chassis.serve.settings import ServerSettings


def _post_raw(route: str, raw: str) -> tuple[int, dict[str, Any]]:
    engine = FakeAsyncLLM(script="Hello there!")
    with TestClient(build_app(engine, ServerSettings())) as http:
        answer = http.post(
            route, content=raw.encode("ascii"), headers={"Content-Type": "application/json"}
        )
        return answer.status_code, answer.json()


@pytest.mark.parametrize(
    ("route", "raw", "param"),
    [
        ("/v1/completions", r'{"prompt": "a \ud800 b", "max_tokens": 2}', "prompt"),
        ("/v1/completions", r'{"prompt": ["ok", "\udc00"], "max_tokens": 2}', "prompt.1"),
        (
            "/v1/chat/completions",
            r'{"messages": [{"role": "user", "content": "\ud83d"}], "max_tokens": 2}',
            "messages.0.content",
        ),
        (
            "/v1/chat/completions",
            r'{"messages": [{"role": "user", "content": "hi"}], "stop": ["\ude00x"]}',
            "stop.0",
        ),
        ("/tokenize", r'{"prompt": "\ud800"}', "prompt"),
        ("/v1/responses", r'{"input": "\ud800", "max_output_tokens": 2}', "input"),
        # the pooling routes' models (validated before the route sees the server's runner)
        ("/v1/embeddings", r'{"input": ["ok", "\ud800"]}', "input.1"),
        ("/score", r'{"text_1": "a", "text_2": ["\udfff"]}', "text_2.0"),
        ("/rerank", r'{"query": "\ud800", "documents": ["a"]}', "query"),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_the_field(route: str, raw: str, param: str) -> None:
    status, answer = _post_raw(route, raw)
    assert status == 400, answer
    assert answer["error"]["param"] == param, answer
    assert "lone UTF-16 surrogate" in answer["error"]["message"], answer


def test_a_surrogate_pair_is_one_character_and_passes() -> None:
    raw = json.dumps({"prompt": "smile \U0001f600", "max_tokens": 2})  # ensure_ascii: a pair
    assert "\\ud83d\\ude00" in raw
    status, answer = _post_raw("/v1/completions", raw)
    assert status == 200, answer


def test_first_lone_surrogate_paths() -> None:
    assert first_lone_surrogate({"a": [1, {"b": "x\ud800"}]}) == "a.1.b"
    assert first_lone_surrogate({"k\udfff": 1}) == "k\udfff"
    assert first_lone_surrogate({"a": ["\U0001f600", 3, None]}) is None
    assert first_lone_surrogate("\ud800") == "body"
