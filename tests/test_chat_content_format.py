"""vLLM's ``--chat-template-content-format {auto,string,openai}`` (core/chat_content_format.py,
core/chat.py): what ``auto`` detects from a template's AST, what each format hands the
template (checked against transformers' own ``apply_chat_template`` given the same message
shapes), and that the text reaches the model through the server's routes (a real tokenizer
and renderer over the test double of the engine) and ``LLM.chat`` (the tiny random Llama)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from fake_engine import FakeAsyncLLM, make_tokenizer
from fastapi.testclient import TestClient

from chassis.core import chat_content_format
from chassis.core.chat import normalize_messages, render_chat
from chassis.core.chat_content_format import detect_content_format, resolve_content_format
from chassis.serve.app import build_app
from chassis.serve.cli import build_parser
from chassis.serve.cli_serve import settings_from_args
from chassis.serve.errors import APIError
from chassis.serve.protocol import ChatMessage
from chassis.serve.renderer import ChatRenderer
from chassis.serve.settings import ServerSettings

_END = "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
#: content as a list of parts (as multimodal-family templates read it)
LIST_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}" + _END
)
#: content as one string
STRING_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    + _END
)
#: both shapes, as Qwen2-VL's and Llama 4's templates do
BOTH_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{{ part['text'] }}{% endfor %}{% endif %}" + _END
)
USER = [{"role": "user", "content": "Hello there"}]
USER_PARTS = [{"role": "user", "content": [{"type": "text", "text": "Hello there"}]}]


@pytest.fixture(scope="module")
def tokenizer():
    """A real byte-level fast tokenizer (tests/fake_engine.py), built in memory."""
    return make_tokenizer()


def _hf(tokenizer, messages: list[dict[str, Any]], template: str, **kwargs: Any) -> str:
    """transformers' own rendering of exactly these message shapes."""
    kwargs.setdefault("add_generation_prompt", True)
    return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, **kwargs)


# -- detection ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "template",
    [
        LIST_TEMPLATE,
        BOTH_TEMPLATE,
        # attribute access, another loop-variable name
        "{% for turn in messages %}{% for p in turn.content %}{{ p.text }}{% endfor %}{% endfor %}",
        # the messages under another name (a slice, then a filter), the content in a variable
        "{% set loop_messages = messages[1:] %}{% set rest = loop_messages | list %}"
        "{% for m in rest %}{% set parts = m['content'] %}{% set texts = parts %}"
        "{% for p in texts %}{{ p['text'] }}{% endfor %}{% endfor %}",
        # a filtered loop over the content
        "{% for m in messages %}{% for p in m['content'] | selectattr('type', 'equalto', 'text')"
        " %}{{ p.text }}{% endfor %}{% endfor %}",
        # a macro whose parameter is named content (Qwen3.5's shape; vLLM counts it)
        "{% macro render(content) %}{% for item in content %}{{ item.text }}{% endfor %}"
        "{% endmacro %}{% for m in messages %}{{ render(m.content) }}{% endfor %}",
        # transformers' {% generation %} extension parses
        "{% for m in messages %}{% generation %}{% for p in m['content'] %}{{ p.text }}"
        "{% endfor %}{% endgeneration %}{% endfor %}",
    ],
    ids=["list", "both", "attribute", "assigned", "filtered", "macro", "generation"],
)
def test_a_loop_over_a_messages_content_is_openai(template: str) -> None:
    assert detect_content_format(template) == "openai"


