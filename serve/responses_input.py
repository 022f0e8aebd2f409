"""Responses API input items -> the chat messages the chat template renders.

A conversation is a list of Responses items (what ``input`` carries, and what a stored
response keeps for ``previous_response_id``: its conversation so far plus its output items,
which are valid input items too):

* a message ``{"role": "user" | "system" | "developer" | "assistant", "content": str | parts}``
  (``"type": "message"`` optional); text parts are ``input_text``, ``output_text`` (an
  earlier answer sent back) or ``text``; image, file and audio parts are refused, since the
  chat path takes text only. The role reaches the chat template as sent, ``developer``
  included, as on the chat route (and in vLLM): the same messages render the same prompt on
  both routes; a template that knows no ``developer`` treats it as it does in chat.
* ``{"type": "function_call", "call_id", "name", "arguments"}``: a call the assistant made; it
  joins the assistant message just before it (calls made together are one turn).
* ``{"type": "function_call_output", "call_id", "output"}``: the result, a ``tool`` message.
* ``{"type": "reasoning", "content": [{"type": "reasoning_text", "text"}], ...}``: the
  reasoning of the next assistant turn (``reasoning_content``, which templates such as
  Qwen3's read; dropped when no assistant turn follows).

Every mistake is a 400 naming the item (``input.3.content``).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from chassis.serve.errors import bad_request
from chassis.serve.protocol import ChatMessage

_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")


def input_items(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``input`` as a list of items (a string is one user message)."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    return list(value)


def chat_messages(
    items: list[dict[str, Any]], where: str = "input", earlier_calls: Collection[str] = ()
) -> list[ChatMessage]:
    """The chat messages of a conversation of Responses items; ``where`` prefixes the
    ``param`` of a 400 (item ``i`` is ``{where}.{i}``). A ``function_call_output`` must answer
    a call made before it, in ``items`` or among ``earlier_calls`` (call ids of turns before
    them), as OpenAI requires."""
    messages: list[ChatMessage] = []
    calls = set(earlier_calls)
    reasoning: str | None = None  # waits for the assistant turn it belongs to
    joinable = False  # the last message is an assistant turn later calls may join
    for i, item in enumerate(items):
        at = f"{where}.{i}"
        if not isinstance(item, Mapping):
            raise bad_request(f"{at} must be an object (an input item)", at)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if not isinstance(role, str) or role not in _ROLES:
                raise bad_request(
                    f"{at}.role must be 'user', 'system', 'developer' or 'assistant'; got {role!r}",
                    f"{at}.role",
                )
            content = _text(item.get("content"), at)
            joinable = role == "assistant"
            extra = {}
            if joinable and reasoning is not None:
                extra, reasoning = {"reasoning_content": reasoning}, None
            messages.append(ChatMessage(role=role, content=content, **extra))
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", at),
                "type": "function",
                "function": {
                    "name": _string(item, "name", at),
                    "arguments": _string(item, "arguments", at, empty=True),
                },
            }
            calls.add(call["id"])
            if joinable:
                messages[-1].tool_calls = [*(messages[-1].tool_calls or []), call]
            else:
                extra = {"reasoning_content": reasoning} if reasoning is not None else {}
                reasoning = None
                messages.append(
                    ChatMessage(role="assistant", content=None, tool_calls=[call], **extra)
                )
                joinable = True
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _text(output, at, "output")
            call_id = _string(item, "call_id", at)
            if call_id not in calls:
                raise bad_request(
                    f"{at}.call_id {call_id!r} answers no function_call before it (send the "
                    "call as an input item, or continue with previous_response_id)",
                    f"{at}.call_id",
                )
            messages.append(ChatMessage(role="tool", content=content, tool_call_id=call_id))
            joinable = False
        elif kind == "reasoning":
            reasoning = _reasoning_text(item)
        elif kind == "item_reference":
            raise bad_request(
                f"{at}: item references are not supported; send the items themselves or "
                "continue with previous_response_id",
                f"{at}.type",
            )
        else:
            raise bad_request(
                f"{at}.type must be 'message', 'function_call', 'function_call_output' or "
                f"'reasoning'; got {kind!r}",
                f"{at}.type",
            )
    return messages


def _text(content: Any, at: str, key: str = "content") -> str | list[dict[str, str]]:
    """A message's content: a string as it is, a list of text parts as chat text parts
    (``{"type": "text", "text"}``), which the renderer joins by newlines or hands the
    template as parts, as ``--chat-template-content-format`` says (vLLM reads
    ``input_text`` and ``output_text`` parts as text parts)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{at}.{key} must be a string or a list of content parts", f"{at}.{key}")
    texts: list[dict[str, str]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind not in _TEXT_PARTS:
            raise bad_request(
                f"{at}.{key}[{j}]: only text parts ({', '.join(_TEXT_PARTS)}) are supported; "
                f"got type {kind!r} (image, file and audio inputs are not)",
                f"{at}.{key}.{j}.type",
            )
        if not isinstance(part.get("text"), str):
            raise bad_request(
                f"{at}.{key}[{j}] needs a string field 'text'", f"{at}.{key}.{j}.text"
            )
        texts.append({"type": "text", "text": part["text"]})
    return texts


def _string(item: Mapping[str, Any], key: str, at: str, *, empty: bool = False) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (not value and not empty):
        raise bad_request(
            f"{at} ({item.get('type')}) needs a {'' if empty else 'non-empty '}string "
            f"field {key!r}",
            f"{at}.{key}",
        )
    return value


def _reasoning_text(item: Mapping[str, Any]) -> str:
    """The text of a reasoning item: its ``reasoning_text`` parts, else its summary."""
    for key in ("content", "summary"):
        parts = item.get(key)
        if not isinstance(parts, list):  # absent, or not parts: no text of its own
            continue
        texts = [
            p["text"] for p in parts if isinstance(p, Mapping) and isinstance(p.get("text"), str)
        ]
        if texts:
            return "\n".join(texts)
    return ""
