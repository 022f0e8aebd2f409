"""Salesforce xLAM's tool calls (registered as ``xlam``, as in vLLM): a JSON list of call
objects (``name`` and ``arguments``), written as the whole message::

    [{"name": "get_weather", "arguments": {"city": "Paris"}}]

or in a block among other text, in any of the forms vLLM's ``xlam`` reads::

    Sure.
    ```json
    [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    ```

    Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]

    Sure. <tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>

A message that starts with ``[`` (after whitespace) is held to the end and is either wholly
calls or, as written, content. Otherwise text streams as content until a block opens (a code
fence, ``[TOOL_CALLS]``, ``<tool_call>``); the block is held until it ends (the closing fence,
the end of the line, ``</tool_call>``; or the message's end) and is then its calls (a JSON
list of calls, or one call object; a fence may name its language first) or, as written, content.
The whitespace before a block of calls is dropped, and text after it is content as
``hermes`` keeps it. Text after a ``</think>`` (a model that reasons without a reasoning
parser) is read as a message of its own: the think block is content, and a JSON list right
after it is calls. Calls are reported whole, when their block ends.

vLLM reads only the first block that parses and drops its whitespace; here each block is read.
"""

from __future__ import annotations

import enum
from typing import Any

from chassis.builtin_plugins.parsers.json_calls import tool_calls_from_json
from chassis.builtin_plugins.parsers.tagged_blocks import first_marker, partial_marker_len
from chassis.builtin_plugins.parsers.text_scan import split_trailing_space, text_after_call
from chassis.serve.tool_parser import ToolCall, ToolDelta, ToolParser

FENCE = "```"
TOOL_CALLS = "[TOOL_CALLS]"
TOOL_CALL = "<tool_call>"
THINK_END = "</think>"
#: each block's opening marker and what ends it
BLOCK_ENDS = {FENCE: FENCE, TOOL_CALLS: "\n", TOOL_CALL: "</tool_call>"}
_MARKERS = (FENCE, TOOL_CALLS, TOOL_CALL, THINK_END)


class _Mode(enum.Enum):
    LEAD = "lead"  # the message's start (or after </think>): a "[" there opens whole calls
    WHOLE = "whole"  # starts with "[": held to the end
    TEXT = "text"
    BLOCK = "block"  # in a block (self._opened), held until it ends
    AFTER_CALL = "after-call"  # text right after a block of calls: its whitespace held


def block_calls(opened: str, body: str) -> list[ToolCall] | None:
    """The calls of a block opened by ``opened`` whose text is ``body`` (less its end), or
    ``None`` when it is not calls."""
    if opened == FENCE:
        stripped = body.lstrip()
        if stripped[:4].lower() == "json":
            body = stripped[4:]
    return tool_calls_from_json(body)


class XLamToolParser(ToolParser):
    """A JSON list of calls, whole or in a fenced, ``[TOOL_CALLS]`` or ``<tool_call>`` block
    (see the module docstring)."""

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]]) -> None:
        super().__init__(tokenizer, tools)
        self._mode = _Mode.LEAD
        self._held = ""
        #: the whitespace before the open block (given back if it holds no calls)
        self._gap = ""
        #: the marker that opened the open block
        self._opened = ""
        #: some content has been returned (whitespace after a call then separates)
        self._has_content = False

    def feed(self, text: str) -> ToolDelta:
        self._held += text
        out = ToolDelta()
        while self._step(out, final=False):
            pass
        self._has_content = self._has_content or bool(out.content)
        return out

    def finish(self) -> ToolDelta:
        out = ToolDelta()
        while self._step(out, final=True):
            pass
        held, self._held = self._held, ""
        if self._mode is _Mode.WHOLE:
            calls = tool_calls_from_json(held)
            if calls is not None:
                out.calls += calls
                return out
        if self._mode is not _Mode.AFTER_CALL:  # after calls: whitespace only, dropped
            out.content += held
        return out

    def _step(self, out: ToolDelta, final: bool) -> bool:
        """Advance over the held text; whether to go on."""
        mode = self._mode
        if mode is _Mode.LEAD:
            body = self._held.lstrip()
            if not body:
                return False
            self._mode = _Mode.WHOLE if body.startswith("[") else _Mode.TEXT
            return True
        if mode is _Mode.WHOLE:
            return False
        if mode is _Mode.AFTER_CALL:
            resumed = text_after_call(self._held, self._has_content or bool(out.content))
            if resumed is None:
                return False
            self._held, self._mode = resumed, _Mode.TEXT
            return True
        if mode is _Mode.TEXT:
            return self._text(out, final)
        return self._block(out, final)

    def _text(self, out: ToolDelta, final: bool) -> bool:
        found = first_marker(self._held, _MARKERS)
        if found is None:
            if final:
                return False  # finish() returns the rest
            keep = partial_marker_len(self._held, _MARKERS)
            ready, space = split_trailing_space(self._held[: len(self._held) - keep])
            self._held = space + self._held[len(self._held) - keep :]
            out.content += ready
            return False
        at, marker = found
        if marker == THINK_END:
            end = at + len(THINK_END)
            out.content += self._held[:end]
            self._held, self._mode = self._held[end:], _Mode.LEAD
            return True
        before, self._gap = split_trailing_space(self._held[:at])
        out.content += before
        self._held, self._opened = self._held[at + len(marker) :], marker
        self._mode = _Mode.BLOCK
        return True

    def _block(self, out: ToolDelta, final: bool) -> bool:
        end_marker = BLOCK_ENDS[self._opened]
        at = self._held.find(end_marker)
        if at < 0 and not final:
            return False
        body = self._held if at < 0 else self._held[:at]
        # the newline that ends a [TOOL_CALLS] line is the text's, read on after the block
        closing = "" if at < 0 or self._opened == TOOL_CALLS else end_marker
        rest = self._held[len(body) + len(closing) :]
        calls = block_calls(self._opened, body)
        if calls is not None:
            out.calls += calls
            self._mode = _Mode.AFTER_CALL
        else:
            out.content += self._gap + self._opened + body + closing
            self._mode = _Mode.TEXT
        self._held, self._gap = rest, ""
        return True