@pytest.mark.parametrize(
    "template",
    [
        STRING_TEMPLATE,
        # loops, but over other things: tool calls, a list that is not the messages
        "{% for m in messages %}{{ m['content'] }}{% for c in m['tool_calls'] %}{{ c.id }}"
        "{% endfor %}{% endfor %}",
        "{% for d in documents %}{% for p in d['content'] %}{{ p }}{% endfor %}{% endfor %}",
        # a loop over a message's content split into lines is a loop over a string's parts
        "{% for m in messages %}{% for line in m['content'].split('\\n') %}{{ line }}"
        "{% endfor %}{% endfor %}",
        # not valid Jinja: string (rendering reports the error)
        "{% for m in messages %}{{ m['content'] }",
    ],
    ids=["string", "tool-calls", "documents", "split", "syntax-error"],
)
def test_anything_else_is_string(template: str) -> None:
    assert detect_content_format(template) == "string"


def test_the_real_chatml_template_is_string(tokenizer) -> None:
    assert detect_content_format(tokenizer.chat_template) == "string"


def test_detection_parses_each_template_once(monkeypatch) -> None:
    parsed: list[str] = []
    real = chat_content_format._parse

    def counting(template: str):
        parsed.append(template)
        return real(template)

    monkeypatch.setattr(chat_content_format, "_parse", counting)
    template = LIST_TEMPLATE + "{# parsed once #}"
    for _ in range(3):
        assert detect_content_format(template) == "openai"
    assert parsed == [template]


def test_auto_logs_what_it_detected_once_per_template(caplog) -> None:
    template = LIST_TEMPLATE + "{# logged once #}"
    with caplog.at_level(logging.INFO, logger="chassis.core.chat_content_format"):
        assert resolve_content_format("auto", template) == "openai"
        assert resolve_content_format("auto", template) == "openai"
        assert resolve_content_format("string", template) == "string"  # a choice is kept
        assert resolve_content_format("auto", None) == "string"  # no template at all
    detected = [r for r in caplog.records if "content format to be 'openai'" in r.message]
    assert len(detected) == 1 and detected[0].levelno == logging.INFO
    with pytest.raises(ValueError, match="must be one of 'auto', 'string', 'openai'"):
        resolve_content_format("parts", template)


# -- what each format hands the template --------------------------------------------------


def test_string_and_openai_shapes() -> None:
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": []},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "sunny"}]},
    ]
    as_string = [m["content"] for m in normalize_messages(messages, "string")]
    assert as_string == ["S", "a\nb", "", "sunny"]
    as_parts = [m["content"] for m in normalize_messages(messages, "openai")]
    assert as_parts == [
        [{"type": "text", "text": "S"}],  # a string is one text part (vLLM)
        [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],  # parts stay parts
        [],  # absent content: no part (vLLM)
        "sunny",  # a tool result stays a string (vLLM joins its text parts)
    ]


@pytest.mark.parametrize("content_format", ["string", "openai", "auto"])
def test_non_text_parts_are_refused_in_every_format(tokenizer, content_format: str) -> None:
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(ValueError, match="only text parts are supported"):
        render_chat(tokenizer, image, chat_template=LIST_TEMPLATE, content_format=content_format)


