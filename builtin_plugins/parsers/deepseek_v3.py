"""DeepSeek-V3's tool calls, as DeepSeek-V3 (and -0324) and DeepSeek-R1 (-0528) write them
(registered as ``deepseek_v3``, as in vLLM)::

    Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time
    ```json
    {}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

The markers are the tokenizer's special tokens (with the fullwidth ``｜`` and ``▁``). A
section opened by ``<｜tool▁calls▁begin｜>`` holds calls, each ``<｜tool▁call▁begin｜>``, a
type (``function``), ``<｜tool▁sep｜>``, the function's name on its own line, and its arguments
as a JSON object in a ```` ```json ```` fence, up to ``<｜tool▁call▁end｜>``; the section ends at
``<｜tool▁calls▁end｜>``. Whitespace between the calls is dropped.

Text around the section is content, as ``hermes`` keeps it
(:mod:`~chassis.builtin_plugins.parsers.tagged_blocks`); text after the calls that does not
open another call also ends the section (a forgotten end marker). A call that is not written
so (no fence, arguments that are not a JSON object) is content, as written, and the section
is read on; a section without a call, its markers included, is content. Arguments are sent as
canonical JSON (``json.dumps`` of the object).

Calls stream (:mod:`~chassis.builtin_plugins.parsers.call_stream`): a call is committed once
its head and the ``{`` of its arguments are written; its arguments are sent as they come.
Committed arguments that stop being JSON get the rest of the call's text, up to the closing
fence or the next marker, as written (invalid JSON, as vLLM streams them); what follows
complete arguments in the call (the fence) is dropped.

:class:`DeepSeekV3ToolParser` reads any such section of calls whose markers and call head
are its class attributes: ``deepseek_v31`` and ``kimi_k2`` are the same machinery with their
formats' markers.
"""

from __future__ import annotations

import re
from typing import Any, cast

from chassis.builtin_plugins.parsers.call_stream import CallStream
from chassis.builtin_plugins.parsers.tagged_blocks import (
    TEXT,
    TaggedBlockToolParser,
    first_marker,
)
from chassis.serve.tool_parser import ToolDelta

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
#: the fence that closes a call's arguments
FENCE_END = "\n```"

#: a call's head, after its begin marker, up to (not including) the "{" of its arguments
_HEAD = re.compile(
    r"[ \t]*[^\s<>]*[ \t]*" + re.escape(SEP) + r"[ \t]*([^\s<>]+)[ \t\r]*\n"
    r"[ \t]*```(?:json)?[ \t\r]*\n[ \t\r\n]*(?=\{)"
)

_SECTION = "section"  # in a section, between calls
_CALL = "call"  # in a call not committed to yet
_STREAMING = "streaming"  # in a committed call's arguments
_CALL_REST = "call-rest"  # after a committed call's arguments, up to its end: dropped


class DeepSeekV3ToolParser(TaggedBlockToolParser):
    """``<｜tool▁calls▁begin｜>`` sections of ``<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>``."""

    #: the markers are special tokens
    needs_special_tokens = True
    start_tag = CALLS_BEGIN
    block_mode = _SECTION
    #: what ends the section (the first is the format's; others are spellings of it)
    section_ends: tuple[str, ...] = (CALLS_END,)
    #: what opens and closes one call
    call_begin = CALL_BEGIN
    call_end = CALL_END
    #: a call's head, after its begin marker, up to (not including) the "{" of its arguments
    head = _HEAD
    #: what else ends committed arguments that broke (besides the markers)
    raw_ends: tuple[str, ...] = (FENCE_END,)

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]]) -> None:
        super().__init__(tokenizer, tools)
        #: where a call not committed to ends
        self._call_ends = (self.call_end, *self.section_ends, self.call_begin)
        #: where committed arguments that broke end
        self._raw_ends = (*self.raw_ends, *self._call_ends)
        self._section_markers = (self.call_begin, *self.section_ends)
        #: the section's begin marker (and the whitespace before it) is held: no call in
        #: the section yet, nor content given back from it
        self._opener_held = True
        #: the section holds a call
        self._section_calls = False
        #: the open call's text before its head (whitespace and its begin marker)
        self._call_prefix = ""
        self._call: CallStream | None = None

    def block_step(self, out: ToolDelta, final: bool) -> bool:
        if self.mode == _SECTION:
            return self._section(out, final)
        if self.mode == _CALL:
            return self._open_call(out, final)
        if self.mode == _STREAMING:
            return self._stream(out, final)
        return self._call_rest(final)

    def _section(self, out: ToolDelta, final: bool) -> bool:
        """Between calls: the next call, or the section's end."""
        body = self.held.lstrip()
        if body.startswith(self.call_begin):
            self._call_prefix = self.held[: len(self.held) - len(body) + len(self.call_begin)]
            self.held, self.mode = body[len(self.call_begin) :], _CALL
            return True
        end = next((m for m in self.section_ends if body.startswith(m)), None)
        if end is not None and self._section_calls:
            self.held = body[len(end) :]
            self._opener_held, self._section_calls = True, False
            self.after_call()
            return True
        if not final and any(marker.startswith(body) for marker in self._section_markers):
            return False  # only whitespace, or what may be a marker, so far
        # the section ends here: text after its calls, or (no call in it) all of it text
        if self._section_calls:
            self.after_call()
        elif self._opener_held:
            self.not_a_call(out)
        else:  # its opener was given back with a call that was text
            self.mode = TEXT
        self._opener_held, self._section_calls = True, False
        return True

    def _open_call(self, out: ToolDelta, final: bool) -> bool:
        """A call not committed to: committed once its head is written, else text when it
        ends."""
        head = self.head.match(self.held)
        named = self.call_name(head) if head is not None else None
        if head is not None and named is not None:
            self._opener_held, self._section_calls = False, True
            index = self.reserve_call()
            name, call_id = named
            self._call = CallStream(
                out, index, name, call_id, form="arguments", stop_markers=self._raw_ends
            )
            self.held, self.mode = self.held[head.end() :], _STREAMING
            return True
        found = first_marker(self.held, self._call_ends)
        if found is None and not final:
            return False
        at, marker = found if found is not None else (len(self.held), "")
        end = at + (len(self.call_end) if marker == self.call_end else 0)
        if self._opener_held:  # the section's opener is text too
            self._opener_held = False
            self.not_a_call(out)
        out.content += self._call_prefix + self.held[:end]
        self.held, self.mode = self.held[end:], _SECTION
        return True

    def _stream(self, out: ToolDelta, final: bool) -> bool:
        """Feed the held text to the committed call's arguments."""
        call = cast(CallStream, self._call)  # set with the mode
        held, self.held = self.held, ""
        call.feed(held, out)
        if final and not call.ended:
            call.finish(out)
            self._call = None
            self.after_call()
            return True
        if not call.ended:
            return False
        self.held, self._call, self.mode = call.rest, None, _CALL_REST
        return True

    def _call_rest(self, final: bool) -> bool:
        """After complete arguments: drop the rest of the call, up to its end."""
        marker = self.skip_to(self._call_ends, final)
        if marker is None:
            if final:
                self.after_call()
            return final
        if marker == self.call_end:
            self.held = self.held[len(self.call_end) :]
        self.mode = _SECTION
        return True

    def call_name(self, head: re.Match[str]) -> tuple[str, str | None] | None:
        """The function's name and the call's id (``None``: the server makes one) that a
        matched :attr:`head` gives, or ``None`` when it is no call's head."""
        return head.group(1), None
