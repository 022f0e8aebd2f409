"""JSON numbers as byte IR, including exact ranges for ``minimum``/``maximum``.

Integers are written canonically (no leading zeros, no ``-0``, no fraction or exponent); a
range such as ``[-12, 305]`` becomes the usual digit-by-digit alternation, so every integer
in the range (and nothing else) is accepted.

Digits are bounded, so that a model cannot write digits forever (small models do, given
the chance: ``1.0000000...``): an integer part has at most :data:`MAX_INTEGER_DIGITS`
digits (or as many as a bound has), a fraction at most :data:`MAX_FRACTION_DIGITS`, an
exponent at most :data:`MAX_EXPONENT_DIGITS`.

Numbers with bounds are written without an exponent; their bounds must be whole numbers
below 10**15 in magnitude. Each number is split by its integer part ``n`` (its magnitude's
floor): every ``n`` strictly inside the range takes any fraction, and only the parts at a
bound need care. ``json.loads`` rounds a decimal to the nearest float, which never crosses
an inclusive whole bound; an exclusive bound could be reached by rounding (``0.99999999999
99999999`` becomes ``1.0``), so next to one the fraction keeps a margin of a few digits.
"""

from __future__ import annotations

from chassis.builtin_plugins.structured_output import ir

__all__ = [
    "MAX_EXPONENT_DIGITS",
    "MAX_FRACTION_DIGITS",
    "MAX_INTEGER_DIGITS",
    "MAX_NUMBER_BOUND",
    "any_number",
    "integer_range",
    "number_range",
]

#: digits of an integer (part) without an upper bound: 64-bit integers have up to 20
MAX_INTEGER_DIGITS = 20
#: digits after the point: more than a float64 holds (about 17 significant digits)
MAX_FRACTION_DIGITS = 16
#: digits of an exponent: float64 exponents have 3
MAX_EXPONENT_DIGITS = 3

#: the largest magnitude of a bound on a ``number`` (integers have no such limit): beyond
#: it, floats no longer hold every whole number and the rounding margins below vanish
MAX_NUMBER_BOUND = 10**15

#: the most fraction digits kept next to an exclusive bound (``< 10`` accepts ``9.999999``)
_MAX_MARGIN_DIGITS = 6

_DIGIT = ir.byte_range(0x30, 0x39)
_NONZERO = ir.byte_range(0x31, 0x39)
_MINUS = ir.Bytes(b"-")
_FRACTION = ir.seq(ir.Bytes(b"."), ir.Repeat(_DIGIT, 1, MAX_FRACTION_DIGITS))
_EXPONENT = ir.seq(
    ir.ByteSet(frozenset(b"eE")),
    ir.optional(ir.ByteSet(frozenset(b"+-"))),
    ir.Repeat(_DIGIT, 1, MAX_EXPONENT_DIGITS),
)
_NOTHING = ir.ByteSet(frozenset())


def any_number() -> ir.Node:
    """Any JSON number: ``-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?``, digits bounded
    as the module docstring says."""
    whole = ir.alt(ir.Bytes(b"0"), ir.seq(_NONZERO, ir.Repeat(_DIGIT, 0, MAX_INTEGER_DIGITS - 1)))
    return ir.seq(ir.optional(_MINUS), whole, ir.optional(_FRACTION), ir.optional(_EXPONENT))


def integer_range(lo: int | None, hi: int | None) -> ir.Node:
    """The canonical decimal texts of the integers in ``[lo, hi]`` (``None``: unbounded).

    An empty range matches nothing (an empty :class:`~ir.ByteSet`).
    """
    if lo is not None and hi is not None and lo > hi:
        return _NOTHING
    parts: list[ir.Node] = []
    if hi is None or hi >= 0:
        parts.append(_natural_range(max(lo, 0) if lo is not None else 0, hi))
    if lo is None or lo < 0:
        # negatives in [lo, min(hi, -1)]: a minus sign and magnitudes in [-min(hi, -1), -lo]
        top = -1 if hi is None else min(hi, -1)
        parts.append(ir.seq(_MINUS, _natural_range(-top, None if lo is None else -lo)))
    return ir.alt(*parts)


