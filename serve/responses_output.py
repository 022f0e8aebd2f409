"""A generated message as Responses output: items, status and usage.

The message is parsed as on the chat route (:class:`~chassis.serve.chat_parsing.ChoiceParser`:
``--reasoning-parser``, then the tool parser), and its parts become output items in this
order: a ``reasoning`` item (when there is reasoning), a ``message`` item with the content
(left out when the content is only whitespace next to other items, as the chat route sends
``content: null`` next to tool calls), then one ``function_call`` item per call.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from chassis.serve.responses_protocol import (
    FunctionCallItem,
    InputTokensDetails,
    OutputItem,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ResponseUsage,
)

if TYPE_CHECKING:
    from chassis.serve.chat_parsing import ChoiceDelta
    from chassis.serve.state import UsageCounter


def new_id(prefix: str) -> str:
    """A fresh id of an object or item (``resp``, ``msg``, ``rs``, ``fc``)."""
    return f"{prefix}_{uuid.uuid4().hex}"


def response_status(finish_reason: str | None) -> tuple[str, dict[str, Any] | None]:
    """The response's ``status`` and ``incomplete_details`` for the engine's finish reason:
    ``length`` (``max_output_tokens`` or the context length reached) is ``incomplete``; a
    stream that ended without one (aborted by the server) is ``cancelled``."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason is None or finish_reason == "abort":
        return "cancelled", None
    return "completed", None


def item_status(status: str) -> str:
    """The status of the last output item of a response of ``status``."""
    return "completed" if status == "completed" else "incomplete"


def message_item(text: str, status: str = "completed") -> OutputMessage:
    return OutputMessage(id=new_id("msg"), status=status, content=[OutputText(text=text)])


def output_items(parsed: ChoiceDelta, status: str) -> list[OutputItem]:
    """The output items of a whole parsed message (see the module docstring); the last
    item's status is :func:`item_status` of the response's ``status``."""
    items: list[OutputItem] = []
    if parsed.reasoning:
        reasoning = ReasoningText(text=parsed.reasoning)
        items.append(ReasoningItem(id=new_id("rs"), content=[reasoning]))
    calls = parsed.calls
    if parsed.content.strip() or not (items or calls):
        items.append(message_item(parsed.content))
    for call in calls:
        assert call.id is not None  # ChoiceParser gives every call an id
        items.append(
            FunctionCallItem(
                id=new_id("fc"), call_id=call.id, name=call.name, arguments=call.arguments
            )
        )
    items[-1].status = item_status(status)  # type: ignore[assignment]
    return items


def reasoning_text(items: list[OutputItem]) -> str:
    """The reasoning of ``items`` (for the ``reasoning_tokens`` count)."""
    return "".join(
        part.text for item in items if isinstance(item, ReasoningItem) for part in item.content
    )


def response_usage(usage: UsageCounter, tokenizer: Any, reasoning: str) -> ResponseUsage:
    """Responses' usage from the route's counter. ``reasoning_tokens`` is the token count of
    the ``reasoning`` text (re-tokenized: the parsers split text, not tokens)."""
    counts = usage.as_dict()
    reasoning_tokens = 0
    if reasoning:
        reasoning_tokens = len(tokenizer.encode(reasoning, add_special_tokens=False))
    return ResponseUsage(
        input_tokens=counts["prompt_tokens"],
        input_tokens_details=InputTokensDetails(
            cached_tokens=counts["prompt_tokens_details"]["cached_tokens"]
        ),
        output_tokens=counts["completion_tokens"],
        output_tokens_details=OutputTokensDetails(
            reasoning_tokens=min(reasoning_tokens, counts["completion_tokens"])
        ),
        total_tokens=counts["total_tokens"],
    )
