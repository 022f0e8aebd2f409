"""Streaming the calls of the JSON-based formats as they are written (``hermes``,
``llama3_json``, ``mistral``, and the forced ``tool_choice`` parsers).

A call is *committed* once its head is written: ``{"name": "<name>", "arguments": `` (or
``"parameters"``) and the ``{`` that opens the arguments object (:func:`match_call_head`;
Mistral's ``name[ARGS]{`` is matched by its parser). Its arguments then stream re-written as
canonical JSON (:class:`~chassis.builtin_plugins.parsers.json_rewrite.JsonRewriter`), the same
text the formats' whole calls carry (``json.dumps`` of the decoded object), so a streamed call
and the same call parsed whole agree. Calls written another way (``arguments`` first, as a
JSON string, ``null`` or absent) are read whole, as before, once complete.

After a committed call, malformed text cannot turn it back into content:

- arguments that stop being JSON (a syntax error, ``NaN``, a number too large, too deep): the
  rest of the call's text, up to where the format ends a call (``</tool_call>``, the next
  ``[TOOL_CALLS]``, the end of the message), is added to the arguments as written, so they
  end up invalid JSON, as vLLM streams them;
- the message ending inside the arguments: they stay as streamed (cut short);
- after complete arguments, the rest of the call object is skipped (other keys, the closing
  ``}``); text that does not fit the format there ends the calls and is read as text.
"""

from __future__ import annotations

import enum
import json
import re

from chassis.builtin_plugins.parsers.json_calls import DECODER, tool_call_from_object
from chassis.builtin_plugins.parsers.json_rewrite import JsonRewriter
from chassis.builtin_plugins.parsers.text_scan import held_prefix_len
from chassis.serve.tool_parser import ToolDelta

_WS = r"[ \t\n\r]*"
#: a call object's head, up to (not including) the "{" of its arguments
_CALL_HEAD = re.compile(
    rf'{_WS}\{{{_WS}"name"{_WS}:{_WS}("(?:[^"\\]|\\.)*"){_WS},{_WS}'
    rf'"(?:arguments|parameters)"{_WS}:{_WS}(?=\{{)'
)


def match_call_head(text: str, pos: int = 0) -> tuple[str, int] | None:
    """The function name of the call object whose head starts at ``pos`` (after JSON
    whitespace) and where its arguments' ``{`` is, or ``None`` while there is no such head
    (yet: a head that matches stays matched as text is added). A name that is empty or not
    valid Unicode is no head."""
    match = _CALL_HEAD.match(text, pos)
    if match is None:
        return None
    try:
        name = DECODER.decode(match.group(1))
        name.encode("utf-8")
    except (json.JSONDecodeError, UnicodeEncodeError):
        return None
    return (name, match.end()) if name else None


class _Stage(enum.Enum):
    ARGUMENTS = "arguments"
    OBJECT_REST = "object-rest"  # after the arguments: the rest of the call object
    BETWEEN = "between"  # after a call in an array: "," or "]"
    ELEMENT = "element"  # after "," in an array: the next call
    RAW = "raw"  # the arguments broke: the rest of the call's text, as written
    ENDED = "ended"


