"""IBM Granite 3.x tool calls (registered as ``granite``, as in vLLM)::

    <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "now", "arguments": {}}]

The message is its calls: after leading whitespace, Granite 3.0's ``<|tool_call|>`` token
and/or Granite 3.1's ``<tool_call>`` string (each optional, in that order, whitespace after
each), a JSON array of call objects with ``name`` and ``arguments`` (or ``parameters``). A
message that starts with anything but ``[`` (after those) is content and streams as it
comes, as in vLLM. Text after the array is content (its leading whitespace dropped).

Calls stream (:mod:`~chassis.builtin_plugins.parsers.call_stream`): the message is committed
to be calls once ``[`` and the first object's head (``{"name": "...", "arguments": {``) are
written; each call's arguments are sent as they come, and the further elements of the array
stream too. Arguments that stop being JSON get the rest of the message, as written (invalid
JSON, as vLLM streams them). A message whose ``[`` is not followed by ``{`` (``[]``,
``[1]``, a Markdown link) is content and streams; one that starts with ``[{`` but not with a
call's head (``arguments`` first, as a string, not a call) is held to the end and is then
wholly calls (and the text after them), or, as written, content.

``<|tool_call|>`` is a special token, which the server drops by default; the parser reads
the array with or without it, so the special tokens are not asked for (as vLLM).
"""

from __future__ import annotations

import enum
import json
import re
from typing import Any

from chassis.builtin_plugins.parsers.call_stream import CallStream, match_call_head
from chassis.builtin_plugins.parsers.json_calls import DECODER, tool_call_from_object
from chassis.builtin_plugins.parsers.text_scan import text_after_call
from chassis.serve.tool_parser import ToolCall, ToolDelta, ToolParser

TOKEN = "<|tool_call|>"
STRING = "<tool_call>"
#: what may come before the array: whitespace and the two optional tags, in that order
_LEAD = re.compile(r"\s*(?:<\|tool_call\|>\s*)?(?:<tool_call>\s*)?")


class _Mode(enum.Enum):
    UNDECIDED = "undecided"  # only whitespace and (part of) the tags so far
    CONTENT = "content"
    HELD = "held"  # starts with "[", but not (yet) with a call's head
    STREAMING = "streaming"  # in the streamed calls (self._call)
    AFTER_CALLS = "after-calls"  # after the array: text, its leading whitespace dropped


def starts_with_calls(text: str) -> bool | None:
    """Whether ``text``, the start of a message, starts with ``[`` after whitespace and the
    optional tags; ``None`` while that is not known yet."""
    rest = text.lstrip()
    for tag in (TOKEN, STRING):
        if rest.startswith(tag):
            rest = rest[len(tag) :].lstrip()
        elif tag.startswith(rest):  # nothing yet, or what may be the start of the tag
            return None
    if not rest:
        return None
    return rest.startswith("[")


def parse_calls(text: str) -> tuple[list[ToolCall], str] | None:
    """The calls of ``text`` (tags, then a JSON array of call objects) and the text after
    the array, or ``None`` when ``text`` does not start so."""
    lead = _LEAD.match(text)
    start = lead.end() if lead else 0
    try:
        value, end = DECODER.raw_decode(text, start)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(value, list) or not value:
        return None
    calls = [tool_call_from_object(item) for item in value]
    if any(call is None for call in calls):
        return None
    return [call for call in calls if call is not None], text[end:]


class GraniteToolParser(ToolParser):
    """``<|tool_call|>[{"name": ..., "arguments": {...}}, ...]`` (see the module docstring)."""

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]]) -> None:
        super().__init__(tokenizer, tools)
        self._mode = _Mode.UNDECIDED
        self._held = ""
        self._call: CallStream | None = None
        #: the next call's index in the message
        self._num_calls = 0

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
            self._end_calls()
        held, self._held = self._held, ""
        if self._mode is _Mode.HELD:
            found = parse_calls(held)
            if found is None:
                out.content += held
            else:
                calls, rest = found
                self._num_calls = out.add_whole_calls(self._num_calls, calls)
                out.content += rest.lstrip()
        elif self._mode is _Mode.AFTER_CALLS:
            out.content += held.lstrip()
        else:  # content, or undecided: the message as written
            out.content += held
        return out

    def _end_calls(self) -> None:
        if self._call is not None:
            self._held = self._call.rest + self._held
            self._num_calls, self._call = self._call.next_index, None
        self._mode = _Mode.AFTER_CALLS

    def _step(self, out: ToolDelta) -> bool:
        """Advance over the held text; whether to go on."""
        mode = self._mode
        if mode is _Mode.UNDECIDED:
            calls = starts_with_calls(self._held)
            if calls is None:
                return False
            self._mode = _Mode.HELD if calls else _Mode.CONTENT
            return True
        if mode is _Mode.HELD:
            lead = _LEAD.match(self._held)
            start = (lead.end() if lead else 0) + 1  # after the "["
            head = match_call_head(self._held, start)
            if head is None:
                element = self._held[start:].lstrip()
                if element and element[0] != "{":  # no call object: content
                    self._mode = _Mode.CONTENT
                    return True
                return False
            name, at = head
            self._call = CallStream(out, self._num_calls, name, form="array")
            self._held = self._held[at:]
            self._mode = _Mode.STREAMING
            return True
        if mode is _Mode.STREAMING and self._call is not None:
            held, self._held = self._held, ""
            self._call.feed(held, out)
            if not self._call.ended:
                return False
            self._end_calls()
            return True
        if mode is _Mode.AFTER_CALLS:
            resumed = text_after_call(self._held, content_before=False)
            if resumed is None:
                return False
            self._held, self._mode = resumed, _Mode.CONTENT
            return True
        out.content += self._held  # CONTENT
        self._held = ""
        return False
