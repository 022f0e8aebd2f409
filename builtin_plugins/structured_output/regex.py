"""Regular expressions (a practical subset of Python's ``re`` syntax) to the byte IR.

The whole output must match (``re.fullmatch`` semantics); a leading ``^`` or ``\\A`` and a
trailing ``$`` or ``\\Z`` on a top-level branch are accepted and change nothing. Supported:

- literal characters (any Unicode, matched as UTF-8) and ``.`` (any character but ``\\n``);
- escapes ``\\n \\t \\r \\f \\v \\a \\0``, octal ``\\NNN``, ``\\xNN``, ``\\uXXXX``,
  ``\\UXXXXXXXX``, ``\\N{NAME}``, and any escaped punctuation (``\\.``, ``\\\\``, ``\\[`` ...);
- ``\\d \\w \\s`` with their **ASCII** meanings (as with ``re.ASCII``: ``[0-9]``,
  ``[A-Za-z0-9_]``, ``[ \\t\\n\\r\\f\\v]``) and ``\\D \\W \\S``: any character but those;
- classes ``[...]`` with ranges, negation ``[^...]`` (every code point except the listed
  ones), escapes (``\\b`` is a backspace there) and the class escapes above;
- groups ``(...)``, ``(?:...)``, ``(?P<name>...)``, comments ``(?#...)``, alternation ``|``;
- quantifiers ``* + ? {m} {m,} {,n} {m,n}`` and their lazy forms (``*?`` ...), which match
  the same whole strings; bounds up to :data:`MAX_REPEAT`.

Groups nest at most :data:`~chassis.core.structured_nesting.MAX_NESTING_DEPTH` deep (each
group is one level; deeper is refused before Python's stack could be the limit).

Anything else raises ``ValueError`` naming the construct and its position: backreferences,
lookarounds, atomic groups and possessive quantifiers (``*+``: these change which strings
match, and are not regular in this simple form), conditionals, inline flags, and anchors or
word boundaries inside the pattern.
"""

from __future__ import annotations

import re
import unicodedata

from chassis.builtin_plugins.structured_output import ir
from chassis.core.structured_nesting import MAX_NESTING_DEPTH, nested_too_deeply

__all__ = ["MAX_REPEAT", "regex_to_ir"]

#: the largest repetition bound accepted (``{m,n}`` is expanded into copies)
MAX_REPEAT = 1000

_Ranges = list[tuple[int, int]]

_DIGIT: _Ranges = [(0x30, 0x39)]
_WORD: _Ranges = [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]
_SPACE: _Ranges = [(0x09, 0x0D), (0x20, 0x20)]
_SIMPLE_ESCAPES = {"n": 10, "t": 9, "r": 13, "f": 12, "v": 11, "a": 7}
_QUANTIFIER = re.compile(r"\{(\d*)(,?)(\d*)\}")
_ANCHOR = re.compile(r"\^|\$|\\[AZbB]")
_END_ANCHORS = re.compile(r"(?:\$|\\Z)*")


def regex_to_ir(pattern: str) -> ir.Node:
    """The IR matching exactly the strings ``re.fullmatch(pattern, s, re.ASCII)`` accepts,
    for the subset of the syntax in the module docstring (``ValueError`` otherwise)."""
    if not isinstance(pattern, str):
        raise ValueError(f"a regex must be a string, not {type(pattern).__name__}")
    return _Parser(pattern).parse()


_CLASS_ESCAPES: dict[str, _Ranges] = {
    "d": _DIGIT,
    "w": _WORD,
    "s": _SPACE,
    "D": ir.complement(_DIGIT),
    "W": ir.complement(_WORD),
    "S": ir.complement(_SPACE),
}


