"""Argument values written as raw text between tags (``qwen3_coder``'s
``<parameter=city>\\nParis\\n</parameter>``, ``glm45``'s ``<arg_value>Paris</arg_value>``),
turned into JSON as the request's ``tools`` declare them, and streamed.

A value is *text* when its declared type is a string (or unknown, as each format decides):
its JSON string then streams as the model writes it, only the characters that may still be
trimmed (the whitespace at its end) or read otherwise (Qwen3-Coder's ``null``) held back. Any
other value is converted when it is complete (:func:`qwen3_coder_value`,
:func:`glm45_value`) and sent whole. A converted value that has no JSON form (``NaN``, a set,
bytes) is sent as the text it was written as, so the arguments are always valid JSON.
:class:`TagArguments` writes a call's keys and values as one JSON object.
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Callable
from typing import Any, cast

from chassis.builtin_plugins.parsers.json_calls import DECODER
from chassis.builtin_plugins.parsers.tagged_blocks import first_marker, partial_marker_len
from chassis.serve.tool_parser import ToolDelta

_SURROGATE = re.compile("[\ud800-\udfff]")
#: Qwen3-Coder's names for a string type (vLLM's list)
_QWEN_STRING_TYPES = frozenset({"string", "str", "text", "varchar", "char", "enum"})


def json_text(text: str) -> str:
    """``text`` escaped as inside a JSON string (``json.dumps`` without the quotes, non-ASCII
    as is); a lone surrogate, which no client could decode, becomes U+FFFD. Escaping is per
    character, so the pieces of a text escape to the pieces of its escape."""
    return json.dumps(_SURROGATE.sub("\ufffd", text), ensure_ascii=False)[1:-1]


def json_value(value: Any, written: str) -> str:
    """``value`` as JSON text, or ``written`` as a JSON string when ``value`` has no valid
    JSON form (NaN, infinities, sets, bytes, a lone surrogate, too deep)."""
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
        text.encode("utf-8")
    except (TypeError, ValueError, RecursionError):  # UnicodeEncodeError is a ValueError
        return f'"{json_text(written)}"'
    return text


def parameter_schemas(tools: list[dict[str, Any]], function: str) -> dict[str, Any] | None:
    """The ``properties`` of the ``parameters`` of the function named ``function`` in
    ``tools`` (OpenAI's shape), or ``None`` when ``tools`` has no such function. As vLLM
    reads it: ``parameters`` without ``properties`` is taken as the properties themselves,
    and missing or odd ``parameters`` declare none."""
    for tool in tools:
        spec = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(spec, dict) or spec.get("name") != function:
            continue
        params = spec.get("parameters")
        if not isinstance(params, dict):
            return {}
        properties = params.get("properties", params)
        return properties if isinstance(properties, dict) else {}
    return None


def declared_type(schemas: dict[str, Any] | None, name: str) -> str | None:
    """The ``type`` declared for parameter ``name`` (``None``: the parameter or its type is
    not declared). A list of types (``["string", "null"]``) is its first one other than
    ``"null"``."""
    schema = (schemas or {}).get(name)
    if not isinstance(schema, dict) or "type" not in schema:
        return None
    kind = schema["type"]
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    return str(kind)


def _literal(text: str) -> Any:
    """``text`` as a Python literal (parsed, never run), or ``text`` itself."""
    try:
        return ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        return text


def _json_or_literal(text: str) -> Any:
    try:
        return DECODER.decode(text)
    except (json.JSONDecodeError, RecursionError):
        return _literal(text)


def _qwen_type(kind: str | None) -> str:
    """A declared type as Qwen3-Coder's conversion compares it (none: ``string``)."""
    return (kind or "string").strip().lower()


def qwen3_coder_is_text(kind: str | None, declared: bool) -> bool:
    """Whether a Qwen3-Coder parameter's value stays text: its parameter is not declared
    (``declared`` false), or its type ``kind`` is a string type or not given."""
    return not declared or _qwen_type(kind) in _QWEN_STRING_TYPES


def qwen3_coder_value(text: str, kind: str | None, declared: bool) -> Any:
    """A Qwen3-Coder parameter's value, converted as vLLM's ``qwen3_coder`` does: ``null``
    (any case) is ``None`` whatever the type; an undeclared parameter (``declared`` false) or
    a string type stays text (:func:`qwen3_coder_is_text`); integer types (``int*``,
    ``uint*``, ``long*``, ``short*``, ``unsigned*``) by ``int()``; number types (``num*``,
    ``float*``) by ``float()``, integral values as integers; booleans are ``true`` (any case)
    or else false; objects and arrays are JSON, else a Python literal; other types a Python
    literal. A value that does not convert stays text."""
    if text.lower() == "null":
        return None
    if qwen3_coder_is_text(kind, declared):
        return text
    kind = _qwen_type(kind)
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        try:
            return int(text)
        except ValueError:
            return text
    if kind.startswith(("num", "float")):
        try:
            number = float(text)
        except ValueError:
            return text
        if not math.isfinite(number):
            return text
        return int(number) if number.is_integer() else number
    if kind in ("boolean", "bool", "binary"):
        return text.lower() == "true"
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        return _json_or_literal(text)
    return _literal(text)


def glm45_value(text: str, kind: str | None) -> Any:
    """A GLM-4.5 argument's value, as vLLM's ``glm45`` reads it: text when its declared type
    is ``string``, otherwise JSON, else a Python literal, else text."""
    return text if kind == "string" else _json_or_literal(text)


class ValueStream:
    """One value's raw text, fed in pieces, sent as JSON text.

    ``trim`` is how the raw text is trimmed: ``"newline"`` drops one newline at each end
    (Qwen3-Coder writes the value on its own lines), ``"space"`` all surrounding whitespace
    (``str.strip``). A ``text`` value streams as a JSON string; a value that reads one of
    ``null_words`` (lowercase; any case matches; none by default) is JSON ``null`` instead.
    Any other value is held and passed, trimmed, to ``convert`` at the end. The concatenated
    output of :meth:`feed` and :meth:`finish` does not depend on the pieces.
    """

    def __init__(
        self,
        trim: str,
        text: bool,
        convert: Callable[[str], Any] = str,
        null_words: tuple[str, ...] = (),
    ) -> None:
        self._trim = trim
        self._text = text
        self._convert = convert
        self._null_words = null_words
        #: raw text read but not sent (all of it for a converted value)
        self._pending = ""
        self._start_trimmed = False  # the trim at the value's start is settled
        self._opened = False  # the string's opening quote was sent

    def feed(self, text: str) -> str:
        """Read ``text``, the next piece of the raw value; return the JSON text it settles."""
        pending = self._pending + text
        if not self._text:
            self._pending = pending
            return ""
        if not self._start_trimmed:
            trimmed = self._trim_start(pending)
            # one newline is trimmed once a character is seen; whitespace until text is
            settled = bool(trimmed) if self._trim == "space" else bool(pending)
            pending = trimmed
            if not settled:
                self._pending = pending
                return ""
            self._start_trimmed = True
        ready = pending[: len(pending) - self._trailing_len(pending)]
        prefix = ""
        if not self._opened:
            if not ready or any(word.startswith(ready.lower()) for word in self._null_words):
                self._pending = pending  # may still be trimmed away, or read as null
                return ""
            self._opened, prefix = True, '"'
        self._pending = pending[len(ready) :]
        return prefix + json_text(ready)

    def finish(self) -> str:
        """The value ended: the rest of its JSON text."""
        pending, self._pending = self._pending, ""
        if not self._start_trimmed:
            pending = self._trim_start(pending)
        value = pending[: len(pending) - self._trailing_len(pending)]
        if not self._text:
            return json_value(self._convert(value), value)
        if self._opened:
            return json_text(value) + '"'
        if value.lower() in self._null_words:
            return "null"
        return f'"{json_text(value)}"'

    def _trim_start(self, text: str) -> str:
        if self._trim == "space":
            return text.lstrip()
        return text[1:] if text.startswith("\n") else text

    def _trailing_len(self, text: str) -> int:
        """How many characters at the end of ``text`` the trim would drop if it ended here."""
        if self._trim == "space":
            return len(text) - len(text.rstrip())
        return 1 if text.endswith("\n") else 0


class TagArguments:
    """One call's arguments, read as keys and raw values between tags, sent as a JSON object:
    ``{`` when the call starts, ``"key": `` (after ``, `` from the second key on) when a value
    starts (:meth:`start_value`), the value's JSON text as it is read (:meth:`read_value`),
    and ``}`` when the call ends (:meth:`close`)."""

    def __init__(self, out: ToolDelta, index: int, schemas: dict[str, Any] | None) -> None:
        #: the call's index in the message (started in ``out`` already)
        self.index = index
        #: the schemas of its function's parameters (:func:`parameter_schemas`)
        self.schemas = schemas
        self._num_keys = 0
        self._value: ValueStream | None = None
        out.add_arguments(index, "{")

    def start_value(self, out: ToolDelta, key: str, value: ValueStream) -> None:
        """Send ``key``; ``value`` reads its value (:meth:`read_value`)."""
        separator = ", " if self._num_keys else ""
        out.add_arguments(self.index, f'{separator}"{json_text(key)}": ')
        self._num_keys += 1
        self._value = value

    def read_value(
        self, out: ToolDelta, held: str, ends: tuple[str, ...], final: bool
    ) -> tuple[str, bool]:
        """Send what ``held`` (the started value's raw text and what follows it) settles of
        the value, up to the first of ``ends``: ``ends[0]`` is the value's own end tag, read
        with it; the others end the value too but are left to be read. Return the text left
        (while the value goes on: what may be the start of an end), and whether the value
        ended (always when ``final``)."""
        value = cast(ValueStream, self._value)  # set by start_value
        found = first_marker(held, ends)
        if found is None and not final:
            cut = len(held) - partial_marker_len(held, ends)
            out.add_arguments(self.index, value.feed(held[:cut]))
            return held[cut:], False
        at, marker = found if found is not None else (len(held), "")
        out.add_arguments(self.index, value.feed(held[:at]) + value.finish())
        self._value = None
        closing = len(marker) if marker == ends[0] else 0
        return held[at + closing :], True

    def close(self, out: ToolDelta) -> None:
        """The call ended: close its object."""
        out.add_arguments(self.index, "}")
