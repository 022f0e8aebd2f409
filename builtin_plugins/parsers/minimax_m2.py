"""MiniMax-M2's tool calls (registered as ``minimax_m2``, as in vLLM)::

    I'll look that up.
    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    <parameter name="days">3</parameter>
    </invoke>
    </minimax:tool_call>

The reading is ``qwen3_coder``'s (:mod:`~chassis.builtin_plugins.parsers.qwen3_coder`) with
MiniMax's tags: each ``<invoke name="NAME">`` in a ``<minimax:tool_call>`` block is a call
(a block may hold several), each ``<parameter name="KEY">`` in it an argument whose value runs
to ``</parameter>``. Names may be quoted (``"..."`` or ``'...'``) or not. Values are stripped
of surrounding whitespace and converted as vLLM's ``minimax_m2`` does, by the types the
parameter's schema in the request's ``tools`` allows (:func:`schema_types`: ``type``, ``enum``
values, ``anyOf``/``oneOf``/``allOf``; undeclared: string), see :func:`minimax_m2_value`:
``null``, ``none`` and ``nil`` (any case) are ``null``; integers, numbers (integral values as
integers), booleans (``true``/``yes``/``on``/``1`` and their opposites), objects and arrays
are read as such when the schema allows them, in that order; a value none of those reads
is text when the schema allows a string (string-only values stream as written), else JSON
when it parses, else text.

Text around the blocks is content; a block that does not start with ``<invoke name=...>`` is
content as written; a call cut short by the end of generation keeps what was written (valid
JSON). Calls stream once ``<invoke name="NAME">`` is written, parameter by parameter. The
block's tags are added tokens of MiniMax-M2's tokenizer: the server keeps special tokens in the
text this parser reads.
"""

from __future__ import annotations

import json
import math
from functools import partial
from typing import Any

from chassis.builtin_plugins.parsers.json_calls import DECODER
from chassis.builtin_plugins.parsers.qwen3_coder import Qwen3CoderToolParser
from chassis.builtin_plugins.parsers.tag_values import ValueStream

START = "<minimax:tool_call>"
END = "</minimax:tool_call>"
INVOKE = "<invoke name="
INVOKE_END = "</invoke>"
PARAMETER = "<parameter name="
PARAMETER_END = "</parameter>"

#: the words a value may be written as to mean ``null`` (any case)
NULL_WORDS = ("null", "none", "nil")
_STRING_TYPES = frozenset({"string", "str", "text"})
#: the types a value is tried as, in order (vLLM's priority); string types stop the search
_PRIORITY = ("integer", "int", "number", "float", "boolean", "bool", "object", "array")
_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def unquote(name: str) -> str:
    """A tag's name attribute without surrounding whitespace and one pair of quotes."""
    name = name.strip()
    if len(name) >= 2 and name[0] == name[-1] and name[0] in "\"'":
        return name[1:-1]
    return name


def schema_types(schema: Any) -> set[str]:
    """The types a parameter's JSON schema allows, lowercased, as vLLM's ``minimax_m2``
    gathers them: ``type`` (a name or a list), the types of ``enum`` values, and those of
    ``anyOf``/``oneOf``/``allOf`` choices; none found (or no schema): ``{"string"}``."""
    if not isinstance(schema, dict):
        return {"string"}
    types: set[str] = set()
    kind = schema.get("type")
    for item in kind if isinstance(kind, list) else [kind]:
        if isinstance(item, str):
            types.add(item.lower())
    enum = schema.get("enum")
    if isinstance(enum, list):
        types.update(_json_type(value) for value in enum)
    for choice in ("anyOf", "oneOf", "allOf"):
        options = schema.get(choice)
        if isinstance(options, list):
            for option in options:
                types |= schema_types(option)
    return types or {"string"}


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, list):
        return "array"
    return "object" if isinstance(value, dict) else "string"


def is_text(types: set[str]) -> bool:
    """Whether a value of these types stays text whatever it reads (but a null word): a
    string type and none that is tried before it."""
    return bool(types & _STRING_TYPES) and not types.intersection(_PRIORITY)


_MISSING = object()


def _as(kind: str, text: str) -> Any:
    """``text`` read as type ``kind``, or ``_MISSING`` when it is not one."""
    if kind in ("integer", "int"):
        try:
            return int(text)
        except ValueError:
            return _MISSING
    if kind in ("number", "float"):
        try:
            number = float(text)
        except ValueError:
            return _MISSING
        if not math.isfinite(number):
            return _MISSING
        return int(number) if number.is_integer() else number
    if kind in ("boolean", "bool"):
        word = text.lower()
        return True if word in _TRUE else False if word in _FALSE else _MISSING
    try:  # object, array
        return DECODER.decode(text)
    except (json.JSONDecodeError, RecursionError):
        return _MISSING


def minimax_m2_value(text: str, types: set[str]) -> Any:
    """A MiniMax-M2 parameter's value (stripped), converted as vLLM's ``minimax_m2`` does:
    a null word (:data:`NULL_WORDS`, any case) is ``None``; else the value is tried as each
    type it may have, in the order integer, number, boolean, object, array, the first that
    reads it winning, and is text when it may be a string and none of those did; otherwise
    JSON, else text."""
    if text.lower() in NULL_WORDS:
        return None
    for kind in _PRIORITY:
        if kind in types:
            value = _as(kind, text)
            if value is not _MISSING:
                return value
    if types & _STRING_TYPES:
        return text
    try:
        return DECODER.decode(text)
    except (json.JSONDecodeError, RecursionError):
        return text


class MiniMaxM2ToolParser(Qwen3CoderToolParser):
    """``<minimax:tool_call><invoke name="NAME"><parameter name="KEY">VALUE</parameter>...
    </invoke></minimax:tool_call>``."""

    needs_special_tokens = True
    start_tag = START
    end_tag = END
    function_tag = INVOKE
    function_end = INVOKE_END
    parameter_tag = PARAMETER
    parameter_end = PARAMETER_END

    def tag_name(self, written: str) -> str:
        return unquote(written)

    def parameter_key(self, written: str) -> str:
        return unquote(written)

    def value_stream(self, schemas: dict[str, Any] | None, name: str) -> ValueStream:
        types = schema_types((schemas or {}).get(name))
        convert = partial(minimax_m2_value, types=types)
        return ValueStream("space", is_text(types), convert, null_words=NULL_WORDS)
