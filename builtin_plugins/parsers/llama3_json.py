"""Llama 3.1/3.2/3.3 JSON tool calls, as Meta's chat templates ask for with custom tools
(registered as ``llama3_json``)::

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}

The message is its calls and nothing else: after optional leading whitespace and an optional
``<|python_tag|>``, one or more JSON objects with ``name`` and ``parameters`` (or
``arguments``), separated by ``;`` (whitespace around it allowed, a trailing ``;`` too). A
message that starts with anything but ``{`` is plain content and streams as it comes. One that
starts with ``{`` is held to the end: if it is not wholly such a list of calls, all of it, as
written, is content.
"""

from __future__ import annotations

import enum
import json
from typing import Any

from chassis.builtin_plugins.parsers.json_calls import tool_call_from_object
from chassis.builtin_plugins.parsers.text_scan import (
    skip_space,
    starts_with_after_tag,
    strip_start_tag,
)
from chassis.serve.tool_parser import ToolCall, ToolDelta, ToolParser

_DECODER = json.JSONDecoder()


class _Mode(enum.Enum):
    UNDECIDED = "undecided"  # only whitespace and part of <|python_tag|> so far
    CONTENT = "content"
    CALLS = "calls"  # starts with "{": held to the end


class Llama3JsonToolParser(ToolParser):
    """``{"name": ..., "parameters": {...}}`` objects separated by ``;``, the whole message."""

    #: ``<|python_tag|>`` is a special token
    needs_special_tokens = True
    python_tag = "<|python_tag|>"

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]]) -> None:
        super().__init__(tokenizer, tools)
        self._mode = _Mode.UNDECIDED
        self._held = ""

    def feed(self, text: str) -> ToolDelta:
        self._held += text
        if self._mode is _Mode.UNDECIDED:
            calls = starts_with_after_tag(self._held, self.python_tag, "{")
            if calls is None:
                return ToolDelta()
            self._mode = _Mode.CALLS if calls else _Mode.CONTENT
        if self._mode is _Mode.CALLS:
            return ToolDelta()
        held, self._held = self._held, ""
        return ToolDelta(content=held)

    def finish(self) -> ToolDelta:
        held, self._held = self._held, ""
        if self._mode is _Mode.CALLS:
            calls = parse_calls(strip_start_tag(held, self.python_tag))
            if calls is not None:
                return ToolDelta(calls=calls)
        return ToolDelta(content=held)


def parse_calls(text: str) -> list[ToolCall] | None:
    """The calls of ``text``, JSON call objects separated by ``;`` (whitespace allowed around
    each, and one trailing ``;``), or ``None`` when ``text`` is anything else."""
    calls: list[ToolCall] = []
    pos = 0
    while True:
        pos = skip_space(text, pos)
        if pos == len(text) and calls:  # after the last object's trailing ";"
            return calls
        try:
            obj, pos = _DECODER.raw_decode(text, pos)
        except json.JSONDecodeError:
            return None
        call = tool_call_from_object(obj)
        if call is None:
            return None
        calls.append(call)
        pos = skip_space(text, pos)
        if pos == len(text):
            return calls
        if text[pos] != ";":
            return None
        pos += 1
