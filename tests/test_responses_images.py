"""Images on ``/v1/responses`` (``input_image`` parts) and on ``/tokenize``, over a real
engine on the tiny Qwen2-VL (tests/fixtures_qwen2_vl.py), compared with the chat route: the
same message and image give the same prompt length and greedy text, streamed, not streamed
and in the background; a ``previous_response_id`` turn sees the earlier image again; bad
images are 400s naming ``input.N.content.M``; a text-only model refuses them as chat does;
``/tokenize`` expands each image to its tokens, as vLLM's does."""

from __future__ import annotations

import base64
import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from fixtures_qwen2_vl import hf_inputs, random_image, save_tiny_qwen2_vl
from PIL import Image

from chassis.core.async_llm import AsyncLLM
from chassis.core.config import EngineConfig
from chassis.serve.app import build_app
from chassis.serve.settings import ServerSettings

openai = pytest.importorskip("openai")

PAD = "<|vision_start|><|image_pad|><|vision_end|>"
QUESTION = "What is this?"
PROMPT = f"<|im_start|>user\n{PAD}{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
GREEDY = {"temperature": 0, "ignore_eos": True}


def _data_url(image: Image.Image) -> str:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


IMAGE = random_image(56, 84, seed=5)
URL = _data_url(IMAGE)


def _image(url: str = URL) -> dict[str, Any]:
    return {"type": "input_image", "image_url": url, "detail": "auto"}


def _text(text: str = QUESTION) -> dict[str, Any]:
    return {"type": "input_text", "text": text}


def _user(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"role": "user", "content": list(parts)}


class VL:
    """The app over a real engine of the tiny Qwen2-VL (at most 2 images a prompt, file URLs
    under ``media``), with its HTTP and ``openai`` clients."""

    def __init__(self, http: TestClient, media: Path, model_dir: Path) -> None:
        self.http = http
        self.media = media
        self.model_dir = model_dir
        self.client = openai.OpenAI(
            base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0
        )

    def chat(self, messages: list[dict[str, Any]], max_tokens: int = 4) -> dict[str, Any]:
        body = {"messages": messages, "max_tokens": max_tokens, **GREEDY}
        reply = self.http.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        return reply.json()

    def respond(self, **fields: Any) -> Any:
        return self.http.post("/v1/responses", json={"max_output_tokens": 4, **GREEDY, **fields})


@pytest.fixture(scope="module")
def vl(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VL]:
    model_dir = save_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny_qwen2_vl"), "qwen2_vl")
    media = tmp_path_factory.mktemp("media")
    engine = AsyncLLM.from_engine_config(
        EngineConfig(
            model=str(model_dir),
            dtype="float32",
            max_model_len=128,
            num_kv_blocks=64,
            limit_mm_per_prompt={"image": 2},
            allowed_local_media_path=str(media),
        )
    )
    try:
        with TestClient(build_app(engine, ServerSettings(shutdown_engine_on_exit=False))) as http:
            yield VL(http, media, model_dir)
    finally:
        engine.shutdown_sync()


def _chat_image(url: str = URL) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def _chat_user() -> dict[str, Any]:
    """The chat route's form of ``_user(_image(), _text())``."""
    return {"role": "user", "content": [_chat_image(), {"type": "text", "text": QUESTION}]}