class CallStream:
    """The calls that follow a committed head, streamed into :class:`ToolDelta` fragments.

    ``form`` is where the committed call sits: ``"arguments"`` (the text is its arguments
    object and nothing more: Mistral's ``name[ARGS]{...}``, a named ``tool_choice``),
    ``"object"`` (one call object) or ``"array"`` (an element of a JSON array of call
    objects, whose further elements stream too). Text fed starts at the arguments' ``{``.
    ``stop_markers`` end malformed arguments' raw text (none: it runs to the message end).

    When the calls end (:attr:`ended`), :attr:`rest` is the text after them (after the
    closing ``]``/``}``, or from the first character that does not fit), for the parser to
    read on; more text fed then only adds to :attr:`rest`.
    """

    def __init__(
        self,
        out: ToolDelta,
        index: int,
        name: str,
        call_id: str | None = None,
        form: str = "object",
        stop_markers: tuple[str, ...] = (),
    ) -> None:
        self._form = form
        self._stop_markers = stop_markers
        self._held = ""
        #: the separator before the element being read (given back if it is no call)
        self._separator = ""
        self._stage = _Stage.ARGUMENTS
        self._rewriter = JsonRewriter()
        #: the index of the call being streamed (the next call's is one more)
        self.index = index
        self.rest = ""
        out.start_call(index, name, call_id)

    @property
    def ended(self) -> bool:
        """No more calls: :attr:`rest` is the text that follows."""
        return self._stage is _Stage.ENDED

    @property
    def next_index(self) -> int:
        """The index the message's next call gets."""
        return self.index + 1

    def feed(self, text: str, out: ToolDelta) -> None:
        """Read ``text``, the next piece; add the fragments it completes to ``out``."""
        if self._stage is _Stage.ENDED:
            self.rest += text
            return
        self._held += text
        while self._step(out):
            pass

    def finish(self, out: ToolDelta) -> None:
        """The message ended: flush arguments cut short (as written) or held raw text; a
        next element cut short is :attr:`rest`."""
        held, self._held = self._held, ""
        if self._stage is _Stage.ARGUMENTS:
            out.add_arguments(self.index, self._rewriter.pending())
        elif self._stage is _Stage.RAW:
            out.add_arguments(self.index, held)
        elif self._stage is _Stage.BETWEEN:
            self.rest = held
        elif self._stage is _Stage.ELEMENT:
            self.rest = self._separator + held
        self._stage = _Stage.ENDED

    def _end(self, rest: str) -> bool:
        self._stage, self.rest, self._held = _Stage.ENDED, rest, ""
        return False

    def _step(self, out: ToolDelta) -> bool:
        """Advance over the held text; whether to go on."""
        stage = self._stage
        if stage is _Stage.ARGUMENTS:
            held, self._held = self._held, ""
            out.add_arguments(self.index, self._rewriter.feed(held))
            rest, self._rewriter.rest = self._rewriter.rest, ""
            if self._rewriter.failed:
                self._stage, self._held = _Stage.RAW, rest
                return True
            if not self._rewriter.done:
                return False
            if self._form == "arguments":
                return self._end(rest)
            self._rewriter = JsonRewriter.object_rest()
            self._stage, self._held = _Stage.OBJECT_REST, rest
            return True
        if stage is _Stage.OBJECT_REST:
            held, self._held = self._held, ""
            self._rewriter.feed(held)  # skipped: other keys of the call object
            rest, self._rewriter.rest = self._rewriter.rest, ""
            if self._rewriter.failed:
                return self._end(rest)
            if not self._rewriter.done:
                return False
            if self._form != "array":
                return self._end(rest)
            self._stage, self._held = _Stage.BETWEEN, rest
            return True
        if stage is _Stage.RAW:
            return self._raw(out)
        if stage is _Stage.BETWEEN:
            body = self._held.lstrip(" \t\n\r")
            if not body:
                return False
            if body[0] == "]":
                return self._end(body[1:])
            if body[0] != ",":
                return self._end(self._held)
            self._separator = self._held[: len(self._held) - len(body) + 1]
            self._stage, self._held = _Stage.ELEMENT, body[1:]
            return True
        if stage is _Stage.ELEMENT:
            return self._element(out)
        return False

    def _raw(self, out: ToolDelta) -> bool:
        found = [at for at in (self._held.find(m) for m in self._stop_markers) if at >= 0]
        if found:
            at = min(found)
            out.add_arguments(self.index, self._held[:at])
            return self._end(self._held[at:])
        keep = max((held_prefix_len(self._held, m) for m in self._stop_markers), default=0)
        cut = len(self._held) - keep
        out.add_arguments(self.index, self._held[:cut])
        self._held = self._held[cut:]
        return False

    def _element(self, out: ToolDelta) -> bool:
        """The next element of the array: streamed when its head is written, read whole
        when it is a call written another way, else the end of the calls."""
        head = match_call_head(self._held)
        if head is not None:
            name, at = head
            self.index += 1
            out.start_call(self.index, name)
            self._rewriter = JsonRewriter()
            self._stage, self._held = _Stage.ARGUMENTS, self._held[at:]
            return True
        start = len(self._held) - len(self._held.lstrip(" \t\n\r"))
        if start == len(self._held):
            return False
        try:
            value, end = DECODER.raw_decode(self._held, start)
        except (json.JSONDecodeError, RecursionError):
            return False  # not complete yet (or malformed: known at the end)
        call = tool_call_from_object(value)
        if call is None:
            return self._end(self._separator + self._held)
        self.index += 1
        out.add_whole_call(self.index, call)
        self._stage, self._held = _Stage.BETWEEN, self._held[end:]
        return True
