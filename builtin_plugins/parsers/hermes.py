"""Hermes-style tool calls, as Qwen2.5, Qwen3, Hermes 2/3 and many other chat templates ask
for (registered as ``hermes``)::

    Let me check.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Each ``<tool_call>...</tool_call>`` block holding a JSON object with ``name`` and
``arguments`` is one call; text around the blocks is content (whitespace next to a block is
dropped). A block whose JSON is not a call is returned as content, unchanged. A block left
open by the end of generation is a call if what follows the tag parses.
"""

from __future__ import annotations

import enum
from typing import Any

from chassis.builtin_plugins.parsers.json_calls import tool_call_from_json
from chassis.builtin_plugins.parsers.text_scan import held_prefix_len, split_trailing_space
from chassis.serve.tool_parser import ToolDelta, ToolParser


class _Mode(enum.Enum):
    TEXT = "text"
    AFTER_CALL = "after-call"  # text right after a block: its leading whitespace is dropped
    IN_CALL = "in-call"


class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks."""

    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]]) -> None:
        super().__init__(tokenizer, tools)
        self._mode = _Mode.TEXT
        self._held = ""
        #: whitespace dropped before the open block: given back if the block is not a call
        self._gap = ""

    def feed(self, text: str) -> ToolDelta:
        self._held += text
        out = ToolDelta()
        while True:
            if self._mode is _Mode.IN_CALL:
                end = self._held.find(self.end_tag)
                if end < 0:
                    return out  # the call is not complete yet
                called = self._close_block(self._held[:end], out, closed=True)
                self._held = self._held[end + len(self.end_tag) :]
                self._mode = _Mode.AFTER_CALL if called else _Mode.TEXT
                continue
            if self._mode is _Mode.AFTER_CALL:
                self._held = self._held.lstrip()
                if not self._held:
                    return out
                self._mode = _Mode.TEXT
            start = self._held.find(self.start_tag)
            if start >= 0:
                out.content, self._gap = _join(out.content, self._held[:start])
                self._held = self._held[start + len(self.start_tag) :]
                self._mode = _Mode.IN_CALL
                continue
            # Hold back what may be the start of "<tool_call>" and the whitespace before it.
            keep = held_prefix_len(self._held, self.start_tag)
            body, space = split_trailing_space(self._held[: len(self._held) - keep])
            out.content += body
            self._held = space + self._held[len(self._held) - keep :]
            return out

    def finish(self) -> ToolDelta:
        out = ToolDelta()
        held, self._held = self._held, ""
        if self._mode is _Mode.IN_CALL:
            self._close_block(held, out, closed=False)
        elif self._mode is _Mode.AFTER_CALL:
            out.content += held.lstrip()
        else:
            out.content += held
        return out

    def _close_block(self, body: str, out: ToolDelta, *, closed: bool) -> bool:
        """Add the block's call to ``out``, or the block itself as content when it holds no
        call; whether it was a call."""
        call = tool_call_from_json(body)
        if call is not None:
            out.calls.append(call)
        else:  # not a call: the block is content, as written
            out.content += self._gap + self.start_tag + body + (self.end_tag if closed else "")
        self._gap = ""
        return call is not None


def _join(content: str, text: str) -> tuple[str, str]:
    """``content`` extended by ``text`` without its trailing whitespace, and that whitespace."""
    body, space = split_trailing_space(text)
    return content + body, space
