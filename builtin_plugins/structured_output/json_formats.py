"""String ``format`` values as byte IR for the content of a JSON string (no quotes).

Each one accepts only texts that are valid for the format: calendar dates with the right
number of days in each month (29 February in leap years only), RFC 3339 times with an
offset, canonical UUIDs, dotted-quad IPv4 addresses without leading zeros and a common
subset of e-mail addresses. Other formats are annotations for the schema compiler (JSON
Schema does not assert ``format`` by default).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from chassis.builtin_plugins.structured_output import ir
from chassis.builtin_plugins.structured_output.json_numbers import integer_range

__all__ = ["FORMATS", "StringFormat"]


def _chars(text: str) -> ir.ByteSet:
    return ir.ByteSet(frozenset(text.encode()))


def _b(text: str) -> ir.Node:
    return ir.Bytes(text.encode())


_DIGIT = ir.byte_range(0x30, 0x39)
_HEX = _chars("0123456789abcdefABCDEF")


def _two_digits(lo: int, hi: int) -> ir.Node:
    """``lo..hi`` as exactly two digits (``07``)."""
    return ir.alt(*(_b(f"{n:02d}") for n in range(lo, hi + 1)))


def _date() -> ir.Node:
    # years 0001..9999 (Python's datetime has no year 0)
    year = ir.alt(
        ir.seq(ir.byte_range(0x31, 0x39), _DIGIT, _DIGIT, _DIGIT),
        ir.seq(_b("0"), ir.byte_range(0x31, 0x39), _DIGIT, _DIGIT),
        ir.seq(_b("00"), ir.byte_range(0x31, 0x39), _DIGIT),
        ir.seq(_b("000"), ir.byte_range(0x31, 0x39)),
    )
    # divisible by 4, and by 400 when a century
    leap_year = ir.alt(
        ir.seq(_DIGIT, _DIGIT, ir.alt(*(_b(f"{n:02d}") for n in range(4, 100, 4)))),
        ir.seq(ir.alt(*(_b(f"{n:02d}") for n in range(4, 100, 4))), _b("00")),
    )
    days_28 = _two_digits(1, 28)
    long_months = ir.alt(*(_b(f"{m:02d}") for m in (1, 3, 5, 7, 8, 10, 12)))
    short_months = ir.alt(*(_b(f"{m:02d}") for m in (4, 6, 9, 11)))
    return ir.alt(
        ir.seq(
            year,
            _b("-"),
            ir.alt(
                ir.seq(long_months, _b("-"), ir.alt(days_28, _two_digits(29, 31))),
                ir.seq(short_months, _b("-"), ir.alt(days_28, _two_digits(29, 30))),
                ir.seq(_b("02-"), days_28),
            ),
        ),
        ir.seq(leap_year, _b("-02-29")),
    )


def _time() -> ir.Node:
    """RFC 3339 ``full-time``: ``HH:MM:SS(.fraction)?`` and ``Z`` or ``+HH:MM``."""
    hours = _two_digits(0, 23)
    minutes = ir.seq(ir.byte_range(0x30, 0x35), _DIGIT)
    fraction = ir.optional(ir.seq(_b("."), ir.Repeat(_DIGIT, 1, 9)))  # to nanoseconds
    offset = ir.alt(_b("Z"), ir.seq(_chars("+-"), hours, _b(":"), minutes))
    return ir.seq(hours, _b(":"), minutes, _b(":"), minutes, fraction, offset)


def _uuid() -> ir.Node:
    groups = [ir.Repeat(_HEX, n, n) for n in (8, 4, 4, 4, 12)]
    items: list[ir.Node] = [groups[0]]
    for group in groups[1:]:
        items += [_b("-"), group]
    return ir.seq(*items)


def _ipv4() -> ir.Node:
    octet = integer_range(0, 255)
    return ir.seq(octet, _b("."), octet, _b("."), octet, _b("."), octet)


def _email() -> ir.Node:
    """``local@domain.tld``: a dot-separated local part of letters, digits and ``_%+-``,
    and a domain of dot-separated labels (letters, digits, inner hyphens). Bounded so that a
    model cannot write one forever: parts of at most 64 characters (RFC 5321's local part),
    at most 4 dots in the local part, labels of at most 63 (RFC 1035) with at most 3 hyphens,
    at most 5 labels after the first."""
    alnum = _chars("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
    atom = ir.Repeat(ir.alt(alnum, _chars("_%+-")), 1, 64)
    local = ir.seq(atom, ir.Repeat(ir.seq(_b("."), atom), 0, 4))
    word = ir.Repeat(alnum, 1, 63)
    label = ir.seq(word, ir.Repeat(ir.seq(_b("-"), word), 0, 3))
    return ir.seq(local, _b("@"), label, ir.Repeat(ir.seq(_b("."), label), 1, 5))


class StringFormat(NamedTuple):
    """An asserted format: the IR of a string's content, and its length in characters."""

    content: Callable[[], ir.Node]
    min_length: int
    max_length: int | None


#: the formats the compiler asserts, by name
FORMATS: dict[str, StringFormat] = {
    "date": StringFormat(_date, 10, 10),
    "time": StringFormat(_time, 9, None),
    "date-time": StringFormat(lambda: ir.seq(_date(), _b("T"), _time()), 20, None),
    "uuid": StringFormat(_uuid, 36, 36),
    "ipv4": StringFormat(_ipv4, 7, 15),
    "email": StringFormat(_email, 5, None),
}
