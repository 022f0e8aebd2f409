"""OpenAI chat messages -> template input (core/chat.py, and serve/renderer.py's 400s), with
real chat templates."""

from __future__ import annotations

import pytest

from chassis.core.chat import normalize_messages
from chassis.serve.errors import APIError
from chassis.serve.protocol import ChatMessage
from chassis.serve.renderer import ChatRenderer

TOOL_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}


def _messages(assistant_content: dict) -> list[ChatMessage]:
    return [
        ChatMessage(role="user", content="Weather in Paris?"),
        ChatMessage(role="assistant", tool_calls=[TOOL_CALL], **assistant_content),
        ChatMessage(role="tool", tool_call_id="call_1", content="sunny"),
    ]


@pytest.mark.parametrize("assistant_content", [{"content": None}, {}], ids=["null", "absent"])
def test_a_tool_calling_turn_without_content_renders(
    smol_tokenizer,
    assistant_content: dict,
) -> None:
    # OpenAI's own tool-call history: the assistant turn has tool_calls and null content
    renderer = ChatRenderer(smol_tokenizer)
    text = renderer.render(_messages(assistant_content))
    same_with_empty = renderer.render(_messages({"content": ""}))
    assert text == same_with_empty
    assert "None" not in text and "sunny" in text


def test_template_input_parses_tool_arguments_and_keeps_extra_keys() -> None:
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [TOOL_CALL],
        "reasoning_content": "hmm",
    }
    [item] = normalize_messages([message])
    assert item["content"] == ""
    assert item["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert item["reasoning_content"] == "hmm"
    # the request's own object is not changed
    assert TOOL_CALL["function"]["arguments"] == '{"city": "Paris"}'


def test_reasoning_sent_back_reaches_templates_as_reasoning_content() -> None:
    [item] = normalize_messages([{"role": "assistant", "content": "4", "reasoning": "2+2"}])
    assert item["reasoning_content"] == "2+2" and item["reasoning"] == "2+2"
    both = {"role": "assistant", "content": "4", "reasoning": "a", "reasoning_content": "b"}
    assert normalize_messages([both])[0]["reasoning_content"] == "b"


def test_text_parts_are_joined_and_bad_parts_named(smol_tokenizer) -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    [item] = normalize_messages([{"role": "user", "content": parts}])
    assert item["content"] == "a\nb"
    renderer = ChatRenderer(smol_tokenizer)  # the server's side: a 400 naming the message
    with pytest.raises(APIError) as info:
        renderer.render([ChatMessage(role="user", content=[{"type": "text"}])])
    assert info.value.status == 400 and "needs a string field 'text'" in info.value.message
    with pytest.raises(APIError) as info:
        renderer.render(
            [ChatMessage(role="user", content=[{"type": "image_url", "image_url": {"url": "x"}}])]
        )
    assert "only text parts" in info.value.message