class _Parser:
    """Recursive descent over the pattern; ``self.i`` is the next character's index."""

    def __init__(self, pattern: str) -> None:
        self.p = pattern
        self.i = 0
        #: groups open at ``self.i`` (at most MAX_NESTING_DEPTH)
        self.open_groups = 0

    def error(self, message: str, position: int | None = None) -> ValueError:
        at = self.i if position is None else position
        return ValueError(f"regex {self.p!r}: {message} at position {at}")

    def peek(self, offset: int = 0) -> str:
        j = self.i + offset
        return self.p[j] if j < len(self.p) else ""

    def parse(self) -> ir.Node:
        node = self.alternation(depth=0)
        if self.i < len(self.p):  # alternation stops at an unmatched ")"
            raise self.error("unbalanced parenthesis")
        return node

    def alternation(self, depth: int) -> ir.Node:
        branches = [self.sequence(depth)]
        while self.peek() == "|":
            self.i += 1
            branches.append(self.sequence(depth))
        return ir.alt(*branches)

    def sequence(self, depth: int) -> ir.Node:
        items: list[ir.Node] = []
        while self.i < len(self.p) and self.peek() not in "|)":
            if self.anchor(depth, at_branch_start=not items):
                continue
            if self.skip_comments():
                continue
            item = self.quantified(self.atom())
            # merge adjacent literals into one Bytes (quantifiers bind to one atom only)
            if items and isinstance(item, ir.Bytes) and isinstance(items[-1], ir.Bytes):
                items[-1] = ir.Bytes(items[-1].value + item.value)
            else:
                items.append(item)
        return ir.seq(*items) if items else ir.EMPTY

    def anchor(self, depth: int, at_branch_start: bool) -> bool:
        """Skip a ``^``/``\\A`` opening or a ``$``/``\\Z`` closing a top-level branch (they
        change nothing under fullmatch); raise for any other anchor or word boundary."""
        m = _ANCHOR.match(self.p, self.i)
        if m is None:
            return False
        token = m.group()
        if depth == 0:
            if token in ("^", "\\A") and at_branch_start:
                self.i = m.end()
                return True
            if token in ("$", "\\Z"):
                rest = _END_ANCHORS.match(self.p, m.end())
                if rest.end() == len(self.p) or self.p[rest.end()] == "|":
                    self.i = m.end()
                    return True
        what = "word boundary" if token in ("\\b", "\\B") else "anchor"
        raise self.error(
            f"{what} {token} is only supported at the start (^, \\A) or end ($, \\Z) of the "
            "whole pattern"
        )

    def atom(self) -> ir.Node:
        c = self.peek()
        if c == "(":
            return self.group()
        if c == "[":
            return self.char_class()
        if c == ".":
            self.i += 1
            return ir.unicode_char([0x0A])  # "." is any character but "\n"
        if c in "*+?" or (c == "{" and self.quantifier_match()):
            raise self.error(f"nothing to repeat before {c!r}")
        start = self.i
        if c == "\\":
            kind, value = self.escape(in_class=False)
            if kind != "char":
                return ir.codepoint_ranges(value)
        else:
            self.i += 1
            value = ord(c)
        if 0xD800 <= value <= 0xDFFF:
            raise self.error(f"surrogate U+{value:04X} cannot be matched in UTF-8", start)
        return ir.literal(chr(value))

    def quantifier_match(self) -> re.Match[str] | None:
        m = _QUANTIFIER.match(self.p, self.i)
        if m is None or (not m.group(2) and not m.group(1)):
            return None  # "{" that starts no quantifier is a literal, as in re
        return m

    def skip_comments(self) -> bool:
        """Skip ``(?#...)`` comments at ``self.i`` (as in re, a quantifier after one applies
        to the item before it); whether there were any."""
        skipped = False
        while self.p.startswith("(?#", self.i):
            end = self.p.find(")", self.i)
            if end < 0:
                raise self.error("missing ), unterminated comment")
            self.i, skipped = end + 1, True
        return skipped

    def quantified(self, item: ir.Node) -> ir.Node:
        self.skip_comments()
        start = self.i
        c = self.peek()
        if c in ("*", "+", "?"):
            self.i += 1
            low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        elif c == "{" and (m := self.quantifier_match()):
            self.i = m.end()
            low = int(m.group(1)) if m.group(1) else 0
            high = int(m.group(3)) if m.group(3) else None
            if not m.group(2):
                high = low
            for bound in (low, high):
                if bound is not None and bound > MAX_REPEAT:
                    raise self.error(
                        f"repetition bound {bound} exceeds the limit of {MAX_REPEAT}", start
                    )
            if high is not None and low > high:
                raise self.error("min repeat greater than max repeat", start)
        else:
            return item
        if self.peek() == "?":  # lazy: the same whole-string matches
            self.i += 1
        elif self.peek() == "+":
            raise self.error(
                "possessive quantifiers (*+, ++, ?+, {m,n}+) are not supported", self.i
            )
        if self.peek() in ("*", "+", "?") or (self.peek() == "{" and self.quantifier_match()):
            raise self.error("multiple repeat")
        return ir.Repeat(item, low, high)

    def group(self) -> ir.Node:
        start = self.i
        self.i += 1
        if self.peek() == "?":
            ext = self.p[self.i : self.i + 3]
            if ext.startswith("?:"):
                self.i += 2
            elif ext == "?P<":
                end = self.p.find(">", self.i)
                name = self.p[self.i + 3 : end] if end >= 0 else ""
                if not name.isidentifier():
                    raise self.error(f"bad group name {name!r}", start)
                self.i = end + 1
            else:
                raise self.error(f"unsupported group {self.describe_group(ext)}", start)
        if self.open_groups >= MAX_NESTING_DEPTH:
            raise nested_too_deeply(f"regex {self.p[:50]!r}: the group at position {start} is")
        self.open_groups += 1
        inner = self.alternation(depth=1)
        self.open_groups -= 1
        if self.peek() != ")":
            raise self.error("missing ), unterminated subpattern", start)
        self.i += 1
        return inner

    @staticmethod
    def describe_group(ext: str) -> str:
        kinds = {
            "?=": "(?=...): lookahead",
            "?!": "(?!...): negative lookahead",
            "?<=": "(?<=...): lookbehind",
            "?<!": "(?<!...): negative lookbehind",
            "?P=": "(?P=name): backreference",
            "?>": "(?>...): atomic group",
            "?(": "(?(...)...): conditional",
        }
        for prefix in sorted(kinds, key=len, reverse=True):
            if ext.startswith(prefix):
                return kinds[prefix]
        if len(ext) > 1 and (ext[1] in "aiLmsux-"):
            return f"(?{ext[1]}...): inline flags"
        return f"({ext}...)"

    def char_class(self) -> ir.Node:
        start = self.i
        self.i += 1
        negate = self.peek() == "^"
        if negate:
            self.i += 1
        ranges: _Ranges = []
        first = True
        while True:
            if self.i >= len(self.p):
                raise self.error("unterminated character set", start)
            if self.peek() == "]" and not first:
                self.i += 1
                break
            first = False
            item_start = self.i
            kind, value = self.class_item()
            if self.peek() == "-" and self.peek(1) not in ("]", ""):
                self.i += 1
                hi_kind, hi = self.class_item()
                if kind != "char" or hi_kind != "char":
                    raise self.error("bad character range", item_start)
                if value > hi:
                    raise self.error(f"bad character range {chr(value)}-{chr(hi)}", item_start)
                ranges.append((value, hi))
            elif kind == "char":
                ranges.append((value, value))
            else:
                ranges.extend(value)
        return ir.codepoint_ranges(ir.complement(ranges) if negate else ranges)

    def class_item(self) -> tuple[str, object]:
        if self.peek() == "\\":
            return self.escape(in_class=True)
        self.i += 1
        return "char", ord(self.p[self.i - 1])

    def escape(self, in_class: bool) -> tuple[str, object]:
        """An escape at ``self.i``: ``("char", code point)`` or ``("set", ranges)``."""
        start = self.i
        c = self.peek(1)
        if not c:
            raise self.error("bad escape (end of pattern)", start)
        self.i += 2
        if c in _CLASS_ESCAPES:
            return "set", _CLASS_ESCAPES[c]
        if c in _SIMPLE_ESCAPES:
            return "char", _SIMPLE_ESCAPES[c]
        if c == "b" and in_class:
            return "char", 8
        if c in "xuU":
            width = {"x": 2, "u": 4, "U": 8}[c]
            digits = self.p[self.i : self.i + width]
            if len(digits) != width or not all(d in "0123456789abcdefABCDEF" for d in digits):
                raise self.error(f"bad escape \\{c}{digits}", start)
            self.i += width
            code = int(digits, 16)
            if code > ir.MAX_CODEPOINT:
                raise self.error(f"bad escape \\{c}{digits}", start)
            return "char", code
        if c == "N":
            end = self.p.find("}", self.i)
            if self.peek() != "{" or end < 0:
                raise self.error("missing {NAME} after \\N", start)
            name = self.p[self.i + 1 : end]
            try:
                code = ord(unicodedata.lookup(name))
            except KeyError:
                raise self.error(f"undefined character name {name!r}", start) from None
            self.i = end + 1
            return "char", code
        if c in "01234567":
            return self.octal(c, in_class, start)
        if c.isascii() and c.isalnum():
            if c in "89":
                what = "a backreference" if not in_class else "a bad escape"
            else:
                what = {
                    "b": "a word boundary",
                    "B": "a word boundary",
                    "A": "an anchor",
                    "Z": "an anchor",
                }.get(c, "a bad escape")
            raise self.error(f"\\{c} ({what}) is not supported", start)
        return "char", ord(c)

    def octal(self, first: str, in_class: bool, start: int) -> tuple[str, object]:
        digits = first
        while len(digits) < 3 and self.peek() in tuple("01234567"):
            digits += self.peek()
            self.i += 1
        # outside a class, \1..\7 with fewer than three digits is a backreference (as in re)
        if first != "0" and not in_class and len(digits) < 3:
            raise self.error(f"\\{digits} (a backreference) is not supported", start)
        code = int(digits, 8)
        if code > 0o377:
            raise self.error(f"octal escape value \\{digits} outside of range 0-0o377", start)
        return "char", code
