"""Streams with several choices (``n`` > 1, a completions batch) send one choice per chunk,
as OpenAI and vLLM do: clients (and the docs' "one chunk per choice" role chunks) read
``chunk.choices[0]``, and a chunk carrying two choices lost the second for them."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fake_engine import FakeAsyncLLM
from fastapi.testclient import TestClient

from chassis.serve.app import build_app
from chassis.serve.settings import ServerSettings


def _chunks(route: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    engine = FakeAsyncLLM()
    with TestClient(build_app(engine, ServerSettings())) as http:
        answer = http.post(route, json={"model": "fake-model", "stream": True, **body})
        assert answer.status_code == 200, answer.text
        events = [
            line.removeprefix("data: ")
            for line in answer.text.splitlines()
            if line.startswith("data: ")
        ]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


USAGE = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}


@pytest.mark.parametrize(
    ("route", "body", "num_choices"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "n": 3}, 3),
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Sure"},
                ],
                "add_generation_prompt": False,
                "continue_final_message": True,
                "echo": True,
                "n": 2,
                "return_token_ids": True,
            },
            2,
        ),
        ("/v1/completions", {"prompt": ["Hi", "Yo"], "n": 2, "echo": True}, 4),
    ],
)
def test_every_chunk_carries_one_choice(route: str, body: dict[str, Any], num_choices: int) -> None:
    chunks = _chunks(route, {"max_tokens": 4, **USAGE, **body})
    *choice_chunks, usage_chunk = chunks
    assert usage_chunk["choices"] == []
    assert all(len(c["choices"]) == 1 for c in choice_chunks), [
        [choice["index"] for choice in c["choices"]] for c in choice_chunks
    ]
    assert all(c["usage"] is not None for c in choice_chunks)  # continuous usage on each
    finished = [c["choices"][0]["index"] for c in choice_chunks if c["choices"][0]["finish_reason"]]
    assert sorted(finished) == list(range(num_choices))
    if route == "/v1/chat/completions":
        roles = [c["choices"][0]["index"] for c in choice_chunks[:num_choices]]
        assert roles == list(range(num_choices))
        assert all(
            c["choices"][0]["delta"].get("role") == "assistant" for c in choice_chunks[:num_choices]
        )
        if body.get("return_token_ids"):  # the prompt's ids come once, with the first chunk
            assert "prompt_token_ids" in choice_chunks[0]
            assert not any("prompt_token_ids" in c for c in choice_chunks[1:])
