"""``template_json_fence``: tool calls written as Markdown JSON code blocks.

Small chat models asked to call a tool often answer with a fenced JSON object::

    I will look it up.
    ```json
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    ```

Each fenced ``json`` block whose object has a ``name`` (and ``arguments``, or a list of such
objects) is a call; every other block, and all text outside blocks, is content, as written.

The parser follows the streaming contract of :class:`chassis.serve.tool_parser.ToolParser`:
it holds back only what may be the start of a fence, reports a call once its block is closed,
and gives the same result whatever pieces the text arrives in. It reuses two public helpers of
chassis' built-in parsers (``held_prefix_len`` and ``tool_calls_from_json``).
"""

from __future__ import annotations

from typing import Any

from chassis.builtin_plugins.parsers.json_calls import tool_calls_from_json
from chassis.builtin_plugins.parsers.text_scan import held_prefix_len
from chassis.serve.tool_parser import ToolDelta, ToolParser

OPEN = "```json"
CLOSE = "```"


class JsonFenceToolParser(ToolParser):
    """Calls in ````json`` fenced blocks (see the module docstring)."""

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]]) -> None:
        super().__init__(tokenizer, tools)
        self._held = ""
        self._in_block = False

    def feed(self, text: str) -> ToolDelta:
        self._held += text
        out = ToolDelta()
        while True:
            if self._in_block:
                end = self._held.find(CLOSE)
                if end < 0:
                    return out  # the block is not closed yet
                body, self._held = self._held[:end], self._held[end + len(CLOSE) :]
                calls = tool_calls_from_json(body)
                if calls is None:  # a code block, not a call: content, as written
                    out.content += OPEN + body + CLOSE
                else:
                    out.calls += calls
                self._in_block = False
                continue
            start = self._held.find(OPEN)
            if start < 0:
                keep = held_prefix_len(self._held, OPEN)  # may be the start of a fence
                out.content += self._held[: len(self._held) - keep]
                self._held = self._held[len(self._held) - keep :]
                return out
            out.content += self._held[:start]
            self._held = self._held[start + len(OPEN) :]
            self._in_block = True

    def finish(self) -> ToolDelta:
        held, self._held = self._held, ""
        # an unclosed block is content: the call may have been cut short
        return ToolDelta(content=OPEN + held if self._in_block else held)
