"""Mistral tool calls, in both forms Mistral's tokenizers use (registered as ``mistral``).
Older tokenizers (Mistral 7B v0.3, Mixtral, Nemo) write a JSON array after the marker::

    Let me check. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]

newer ones (tokenizer v11 and later, e.g. Mistral Small 3.2, Magistral) one
``name[ARGS]{json}`` per call, each after its own marker, sometimes with a call id
(``name[CALL_ID]a1b2c3d4e[ARGS]{...}``)::

    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}

Text before a marker is content and streams as it comes (only what may be the start of a
marker is held back); whitespace right after a call is dropped, unless text came before the
call and resumes after it. An id the model wrote (``[CALL_ID]`` or an ``"id"`` key) is kept;
ids made for calls without one are nine letters and digits, as Mistral's templates require. A call is reported as soon as
its JSON is complete. The array form may also be a single call object, not in a list. A marker
not followed by a valid call (a malformed array, an array with a non-call, a bad name, JSON cut
short by the end of generation) is content, as written, and the text after it is read on.

Calls stream (:mod:`~chassis.builtin_plugins.parsers.call_stream`): committed once
``name[ARGS]{`` or a call object's head (``{"name": "...", "arguments": {``, first in the
array or alone) is written; their arguments are sent as they come, and the further calls of an
array stream too. Arguments that stop being JSON get the rest of the text up to the next
``[TOOL_CALLS]`` (or the end), as written; after a streamed call, text that does not continue
the array is read as text after the calls. An ``"id"`` written after a streamed call's
arguments comes too late to be used (the call already has one).
"""

from __future__ import annotations

import enum
import json
import re
import secrets
import string
from typing import Any

from chassis.builtin_plugins.parsers.call_stream import CallStream, match_call_head
from chassis.builtin_plugins.parsers.json_calls import DECODER, tool_call_from_object
from chassis.builtin_plugins.parsers.text_scan import (
    held_prefix_len,
    skip_space,
    text_after_call,
)
from chassis.serve.tool_parser import ToolCall, ToolDelta, ToolParser

_ID_ALPHABET = string.ascii_letters + string.digits
MARKER = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
#: a whole ``name[CALL_ID]id`` header (the id optional), before ``[ARGS]``
_HEADER = re.compile(r"\s*([\w.\-]+)(?:\[CALL_ID\]([\w\-]+))?")
#: what the start of a header may look like before ``[ARGS]`` arrives (partial markers cut off)
_HEADER_START = re.compile(r"\s*[\w.\-]*(?:\[CALL_ID\][\w\-]*)?")
#: a v11 call's head, up to the "{" of its arguments
_ARGS_HEAD = re.compile(r"\s*([\w.\-]+)(?:\[CALL_ID\]([\w\-]+))?\[ARGS\][ \t\n\r]*(?=\{)")
_ARRAY_START = re.compile(r"[ \t\n\r]*\[")


class _Mode(enum.Enum):
    TEXT = "text"
    AFTER_CALL = "after-call"  # text right after a call: its leading whitespace is dropped
    CALLS = "calls"  # the held text follows a marker
    STREAMING = "streaming"  # in committed calls (self._call)


#: what :func:`_read_calls` answers for a marker that is followed by no valid call
_NOT_A_CALL: tuple[list[ToolCall], int] = ([], 0)


