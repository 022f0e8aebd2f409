"""Tool calls read from output that was constrained to be them (``tool_choice`` ``"required"``
or a named function; the constraint is serve/structured_request.py:for_tool_choice).

These are not format parsers: the model wrote JSON because it could write nothing else. The
calls stream (:mod:`chassis.builtin_plugins.parsers.call_stream`): a named function's call
starts with the message's first ``{`` (the message is its arguments), ``"required"``'s first
call once ``[{"name": "...", "parameters": {`` is written, and each further element of the
array once its head is. Output cut short (``max_tokens``) after a call started leaves that
call's arguments as written so far (``finish_reason`` ``length``); output cut short before is
content, as written, and so is output that is not the calls' JSON (it cannot be, constrained,
except cut short). Whitespace after the calls is dropped.
"""

from __future__ import annotations

import json
import re
from typing import Any

from chassis.builtin_plugins.parsers.call_stream import CallStream, match_call_head
from chassis.serve.tool_parser import ToolCall, ToolDelta, ToolParser

_ARRAY_START = re.compile(r"[ \t\n\r]*\[")


class _ConstrainedCalls(ToolParser):
    """The message is the calls' JSON: streamed once :meth:`_head` finds the first call's
    head, else held to the end and read whole (:meth:`calls_in`)."""

    #: how the committed call sits in the JSON (see CallStream)
    form = "arguments"

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]]) -> None:
        super().__init__(tokenizer, tools)
        self._held = ""
        self._call: CallStream | None = None

    def feed(self, text: str) -> ToolDelta:
        out = ToolDelta()
        if self._call is not None:
            self._call.feed(text, out)
            return out
        self._held += text
        head = self._head(self._held)
        if head is not None:
            name, at = head
            self._call = CallStream(out, 0, name, form=self.form)
            held, self._held = self._held[at:], ""
            self._call.feed(held, out)
        return out

    def finish(self) -> ToolDelta:
        out = ToolDelta()
        if self._call is not None:
            self._call.finish(out)  # what follows the calls is whitespace, dropped
            return out
        held, self._held = self._held, ""
        try:
            calls = self.calls_in(json.loads(held))
        except ValueError:  # cut short: not JSON (json.JSONDecodeError is a ValueError)
            calls = None
        if not calls:
            return ToolDelta(content=held)
        out.add_whole_calls(0, calls)
        return out

    def _head(self, text: str) -> tuple[str, int] | None:
        """The first call's name and where its arguments' ``{`` is, once written."""
        raise NotImplementedError

    def calls_in(self, value: Any) -> list[ToolCall] | None:
        """The calls of the whole message's JSON ``value``, or ``None``."""
        raise NotImplementedError


class NamedToolCallParser(_ConstrainedCalls):
    """``tool_choice`` names a function (``tools`` holds just that one): the message is the
    arguments object of one call. The choice's finish reason stays ``stop`` (OpenAI's and
    vLLM's answer to a named function)."""

    finish_reason_after_calls = "stop"

    def _head(self, text: str) -> tuple[str, int] | None:
        start = len(text) - len(text.lstrip(" \t\n\r"))
        if start == len(text) or text[start] != "{":
            return None
        return self.tools[0]["function"]["name"], start

    def calls_in(self, value: Any) -> list[ToolCall] | None:
        if not isinstance(value, dict):
            return None
        name = self.tools[0]["function"]["name"]
        return [ToolCall(name, json.dumps(value, ensure_ascii=False))]


class RequiredToolCallsParser(_ConstrainedCalls):
    """``tool_choice: "required"``: the message is an array of ``{"name", "parameters"}``."""

    form = "array"

    def _head(self, text: str) -> tuple[str, int] | None:
        array = _ARRAY_START.match(text)
        return match_call_head(text, array.end()) if array else None

    def calls_in(self, value: Any) -> list[ToolCall] | None:
        if not isinstance(value, list) or not all(
            isinstance(c, dict) and isinstance(c.get("name"), str) for c in value
        ):
            return None
        return [
            ToolCall(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False))
            for c in value
        ]
