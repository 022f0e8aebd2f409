"""GLM-4.5's tool calls (registered as ``glm45``, as in vLLM)::

    Let me check.
    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

Each ``<tool_call>`` block is one call: the function's name on the tag's line, then
``<arg_key>KEY</arg_key>`` / ``<arg_value>VALUE</arg_value>`` pairs, key and value stripped
of surrounding whitespace. As in vLLM, a value is text when the request's ``tools`` declare
its parameter a ``string``, and otherwise read as JSON, else as a Python literal, else kept as
text (:func:`~chassis.builtin_plugins.parsers.tag_values.glm45_value`); a value with no JSON
form (``NaN``) stays text. The arguments are the JSON object of the pairs in the order
written (a repeated key is kept twice; JSON readers keep its last value).

Text around the blocks is content, as ``hermes`` keeps it
(:mod:`~chassis.builtin_plugins.parsers.tagged_blocks`). A block whose first line is not a
function name (one word without ``<`` or ``>``, followed by a newline, ``<arg_key>`` or the
block's end) is content, as written. In a call, text that is not a pair is dropped, and so
is a key not followed by ``<arg_value>`` or holding a ``<``. A call ends at ``</tool_call>``
or at the next ``<tool_call>`` (a forgotten end tag); a value ends at ``</arg_value>`` or
``</tool_call>``. A call cut short by the end of generation keeps the pairs written so far
(the last value as far as it was written), and is valid JSON.

Calls stream: a call is committed once its name's line is written; its arguments follow
pair by pair, text values as they are written (the whitespace at their end held back), other
values once they are complete.
"""

from __future__ import annotations

import re
from functools import partial
from typing import Any, cast

from chassis.builtin_plugins.parsers.tag_values import (
    TagArguments,
    ValueStream,
    declared_type,
    glm45_value,
    parameter_schemas,
)
from chassis.builtin_plugins.parsers.tagged_blocks import (
    TaggedBlockToolParser,
    partial_marker_len,
)
from chassis.builtin_plugins.parsers.text_scan import held_prefix_len
from chassis.serve.tool_parser import ToolDelta

START = "<tool_call>"
END = "</tool_call>"
ARG_KEY = "<arg_key>"
ARG_KEY_END = "</arg_key>"
ARG_VALUE = "<arg_value>"
ARG_VALUE_END = "</arg_value>"

#: what may follow the name on the tag's line
_AFTER_NAME = (ARG_KEY, END, START)
#: the name's line: a word, then a newline or (on the same line) a pair or the block's end
_HEAD = re.compile(
    r"[ \t]*([^\s<>]+)[ \t\r]*(?:\n|(?=" + "|".join(map(re.escape, _AFTER_NAME)) + "))"
)
#: what the start of a name's line may look like before its end is written
_HEAD_START = re.compile(r"[ \t]*[^\s<>]*[ \t\r]*")
#: what a call's body is read for between its pairs (other text is dropped)
_BODY_MARKERS = (ARG_KEY, END, START)
#: where a value ends; its own end tag first
_VALUE_ENDS = (ARG_VALUE_END, END)

_NAME = "name"  # the block's first line: the function's name (committed to nothing yet)
_BODY = "body"  # in a committed call, between pairs
_KEY = "key"  # after "<arg_key>"
_AFTER_KEY = "after-key"  # after "</arg_key>": its "<arg_value>" expected
_VALUE = "value"  # in a value


class Glm45ToolParser(TaggedBlockToolParser):
    """``<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>...</tool_call>``."""

    # GLM-4.5's tags are added tokens; vLLM asks for them not to be skipped
    needs_special_tokens = True
    start_tag = START
    block_mode = _NAME

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]]) -> None:
        super().__init__(tokenizer, tools)
        #: the arguments of the call being read (set when it is committed)
        self._arguments: TagArguments | None = None
        self._key = ""  # the key read last, sent when its value starts

    def block_step(self, out: ToolDelta, final: bool) -> bool:
        if self.mode == _NAME:
            return self._name(out, final)
        if self.mode == _BODY:
            return self._body(out, final)
        if self.mode == _KEY:
            return self._read_key(final)
        if self.mode == _AFTER_KEY:
            return self._after_key(out, final)
        return self._read_value(out, final)

    def _name(self, out: ToolDelta, final: bool) -> bool:
        """The name's line: commit to the call; a line that cannot be one: the block is text."""
        head = _HEAD.match(self.held)
        if head is None:
            cut = len(self.held) - partial_marker_len(self.held, _AFTER_NAME)
            if not final and _HEAD_START.fullmatch(self.held[:cut]):
                return False
            self.not_a_call(out)
            return True
        name = head.group(1)
        index = self.start_call(out, name)
        self._arguments = TagArguments(out, index, parameter_schemas(self.tools, name))
        self.held, self.mode = self.held[head.end() :], _BODY
        return True

    def _body(self, out: ToolDelta, final: bool) -> bool:
        """Between pairs: the next key, or the call's end; other text is dropped."""
        marker = self.skip_to(_BODY_MARKERS, final)
        if marker is None:
            if final:
                self._close(out)
            return final
        if marker == ARG_KEY:
            self.held, self.mode = self.held[len(ARG_KEY) :], _KEY
            return True
        self._close(out)
        if marker == END:
            self.held = self.held[len(END) :]
        return True  # START stays: it opens the next block

    def _read_key(self, final: bool) -> bool:
        """A key, up to ``</arg_key>``; one holding a ``<`` is dropped."""
        close = self.held.find(ARG_KEY_END)
        if close >= 0:
            key = self.held[:close]
        else:
            key = self.held[: len(self.held) - held_prefix_len(self.held, ARG_KEY_END)]
        if "<" in key or (close < 0 and final):
            self.mode = _BODY  # a broken key: dropped
            return True
        if close < 0:
            return False
        self._key = key.strip()
        self.held, self.mode = self.held[close + len(ARG_KEY_END) :], _AFTER_KEY
        return True

    def _after_key(self, out: ToolDelta, final: bool) -> bool:
        """``<arg_value>`` after whitespace: the pair's value starts; else the key is
        dropped."""
        body = self.held.lstrip()
        if not body.startswith(ARG_VALUE):
            if ARG_VALUE.startswith(body) and not final:
                return False
            self.mode = _BODY
            return True
        arguments = self._call_arguments()
        kind = declared_type(arguments.schemas, self._key)
        convert = partial(glm45_value, kind=kind)
        arguments.start_value(out, self._key, ValueStream("space", kind == "string", convert))
        self.held, self.mode = body[len(ARG_VALUE) :], _VALUE
        return True

    def _read_value(self, out: ToolDelta, final: bool) -> bool:
        """A value, streamed up to its end."""
        self.held, ended = self._call_arguments().read_value(out, self.held, _VALUE_ENDS, final)
        if ended:
            self.mode = _BODY
        return ended

    def _close(self, out: ToolDelta) -> None:
        """The call ended: close its arguments and read on as text after a call."""
        self._call_arguments().close(out)
        self.after_call()

    def _call_arguments(self) -> TagArguments:
        return cast(TagArguments, self._arguments)  # set with the call's name