def number_range(lo: int | None, lo_exclusive: bool, hi: int | None, hi_exclusive: bool) -> ir.Node:
    """JSON numbers (optional fraction, no exponent) whose value ``json.loads`` reads as
    ``lo <(=) x <(=) hi``; ``lo``/``hi`` are whole numbers or ``None`` (unbounded).

    Raises ``ValueError`` for a bound of magnitude :data:`MAX_NUMBER_BOUND` or more.
    Matches nothing when the range is empty.
    """
    for bound in (lo, hi):
        if bound is not None and abs(bound) >= MAX_NUMBER_BOUND:
            raise ValueError(
                f"a number bound of {bound} is too large (at most {MAX_NUMBER_BOUND - 1} in "
                'magnitude); use "type": "integer" for large whole numbers'
            )
    parts: list[ir.Node] = []
    # values >= 0 are written without a sign: their magnitude is their value
    if hi is None or hi > 0 or (hi == 0 and not hi_exclusive):
        if lo is None or lo < 0:
            parts.append(_magnitude(0, False, hi, hi_exclusive))
        else:
            parts.append(_magnitude(lo, lo_exclusive, hi, hi_exclusive))
    # values < 0 are "-" and a magnitude m = -x > 0 (so "-0" is never written)
    if lo is None or lo < 0:
        if hi is not None and hi < 0:
            m_lo, m_lo_exclusive = -hi, hi_exclusive
        else:
            m_lo, m_lo_exclusive = 0, True
        m_hi, m_hi_exclusive = (None, False) if lo is None else (-lo, lo_exclusive)
        parts.append(ir.seq(_MINUS, _magnitude(m_lo, m_lo_exclusive, m_hi, m_hi_exclusive)))
    options = [p for p in parts if p != _NOTHING]
    return ir.alt(*options) if options else _NOTHING


# -- unsigned decimals ---------------------------------------------------------------------


def _magnitude(lo: int, lo_exclusive: bool, hi: int | None, hi_exclusive: bool) -> ir.Node:
    """Unsigned decimals ``n(.f)?`` with ``lo <(=) value <(=) hi`` (``0 <= lo``)."""
    if hi is not None and (hi < lo or (hi == lo and (lo_exclusive or hi_exclusive))):
        return _NOTHING
    # integer parts next to a bound need a restricted fraction; the others take any
    special = sorted({lo} | ({hi - 1, hi} if hi is not None else set()))
    special = [n for n in special if n >= lo and (hi is None or n <= hi)]
    parts: list[ir.Node] = []
    start = lo
    for n in special:
        if start <= n - 1:
            parts.append(ir.seq(_natural_range(start, n - 1), ir.optional(_FRACTION)))
        fraction = _fraction_at(n, lo, lo_exclusive, hi, hi_exclusive)
        if fraction is not None:
            parts.append(ir.seq(_natural_range(n, n), fraction))
        start = n + 1
    if hi is None:
        parts.append(ir.seq(_natural_range(start, None), ir.optional(_FRACTION)))
    return ir.alt(*parts) if parts else _NOTHING


