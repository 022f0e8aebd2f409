"""A pydantic validation 400's ``param`` names the request field, never one of pydantic's
union-member names: ``prompt``, not ``prompt.str`` (the message still lists what each
alternative wanted)."""

from __future__ import annotations

from typing import Any

import pytest
from fake_engine import FakeAsyncLLM
from fastapi.testclient import TestClient

from chassis.serve.app import build_app
from chassis.serve.settings import ServerSettings

USER = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/v1/completions", {"prompt": ["a", [1]]}, "prompt"),
        ("/v1/completions", {"prompt": "a", "stop": 5}, "stop"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": 5}]},
            "messages.0.content",
        ),
        ("/v1/chat/completions", {"messages": USER, "tool_choice": 5}, "tool_choice"),
        ("/v1/chat/completions", {"messages": USER, "logit_bias": {"7": "x"}}, "logit_bias.7"),
        ("/v1/chat/completions", {"messages": USER, "temperature": "hot"}, "temperature"),
        ("/v1/responses", {"input": 5}, "input"),
    ],
)
def test_param_is_the_field_not_a_union_member(
    route: str, body: dict[str, Any], param: str
) -> None:
    with TestClient(build_app(FakeAsyncLLM(), ServerSettings())) as http:
        answer = http.post(route, json=body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param, error
    assert error["message"].startswith(param), error  # the message keeps the full locations
