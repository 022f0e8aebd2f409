"""GBNF (llama.cpp / xgrammar EBNF) text parsed into rules of expression trees.

What is accepted (a superset of llama.cpp's GBNF):

- rules ``name ::= alternatives``; names are letters, digits, ``_`` and ``-``; a rule runs
  until the next ``name ::=`` or the end of the text, so it may span lines, and an
  alternative may start a line with ``|``; every rule is defined once;
- string literals in double (or single) quotes, with the escapes ``\\n \\r \\t \\b \\f \\v \\a
  \\e \\0``, ``\\xHH``, ``\\uHHHH``, ``\\UHHHHHHHH`` (code points, not raw bytes) and a backslash
  before any other ASCII punctuation (that character itself, e.g. ``\\" \\\\ \\[``);
- character classes ``[a-z_]`` and ``[^...]`` (of code points, with the same escapes), and
  ``.`` for any character (newline included, as llama.cpp);
- grouping ``( ... )`` (newlines allowed inside), alternation ``|``, the empty alternative,
  and the postfix operators ``* + ?`` and ``{m}`` ``{m,}`` ``{m,n}`` ``{,n}``;
- ``#`` comments to the end of the line.

Inside a rule, groups and repetitions nest at most
:data:`~chassis.core.structured_nesting.MAX_NESTING_DEPTH` deep: each group ``( )`` and each
repetition is one level, a repeated group one in all (``("," item)*`` is one level, ``x*?``
two; :func:`nesting_cost`).

Not accepted, with a ``ValueError`` naming the line and column: anything else, such as
Lark's ``rule: ...`` syntax, regex terminals ``/.../``, ``%import`` (a grammar without
``::=`` is read as Lark by grammar_lark.py before it gets here), and xgrammar's
lookahead assertions ``(= ...)``; references to undefined rules; a grammar without a
``root`` rule (the start rule).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from chassis.core.structured_nesting import MAX_NESTING_DEPTH, nested_too_deeply

__all__ = [
    "MAX_REPEAT",
    "AnyChar",
    "CharClass",
    "Choice",
    "Expr",
    "Literal",
    "Repetition",
    "Rule",
    "RuleRef",
    "SeparatedRepetition",
    "Sequence",
    "nesting_cost",
    "parse_grammar",
]

#: the largest bound of ``{m,n}`` (each repetition is a copy in the automaton)
MAX_REPEAT = 1000
#: the start rule
ROOT = "root"


@dataclass(frozen=True)
class Literal:
    """Exactly this text."""

    text: str


@dataclass(frozen=True)
class CharClass:
    """One character in the inclusive code-point ``ranges`` (outside them if ``negated``)."""

    ranges: tuple[tuple[int, int], ...]
    negated: bool = False


@dataclass(frozen=True)
class AnyChar:
    """Any one character."""


@dataclass(frozen=True)
class RuleRef:
    """The rule ``name``, referenced at ``line``:``column`` (1-based)."""

    name: str
    line: int
    column: int


@dataclass(frozen=True)
class Sequence:
    """Each item in turn (none: the empty text)."""

    items: tuple[Expr, ...]


@dataclass(frozen=True)
class Choice:
    """Any one of the options."""

    options: tuple[Expr, ...]


@dataclass(frozen=True)
class Repetition:
    """``item`` from ``min`` to ``max`` times (``None``: unbounded)."""

    item: Expr
    min: int
    max: int | None


@dataclass(frozen=True)
class SeparatedRepetition:
    """The items of ``item`` in turn, from ``min`` (at least 1) to ``max`` times (``None``:
    unbounded), the items of ``separator`` between each two: ``item (separator item)*`` and
    its kin. Never written by the parser: :mod:`.grammar_lists` recognises those shapes in
    a rule's sequences and rewrites them to this, so the automaton builds ``item`` once.

    Toward the nesting limit it is a repetition (one level), its ``separator`` and ``item``
    items inside it as inside a sequence: so its height is that of the shape it replaces
    (whose deepest copy of ``item`` was inside the repeated group).
    """

    item: tuple[Expr, ...]
    separator: tuple[Expr, ...]
    min: int
    max: int | None


Expr = (
    Literal | CharClass | AnyChar | RuleRef | Sequence | Choice | Repetition | SeparatedRepetition
)


@dataclass(frozen=True)
class Rule:
    """``name ::= body``, defined at ``line`` (1-based)."""

    name: str
    body: Expr
    line: int


def parse_grammar(text: str) -> dict[str, Rule]:
    """The rules of the GBNF ``text``, by name, in the order defined. ``ValueError`` naming
    the line and column for a syntax error, a rule defined twice or an undefined reference,
    and for a grammar without a ``root`` rule."""
    if not isinstance(text, str):
        raise ValueError(f"a grammar must be a string, not {type(text).__name__}")
    rules = _Parser(text).grammar()
    if ROOT not in rules:
        raise ValueError(
            f"the grammar has no {ROOT!r} rule: it is where the output starts "
            f"(write `{ROOT} ::= ...`)"
        )
    for rule in rules.values():
        for ref in _references(rule.body):
            if ref.name not in rules:
                raise ValueError(
                    f"grammar line {ref.line}, column {ref.column}: rule {ref.name!r} is not "
                    "defined"
                )
    return rules


def nesting_cost(parent: Expr | None, child: Expr) -> int:
    """The nesting levels (0 or 1) ``child`` adds inside ``parent`` (``None``: ``child`` is
    a rule's body): a repetition is a level, and so is a group, except a repeated one
    (``("," item)*`` is one level). The parser writes a group as the expression inside it,
    so a group is an alternation or sequence inside a sequence, or an alternation inside
    an alternation; a sequence inside an alternation is one of its options, no group. A
    :class:`SeparatedRepetition` is a repetition, and its items count as a sequence's."""
    if isinstance(child, Repetition | SeparatedRepetition):
        return 1
    if parent is None or not isinstance(child, Sequence | Choice):
        return 0
    if isinstance(parent, Sequence | SeparatedRepetition):  # (its items as a sequence's)
        return 1
    return int(isinstance(parent, Choice) and isinstance(child, Choice))


def _nesting(body: Expr) -> int:
    """How many levels (:func:`nesting_cost`) a rule's ``body`` nests, without recursion."""
    deepest = 0
    stack: list[tuple[Expr | None, Expr, int]] = [(None, body, 0)]
    while stack:
        parent, expr, level = stack.pop()
        level += nesting_cost(parent, expr)
        deepest = max(deepest, level)
        stack.extend((expr, child, level) for child in children(expr))
    return deepest


def children(expr: Expr) -> tuple[Expr, ...]:
    """The expressions directly inside ``expr``."""
    if isinstance(expr, Sequence):
        return expr.items
    if isinstance(expr, Choice):
        return expr.options
    if isinstance(expr, Repetition):
        return (expr.item,)
    if isinstance(expr, SeparatedRepetition):
        return (*expr.separator, *expr.item)
    return ()


def _references(expr: Expr) -> list[RuleRef]:
    if isinstance(expr, RuleRef):
        return [expr]
    return [ref for child in children(expr) for ref in _references(child)]


_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
_SIMPLE_ESCAPES = {
    "n": "\n",
    "r": "\r",
    "t": "\t",
    "b": "\b",
    "f": "\f",
    "v": "\v",
    "a": "\a",
    "e": "\x1b",
    "0": "\0",
}
_HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}


