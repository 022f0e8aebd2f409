"""Turning a decoded JSON call object (``{"name": ..., "arguments": {...}}``) into a
:class:`~chassis.serve.tool_parser.ToolCall`, as several formats need."""

from __future__ import annotations

import json
from typing import Any

from chassis.serve.tool_parser import ToolCall


def tool_call_from_object(
    obj: Any, argument_keys: tuple[str, ...] = ("arguments", "parameters")
) -> ToolCall | None:
    """The call ``obj`` describes, or ``None`` when it is not one.

    A call is a JSON object with a non-empty string ``name`` and its arguments under the first
    of ``argument_keys`` present: an object, or a string holding a JSON object (absent: no
    arguments, ``{}``). The arguments are re-encoded as JSON text (``json.dumps``, non-ASCII
    kept as is).
    """
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments: Any = {}
    for key in argument_keys:
        if key in obj:
            arguments = obj[key]
            break
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(name=obj["name"], arguments=json.dumps(arguments, ensure_ascii=False))


def tool_call_from_json(text: str) -> ToolCall | None:
    """The call in ``text`` (one JSON object, surrounding whitespace allowed), or ``None``."""
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, RecursionError):  # deeply nested: not a call either
        return None
    return tool_call_from_object(obj)


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
