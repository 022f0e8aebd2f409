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
tag_values.qwen3_coder_value`): undeclared parameters, those without a type and string
types stay text, ``null`` is ``null``, integers, numbers, booleans, objects and arrays are
read as such (a value that does not convert stays text). The arguments are the JSON object
of the parameters in the order written (a repeated parameter is kept twice; JSON readers
keep its last value).

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
    TagArguments,
    ValueStream,
    declared_type,
    parameter_schemas,
    qwen3_coder_is_text,
    qwen3_coder_value,
)
from chassis.builtin_plugins.parsers.tagged_blocks import TaggedBlockToolParser
from chassis.serve.tool_parser import ToolDelta

START = "<tool_call>"
END = "</tool_call>"
FUNCTION = "<function="
FUNCTION_END = "</function>"
PARAMETER = "<parameter="
PARAMETER_END = "</parameter>"


_HEAD = "head"  # in a block, before a function's head (committed to nothing yet)
_BODY = "body"  # in a committed call, between parameters
_NAME = "name"  # after "<parameter=": its name
_VALUE = "value"  # in a parameter's value
_REST = "rest"  # after a call, up to the block's end or its next function: dropped


class Qwen3CoderToolParser(TaggedBlockToolParser):
    """``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>``."""

    start_tag = START
    #: the tag that closes a block
    end_tag = END
    block_mode = _HEAD
    #: what opens a call (its name follows, up to ``>``), what closes it, and the same for
    #: a parameter (MiniMax-M2's ``<invoke name=`` and ``<parameter name=`` differ)
    function_tag = FUNCTION
    function_end = FUNCTION_END
    parameter_tag = PARAMETER
    parameter_end = PARAMETER_END

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]]) -> None:
        super().__init__(tokenizer, tools)
        start, end = self.start_tag, self.end_tag
        #: where a parameter's value ends (vLLM's ends, and the block's end); its own end
        #: tag first
        function, function_end = self.function_tag, self.function_end
        parameter = self.parameter_tag
        self._value_ends = (self.parameter_end, parameter, function_end, end)
        #: what a call's body is read for between its parameters (other text is dropped)
        self._body_markers = (parameter, function_end, end, start, function)
        #: what the rest of a block after a call is read for
        self._rest_markers = (end, start, function)
        #: the head being read opens the block (no call in it yet): if broken, it is text
        self._fresh_block = True
        #: the arguments of the call being read (set when it is committed)
        self._arguments: TagArguments | None = None

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
        function = self.function_tag
        complete = body.startswith(function)
        if not complete and function.startswith(body) and not final:
            return False
        close = body.find(">", len(function)) if complete else -1
        name = body[len(function) : close if close >= 0 else len(body)] if complete else ""
        broken = not complete or "<" in name or "\n" in name
        if not broken and close < 0 and not final:
            return False  # the name goes on
        name = self.tag_name(name)
        if broken or close < 0 or not name:
            if self._fresh_block:
                self.not_a_call(out)
            else:  # a broken head after a call: dropped with the rest of the block (its
                # "<" first, so that it is not read as a function again)
                self.held, self.mode = body[1:], _REST
            return True
        index = self.start_call(out, name)
        self._arguments = TagArguments(out, index, parameter_schemas(self.tools, name))
        self.held, self.mode = body[close + 1 :], _BODY
        return True

    def _body(self, out: ToolDelta, final: bool) -> bool:
        """Between parameters: the next parameter, or the function's end; other text is
        dropped."""
        marker = self.skip_to(self._body_markers, final)
        if marker is None:
            if final:
                self._call_arguments().close(out)
                self.after_call()
            return final
        if marker == self.parameter_tag:
            self.held, self.mode = self.held[len(self.parameter_tag) :], _NAME
            return True
        self._call_arguments().close(out)
        if marker == self.function_end:
            self.held = self.held[len(self.function_end) :]
        self.mode = _REST  # reads the block's end, a new block or the next function
        return True

    def _name(self, out: ToolDelta, final: bool) -> bool:
        """A parameter's name, up to ``>``: its key is sent and its value starts."""
        close = self.held.find(">")
        name = self.held[: close if close >= 0 else len(self.held)]
        if "<" in name or "\n" in name or (close < 0 and final):
            self.mode = _BODY  # a broken parameter: dropped
            return True
        if close < 0:
            return False
        arguments = self._call_arguments()
        name = self.parameter_key(name)
        arguments.start_value(out, name, self.value_stream(arguments.schemas, name))
        self.held, self.mode = self.held[close + 1 :], _VALUE
        return True

    def tag_name(self, written: str) -> str:
        """The function's name as written in its opening tag (empty: no name)."""
        return written.strip()

    def parameter_key(self, written: str) -> str:
        """A parameter's key as written in its opening tag (Qwen3-Coder's: as is)."""
        return written

    def value_stream(self, schemas: dict[str, Any] | None, name: str) -> ValueStream:
        """How parameter ``name``'s value is trimmed, streamed and converted, given the
        schemas of the function's parameters (:func:`~chassis.builtin_plugins.parsers.
        tag_values.parameter_schemas`)."""
        declared = schemas is not None and name in schemas
        kind = declared_type(schemas, name)
        convert = partial(qwen3_coder_value, kind=kind, declared=declared)
        return ValueStream(
            "newline", qwen3_coder_is_text(kind, declared), convert, null_words=("null",)
        )

    def _read_value(self, out: ToolDelta, final: bool) -> bool:
        """A parameter's value, streamed up to its end."""
        arguments = self._call_arguments()
        self.held, ended = arguments.read_value(out, self.held, self._value_ends, final)
        if ended:
            self.mode = _BODY
        return ended

    def _rest(self, final: bool) -> bool:
        """After a call: the block's end, or another function in it; other text is
        dropped."""
        marker = self.skip_to(self._rest_markers, final)
        if marker is None:
            if final:
                self.after_call()
            return final
        if marker == self.end_tag:
            self.held = self.held[len(self.end_tag) :]
            self.after_call()
        elif marker == self.start_tag:  # a new block, this one's end tag forgotten
            self.after_call()
        else:  # FUNCTION: the next call in this block
            self._fresh_block, self.mode = False, _HEAD
        return True

    def _call_arguments(self) -> TagArguments:
        return cast(TagArguments, self._arguments)  # set with the call's head

    def not_a_call(self, out: ToolDelta) -> None:
        super().not_a_call(out)
        self._fresh_block = True

    def after_call(self) -> None:
        super().after_call()
        self._fresh_block = True
