"""Llama 3.1/3.2/3.3 JSON tool calls, as Meta's chat templates ask for with custom tools
(registered as ``llama3_json``)::

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}

The message is its calls and nothing else: after optional leading whitespace and an optional
``<|python_tag|>`` (also allowed before each further call), one or more JSON objects with
``name`` and ``parameters`` (or ``arguments``), separated by ``;`` (whitespace around it
allowed, a trailing ``;`` too). A message that starts with anything but ``{`` is plain content
and streams as it comes. One that starts with ``{`` is held to the end: if it is not wholly
such a list of calls, all of it, as written, is content.
"""

from __future__ import annotations

import json

from chassis.builtin_plugins.parsers.json_calls import DECODER, tool_call_from_object
from chassis.builtin_plugins.parsers.text_scan import skip_space
from chassis.builtin_plugins.parsers.whole_message import WholeMessageToolParser
from chassis.serve.tool_parser import ToolCall


class Llama3JsonToolParser(WholeMessageToolParser):
    """``{"name": ..., "parameters": {...}}`` objects separated by ``;``, the whole message."""

    #: ``<|python_tag|>`` is a special token
    needs_special_tokens = True
    start_tag = "<|python_tag|>"
    opener = "{"

    def calls_in(self, message: str) -> list[ToolCall] | None:
        return parse_calls(message, self.start_tag)


def parse_calls(text: str, tag: str = "") -> list[ToolCall] | None:
    """The calls of ``text``, JSON call objects separated by ``;`` (whitespace allowed around
    each, and one trailing ``;``), each after an optional ``tag`` (models repeat
    ``<|python_tag|>`` before every call), or ``None`` when ``text`` is anything else."""
    calls: list[ToolCall] = []
    pos = 0
    while True:
        pos = skip_space(text, pos)
        if tag and text.startswith(tag, pos):
            pos = skip_space(text, pos + len(tag))
        if pos == len(text) and calls:  # after the last object's trailing ";"
            return calls
        try:
            obj, pos = DECODER.raw_decode(text, pos)
        except (json.JSONDecodeError, RecursionError):  # deep nesting: not a call either
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
