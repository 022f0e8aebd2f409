"""The regular-expression tree that every constraint compiles to, over UTF-8 bytes.

A JSON schema, a regex, a list of choices and "any JSON object" each become one
:data:`Node`; :mod:`~chassis.builtin_plugins.structured_output.automaton` turns it into a
byte automaton. Working on bytes (not characters) matters because a token is a byte string:
a token may end in the middle of a multi-byte character.

Nodes are immutable and hashable, so compilers may share sub-trees freely.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "ANY_BYTE",
    "EMPTY",
    "Alt",
    "ByteSet",
    "Bytes",
    "Node",
    "Repeat",
    "Separated",
    "Seq",
    "alt",
    "byte_range",
    "codepoint_ranges",
    "complement",
    "literal",
    "optional",
    "seq",
    "unicode_char",
]


@dataclass(frozen=True)
class Bytes:
    """Exactly these bytes (``b""`` matches the empty string)."""

    value: bytes


@dataclass(frozen=True)
class ByteSet:
    """One byte whose value is in ``allowed`` (an empty set matches nothing)."""

    allowed: frozenset[int]


@dataclass(frozen=True)
class Seq:
    """Each item in turn (no items: the empty string)."""

    items: tuple[Node, ...]


@dataclass(frozen=True)
class Alt:
    """Any one of the options (no options: matches nothing)."""

    options: tuple[Node, ...]


@dataclass(frozen=True)
class Repeat:
    """``item`` at least ``min`` and at most ``max`` times (``max=None``: unbounded), with
    ``separator`` between each two consecutive items when it is set (``a (, a)*`` is
    ``Repeat(a, 1, None, separator=,)``).

    A separated repetition is its own node (not ``item (separator item)*``) because the
    automaton then builds ``item`` once for an unbounded one, looping back into that copy
    after each separator: spelled out, every level of nested lists would copy its item
    twice, and the automaton would grow as 2^depth.
    """

    item: Node
    min: int = 0
    max: int | None = None
    separator: Node | None = None

    def __post_init__(self) -> None:
        if self.min < 0 or (self.max is not None and self.max < self.min):
            raise ValueError(f"bad repetition bounds {{{self.min},{self.max}}}")


@dataclass(frozen=True)
class Separated:
    """Each of ``items`` in turn, an optional one (``(node, False)``) written or left out,
    a required one (``(node, True)``) always written, with ``separator`` between each two
    written (a JSON object's members: ``{"a": 1, "c": 3}`` leaves ``"b"`` out). Nothing
    written at all is the empty string.

    Its own node because the automaton then builds each item once, reached either with
    nothing written before it or through a separator: as a regular expression, whether an
    item needs its separator depends on the optional items before it, and every way of
    writing that copies items (nested objects with optional members grew as 2^depth).
    """

    items: tuple[tuple[Node, bool], ...]
    separator: Node


Node = Bytes | ByteSet | Seq | Alt | Repeat | Separated

EMPTY: Node = Bytes(b"")
ANY_BYTE: Node = ByteSet(frozenset(range(256)))


def literal(text: str) -> Node:
    """The UTF-8 bytes of ``text``."""
    return Bytes(text.encode("utf-8"))


def seq(*items: Node) -> Node:
    """A sequence, flattened; a single item is returned as it is."""
    flat: list[Node] = []
    for item in items:
        flat.extend(item.items if isinstance(item, Seq) else (item,))
    return flat[0] if len(flat) == 1 else Seq(tuple(flat))


def alt(*options: Node) -> Node:
    """An alternative, flattened and without duplicates; a single option is returned as it is."""
    flat: list[Node] = []
    # Literals are deduplicated by value (a choice may list thousands); other options by
    # comparison, which is cheap for the few a compiler joins (hashing a deep shared tree is
    # not: dataclass hashes are not cached).
    literals: set[bytes] = set()
    for option in options:
        for o in option.options if isinstance(option, Alt) else (option,):
            if isinstance(o, Bytes):
                if o.value in literals:
                    continue
                literals.add(o.value)
            elif o in flat:
                continue
            flat.append(o)
    return flat[0] if len(flat) == 1 else Alt(tuple(flat))


def optional(item: Node) -> Node:
    return Repeat(item, 0, 1)


def byte_range(lo: int, hi: int) -> ByteSet:
    """One byte in ``[lo, hi]``."""
    return ByteSet(frozenset(range(lo, hi + 1)))


# -- Unicode code points as UTF-8 byte sequences -------------------------------------------------

#: the largest Unicode code point
MAX_CODEPOINT = 0x10FFFF
#: (first code point, last code point, encoded length) of each UTF-8 length class
_UTF8_CLASSES = ((0x0, 0x7F, 1), (0x80, 0x7FF, 2), (0x800, 0xFFFF, 3), (0x10000, MAX_CODEPOINT, 4))
_SURROGATES = (0xD800, 0xDFFF)


def codepoint_ranges(ranges: Iterable[tuple[int, int]]) -> Node:
    """One character whose code point lies in one of the inclusive ``ranges``, as UTF-8.

    Surrogates (U+D800..U+DFFF) are never matched: they are not valid in UTF-8. Overlapping
    or unsorted ranges are fine.
    """
    merged = _merge(
        part
        for lo, hi in ranges
        for part in ((lo, min(hi, _SURROGATES[0] - 1)), (max(lo, _SURROGATES[1] + 1), hi))
        if part[0] <= part[1]
    )
    options: list[Node] = []
    for lo, hi in merged:
        for first, last, length in _UTF8_CLASSES:
            a, b = max(lo, first), min(hi, last)
            if a <= b:
                options.extend(_same_length(a, b, length))
    return alt(*options) if options else ByteSet(frozenset())


def unicode_char(excluded_ascii: Iterable[int] = ()) -> Node:
    """Any character (any valid UTF-8 sequence) except the ASCII code points listed."""
    return codepoint_ranges(complement((code, code) for code in excluded_ascii))


def complement(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The code points ``0..MAX_CODEPOINT`` outside the inclusive ``ranges`` (which may
    overlap or be unsorted), as sorted inclusive ranges."""
    out, start = [], 0
    for lo, hi in sorted(ranges):
        if lo > start:
            out.append((start, lo - 1))
        start = max(start, hi + 1)
    if start <= MAX_CODEPOINT:
        out.append((start, MAX_CODEPOINT))
    return out


def _merge(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _same_length(lo: int, hi: int, length: int) -> list[Node]:
    """UTF-8 sequences of the code points ``lo..hi``, all of one encoded ``length``."""
    if length == 1:
        return [byte_range(lo, hi)]
    lo_bytes = chr(lo).encode("utf-8")
    hi_bytes = chr(hi).encode("utf-8")
    return _split(lo_bytes, hi_bytes)


def _split(lo: bytes, hi: bytes) -> list[Node]:
    """Byte-sequence ranges ``lo..hi`` (equal lengths, continuation bytes 0x80..0xBF after the
    first) as sequences of byte ranges: the usual split into a low edge, a full middle and a
    high edge."""
    if len(lo) == 1:
        return [byte_range(lo[0], hi[0])]
    if lo[0] == hi[0]:
        return [seq(Bytes(lo[:1]), tail) for tail in _split(lo[1:], hi[1:])]
    tail_min = bytes([0x80] * (len(lo) - 1))
    tail_max = bytes([0xBF] * (len(lo) - 1))
    parts: list[Node] = []
    first = lo[0]
    if lo[1:] != tail_min:
        parts += [seq(Bytes(lo[:1]), tail) for tail in _split(lo[1:], tail_max)]
        first += 1
    last = hi[0]
    high_edge: list[Node] = []
    if hi[1:] != tail_max:
        high_edge = [seq(Bytes(hi[:1]), tail) for tail in _split(tail_min, hi[1:])]
        last -= 1
    if first <= last:
        parts.append(seq(byte_range(first, last), *[byte_range(0x80, 0xBF)] * (len(lo) - 1)))
    return parts + high_edge
