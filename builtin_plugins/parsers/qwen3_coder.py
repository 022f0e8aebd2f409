"""Qwen3-Coder's XML-style tool calls (registered as ``qwen3_coder``, as in vLLM)::

    I'll look that up.
    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Each ``<function=NAME>`` in a ``<tool_call>`` block is a call (a block may hold several);
each ``<parameter=KEY>`` in it an argument, whose value is the text up to ``</parameter>``
(or the next ``<parameter=``, ``</function>`` or ``</tool_call>``, when the model forgot the
end tag), less one newline at each end. Values are converted as vLLM does, by the type the
request's ``tools`` declare for the parameter (:func:`~chassis.builtin_plugins.parsers.
tag_values.qwen3_coder_value`): undeclared parameters and string types stay text, ``null``
is ``null``, integers, numbers, booleans, objects and arrays are read as such (a value that
does not convert stays text). The arguments are the JSON object of the parameters in the
order written (a repeated parameter is kept twice; JSON readers keep its last value).

Text around the blocks is content, as ``hermes`` keeps it
(:mod:`~chassis.builtin_plugins.parsers.tagged_blocks`). A block that does not start with
``<function=NAME>`` (after whitespace) is content, as written. Text in a call that is not a
parameter is dropped, as are parameters whose name is broken (a newline or ``<`` before its
``>``), and what follows ``</function>`` in the block. A call cut short by the end of
generation keeps the parameters written so far (the last one's value as far as it was
written), and is valid JSON. A function ends at ``</function>``, ``</tool_call>``, the next
``<function=`` or the next ``<tool_call>``.

Calls stream: a call is committed once ``<function=NAME>`` is written; its arguments follow
parameter by parameter, text values as they are written (only what may still be the end
newline, an end tag, or ``null`` held back), other values once they are complete. Unlike
vLLM's non-streamed reading, a ``<function=`` outside a ``<tool_call>`` block is text.
"""

from __future__ import annotations

from functools import partial
from typing import Any, cast

from chassis.builtin_plugins.parsers.tag_values import (
    QWEN_STRING_TYPES,
    ValueStream,
    declared_type,
    json_text,
    parameter_schemas,
    qwen3_coder_value,
)
from chassis.builtin_plugins.parsers.tagged_blocks import (
    TaggedBlockToolParser,
    first_marker,
    partial_marker_len,
)
from chassis.serve.tool_parser import ToolDelta

START = "<tool_call>"
END = "</tool_call>"
FUNCTION = "<function="
FUNCTION_END = "</function>"
PARAMETER = "<parameter="
PARAMETER_END = "</parameter>"

#: where a parameter's value ends (vLLM's ends, and the block's end)
_VALUE_ENDS = (PARAMETER_END, PARAMETER, FUNCTION_END, END)
#: what a call's body is read for between its parameters (other text is dropped)
_BODY_MARKERS = (PARAMETER, FUNCTION_END, END, START, FUNCTION)
#: what the rest of a block after ``</function>`` is read for
_REST_MARKERS = (END, START, FUNCTION)

_HEAD = "head"  # in a block, before a function's head (committed to nothing yet)
_BODY = "body"  # in a committed call, between parameters
_NAME = "name"  # after "<parameter=": its name
_VALUE = "value"  # in a parameter's value
_REST = "rest"  # after "</function>", up to the block's end: dropped


