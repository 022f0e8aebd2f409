"""Hermes-style tool calls, as Qwen2.5, Qwen3, Hermes 2/3 and many other chat templates ask
for (registered as ``hermes``)::

    Let me check.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Each ``<tool_call>...</tool_call>`` block holding a JSON object with ``name`` and
``arguments`` (or a list of such objects) is a call; text around the blocks is content. The
whitespace before a block and after it is dropped, except that text resuming after a call
keeps the whitespace that followed the call when content came before it (so the pieces of
text around a call do not run together). A block ends at ``</tool_call>`` or at the next
``<tool_call>`` (a forgotten end tag between parallel calls), but not at a tag inside a JSON
string of the call. A block whose JSON is not a call is returned as content, unchanged. A
block left open by the end of generation is a call if what follows the tag parses.

Calls stream (:mod:`~chassis.builtin_plugins.parsers.call_stream`): a block is committed to be
a call once ``<tool_call>{"name": "...", "arguments": {`` is written, and its arguments are
sent as they come. A committed block's arguments that stop being JSON get the rest of the
block, as written, up to its end tag; what follows complete arguments in the block (the
object's ``}``, other keys) is dropped. Blocks written otherwise (a list of calls,
``arguments`` first or as a string) are read whole when they end, as above.
"""

from __future__ import annotations

import enum
from typing import Any, cast

from chassis.builtin_plugins.parsers.call_stream import CallStream, match_call_head
from chassis.builtin_plugins.parsers.json_calls import inside_json_string, tool_calls_from_json
from chassis.builtin_plugins.parsers.text_scan import (
    held_prefix_len,
    hold_back,
    split_trailing_space,
    text_after_call,
)
from chassis.serve.tool_parser import ToolDelta, ToolParser


class _Mode(enum.Enum):
    TEXT = "text"
    AFTER_CALL = "after-call"  # text right after a call: its leading whitespace is held
    IN_CALL = "in-call"  # in a block not committed to yet
    STREAMING = "streaming"  # in a committed call (self._call)
    BLOCK_REST = "block-rest"  # after a committed call, up to the block's end: dropped


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
        #: where the search for the open block's end tag resumes
        self._search_from = 0
        #: some content has been returned (whitespace after a call then separates)
        self._has_content = False
        self._call: CallStream | None = None
        #: the next call's index in the message
        self._num_calls = 0

    def feed(self, text: str) -> ToolDelta:
        self._held += text
        out = ToolDelta()
        while True:
            if self._mode is _Mode.STREAMING:
                if not self._stream(out):
                    break
                continue
            if self._mode is _Mode.BLOCK_REST:
                if not self._skip_block_rest():
                    break
                continue
            if self._mode is _Mode.IN_CALL:
                if self._commit(out):
                    continue
                if not self._close_block(out):
                    break  # the call is not complete yet
                continue
            if self._mode is _Mode.AFTER_CALL:
                resumed = text_after_call(self._held, self._has_content or bool(out.content))
                if resumed is None:
                    break
                self._held = resumed
                self._mode = _Mode.TEXT
            start = self._held.find(self.start_tag)
            if start < 0:
                ready, self._held = hold_back(self._held, self.start_tag)
                out.content += ready
                break
            text_before, self._gap = split_trailing_space(self._held[:start])
            out.content += text_before
            self._held = self._held[start + len(self.start_tag) :]
            self._mode = _Mode.IN_CALL
            self._search_from = 0
        self._has_content = self._has_content or bool(out.content)
        return out

    def finish(self) -> ToolDelta:
        out = ToolDelta()
        held, self._held = self._held, ""
        if self._mode is _Mode.STREAMING and self._call is not None:
            self._call.finish(out)
        elif self._mode is _Mode.IN_CALL:
            calls = tool_calls_from_json(held)
            if calls is not None:
                self._num_calls = out.add_whole_calls(self._num_calls, calls)
            else:
                out.content += self._gap + self.start_tag + held
        elif self._mode is _Mode.TEXT:
            out.content += held
        # AFTER_CALL: only whitespace after the last call, dropped; BLOCK_REST: dropped
        return out

    def _commit(self, out: ToolDelta) -> bool:
        """Start streaming the open block's call if its head is written; whether it was."""
        head = match_call_head(self._held)
        if head is None:
            return False
        name, at = head
        self._call = CallStream(
            out, self._num_calls, name, stop_markers=(self.end_tag, self.start_tag)
        )
        self._num_calls += 1
        self._held = self._held[at:]
        self._gap = ""
        self._mode = _Mode.STREAMING
        return True

    def _stream(self, out: ToolDelta) -> bool:
        """Feed the held text to the committed call; whether it ended."""
        call = cast(CallStream, self._call)  # set with the mode
        held, self._held = self._held, ""
        call.feed(held, out)
        if not call.ended:
            return False
        self._held, self._call = call.rest, None
        self._mode = _Mode.BLOCK_REST
        return True

    def _skip_block_rest(self) -> bool:
        """Drop what is left of a committed block, up to its end tag (a next ``<tool_call>``
        stays, to open its block); whether the end was found."""
        ends = [self._held.find(self.end_tag), self._held.find(self.start_tag)]
        found = [at for at in ends if at >= 0]
        if not found:
            keep = max(held_prefix_len(self._held, tag) for tag in (self.end_tag, self.start_tag))
            self._held = self._held[len(self._held) - keep :]
            return False
        at = min(found)
        closing = len(self.end_tag) if at == ends[0] else 0
        self._held = self._held[at + closing :]
        self._mode = _Mode.AFTER_CALL
        return True

    def _close_block(self, out: ToolDelta) -> bool:
        """End the open block, if the held text has its end: a ``</tool_call>``, or a new
        ``<tool_call>`` (models forget the end tag between parallel calls; prose may mention
        the tag), either outside the JSON's strings. The block's calls go to ``out``, or the
        block itself as content when it holds none. Whether it ended."""
        while True:
            end = self._held.find(self.end_tag, self._search_from)
            nested = self._held.find(self.start_tag, self._search_from)
            if nested >= 0 and (end < 0 or nested < end):
                at, closing = nested, ""  # the new tag stays, to open the next block
            elif end >= 0:
                at, closing = end, self.end_tag
            else:
                # resume where a tag may still start
                self._search_from = max(0, len(self._held) - len(self.end_tag) + 1)
                return False
            body = self._held[:at]
            calls = tool_calls_from_json(body)
            if calls is None and body.lstrip()[:1] in ("{", "[") and inside_json_string(body):
                self._search_from = at + 1  # the tag is inside a string of the call
                continue
            break
        if calls is not None:
            self._num_calls = out.add_whole_calls(self._num_calls, calls)
            self._mode = _Mode.AFTER_CALL
        else:  # not a call: the block is content, as written
            out.content += self._gap + self.start_tag + body + closing
            self._mode = _Mode.TEXT
        self._held = self._held[at + len(closing) :]
        self._gap = ""
        return True
