"""``serve.message_parts.replace_parts``: the swap of decoded media into chat messages."""

from __future__ import annotations

import pytest

from chassis.serve.message_parts import replace_parts
from chassis.serve.protocol import ChatMessage


def _messages() -> list[ChatMessage]:
    return [
        ChatMessage(role="system", content="plain text"),
        ChatMessage(
            role="user",
            content=[
                {"type": "text", "text": "a"},
                {"type": "image_url", "image_url": {"url": "u1"}},
                {"type": "image_url", "image_url": {"url": "u2"}},
            ],
        ),
        ChatMessage(role="user", content=[{"type": "text", "text": "no media"}]),
    ]


def test_parts_are_replaced_in_order_and_other_messages_kept() -> None:
    messages = _messages()
    out = replace_parts(messages, "image_url", "image_pil", ["first", "second"])
    assert out[0] is messages[0] and out[2] is messages[2]  # untouched messages are kept
    assert out[1].content == [
        {"type": "text", "text": "a"},
        {"type": "image_pil", "image_pil": "first"},
        {"type": "image_pil", "image_pil": "second"},
    ]
    assert messages[1].content[1]["type"] == "image_url"  # the input is not changed


@pytest.mark.parametrize("values", [["only one"], ["a", "b", "c"]])
def test_a_count_that_disagrees_is_a_bug(values: list[str]) -> None:
    with pytest.raises(AssertionError, match="image_url parts"):
        replace_parts(_messages(), "image_url", "image_pil", values)