class Qwen3CoderToolParser(TaggedBlockToolParser):
    """``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>``."""

    start_tag = START
    block_mode = _HEAD

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]]) -> None:
        super().__init__(tokenizer, tools)
        #: the head being read opens the block (no call in it yet): if broken, it is text
        self._fresh_block = True
        self._index = -1  # the committed call's index
        self._schemas: dict[str, Any] | None = None  # its parameters' schemas
        self._params = 0  # parameters it has so far
        self._value: ValueStream | None = None

    def block_step(self, out: ToolDelta, final: bool) -> bool:
        if self.mode == _HEAD:
            return self._head(out, final)
        if self.mode == _BODY:
            return self._body(out, final)
        if self.mode == _NAME:
            return self._name(out, final)
        if self.mode == _VALUE:
            return self._read_value(out, final)
        return self._rest(final)

    def _head(self, out: ToolDelta, final: bool) -> bool:
        """``<function=NAME>`` after whitespace: commit to the call; anything else: the block
        is text (or, after a call in the block, dropped)."""
        body = self.held.lstrip()
        complete = body.startswith(FUNCTION)
        if not complete and FUNCTION.startswith(body) and not final:
            return False
        close = body.find(">", len(FUNCTION)) if complete else -1
        name = body[len(FUNCTION) : close if close >= 0 else len(body)] if complete else ""
        broken = not complete or "<" in name or "\n" in name
        if not broken and close < 0 and not final:
            return False  # the name goes on
        if broken or close < 0 or not name.strip():
            if self._fresh_block:
                self.not_a_call(out)
            else:  # a broken head after a call: the rest of the block
                self.held, self.mode = body[1:], _REST
            return True
        self._index = self.start_call(out, name.strip())
        out.add_arguments(self._index, "{")
        self._schemas = parameter_schemas(self.tools, name.strip())
        self._params = 0
        self.held, self.mode = body[close + 1 :], _BODY
        return True

    def _body(self, out: ToolDelta, final: bool) -> bool:
        """Between parameters: the next parameter, or the function's end."""
        found = first_marker(self.held, _BODY_MARKERS)
        if found is None:
            if final:
                self._close(out)
                self.held = ""
                self.after_call()
                return True
            keep = partial_marker_len(self.held, _BODY_MARKERS)
            self.held = self.held[len(self.held) - keep :]  # text that is no parameter
            return False
        at, marker = found
        self.held = self.held[at:]
        if marker == PARAMETER:
            self.held, self.mode = self.held[len(PARAMETER) :], _NAME
            return True
        self._close(out)
        if marker == FUNCTION_END:
            self.held, self.mode = self.held[len(FUNCTION_END) :], _REST
        elif marker == END:
            self.held = self.held[len(END) :]
            self.after_call()
        elif marker == START:  # a new block, its predecessor's end tag forgotten
            self.after_call()
        else:  # FUNCTION: the next call in this block, this one's end tag forgotten
            self._fresh_block, self.mode = False, _HEAD
        return True

    def _name(self, out: ToolDelta, final: bool) -> bool:
        """A parameter's name, up to ``>``: its key is sent and its value starts."""
        close = self.held.find(">")
        name = self.held[: close if close >= 0 else len(self.held)]
        if "<" in name or "\n" in name or (close < 0 and final):
            self.mode = _BODY  # a broken parameter: dropped
            if final:
                self.held = ""
            return True
        if close < 0:
            return False
        separator = ", " if self._params else ""
        out.add_arguments(self._index, f'{separator}"{json_text(name)}": ')
        self._params += 1
        declared = self._schemas is not None and name in self._schemas
        kind = declared_type(self._schemas, name)
        text = not declared or (kind or "string").strip().lower() in QWEN_STRING_TYPES
        convert = partial(qwen3_coder_value, kind=kind, declared=declared)
        self._value = ValueStream("newline", text, convert, null_word=True)
        self.held, self.mode = self.held[close + 1 :], _VALUE
        return True

    def _read_value(self, out: ToolDelta, final: bool) -> bool:
        """A parameter's value, streamed up to its end."""
        value = cast(ValueStream, self._value)  # set with the mode
        found = first_marker(self.held, _VALUE_ENDS)
        if found is None and not final:
            cut = len(self.held) - partial_marker_len(self.held, _VALUE_ENDS)
            out.add_arguments(self._index, value.feed(self.held[:cut]))
            self.held = self.held[cut:]
            return False
        at, marker = found if found is not None else (len(self.held), "")
        out.add_arguments(self._index, value.feed(self.held[:at]) + value.finish())
        closing = len(PARAMETER_END) if marker == PARAMETER_END else 0
        self.held, self.mode, self._value = self.held[at + closing :], _BODY, None
        return True

    def _rest(self, final: bool) -> bool:
        """After ``</function>``: the block's end, or another function in it."""
        found = first_marker(self.held, _REST_MARKERS)
        if found is None:
            keep = 0 if final else partial_marker_len(self.held, _REST_MARKERS)
            self.held = self.held[len(self.held) - keep :]
            if final:
                self.after_call()
                return True
            return False
        at, marker = found
        self.held = self.held[at:]
        if marker == END:
            self.held = self.held[len(END) :]
            self.after_call()
        elif marker == START:
            self.after_call()
        else:
            self._fresh_block, self.mode = False, _HEAD
        return True

    def _close(self, out: ToolDelta) -> None:
        out.add_arguments(self._index, "}")

    def not_a_call(self, out: ToolDelta) -> None:
        super().not_a_call(out)
        self._fresh_block = True

    def after_call(self) -> None:
        super().after_call()
        self._fresh_block = True