class _Parser:
    """Recursive descent over the text; positions are offsets, reported as line/column."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0
        #: the groups open around the expression being parsed
        self.level = 0
        # the offset of every newline: every rule reference records its line and column,
        # so finding them must not rescan the text (quadratic in a long grammar)
        self.newlines = [at for at, char in enumerate(text) if char == "\n"]

    # -- errors and positions -------------------------------------------------------------

    def where(self, pos: int | None = None) -> tuple[int, int]:
        pos = self.pos if pos is None else pos
        line = bisect.bisect_left(self.newlines, pos)  # newlines before pos
        column = pos - (self.newlines[line - 1] + 1 if line else 0) + 1
        return line + 1, column

    def error(self, message: str, pos: int | None = None) -> ValueError:
        line, column = self.where(pos)
        return ValueError(f"grammar line {line}, column {column}: {message}")

    def found(self) -> str:
        return repr(self.text[self.pos]) if self.pos < len(self.text) else "the end"

    # -- lexical helpers ------------------------------------------------------------------

    def skip_space(self) -> None:
        """Whitespace (newlines included) and ``#`` comments."""
        text = self.text
        while self.pos < len(text):
            char = text[self.pos]
            if char == "#":
                end = text.find("\n", self.pos)
                self.pos = len(text) if end < 0 else end
            elif char.isspace():
                self.pos += 1
            else:
                break

    def peek(self, literal: str) -> bool:
        return self.text.startswith(literal, self.pos)

    def name(self) -> str:
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos] in _NAME_CHARS:
            self.pos += 1
        return self.text[start : self.pos]

    def at_rule_start(self) -> bool:
        """Whether a ``name ::=`` starts here (the end of the rule before it)."""
        saved = self.pos
        try:
            if not self.name():
                return False
            self.skip_space()
            return self.peek("::=")
        finally:
            self.pos = saved

    # -- grammar --------------------------------------------------------------------------

    def grammar(self) -> dict[str, Rule]:
        rules: dict[str, Rule] = {}
        self.skip_space()
        while self.pos < len(self.text):
            start = self.pos
            name = self.name()
            if not name:
                raise self.error(f"expected a rule name, found {self.found()}")
            line, _ = self.where(start)
            self.skip_space()
            if not self.peek("::="):
                if self.peek(":"):
                    raise self.error(
                        "rules are defined with '::=' (GBNF), not ':' (Lark syntax is read "
                        "only in a grammar without '::=')"
                    )
                raise self.error(f"expected '::=' after the rule name {name!r}")
            self.pos += 3
            if name in rules:
                raise self.error(
                    f"rule {name!r} is defined twice (first on line {rules[name].line})", start
                )
            body = self.alternatives(None)
            if _nesting(body) > MAX_NESTING_DEPTH:
                raise nested_too_deeply(
                    f"grammar rule {name!r} (line {line}): groups and repetitions are"
                )
            rules[name] = Rule(name, body, line)
        return rules

    def alternatives(self, group: int | None) -> Expr:
        """Alternatives at the top of a rule (``group`` None) or inside the parenthesis at
        offset ``group``."""
        options = [self.sequence(group)]
        while self.peek("|"):
            self.pos += 1
            options.append(self.sequence(group))
        return options[0] if len(options) == 1 else Choice(tuple(options))

    def sequence(self, group: int | None) -> Expr:
        """Items up to ``|``, ``)`` (when nested), the next rule or the end."""
        items: list[Expr] = []
        while True:
            self.skip_space()
            if self.pos >= len(self.text) or self.peek("|"):
                break
            if self.peek(")"):
                if group is None:
                    raise self.error("unbalanced ')'")
                break
            if self.at_rule_start():
                if group is not None:
                    raise self.error("this '(' is not closed before the next rule", group)
                break
            items.append(self.postfix(self.atom()))
        if group is not None and self.pos >= len(self.text):
            raise self.error("this '(' is never closed (missing ')')", group)
        return items[0] if len(items) == 1 else Sequence(tuple(items))

    def atom(self) -> Expr:
        char = self.text[self.pos]
        if char in "\"'":
            return self.string(char)
        if char == "[":
            return self.char_class()
        if char == ".":
            self.pos += 1
            return AnyChar()
        if char == "(":
            start = self.pos
            self.pos += 1
            self.skip_space()
            if self.peek("="):
                raise self.error("lookahead assertions '(= ...)' are not supported", start)
            self.enter(start)
            inner = self.alternatives(start)  # (stops only at its ')', or raises)
            self.level -= 1
            self.pos += 1
            return inner
        if char in _NAME_CHARS:
            line, column = self.where()
            return RuleRef(self.name(), line, column)
        if char == "/":
            raise self.error("regex terminals '/.../' are not supported; use a character class")
        if char == "%":
            raise self.error("directives such as %import are not supported")
        raise self.error(f"unexpected {char!r}")

    def enter(self, pos: int) -> None:
        """One more group, opened at ``pos`` (the parser recurses into groups only: so its
        depth stays within the limit), or the refusal."""
        if self.level >= MAX_NESTING_DEPTH:
            line, column = self.where(pos)
            raise nested_too_deeply(f"grammar line {line}, column {column}: groups are")
        self.level += 1

    def postfix(self, expr: Expr) -> Expr:
        while True:
            self.skip_space()
            if self.pos >= len(self.text):
                break
            char = self.text[self.pos]
            if char in "*+?":
                self.pos += 1
                low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[char]
            elif char == "{":
                low, high = self.bounds()
            else:
                break
            expr = Repetition(expr, low, high)
        return expr

    def bounds(self) -> tuple[int, int | None]:
        start = self.pos
        end = self.text.find("}", start)
        if end < 0:
            raise self.error("missing '}' after a repetition count", start)
        body = self.text[start + 1 : end].replace(" ", "")
        low_text, comma, high_text = body.partition(",")
        try:
            low = int(low_text) if low_text else 0
            high = (int(high_text) if high_text else None) if comma else low
        except ValueError:
            raise self.error(
                f"a repetition is {{m}}, {{m,}}, {{m,n}} or {{,n}}; got {{{body}}}", start
            ) from None
        if not (low_text or comma) or low < 0 or (high is not None and high < low):
            raise self.error(f"bad repetition bounds {{{body}}}", start)
        if max(low, high or 0) > MAX_REPEAT:
            raise self.error(f"repetition bounds are at most {MAX_REPEAT}; got {{{body}}}", start)
        self.pos = end + 1
        return low, high

    def string(self, quote: str) -> Literal:
        start = self.pos
        self.pos += 1
        chars: list[str] = []
        while True:
            if self.pos >= len(self.text) or self.text[self.pos] == "\n":
                raise self.error("unterminated string literal", start)
            char = self.text[self.pos]
            if char == quote:
                self.pos += 1
                return Literal("".join(chars))
            chars.append(self.char())

    def char(self) -> str:
        """One character of a literal or class, escapes decoded."""
        char = self.text[self.pos]
        if char != "\\":
            self.pos += 1
            return char
        start = self.pos
        if self.pos + 1 >= len(self.text):
            raise self.error("a backslash at the end of the grammar", start)
        kind = self.text[self.pos + 1]
        self.pos += 2
        if kind in _SIMPLE_ESCAPES:
            return _SIMPLE_ESCAPES[kind]
        if kind in _HEX_ESCAPES:
            digits = self.text[self.pos : self.pos + _HEX_ESCAPES[kind]]
            if len(digits) != _HEX_ESCAPES[kind] or any(
                d not in "0123456789abcdefABCDEF" for d in digits
            ):
                raise self.error(f"\\{kind} needs {_HEX_ESCAPES[kind]} hexadecimal digits", start)
            code = int(digits, 16)
            if code > 0x10FFFF or 0xD800 <= code <= 0xDFFF:
                raise self.error(f"\\{kind}{digits} is not a Unicode character", start)
            self.pos += len(digits)
            return chr(code)
        if kind.isascii() and not kind.isalnum() and kind.isprintable():
            return kind
        raise self.error(f"unknown escape \\{kind}", start)

    def char_class(self) -> CharClass:
        start = self.pos
        self.pos += 1
        negated = self.peek("^")
        if negated:
            self.pos += 1
        ranges: list[tuple[int, int]] = []
        while True:
            if self.pos >= len(self.text):
                raise self.error("missing ']' after a character class", start)
            if self.peek("]"):
                self.pos += 1
                return CharClass(tuple(ranges), negated)
            low = ord(self.char())
            high = low
            if self.peek("-") and not self.text.startswith("]", self.pos + 1):
                self.pos += 1
                if self.pos >= len(self.text):
                    raise self.error("missing ']' after a character class", start)
                high = ord(self.char())
                if high < low:
                    raise self.error(
                        f"character range {chr(low)!r}-{chr(high)!r} is reversed", start
                    )
            ranges.append((low, high))
