"""Turning decoded JSON call objects (``{"name": ..., "arguments": {...}}``) into
:class:`~chassis.serve.tool_parser.ToolCall`\\ s, as several formats need.

Models write JSON loosely, so decoding is lenient where no meaning is lost: raw newlines and
tabs inside strings (code arguments) are accepted (``strict=False``), and ``"arguments":
null`` means no arguments. What a client could not decode is refused, so the call stays text:
``NaN`` and infinities, and strings that are not valid Unicode (a lone surrogate escape).
"""

from __future__ import annotations

import json
from typing import Any

from chassis.serve.tool_parser import ToolCall

#: the decoder every built-in JSON format uses (raw control characters allowed in strings)
DECODER = json.JSONDecoder(strict=False)


def arguments_json(arguments: dict[str, Any]) -> str | None:
    """``arguments`` as the JSON text of a call (non-ASCII kept as is), or ``None`` when it
    has no valid JSON text: NaN, infinities, a lone surrogate in a string."""
    try:
        text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
        text.encode("utf-8")  # a lone surrogate cannot be sent
    except (ValueError, RecursionError):  # UnicodeEncodeError is a ValueError
        return None
    return text


def _valid_text(value: Any) -> bool:
    if not isinstance(value, str) or not value:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def tool_call_from_object(
    obj: Any, argument_keys: tuple[str, ...] = ("arguments", "parameters")
) -> ToolCall | None:
    """The call ``obj`` describes, or ``None`` when it is not one.

    A call is a JSON object with a non-empty string ``name`` and its arguments under the first
    of ``argument_keys`` present: an object, a string holding a JSON object, or ``null``
    (absent or ``null``: no arguments, ``{}``). The arguments are re-encoded as JSON text
    (:func:`arguments_json`). A non-empty string ``id`` is kept as the call's id.
    """
    if not isinstance(obj, dict) or not _valid_text(obj.get("name")):
        return None
    arguments: Any = None
    for key in argument_keys:
        if key in obj:
            arguments = obj[key]
            break
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):
        try:
            arguments = DECODER.decode(arguments)
        except (json.JSONDecodeError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    text = arguments_json(arguments)
    if text is None:
        return None
    call_id = obj.get("id") if _valid_text(obj.get("id")) else None
    return ToolCall(name=obj["name"], arguments=text, id=call_id)


def tool_calls_from_json(text: str) -> list[ToolCall] | None:
    """The calls in ``text``: one JSON call object, or a non-empty list of them (surrounding
    whitespace allowed); ``None`` when ``text`` is anything else."""
    try:
        value = DECODER.decode(text.strip())
    except (json.JSONDecodeError, RecursionError):  # deeply nested: not a call either
        return None
    items = value if isinstance(value, list) else [value]
    calls = [tool_call_from_object(item) for item in items]
    if not calls or any(call is None for call in calls):
        return None
    return [call for call in calls if call is not None]


def inside_json_string(text: str) -> bool:
    """Whether ``text``, the start of a JSON value, ends inside a string literal (so a marker
    right after it would be part of the string, not the end of the value)."""
    inside = escaped = False
    for char in text:
        if escaped:
            escaped = False
        elif char == "\\" and inside:
            escaped = True
        elif char == '"':
            inside = not inside
    return inside