class MistralToolParser(ToolParser):
    """``[TOOL_CALLS][{...}, ...]`` arrays and ``[TOOL_CALLS]name[ARGS]{...}`` calls."""

    #: ``[TOOL_CALLS]`` and ``[ARGS]`` are special tokens
    needs_special_tokens = True

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]]) -> None:
        super().__init__(tokenizer, tools)
        self._mode = _Mode.TEXT
        self._held = ""
        #: some content has been returned (whitespace after a call then separates)
        self._has_content = False
        self._call: CallStream | None = None
        #: the next call's index in the message
        self._num_calls = 0

    def new_call_id(self) -> str:
        """Nine letters and digits: Mistral's chat templates refuse other ids."""
        return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))

    def feed(self, text: str) -> ToolDelta:
        self._held += text
        out = self._scan(final=False)
        self._has_content = self._has_content or bool(out.content)
        return out

    def finish(self) -> ToolDelta:
        out = ToolDelta()
        if self._call is not None:
            self._call.finish(out)
            self._end_stream()
        out += self._scan(final=True)
        return out

    def _end_stream(self) -> None:
        """The streamed calls ended: what follows them is text after a call."""
        if self._call is not None:
            self._num_calls = self._call.next_index
            self._held = self._call.rest + self._held
            self._call = None
        self._mode = _Mode.AFTER_CALL

    def _commit(self, out: ToolDelta) -> bool:
        """Start streaming the call after the marker if its head is written."""
        head = _ARGS_HEAD.match(self._held)
        form = "arguments"
        if head is not None:
            name, call_id, at = head.group(1), head.group(2), head.end()
        else:
            array = _ARRAY_START.match(self._held)
            form = "array" if array else "object"
            found = match_call_head(self._held, array.end() if array else 0)
            if found is None:
                return False
            (name, at), call_id = found, None
        self._call = CallStream(out, self._num_calls, name, call_id, form, (MARKER,))
        held, self._held = self._held[at:], ""
        self._mode = _Mode.STREAMING
        self._stream(held, out)
        return True

    def _stream(self, text: str, out: ToolDelta) -> None:
        if self._call is not None:
            self._call.feed(text, out)
            if self._call.ended:
                self._end_stream()

    def _scan(self, *, final: bool) -> ToolDelta:
        """Everything the held text now settles; at the end (``final``) that is all of it."""
        out = ToolDelta()
        while True:
            if self._mode is _Mode.STREAMING:
                held, self._held = self._held, ""
                self._stream(held, out)
                if self._mode is _Mode.STREAMING:
                    return out
                continue
            if self._mode is _Mode.AFTER_CALL:
                resumed = text_after_call(self._held, self._has_content or bool(out.content))
                if resumed is None:
                    return out
                self._held = resumed
                self._mode = _Mode.TEXT
            if self._mode is _Mode.TEXT:
                start = self._held.find(MARKER)
                if start < 0:
                    keep = 0 if final else held_prefix_len(self._held, MARKER)
                    cut = len(self._held) - keep
                    out.content += self._held[:cut]
                    self._held = self._held[cut:]
                    return out
                out.content += self._held[:start]
                self._held = self._held[start + len(MARKER) :]
                self._mode = _Mode.CALLS
                continue
            if self._commit(out):
                continue
            found = _read_calls(self._held, final=final)
            if found is None:
                return out  # the call is not complete yet
            calls, end = found
            if calls:
                self._num_calls = out.add_whole_calls(self._num_calls, calls)
                self._held = self._held[end:]
                self._mode = _Mode.AFTER_CALL
            else:  # the marker starts no call: it is text, and what follows it is read on
                out.content += MARKER
                self._mode = _Mode.TEXT


def _read_calls(text: str, *, final: bool) -> tuple[list[ToolCall], int] | None:
    """The calls at the start of ``text`` (what follows a marker) and where they end;
    ``_NOT_A_CALL`` when ``text`` cannot start with one, ``None`` when more text is needed to
    tell (never when ``final``)."""
    undecided = _NOT_A_CALL if final else None
    pos = skip_space(text, 0)
    if pos == len(text):
        return undecided
    if text[pos] in "[{":  # the JSON form: an array of calls, or one call
        try:
            value, end = DECODER.raw_decode(text, pos)
        except (json.JSONDecodeError, RecursionError):
            return undecided  # incomplete so far, or malformed (known only at the end)
        items = value if isinstance(value, list) else [value]
        calls = [tool_call_from_object(item) for item in items]
        if not calls or any(call is None for call in calls):
            return _NOT_A_CALL
        return [call for call in calls if call is not None], end
    args = text.find(ARGS)
    if args < 0:
        cut = max(held_prefix_len(text, ARGS), held_prefix_len(text, CALL_ID))
        if _HEADER_START.fullmatch(text[: len(text) - cut]):
            return undecided
        return _NOT_A_CALL  # no name can start like this
    header = _HEADER.fullmatch(text[:args])
    if header is None:
        return _NOT_A_CALL
    pos = skip_space(text, args + len(ARGS))
    if pos == len(text):
        return undecided
    if text[pos] != "{":
        return _NOT_A_CALL
    try:
        arguments, end = DECODER.raw_decode(text, pos)
    except (json.JSONDecodeError, RecursionError):
        return undecided
    call = tool_call_from_object(
        {"name": header.group(1), "arguments": arguments, "id": header.group(2)}
    )
    return ([call], end) if call is not None else _NOT_A_CALL
