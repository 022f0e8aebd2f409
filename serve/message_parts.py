"""Swap one kind of content part of chat messages for another, in order.

The Responses routes decode a conversation's media once, while validating it, and hand the
decoded objects to the chat renderer in place of the parts that named them (images for
``image_url`` parts, clips for ``input_audio`` parts): :func:`replace_parts` does that swap.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from chassis.serve.protocol import ChatMessage


def replace_parts(
    messages: list[ChatMessage], old_type: str, new_type: str, values: Sequence[Any]
) -> list[ChatMessage]:
    """``messages`` with their parts of type ``old_type`` replaced, in order, by
    ``{"type": new_type, new_type: value}`` for each of ``values``; messages without such a
    part are kept, the others copied. ``values`` must hold exactly one value per part (the
    caller made them from those parts): a count that disagrees is an ``AssertionError``."""
    remaining = iter(values)
    out = []
    for message in messages:
        content = message.content
        if not isinstance(content, list) or not any(
            part.get("type") == old_type for part in content
        ):
            out.append(message)
            continue
        try:
            parts = [
                {"type": new_type, new_type: next(remaining)}
                if part.get("type") == old_type
                else part
                for part in content
            ]
        except StopIteration:
            raise AssertionError(f"fewer values than {old_type} parts in the messages") from None
        out.append(message.model_copy(update={"content": parts}))
    if next(remaining, None) is not None:
        raise AssertionError(f"more values than {old_type} parts in the messages")
    return out
