"""Llama 3.1/3.2/3.3 JSON tool calls, as Meta's chat templates ask for with custom tools
(registered as ``llama3_json``)::

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}

The message is its calls and nothing else: after optional leading whitespace and an optional
``<|python_tag|>`` (also allowed before each further call), one or more JSON objects with
``name`` and ``parameters`` (or ``arguments``), separated by ``;`` (whitespace around it
allowed, a trailing ``;`` too). A message that starts with anything but ``{`` is plain content
and streams as it comes.

Calls stream (:mod:`~chassis.builtin_plugins.parsers.call_stream`): the message is committed
to be calls once the first object's head (``{"name": "...", "parameters": {``) is written, and
each call's arguments are sent as they come; so is each further call whose head follows a
``;``. Arguments that stop being JSON get the rest of the message, as written. After a
streamed call, text that does not start with ``;`` is content, as written, and so is text
after a ``;`` that is not calls (calls written otherwise are read whole at the end). A message
that starts with ``{`` but not with a call's head is held to the end and is either wholly calls
or, as written, content.
"""

from __future__ import annotations

import enum
import json
import re
from typing import Any

from chassis.builtin_plugins.parsers.call_stream import CallStream, match_call_head
from chassis.builtin_plugins.parsers.json_calls import DECODER, tool_call_from_object
from chassis.builtin_plugins.parsers.text_scan import skip_space, starts_with_after_tag
from chassis.serve.tool_parser import ToolCall, ToolDelta, ToolParser

TAG = "<|python_tag|>"
#: what may come before a call: whitespace and the python tag
_LEAD = re.compile(r"\s*(?:<\|python_tag\|>\s*)?")
#: between calls: ";", whitespace, the python tag
_SEPARATOR = re.compile(r"\s*;\s*(?:<\|python_tag\|>\s*)?")


class _Mode(enum.Enum):
    UNDECIDED = "undecided"  # only whitespace and part of the tag so far
    CONTENT = "content"
    HELD = "held"  # starts like calls, but not with a call's head: held to the end
    STREAMING = "streaming"  # in a streamed call (self._call)
    AFTER_CALL = "after-call"  # after a streamed call: ";" and more calls, or content


class Llama3JsonToolParser(ToolParser):
    """``{"name": ..., "parameters": {...}}`` objects separated by ``;``, the whole message
    (see the module docstring)."""

    #: ``<|python_tag|>`` is a special token
    needs_special_tokens = True
    start_tag = TAG

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]]) -> None:
        super().__init__(tokenizer, tools)
        self._mode = _Mode.UNDECIDED
        self._held = ""
        self._call: CallStream | None = None
        #: the next call's index in the message
        self._num_calls = 0

    def calls_in(self, message: str) -> list[ToolCall] | None:
        """The calls of ``message`` read whole, or ``None`` when it is not wholly calls."""
        return parse_calls(message, self.start_tag)

    def feed(self, text: str) -> ToolDelta:
        self._held += text
        out = ToolDelta()
        while self._step(out):
            pass
        return out

    def finish(self) -> ToolDelta:
        out = ToolDelta()
        if self._call is not None:
            self._call.finish(out)
            self._end_call()
        held, self._held = self._held, ""
        if self._mode is _Mode.HELD:
            calls = self.calls_in(held)
            if calls is None:
                out.content += held
            else:
                self._num_calls = out.add_whole_calls(self._num_calls, calls)
        elif self._mode is _Mode.AFTER_CALL:
            rest = _SEPARATOR.match(held)
            after = held[rest.end() :] if rest else held
            calls = self.calls_in(after) if rest and after.strip() else None
            if calls is not None:
                self._num_calls = out.add_whole_calls(self._num_calls, calls)
            elif not rest or after.strip():  # not just a trailing ";": text, as written
                out.content += held
        elif self._mode is not _Mode.STREAMING:  # content, or undecided
            out.content += held
        return out

    def _end_call(self) -> None:
        if self._call is not None:
            self._held = self._call.rest + self._held
            self._num_calls, self._call = self._call.next_index, None
        self._mode = _Mode.AFTER_CALL

    def _commit(self, lead_end: int, out: ToolDelta) -> bool:
        """Stream the call whose head starts at ``lead_end``, if it is written."""
        head = match_call_head(self._held, lead_end)
        if head is None:
            return False
        name, at = head
        self._call = CallStream(out, self._num_calls, name)
        self._held = self._held[at:]
        self._mode = _Mode.STREAMING
        return True

    def _step(self, out: ToolDelta) -> bool:
        """Advance over the held text; whether to go on."""
        mode = self._mode
        if mode is _Mode.UNDECIDED:
            calls = starts_with_after_tag(self._held, self.start_tag, "{")
            if calls is None:
                return False
            self._mode = _Mode.HELD if calls else _Mode.CONTENT
            return True
        if mode is _Mode.CONTENT:
            out.content += self._held
            self._held = ""
            return False
        if mode is _Mode.HELD:
            lead = _LEAD.match(self._held)
            return self._commit(lead.end() if lead else 0, out)
        if mode is _Mode.STREAMING and self._call is not None:
            held, self._held = self._held, ""
            self._call.feed(held, out)
            if not self._call.ended:
                return False
            self._end_call()
            return True
        # AFTER_CALL: another call after ";", or content
        body = self._held.lstrip()
        if not body:
            return False
        if body[0] != ";":
            self._mode = _Mode.CONTENT
            return True
        separator = _SEPARATOR.match(self._held)
        return self._commit(separator.end(), out) if separator else False


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