@pytest.mark.parametrize("content_format", ["auto", "openai"])
def test_a_list_template_renders_the_content_as_parts(tokenizer, content_format: str) -> None:
    text = render_chat(tokenizer, USER, chat_template=LIST_TEMPLATE, content_format=content_format)
    assert text == "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
    assert text == _hf(tokenizer, USER_PARTS, LIST_TEMPLATE)
    # several parts reach the template one by one (this one writes them back to back)
    two = [
        {"role": "user", "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]}
    ]
    assert "\nAB<|im_end|>" in render_chat(
        tokenizer, two, chat_template=LIST_TEMPLATE, content_format=content_format
    )


@pytest.mark.parametrize("content_format", ["auto", "string"])
def test_a_string_template_renders_the_content_as_a_string(tokenizer, content_format: str) -> None:
    text = render_chat(
        tokenizer, USER_PARTS, chat_template=STRING_TEMPLATE, content_format=content_format
    )
    assert text == "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
    assert text == _hf(tokenizer, USER, STRING_TEMPLATE)


@pytest.mark.parametrize("content_format", ["auto", "string", "openai"])
def test_a_template_taking_both_renders_the_text_in_every_format(
    tokenizer, content_format: str
) -> None:
    text = render_chat(
        tokenizer, USER_PARTS, chat_template=BOTH_TEMPLATE, content_format=content_format
    )
    assert text == "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"


def test_a_format_the_template_does_not_read_renders_as_transformers_does(tokenizer) -> None:
    # openai on a string template: the list's text, as transformers writes it given the list
    wrong_way = render_chat(tokenizer, USER, chat_template=STRING_TEMPLATE, content_format="openai")
    assert wrong_way == _hf(tokenizer, USER_PARTS, STRING_TEMPLATE)
    assert "[{'type': 'text', 'text': 'Hello there'}]" in wrong_way
    # string on a list template: the loop walks the string's characters, none a text part,
    # so the content is lost, as transformers loses it given the string
    lost = render_chat(tokenizer, USER_PARTS, chat_template=LIST_TEMPLATE, content_format="string")
    assert lost == _hf(tokenizer, USER, LIST_TEMPLATE)
    assert lost == "<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n"


def test_the_tokenizers_own_template_renders_as_transformers_does(smol_tokenizer) -> None:
    # the real SmolLM2 template (ChatML, message['content']): auto is string, as before
    messages = [{"role": "system", "content": "Be brief."}, *USER]
    assert render_chat(smol_tokenizer, messages) == smol_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_continue_final_message_with_parts(tokenizer) -> None:
    messages = [*USER, {"role": "assistant", "content": "The capital"}]
    text = render_chat(
        tokenizer,
        messages,
        chat_template=LIST_TEMPLATE,
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert text.endswith("<|im_start|>assistant\nThe capital")


# -- the server ---------------------------------------------------------------------------


def test_the_flag_reaches_the_settings() -> None:
    args = build_parser().parse_args(["serve", "--chat-template-content-format", "openai"])
    assert settings_from_args(args).chat_template_content_format == "openai"
    assert settings_from_args(
        build_parser().parse_args(["serve"])
    ).chat_template_content_format == ("auto")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--chat-template-content-format", "parts"])
    with pytest.raises(ValueError, match="--chat-template-content-format must be one of"):
        ServerSettings(chat_template_content_format="parts")


def test_the_server_logs_the_detected_format_at_start_up(caplog) -> None:
    template = LIST_TEMPLATE + "{# the server's #}"
    with caplog.at_level(logging.INFO, logger="chassis.core.chat_content_format"):
        renderer = ChatRenderer(make_tokenizer(), template)
    assert renderer.server_content_format == "openai"
    assert any("content format to be 'openai'" in r.message for r in caplog.records)
    fixed = ChatRenderer(make_tokenizer(), template, chat_template_content_format="string")
    assert fixed.server_content_format == "string"
    assert ChatRenderer(make_tokenizer()).server_content_format == "string"  # the model's


def test_a_request_template_is_detected_on_its_own() -> None:
    # the server's template reads strings; a request's own reads parts: each gets its shape
    renderer = ChatRenderer(make_tokenizer(), STRING_TEMPLATE, trust_request_chat_template=True)
    messages = [ChatMessage(role="user", content="Hello there")]
    assert "\nHello there<|im_end|>" in renderer.render(messages)
    assert "\nHello there<|im_end|>" in renderer.render(messages, chat_template=LIST_TEMPLATE)
    # an explicit format holds for every template
    fixed = ChatRenderer(
        make_tokenizer(),
        STRING_TEMPLATE,
        trust_request_chat_template=True,
        chat_template_content_format="string",
    )
    assert "Hello there" not in fixed.render(messages, chat_template=LIST_TEMPLATE)
    with pytest.raises(APIError) as info:  # a non-text part is still the request's 400
        fixed.render([ChatMessage(role="user", content=[{"type": "image_url"}])])
    assert info.value.status == 400 and info.value.param == "messages.0.content"


def _ids(engine: FakeAsyncLLM, text: str) -> list[int]:
    return list(engine.tokenizer(text, add_special_tokens=False).input_ids)


@pytest.mark.parametrize("content_format", ["auto", "openai", "string"])
def test_the_model_sees_the_text_through_the_routes(content_format: str) -> None:
    # the model's template reads parts: with auto (and openai) every route renders the text;
    # string loses it, as transformers does
    engine = FakeAsyncLLM(chat_template=LIST_TEMPLATE)
    settings = ServerSettings(chat_template_content_format=content_format)
    sees_text = content_format != "string"
    expected = _hf(engine.tokenizer, USER_PARTS if sees_text else USER, LIST_TEMPLATE)
    assert ("Hello there" in expected) is sees_text
    with TestClient(build_app(engine, settings)) as client:
        tokenized = client.post("/tokenize", json={"messages": USER})
        assert tokenized.status_code == 200, tokenized.text
        assert tokenized.json()["tokens"] == _ids(engine, expected)

        chat = client.post(
            "/v1/chat/completions", json={"model": "fake-model", "messages": USER, "max_tokens": 1}
        )
        assert chat.status_code == 200, chat.text
        assert engine.requests[-1][1] == _ids(engine, expected)

        # Responses: input_text parts reach the template as text parts, one by one
        parts = [{"type": "input_text", "text": "Hello"}, {"type": "input_text", "text": " there"}]
        responses = client.post(
            "/v1/responses",
            json={
                "model": "fake-model",
                "input": [{"role": "user", "content": parts}],
                "max_output_tokens": 1,
            },
        )
        assert responses.status_code == 200, responses.text
        assert engine.requests[-1][1] == _ids(engine, expected)


def test_responses_parts_are_joined_for_a_string_template() -> None:
    engine = FakeAsyncLLM(chat_template=STRING_TEMPLATE)
    with TestClient(build_app(engine, ServerSettings())) as client:
        parts = [{"type": "input_text", "text": "Hello"}, {"type": "output_text", "text": "there"}]
        response = client.post(
            "/v1/responses",
            json={
                "model": "fake-model",
                "input": [{"role": "user", "content": parts}],
                "max_output_tokens": 1,
            },
        )
        assert response.status_code == 200, response.text
    joined = [{"role": "user", "content": "Hello\nthere"}]
    assert engine.requests[-1][1] == _ids(engine, _hf(engine.tokenizer, joined, STRING_TEMPLATE))


# -- LLM.chat -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path):
    from chassis.core.llm import LLM

    return LLM(str(tiny_llama_dir), dtype="float32", max_model_len=128)


def test_llm_chat_takes_the_format(llm) -> None:
    from chassis.core.sampling_params import SamplingParams

    one = SamplingParams(max_tokens=1, temperature=0.0)
    seen = llm.chat(USER, one, chat_template=LIST_TEMPLATE)[0]  # auto: openai
    assert seen.prompt == _hf(llm.tokenizer, USER_PARTS, LIST_TEMPLATE)
    assert "Hello there" in seen.prompt
    assert seen.prompt_token_ids == llm.tokenizer(seen.prompt, add_special_tokens=False).input_ids
    explicit = llm.chat(
        USER, one, chat_template=LIST_TEMPLATE, chat_template_content_format="openai"
    )
    assert explicit[0].prompt == seen.prompt
    lost = llm.chat(USER, one, chat_template=LIST_TEMPLATE, chat_template_content_format="string")
    assert "Hello there" not in lost[0].prompt
    # the model's own (ChatML, string) template: auto renders as before
    own = llm.chat(USER_PARTS, one)[0].prompt
    assert own == llm.tokenizer.apply_chat_template(
        USER, tokenize=False, add_generation_prompt=True
    )
    with pytest.raises(ValueError, match="chat_template_content_format must be one of"):
        llm.chat(USER, one, chat_template_content_format="parts")
