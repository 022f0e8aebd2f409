"""How deeply a structured-output constraint may nest, counted by the front ends themselves.

Every compiler of a constraint (JSON texts and schemas, regular expressions, GBNF grammars,
structural tags) counts its own nesting and refuses a constraint nested deeper than
:data:`MAX_NESTING_DEPTH` (a JSON text's arrays and objects: :data:`MAX_JSON_TEXT_DEPTH`)
with :func:`nested_too_deeply`. What counts as one level is each
front end's (docs/structured_outputs.md, "What is refused"). So whether a constraint is
accepted never depends on Python's recursion limit, which differs between processes
(``torch.compile`` raises it to 2000 in an engine that compiled a model): the limit is low
enough that every walker stays well under Python's default limit of 1000 frames at it.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = [
    "FORCED_TOOL_CALL_LEVELS",
    "MAX_JSON_TEXT_DEPTH",
    "MAX_NESTING_DEPTH",
    "check_json_text_nesting",
    "check_json_value_nesting",
    "json_text_depth",
    "json_value_depth",
    "nested_too_deeply",
]

#: the deepest nesting a constraint may have, in each front end's levels (a regex group, a
#: grammar group, repetition or rule expansion, a JSON subschema; a JSON text's arrays and
#: objects have their own limit, MAX_JSON_TEXT_DEPTH, derived from it).
#: Real schemas, regexes and grammars stay far below it; at it, the deepest walk measured
#: uses fewer than half of Python's default 1000 frames (tests/test_structured_nesting.py)
MAX_NESTING_DEPTH = 32

#: the subschema levels a forced tool call (``tool_choice`` ``"required"``) wraps around each
#: function's ``parameters`` schema (the array of calls, its ``items``' ``anyOf``, a call
#: object; serve/structured_request.py). They do not count against MAX_NESTING_DEPTH
#: (:attr:`~chassis.core.structured_output.StructuredOutputsParams.json_wrapper_levels`)
FORCED_TOOL_CALL_LEVELS = 3

#: the deepest nesting of the arrays and objects of a JSON text that holds a schema: two per
#: subschema level (``"properties": {"a": {...}}``, ``"anyOf": [{...}]``), for a schema at
#: MAX_NESTING_DEPTH wrapped in a forced tool call, plus two for its innermost subschema's
#: values (an ``enum`` of arrays). So the text check refuses no schema that the subschema
#: count accepts; a text this deep is parsed by ``json.loads`` and walked without recursion
MAX_JSON_TEXT_DEPTH = 2 * (MAX_NESTING_DEPTH + FORCED_TOOL_CALL_LEVELS) + 2

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKET = re.compile(r"[\[\]{}]")


def nested_too_deeply(what: str, limit: int = MAX_NESTING_DEPTH) -> ValueError:
    """The refusal of a constraint deeper than ``limit``: ``what`` says what nests
    (``"the JSON schema's subschemas are"``)."""
    return ValueError(f"{what} nested too deeply (limit {limit})")


def json_text_depth(text: str) -> int:
    """How deeply the arrays and objects of the JSON ``text`` nest (a scalar: 0), counted
    without parsing it (brackets inside strings do not count). For malformed text, the
    depth its brackets outside strings reach."""
    depth = deepest = 0
    for match in _BRACKET.finditer(_STRING.sub("", text)):
        if match.group() in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def json_value_depth(value: Any) -> int:
    """How deeply the lists and dicts of ``value`` nest (a scalar: 0), without recursion."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        if depth > MAX_JSON_TEXT_DEPTH:  # deep enough to refuse: stop walking
            break
        stack.extend((child, depth + 1) for child in children)
    return deepest


def check_json_text_nesting(text: str, what: str) -> None:
    """Refuse the JSON ``text`` (of ``what``) if its arrays and objects nest deeper than
    :data:`MAX_JSON_TEXT_DEPTH` (before ``json.loads``, whose C parser would otherwise stop
    at Python's recursion limit)."""
    if json_text_depth(text) > MAX_JSON_TEXT_DEPTH:
        raise nested_too_deeply(f"{what} (its arrays and objects)", MAX_JSON_TEXT_DEPTH)


def check_json_value_nesting(value: Any, what: str) -> None:
    """:func:`check_json_text_nesting` for a value already parsed (before ``json.dumps``)."""
    if json_value_depth(value) > MAX_JSON_TEXT_DEPTH:
        raise nested_too_deeply(f"{what} (its arrays and objects)", MAX_JSON_TEXT_DEPTH)
