"""Pythonic tool calls, as Llama 3.2 (1B/3B), Llama 4 and other models prompted with a
"list of Python calls" template write them (registered as ``pythonic``)::

    [get_weather(city="Paris", days=3), get_time(zone=None, formats=["iso", "unix"])]

The message is its calls and nothing else: after optional leading whitespace (and, as Llama 4
writes it, between ``<|python_start|>`` and an optional ``<|python_end|>``), a Python list of
calls of plain function names with keyword arguments only, each argument a literal (string,
number, ``True``/``False``/``None``, or lists, tuples and string-keyed dicts of those). The
arguments become a JSON object. A message that starts with anything but ``[`` is plain content
and streams as it comes; one that starts with ``[`` is held to the end and, if it is not
wholly such a list, all of it, as written, is content. The text is parsed, never run.

Calls are reported whole, not streamed: the arguments are Python literals converted to JSON,
so no piece of the JSON is known before the call parses (and a list that later fails to parse
must stay content).
"""

from __future__ import annotations

import ast
import math
from typing import Any

from chassis.builtin_plugins.parsers.json_calls import arguments_json
from chassis.builtin_plugins.parsers.whole_message import WholeMessageToolParser
from chassis.serve.tool_parser import ToolCall

PYTHON_START = "<|python_start|>"
PYTHON_END = "<|python_end|>"


class PythonicToolParser(WholeMessageToolParser):
    """``[name(key=literal, ...), ...]``, the whole message."""

    # False: Llama 4's <|python_start|>/<|python_end|> are special tokens, and with them
    # dropped by the detokenizer the bare list is left, which parses the same; asking for
    # special tokens would only let other ones leak into plain content.
    needs_special_tokens = False
    start_tag = PYTHON_START
    opener = "["

    def calls_in(self, message: str) -> list[ToolCall] | None:
        return parse_calls(_unwrap(message))


def _unwrap(text: str) -> str:
    """``text`` without surrounding whitespace and the ``<|python_start|>`` ...
    ``<|python_end|>`` wrapper, when it has one (the end tag is optional)."""
    text = text.strip()
    if not text.startswith(PYTHON_START):
        return text
    return text[len(PYTHON_START) :].strip().removesuffix(PYTHON_END).rstrip()


def parse_calls(text: str) -> list[ToolCall] | None:
    """The calls of ``text``, a Python list of calls (see the module docstring), or ``None``
    when ``text`` is anything else. Only parses: nothing in ``text`` is evaluated as code."""
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls: list[ToolCall] = []
    for node in tree.body.elts:
        call = _call_from_node(node)
        if call is None:
            return None
        calls.append(call)
    return calls


def _call_from_node(node: ast.expr) -> ToolCall | None:
    """The call ``node`` is, ``name(key=literal, ...)``, or ``None``."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    arguments: dict[str, Any] = {}
    for keyword in node.keywords:
        # keyword.arg is None for **spread; a repeated name is legal to parse, not to call
        if keyword.arg is None or keyword.arg in arguments:
            return None
        try:
            value = ast.literal_eval(keyword.value)
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None
        if not _is_json(value):
            return None
        arguments[keyword.arg] = value
    text = arguments_json(arguments)
    return None if text is None else ToolCall(name=node.func.id, arguments=text)


def _is_json(value: Any) -> bool:
    """Whether ``value`` has a faithful JSON form: no sets, bytes, complex numbers, NaN or
    infinities, and dicts keyed by strings (tuples become arrays)."""
    if value is None or isinstance(value, bool | int | str):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list | tuple):
        return all(_is_json(item) for item in value)
    if isinstance(value, dict):
        return all(isinstance(key, str) and _is_json(item) for key, item in value.items())
    return False


class Llama4PythonicToolParser(PythonicToolParser):
    """Llama 4's calls (``llama4_pythonic``, vLLM's name): ``pythonic``'s reading, which
    already takes the list between ``<|python_start|>`` and an optional ``<|python_end|>``
    (or bare, as the detokenizer leaves it once it drops those special tokens)."""