def _events(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


@pytest.mark.timeout(300)
def test_a_responses_image_runs_as_the_chat_route_runs_it(vl: VL) -> None:
    chat = vl.chat([_chat_user()])
    prompt_tokens = chat["usage"]["prompt_tokens"]
    # the expanded prompt: the image's 12 tokens, as HF's processor expands it
    assert prompt_tokens == hf_inputs(vl.model_dir, PROMPT, [IMAGE])["input_ids"].shape[1]
    text = chat["choices"][0]["message"]["content"]
    assert chat["usage"]["completion_tokens"] == 4

    # the openai client's Responses call, the image first (as the chat message)
    response = vl.client.responses.create(
        model=vl.client.models.list().data[0].id,
        input=[_user(_image(), _text())],
        max_output_tokens=4,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert response.status == "incomplete"  # (max_output_tokens ended it, as chat's 4 tokens)
    assert response.output_text == text
    assert response.usage.input_tokens == prompt_tokens
    assert response.usage.output_tokens == 4

    # streamed: the deltas and the final response carry the same text and usage
    streamed = vl.respond(input=[_user(_image(), _text())], stream=True)
    assert streamed.status_code == 200
    events = _events(streamed.text)
    assert events[-1]["type"] == "response.incomplete"
    final = events[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == text
    assert final["usage"]["input_tokens"] == prompt_tokens
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert "".join(deltas) == text

    # background: queued at once, then the same response
    queued = vl.respond(input=[_user(_image(), _text())], background=True)
    assert queued.status_code == 200 and queued.json()["status"] == "queued"
    response_id = queued.json()["id"]
    deadline = time.monotonic() + 60
    while True:
        stored = vl.http.get(f"/v1/responses/{response_id}").json()
        if stored["status"] not in ("queued", "in_progress") or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert stored["status"] == "incomplete"
    assert stored["output"][0]["content"][0]["text"] == text
    assert stored["usage"]["input_tokens"] == prompt_tokens

    # /tokenize counts the same prompt: one image placeholder expanded to the image's tokens
    tokenized = vl.http.post("/tokenize", json={"messages": [_chat_user()]})
    assert tokenized.status_code == 200, tokenized.text
    assert tokenized.json()["count"] == prompt_tokens
    assert (
        tokenized.json()["tokens"]
        == hf_inputs(vl.model_dir, PROMPT, [IMAGE])["input_ids"][0].tolist()
    )


@pytest.mark.timeout(300)
def test_a_later_turn_sees_the_earlier_image_again(vl: VL) -> None:
    first = vl.respond(input=[_user(_image(), _text())])
    assert first.status_code == 200, first.text
    answer = first.json()["output"][0]["content"][0]["text"]
    follow_up = vl.respond(
        input=[_user(_text("And the colours?"))], previous_response_id=first.json()["id"]
    )
    assert follow_up.status_code == 200, follow_up.text
    messages = [
        _chat_user(),
        {"role": "assistant", "content": answer},
        {"role": "user", "content": [{"type": "text", "text": "And the colours?"}]},
    ]
    chat = vl.chat(messages)
    assert follow_up.json()["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert (
        follow_up.json()["output"][0]["content"][0]["text"]
        == chat["choices"][0]["message"]["content"]
    )

    # the image's tokens are in the follow-up's count, as in the first turn's
    def tokens(messages: list[dict[str, Any]]) -> int:
        return vl.http.post("/tokenize", json={"messages": messages}).json()["count"]

    text_only = [{"role": "user", "content": QUESTION}, *messages[1:]]
    image_tokens = first.json()["usage"]["input_tokens"] - tokens(text_only[:1])
    assert image_tokens > 3  # the vision markers and the image's own tokens
    assert follow_up.json()["usage"]["input_tokens"] - tokens(text_only) == image_tokens
    # the input items list the image part as it was sent
    items = vl.client.responses.input_items.list(
        follow_up.json()["id"], order="asc", include=["message.input_image.image_url"]
    )
    part = items.data[0].content[0]
    assert (part.type, part.image_url, part.detail) == ("input_image", URL, "auto")
    raw = vl.http.get(f"/v1/responses/{follow_up.json()['id']}/input_items?order=asc").json()
    assert raw["data"][0]["content"][0] == _image()
    assert [item.type for item in items.data] == ["message", "message", "message"]
    # a third image over two turns passes --limit-mm-per-prompt (2): named in this input
    over = vl.respond(
        input=[_user(_text("More:"), _image(), _image())], previous_response_id=first.json()["id"]
    )
    assert over.status_code == 400
    assert over.json()["error"]["param"] == "input.0.content.1"
    assert "At most 2 image(s)" in over.json()["error"]["message"]


@pytest.mark.timeout(300)
def test_image_mistakes_are_400s_naming_the_part(vl: VL) -> None:
    inside = vl.media / "img.png"
    inside.write_bytes(base64.b64decode(URL.split(",", 1)[1]))
    outside = vl.media.parent / "secret.png"
    outside.write_bytes(inside.read_bytes())
    from_file = vl.respond(input=[_user(_image(inside.as_uri()), _text())])
    assert from_file.status_code == 200, from_file.text
    for content, param, match in (
        ([_image("data:image/png;base64,@@"), _text()], "input.0.content.0", "invalid base64"),
        ([_text(), _image(outside.as_uri())], "input.0.content.1", "must lie under"),
        ([_image(), _image(), _image()], "input.0.content.0", "At most 2 image(s)"),
        ([{"type": "input_image", "file_id": "file-1"}], "input.0.content.0", "Files API"),
        ([{"type": "input_image", "detail": "low"}], "input.0.content.0", "needs its URL"),
        ([{"type": "input_file", "file_id": "f"}], "input.0.content.0.type", "input_file"),
    ):
        for background in (False, True):
            refused = vl.respond(input=[_user(*content)], background=background)
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert error["param"] == param and match in error["message"], error
    # an image past the first item is named by its item
    second = vl.respond(input=[_user(_text()), _user(_image("data:image/png;base64,@@"))])
    assert second.json()["error"]["param"] == "input.1.content.0"
    # a background response's context check counts the image's tokens: a prompt that fits
    # with one placeholder but not with the image expanded is refused before it is queued
    count = vl.http.post("/tokenize", json={"messages": [_chat_user()]}).json()["count"]
    refused = vl.respond(
        input=[_user(_image(), _text())], background=True, max_output_tokens=128 - count + 1
    )
    assert refused.status_code == 400, refused.text
    assert "maximum context length" in refused.json()["error"]["message"]


@pytest.mark.timeout(300)
def test_tokenize_expands_images_with_the_request_processor_settings(vl: VL) -> None:
    big = random_image(112, 112, seed=3)
    messages = [
        {"role": "user", "content": [_chat_image(_data_url(big)), {"type": "text", "text": "x"}]}
    ]
    full = vl.http.post("/tokenize", json={"messages": messages, "return_token_strs": True})
    assert full.status_code == 200, full.text
    small = vl.http.post(
        "/tokenize", json={"messages": messages, "mm_processor_kwargs": {"max_pixels": 56 * 56}}
    )
    assert full.json()["count"] - small.json()["count"] == 16 - 4  # 112 px: 16 tokens; 56: 4
    assert full.json()["token_strs"].count("<|image_pad|>") == 16
    for body, param, match in (
        ({"mm_processor_kwargs": {"num_frames": 1}}, None, "num_frames"),
        (
            {"messages": [_user(_chat_image("data:image/png;base64,@@"))]},
            "messages.0.content",
            "base64",
        ),
        ({"messages": [_user(*[_chat_image()] * 3)]}, "messages.0.content", "At most 2"),
    ):
        refused = vl.http.post("/tokenize", json={"messages": messages, **body})
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == param
        assert match in refused.json()["error"]["message"]


@pytest.mark.timeout(300)
def test_a_text_only_model_refuses_images_as_the_chat_route_does(tiny_llama_dir: Path) -> None:
    engine = AsyncLLM.from_engine_config(
        EngineConfig(model=str(tiny_llama_dir), max_model_len=64, num_kv_blocks=16)
    )
    try:
        with TestClient(build_app(engine, ServerSettings(shutdown_engine_on_exit=False))) as http:
            chat = http.post("/v1/chat/completions", json={"messages": [_chat_user()]})
            tokenize = http.post("/tokenize", json={"messages": [_chat_user()]})
            response = http.post("/v1/responses", json={"input": [_user(_text(), _image())]})
            for reply in (chat, tokenize, response):
                assert reply.status_code == 400, reply.text
            chat_error, error = chat.json()["error"], response.json()["error"]
            assert chat_error["param"] == "messages.0.content"
            assert tokenize.json()["error"] == chat_error
            assert error["param"] == "input.0.content.1"
            assert "(LlamaForCausalLM) takes text only" in error["message"]
            # the same words after the part's name
            assert error["message"].split(": ", 1)[1] == chat_error["message"].split(": ", 1)[1]
    finally:
        engine.shutdown_sync()


def test_routes_that_take_no_images_say_which_do(smol_tokenizer: Any) -> None:
    """The pooling routes' ``messages`` render without images: an image part is a 400
    naming the routes that take them."""
    from chassis.serve.errors import APIError
    from chassis.serve.protocol import ChatMessage
    from chassis.serve.renderer import ChatRenderer

    renderer = ChatRenderer(smol_tokenizer)
    message = ChatMessage(role="user", content=[{"type": "text", "text": "a"}, _chat_image()])
    with pytest.raises(APIError) as info:
        renderer.render_ids([message])
    assert info.value.param == "messages.0.content"
    assert "content[1]: only text parts" in info.value.message
    assert "/v1/responses and /tokenize" in info.value.message
