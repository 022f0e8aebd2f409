"""Audio on ``/v1/responses`` (OpenAI's ``input_audio`` parts) over a real engine on the tiny
Qwen2-Audio (tests/fixtures_qwen2_audio.py), compared with the chat route: the same message
and clip give the same prompt length and greedy text; a ``previous_response_id`` turn sees
the earlier clip again; a malformed part, bad audio bytes and too many clips are 400s naming
the part as Responses names it (``input.N.content.M``); each clip is decoded once per
request (an ``audio_clip`` part sent over HTTP is refused); a model without audio refuses the part with a 400 naming it and saying why."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from fixtures_qwen2_audio import random_clip, save_tiny_qwen2_audio, wav_bytes

from chassis.core import audio_loading
from chassis.core.async_llm import AsyncLLM
from chassis.core.config import EngineConfig
from chassis.serve.app import build_app
from chassis.serve.settings import ServerSettings

GREEDY = {"temperature": 0, "ignore_eos": True}
QUESTION = "What is that sound?"
WAV = base64.b64encode(wav_bytes(random_clip(0.7, seed=2))).decode()


def audio_part(data: str = WAV, fmt: str = "wav") -> dict[str, Any]:
    """The part as OpenAI's Responses and Chat Completions APIs both write it."""
    return {"type": "input_audio", "input_audio": {"data": data, "format": fmt}}


def user(*parts: dict[str, Any], text_type: str = "input_text") -> dict[str, Any]:
    return {"role": "user", "content": [*parts, {"type": text_type, "text": QUESTION}]}


def serve(model_dir: Path, **config: Any) -> tuple[AsyncLLM, Any]:
    engine = AsyncLLM.from_engine_config(
        EngineConfig(model=str(model_dir), dtype="float32", max_model_len=256, **config)
    )
    return engine, build_app(engine, ServerSettings(shutdown_engine_on_exit=False))


@pytest.fixture(scope="module")
def http(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    """The app over the tiny Qwen2-Audio, at most 2 clips a prompt."""
    model_dir = save_tiny_qwen2_audio(tmp_path_factory.mktemp("qwen2_audio"))
    engine, app = serve(model_dir, num_kv_blocks=128, limit_mm_per_prompt={"audio": 2})
    try:
        with TestClient(app) as client:
            yield client
    finally:
        engine.shutdown_sync()


def test_a_responses_clip_runs_as_the_chat_route_runs_it(http: TestClient) -> None:
    """Not streamed and streamed: the chat route's prompt length and text; a later turn
    (``previous_response_id``) renders the earlier clip again: its prompt is the chat
    route's for the whole conversation."""
    chat = http.post(
        "/v1/chat/completions",
        json={"messages": [user(audio_part(), text_type="text")], "max_tokens": 4, **GREEDY},
    )
    assert chat.status_code == 200, chat.text
    chat = chat.json()
    text = chat["choices"][0]["message"]["content"]
    body = {"input": [user(audio_part())], "max_output_tokens": 4, **GREEDY}
    response = http.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    first = response.json()
    assert first["output"][0]["content"][0]["text"] == text
    assert first["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert chat["usage"]["prompt_tokens"] > 17  # the clip's 17 rows are in the prompt
    with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as stream:
        lines = [line for line in stream.iter_lines() if line.startswith("data: ")]
    events = [json.loads(line.removeprefix("data: ")) for line in lines]
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    streamed = "".join(deltas)
    assert streamed == text
    follow_up = http.post(
        "/v1/responses",
        json={
            "input": "And again?",
            "previous_response_id": first["id"],
            "max_output_tokens": 4,
            **GREEDY,
        },
    )
    assert follow_up.status_code == 200, follow_up.text
    messages = [
        user(audio_part(), text_type="text"),
        {"role": "assistant", "content": text},
        {"role": "user", "content": "And again?"},
    ]
    again = http.post(
        "/v1/chat/completions", json={"messages": messages, "max_tokens": 4, **GREEDY}
    )
    assert again.status_code == 200, again.text
    assert follow_up.json()["usage"]["input_tokens"] == again.json()["usage"]["prompt_tokens"]
    assert (
        follow_up.json()["output"][0]["content"][0]["text"]
        == (again.json()["choices"][0]["message"]["content"])
    )


def test_audio_mistakes_are_400s_naming_the_part(http: TestClient) -> None:
    """A part without format, bytes that are no audio, an unknown format and three clips
    (over ``--limit-mm-per-prompt``): 400s naming the part."""
    cases = [
        ([{"type": "input_audio", "input_audio": {"data": WAV}}], "input.0.content.0", "needs"),
        ([audio_part(base64.b64encode(b"junk").decode())], "input.0.content.0", "not an audio"),
        ([audio_part(fmt="ogg")], "input.0.content.0", "format must be one of wav, mp3"),
        ([audio_part(), audio_part("@@")], "input.0.content.1", "not valid base64"),
        ([audio_part()] * 3, "input.0.content.0", "At most 2 audio"),
    ]
    for parts, param, match in cases:
        reply = http.post("/v1/responses", json={"input": [user(*parts)], "max_output_tokens": 2})
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == param and match in error["message"], error
        assert error["message"].startswith("input") and "messages" not in error["message"]


def test_each_clip_is_decoded_once(http: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two clips: two decodes (checked and rendered from the same decode), also for a later
    turn that sees them again through ``previous_response_id``."""
    decoded: list[str] = []

    def counting_decode(data: bytes, where: str) -> Any:
        decoded.append(where)
        return real_decode(data, where)

    real_decode = audio_loading.decode_audio
    monkeypatch.setattr(audio_loading, "decode_audio", counting_decode)
    body = {"input": [user(audio_part(), audio_part())], "max_output_tokens": 2, **GREEDY}
    first = http.post("/v1/responses", json=body)
    assert first.status_code == 200, first.text
    assert len(decoded) == 2
    assert first.json()["usage"]["input_tokens"] > 2 * 17  # (both clips' rows)
    follow_up = http.post(
        "/v1/responses",
        json={"input": "Again?", "previous_response_id": first.json()["id"], **GREEDY},
    )
    assert follow_up.status_code == 200, follow_up.text
    assert len(decoded) == 4


def test_a_decoded_clip_part_sent_over_http_is_refused(http: TestClient) -> None:
    """The ``audio_clip`` part (how Responses hands its decoded clips to the renderer) holds
    a numpy clip, which JSON cannot: sent to the chat route it is a 400 naming the part."""
    part = {"type": "audio_clip", "audio_clip": [[0.0, 0.1], 16000]}
    reply = http.post(
        "/v1/chat/completions",
        json={"messages": [user(part, text_type="text")], "max_tokens": 2},
    )
    assert reply.status_code == 400, reply.text
    message = reply.json()["error"]["message"]
    assert message.startswith("messages[0].content[0]: an audio_clip part needs"), message


def test_a_model_without_audio_refuses_the_part(tiny_llama_dir: Path) -> None:
    """A text-only model: a 400 naming the part and saying the model takes text only."""
    engine = AsyncLLM.from_engine_config(
        EngineConfig(model=str(tiny_llama_dir), max_model_len=64, num_kv_blocks=16)
    )
    app = build_app(engine, ServerSettings(shutdown_engine_on_exit=False))
    try:
        with TestClient(app) as http:
            reply = http.post("/v1/responses", json={"input": [user(audio_part())]})
    finally:
        engine.shutdown_sync()
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "input.0.content.0"
    assert error["message"].startswith("input[0].content[0]: audio parts are not supported")
    assert "(LlamaForCausalLM) takes text only; it cannot take audio inputs" in error["message"]
