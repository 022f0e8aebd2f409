"""Phi-4-mini's tool calls (registered as ``phi4_mini_json``, as in vLLM)::

    functools[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]

The message is its calls and nothing else: after optional whitespace, ``functools`` and a
JSON list of call objects (``name`` and ``arguments``, or ``parameters``). A message that does
not start so is content and streams as it comes; one that does is held to the end and is
either wholly such a list or, as written, content (vLLM finds ``functools[...]`` anywhere and
cuts the list at its first ``]``; here the whole JSON list is read, nested lists included).
Calls are reported whole (as in vLLM, which streams none).
"""

from __future__ import annotations

from chassis.builtin_plugins.parsers.json_calls import tool_calls_from_json
from chassis.builtin_plugins.parsers.whole_message import WholeMessageToolParser
from chassis.serve.tool_parser import ToolCall

TAG = "functools"


class Phi4MiniJsonToolParser(WholeMessageToolParser):
    """``functools[{...}, ...]``, the whole message (plain text in Phi-4-mini's vocabulary)."""

    start_tag = TAG
    opener = "["

    def calls_in(self, message: str) -> list[ToolCall] | None:
        body = message.strip()
        if not body.startswith(TAG):
            return None
        body = body[len(TAG) :].lstrip()
        if not body.startswith("["):
            return None
        return tool_calls_from_json(body)
