"""Responses API input items -> the chat messages the chat template renders.

A conversation is a list of Responses items (what ``input`` carries, and what a stored
response keeps for ``previous_response_id``: its conversation so far plus its output items,
which are valid input items too):

* a message ``{"role": "user" | "system" | "developer" | "assistant", "content": str | parts}``
  (``"type": "message"`` optional); text parts are ``input_text``, ``output_text`` (an
  earlier answer sent back) or ``text``; image parts are OpenAI's ``{"type": "input_image",
  "image_url": URL, "detail": ...}`` (``detail`` ignored, as vLLM), which become the chat
  route's ``image_url`` parts: the URL is checked only for being a non-empty string here, and
  loaded, with the chat route's loader and limits, by :mod:`chassis.serve.responses_images`;
  an ``input_image`` naming a ``file_id`` is refused (this server has no Files API), and so
  are file parts. Audio parts are OpenAI's ``{"type": "input_audio", "input_audio":
  {"data": BASE64, "format": "wav" | "mp3"}}``, passed on as they are, then decoded
  once and handed to the renderer as decoded clips (the engine's model must take audio:
  :mod:`chassis.serve.responses_audio`). The role reaches the chat template as sent, ``developer``
  included, as on the chat route (and in vLLM): the same messages render the same prompt on
  both routes; a template that knows no ``developer`` treats it as it does in chat.
* ``{"type": "function_call", "call_id", "name", "arguments"}``: a call the assistant made; it
  joins the assistant message just before it (calls made together are one turn).
* ``{"type": "function_call_output", "call_id", "output"}``: the result, a ``tool`` message
  (its ``output`` a string or text parts: images there are refused).
* ``{"type": "reasoning", "content": [{"type": "reasoning_text", "text"}], ...}``: the
  reasoning of the next assistant turn (``reasoning_content``, which templates such as
  Qwen3's read; dropped when no assistant turn follows).

Every mistake is a 400 naming the item (``input.3.content``), or its part
(``input.3.content.1``).

A stored conversation keeps its ``input_image`` parts as they were sent (the URL, a data
URL whole), so a later turn (``previous_response_id``) renders and loads the earlier turns'
images again, as the first turn did.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from chassis.serve.errors import bad_request
from chassis.serve.protocol import ChatMessage

_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")
#: OpenAI's image part of a message's content
IMAGE_PART = "input_image"
#: OpenAI's audio part of a message's content (``{"input_audio": {"data", "format"}}``)
AUDIO_PART = "input_audio"


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
            content = _content(item.get("content"), at, images=True)
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
            content = output if isinstance(output, str) else _content(output, at, "output")
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


def _content(
    content: Any, at: str, key: str = "content", *, images: bool = False
) -> str | list[dict[str, Any]]:
    """A message's content: a string as it is, a list of parts as chat parts: text parts as
    ``{"type": "text", "text"}`` (which the renderer joins by newlines or hands the template
    as parts, as ``--chat-template-content-format`` says; vLLM reads ``input_text`` and
    ``output_text`` parts as text parts) and, with ``images``, ``input_image`` parts as
    ``{"type": "image_url", "image_url": {"url"}}`` (:func:`_image_part`)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{at}.{key} must be a string or a list of content parts", f"{at}.{key}")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if images and kind == IMAGE_PART:
            parts.append(_image_part(part, f"{at}.{key}", j))
            continue
        if images and kind == AUDIO_PART:
            parts.append(_audio_part(part, f"{at}.{key}", j))
            continue
        if kind not in _TEXT_PARTS:
            taken = ", ".join(_TEXT_PARTS) + (f", {IMAGE_PART} and {AUDIO_PART}" if images else "")
            refused = "file inputs are not" if images else "images and audio are not"
            raise bad_request(
                f"{at}.{key}[{j}]: only text parts ({taken}) are supported here; got type "
                f"{kind!r} ({refused})",
                f"{at}.{key}.{j}.type",
            )
        if not isinstance(part.get("text"), str):
            raise bad_request(
                f"{at}.{key}[{j}] needs a string field 'text'", f"{at}.{key}.{j}.text"
            )
        parts.append({"type": "text", "text": part["text"]})
    return parts


def _audio_part(part: Mapping[str, Any], at: str, j: int) -> dict[str, Any]:
    """An ``input_audio`` part (``at`` its content's path, ``j`` its index) as the chat
    route's part of the same shape (its audio decoded by :mod:`chassis.serve.responses_audio`,
    wav or mp3 as on the chat route); a 400 naming the part when ``input_audio`` is not an object with
    string ``data`` (base64) and ``format``."""
    value = part.get(AUDIO_PART)
    if not (
        isinstance(value, Mapping)
        and isinstance(value.get("data"), str)
        and isinstance(value.get("format"), str)
    ):
        raise bad_request(
            f'{at}[{j}]: an input_audio part needs {{"input_audio": {{"data": BASE64, '
            '"format": "wav" | "mp3"}}',
            f"{at}.{j}",
        )
    return {"type": AUDIO_PART, AUDIO_PART: {"data": value["data"], "format": value["format"]}}


def _image_part(part: Mapping[str, Any], at: str, j: int) -> dict[str, Any]:
    """An ``input_image`` part (``at`` its content's path, ``j`` its index) as the chat
    route's ``image_url`` part; a 400 naming the part for a ``file_id`` image (no Files API
    here) or one without a URL. ``detail`` is ignored, as vLLM ignores it."""
    url = part.get("image_url")
    if part.get("file_id") is not None:
        raise bad_request(
            f"{at}[{j}]: input_image parts naming a file_id are not supported (this server "
            "has no Files API); send the image as image_url: a data:image/...;base64, URL, an "
            "http(s) URL, or a file:// URL under --allowed-local-media-path",
            f"{at}.{j}",
        )
    if not isinstance(url, str) or not url:
        raise bad_request(
            f"{at}[{j}]: an input_image part needs its URL as a non-empty string field "
            "'image_url' (a data:image/...;base64, URL, an http(s) URL, or a file:// URL)",
            f"{at}.{j}",
        )
    return {"type": "image_url", "image_url": {"url": url}}


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