def _fraction_at(
    n: int, lo: int, lo_exclusive: bool, hi: int | None, hi_exclusive: bool
) -> ir.Node | None:
    """The fractions allowed after the integer part ``n`` (``None``: none at all)."""
    need_nonzero = n == lo and lo_exclusive  # x > lo with floor lo: some digit is not 0
    if hi is not None and n == hi:
        # x <= hi with floor hi: the fraction is all zeros (x < hi is impossible here)
        if hi_exclusive or need_nonzero:
            return None
        return ir.optional(
            ir.seq(ir.Bytes(b"."), ir.Repeat(ir.Bytes(b"0"), 1, MAX_FRACTION_DIGITS))
        )
    need_short = hi is not None and n == hi - 1 and hi_exclusive
    if not need_nonzero and not need_short:
        return ir.optional(_FRACTION)
    margin = _margin_digits(lo if need_nonzero else 0, hi if need_short else 0)
    if need_nonzero and need_short:
        if margin == 0:
            return None
        # at most `margin` digits, one not 0: above n, and below n + 1 by 10**-margin
        return ir.alt(
            *(
                ir.seq(
                    ir.Bytes(b"." + b"0" * zeros),
                    _NONZERO,
                    ir.Repeat(_DIGIT, 0, margin - 1 - zeros),
                )
                for zeros in range(margin)
            )
        )
    if need_nonzero:
        if margin == 0:
            return None
        # a non-zero digit among the first `margin`: at least n + 10**-margin
        zeros = ir.Repeat(ir.Bytes(b"0"), 0, margin - 1)
        return ir.seq(
            ir.Bytes(b"."), zeros, _NONZERO, ir.Repeat(_DIGIT, 0, MAX_FRACTION_DIGITS - margin)
        )
    # need_short: at most `margin` digits, so at most n + 1 - 10**-margin
    if margin == 0:
        return ir.EMPTY
    return ir.optional(ir.seq(ir.Bytes(b"."), ir.Repeat(_DIGIT, 1, margin)))


def _margin_digits(*bounds: int) -> int:
    """Fraction digits that stay distinguishable from the bounds after rounding to a float:
    a float near ``b < 10**L`` is exact to about ``10**(L - 16)``, so ``10**-(15 - L)`` is
    safely above half a unit in the last place."""
    length = max(len(str(abs(b))) for b in bounds)
    return max(0, min(_MAX_MARGIN_DIGITS, 15 - length))


def _natural_range(lo: int, hi: int | None) -> ir.Node:
    """Canonical decimals (no leading zeros) of the integers in ``[lo, hi]``, ``0 <= lo``."""
    if hi is not None and lo > hi:
        return _NOTHING
    lo_text = str(lo)
    last_length = len(str(hi)) if hi is not None else len(lo_text)
    parts: list[ir.Node] = []
    for length in range(len(lo_text), last_length + 1):
        first = 0 if length == 1 else 10 ** (length - 1)
        a = max(lo, first)
        b = 10**length - 1 if hi is None else min(hi, 10**length - 1)
        if a <= b:
            parts.append(_same_length(str(a), str(b)))
    longest = max(MAX_INTEGER_DIGITS, len(lo_text))
    if hi is None and longest > len(lo_text):  # and every longer number, up to the cap
        parts.append(ir.seq(_NONZERO, ir.Repeat(_DIGIT, len(lo_text), longest - 1)))
    return ir.alt(*parts)


def _same_length(a: str, b: str) -> ir.Node:
    """Digit strings of one length from ``a`` to ``b`` (``a <= b``), digit by digit."""
    if a == b:
        return ir.Bytes(a.encode())
    if a[0] == b[0]:
        return ir.seq(ir.Bytes(a[:1].encode()), _same_length(a[1:], b[1:]))
    rest = len(a) - 1
    low, high = int(a[0]), int(b[0])
    parts: list[ir.Node] = []
    if a[1:] != "0" * rest:  # the low edge: a[0] followed by a[1:] .. 99..9
        parts.append(ir.seq(ir.Bytes(a[:1].encode()), _same_length(a[1:], "9" * rest)))
        low += 1
    high_edge = b[1:] != "9" * rest
    if high_edge:
        high -= 1
    if low <= high:  # the full middle: any digits after the first
        parts.append(ir.seq(ir.byte_range(0x30 + low, 0x30 + high), *[_DIGIT] * rest))
    if high_edge:
        parts.append(ir.seq(ir.Bytes(b[:1].encode()), _same_length("0" * rest, b[1:])))
    return ir.alt(*parts)
