"""JSON text as byte IR: whitespace, strings, literals, arrays, objects and "any value".

The pieces the JSON-schema compiler assembles, and "any JSON object" on its own. Every
helper here keeps one rule: a part that can match nothing (:data:`NOTHING`, e.g. a schema
with no instance) makes a sequence match nothing and drops out of an alternative, so a
bounded recursion or an impossible property disappears cleanly.

Layout: whitespace runs (:data:`MAX_WHITESPACE` bytes at most, so generation cannot spin on
spaces forever) are allowed after ``{ [ , :`` and before ``} ] , :``, nowhere else; a value
is therefore followed by its trailing whitespace inside a container, and the top-level
value has none around it. The comma-separated lists below are separated repetitions
(``ir.Repeat`` with a ``separator``), which the automaton builds with one copy of an
unbounded list's item: spelled out as ``item ("," item)*`` every level of nested arrays
would copy its item twice, because the automaton copies shared sub-trees.

The whitespace between tokens is :data:`WS` unless a constraint asks for another
(``disable_any_whitespace``: none, compact JSON; ``whitespace_pattern``: its regex): the
builders read it from :func:`whitespace`'s context when they run, so a compiler builds a
whole constraint inside one ``with whitespace(node):`` block.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
from collections.abc import Iterator
from typing import Any

from chassis.builtin_plugins.structured_output import ir
from chassis.builtin_plugins.structured_output.json_numbers import any_number

__all__ = [
    "MAX_WHITESPACE",
    "NOTHING",
    "STRING_CHAR",
    "WS",
    "any_object",
    "any_value",
    "array",
    "either",
    "free_object",
    "join",
    "json_literal",
    "maybe",
    "object_members",
    "quoted",
    "repeat",
    "string",
    "whitespace",
]

#: the longest whitespace run allowed between two tokens (a newline and 19 spaces of indent)
MAX_WHITESPACE = 20

#: matches nothing: an empty byte set
NOTHING: ir.Node = ir.ByteSet(frozenset())

#: the bytes JSON counts as whitespace between tokens
WHITESPACE_BYTES = frozenset(b" \t\n\r")

#: the default whitespace between tokens: a run of at most :data:`MAX_WHITESPACE` bytes
WS: ir.Node = ir.Repeat(ir.ByteSet(WHITESPACE_BYTES), 0, MAX_WHITESPACE)

_layout: contextvars.ContextVar[ir.Node] = contextvars.ContextVar("json_whitespace", default=WS)


@contextlib.contextmanager
def whitespace(node: ir.Node) -> Iterator[None]:
    """Within the block, the builders below put ``node`` wherever JSON allows whitespace
    (:data:`ir.EMPTY`: compact JSON). ``node`` must match JSON whitespace only (the
    caller's check: see ``backend.whitespace_node``)."""
    token = _layout.set(node)
    try:
        yield
    finally:
        _layout.reset(token)


def _ws() -> ir.Node:
    """The whitespace between tokens in the current context (:func:`whitespace`)."""
    return _layout.get()


# -- NOTHING-aware combinators -------------------------------------------------------------


def join(*items: ir.Node) -> ir.Node:
    """``ir.seq``, matching nothing if any item matches nothing."""
    return NOTHING if any(item == NOTHING for item in items) else ir.seq(*items)


def either(*options: ir.Node) -> ir.Node:
    """``ir.alt`` without the options that match nothing (none left: :data:`NOTHING`)."""
    kept = [option for option in options if option != NOTHING]
    return ir.alt(*kept) if kept else NOTHING


def maybe(item: ir.Node) -> ir.Node:
    """``item`` or nothing at all (the empty string when ``item`` matches nothing)."""
    return ir.EMPTY if item == NOTHING else ir.optional(item)


def repeat(item: ir.Node, low: int, high: int | None, separator: ir.Node | None = None) -> ir.Node:
    """``ir.Repeat`` (``separator`` between items, if given) that copes with an ``item`` or
    ``separator`` that matches nothing and with ``high == 0``."""
    if separator == NOTHING:  # no second item can follow
        if low > 1:
            return NOTHING
        high, separator = (1 if high is None else min(high, 1)), None
    if high == 0 or (item == NOTHING and low == 0):
        return ir.EMPTY
    if item == NOTHING:
        return NOTHING
    return ir.Repeat(item, low, high, separator)


# -- strings ------------------------------------------------------------------------------

_HEX = ir.ByteSet(frozenset(b"0123456789abcdefABCDEF"))
_D = ir.ByteSet(frozenset(b"dD"))
# \uXXXX: any code unit but a surrogate, or a high surrogate escape then a low one (one
# character); a lone surrogate would decode to a string no UTF-8 text can hold
_NOT_SURROGATE = ir.alt(
    ir.seq(ir.ByteSet(frozenset(b"0123456789abcefABCEF")), _HEX, _HEX, _HEX),
    ir.seq(_D, ir.byte_range(0x30, 0x37), _HEX, _HEX),
)
_SURROGATE_PAIR = ir.seq(
    _D,
    ir.ByteSet(frozenset(b"89abAB")),
    _HEX,
    _HEX,
    ir.Bytes(b"\\u"),
    _D,
    ir.ByteSet(frozenset(b"cdefCDEF")),
    _HEX,
    _HEX,
)
_ESCAPE = ir.seq(
    ir.Bytes(b"\\"),
    ir.alt(
        ir.ByteSet(frozenset(b'"\\/bfnrt')),
        ir.seq(ir.Bytes(b"u"), ir.alt(_NOT_SURROGATE, _SURROGATE_PAIR)),
    ),
)
#: bytes a JSON string cannot hold unescaped: the quote, the backslash, control characters
UNESCAPED_FORBIDDEN = frozenset([*range(0x20), 0x22, 0x5C])

#: one character of a string's content, raw or escaped (JSON Schema counts it as one)
STRING_CHAR: ir.Node = ir.alt(ir.unicode_char(UNESCAPED_FORBIDDEN), _ESCAPE)

_QUOTE = ir.Bytes(b'"')


def quoted(content: ir.Node) -> ir.Node:
    """``content`` between double quotes."""
    return join(_QUOTE, content, _QUOTE)


def string(min_length: int = 0, max_length: int | None = None) -> ir.Node:
    """A JSON string of ``min_length`` to ``max_length`` characters (escapes count as one)."""
    if max_length is not None and max_length < min_length:
        return NOTHING
    return quoted(repeat(STRING_CHAR, min_length, max_length))


def json_literal(value: Any) -> ir.Node:
    """The JSON text of ``value``: scalars as ``json.dumps(value, ensure_ascii=False)``
    writes them; arrays and objects with their items (and keys) in order and whitespace
    wherever JSON allows it, so compact, ``", "``/``": "`` and pretty forms all match."""
    if isinstance(value, list):
        return array([json_literal(item) for item in value], NOTHING, len(value), len(value))
    if isinstance(value, dict):
        return object_members([(str(k), json_literal(v), True) for k, v in value.items()])
    try:
        return ir.literal(json.dumps(value, ensure_ascii=False, allow_nan=False))
    except ValueError:  # NaN and the infinities: Python's JSON parser reads them, JSON has none
        raise ValueError(
            f"{value!r} in an enum or const is not a JSON value (JSON has no NaN or Infinity)"
        ) from None


# -- containers ---------------------------------------------------------------------------


def _comma() -> ir.Node:
    return ir.seq(ir.Bytes(b","), _ws())


def _colon() -> ir.Node:
    return ir.seq(ir.Bytes(b":"), _ws())


def array(
    prefix: list[ir.Node], items: ir.Node, min_items: int = 0, max_items: int | None = None
) -> ir.Node:
    """A JSON array: ``prefix[i]`` at position ``i``, ``items`` after the prefix, with
    ``min_items`` to ``max_items`` elements (whitespace inside, none around)."""
    ws = _ws()
    if max_items is not None:
        if max_items < min_items:
            return NOTHING
        prefix = prefix[:max_items]
    # built from the end: each element after the first is preceded by its comma
    tail_min = max(0, min_items - len(prefix))
    tail_max = None if max_items is None else max_items - len(prefix)
    element = join(items, ws)
    if not prefix:
        if tail_max == 0:
            return ir.seq(ir.Bytes(b"["), ws, ir.Bytes(b"]"))
        body = repeat(element, tail_min, tail_max, separator=_comma())
        return join(ir.Bytes(b"["), ws, body, ir.Bytes(b"]"))
    following = repeat(join(_comma(), element), tail_min, tail_max)
    for position in range(len(prefix) - 1, 0, -1):
        following = join(_comma(), prefix[position], ws, following)
        if position >= min_items:
            following = maybe(following)
    body = join(prefix[0], ws, following)
    if min_items == 0:
        body = maybe(body)
    return join(ir.Bytes(b"["), ws, body, ir.Bytes(b"]"))


def object_members(members: list[tuple[str, ir.Node, bool]]) -> ir.Node:
    """A JSON object with these ``(name, value, required)`` members, in this order: the
    required ones always, each optional one at most once, commas between those present."""
    ws = _ws()
    items: list[tuple[ir.Node, bool]] = []
    for name, value, required in members:
        member = join(ir.literal(json.dumps(name, ensure_ascii=False)), ws, _colon(), value, ws)
        if member == NOTHING:
            if required:
                return NOTHING
            continue  # (an optional member that cannot be written is left out)
        items.append((member, required))
    # (a separated run of members: each member's value is built once, see ir.Separated)
    body = ir.Separated(tuple(items), _comma()) if items else ir.EMPTY
    return join(ir.Bytes(b"{"), ws, body, ir.Bytes(b"}"))


def free_object(values: ir.Node, min_properties: int = 0) -> ir.Node:
    """A JSON object with any keys (any JSON strings) whose values match ``values``;
    ``min_properties`` is 0 or 1."""
    ws = _ws()
    member = join(string(), ws, _colon(), values, ws)
    body = repeat(member, min_properties, None, separator=_comma())
    return join(ir.Bytes(b"{"), ws, body, ir.Bytes(b"}"))


# -- any value ----------------------------------------------------------------------------

_SCALAR = ir.alt(string(), any_number(), ir.Bytes(b"true"), ir.Bytes(b"false"), ir.Bytes(b"null"))


def any_value(depth: int) -> ir.Node:
    """Any JSON value with arrays and objects nested at most ``depth`` deep (0: scalars)."""
    return _any_value(depth, _ws())


def any_object(depth: int) -> ir.Node:
    """Any JSON object whose values nest at most ``depth - 1`` deeper (``depth >= 1``)."""
    return _any_object(depth, _ws())


# (cached per whitespace too, for the few most recent ones: a constraint that uses any value
# at the same depth and whitespace shares its node)
@functools.lru_cache(maxsize=256)
def _any_value(depth: int, ws: ir.Node) -> ir.Node:
    if depth <= 0:
        return _SCALAR
    return ir.alt(_SCALAR, array([], _any_value(depth - 1, ws)), _any_object(depth, ws))


@functools.lru_cache(maxsize=256)
def _any_object(depth: int, ws: ir.Node) -> ir.Node:
    return free_object(_any_value(depth - 1, ws))
