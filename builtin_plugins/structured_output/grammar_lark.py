"""Lark grammars (a subset of the Lark parsing toolkit's syntax), translated to GBNF.

vLLM's ``structured_outputs.grammar`` takes GBNF/EBNF and, with some backends, Lark syntax;
like vLLM, a grammar is taken as Lark when no line has ``::=`` outside strings and comments
and some line defines a rule with ``name:`` (:func:`is_lark`). :func:`lark_to_gbnf` translates it to
GBNF text, which grammar_parser.py parses to the same rules, and so the same IR, as the
GBNF grammar written by hand. The translation keeps each definition on the Lark grammar's
line, so the GBNF parser's messages name the user's lines.

What is accepted:

- rules ``name: expansions`` and terminals ``NAME: expansions`` (both become rules; the
  ``?`` and ``!`` rule modifiers and ``-> alias`` only shape Lark's parse tree, so they are
  dropped); a definition runs until the next line that starts a definition or directive;
  the start rule is ``start``;
- strings ``"..."`` (GBNF's escapes), character ranges ``"a".."z"``, regex terminals
  ``/.../`` without flags (literal characters, ``\\xHH \\uHHHH \\UHHHHHHHH`` escapes,
  ``[...]`` classes, ``.`` (not a newline), ``\\d \\w \\s`` (ASCII only, unlike Python's
  ``re``) and their negations outside classes, ``(...)``, ``(?:...)``, ``|``, and
  ``* + ? {m} {m,} {m,n}``, a lazy ``?`` being the same language);
- grouping ``( )``, optional ``[ ]``, alternation ``|``, ``* + ?``, ``x ~ n`` and
  ``x ~ m..n``; ``//`` comments.

Refused with a ``ValueError`` naming the line: ``%ignore`` (it lets the ignored text
appear between any two terminals; write it into the rules), ``%import``, ``%declare`` and
other directives, templates ``name{...}``, priorities ``NAME.2``, case-insensitive
strings ``"..."i`` and regex flags, lookarounds and anchors in regexes, ranges of
strings longer than one character, and a rule named ``root`` (GBNF's start rule, which
``start`` becomes).
"""

from __future__ import annotations

import re

__all__ = ["is_lark", "lark_to_gbnf"]

#: a line that defines a rule or terminal: ``name:``, ``?name:``, ``!name:``, ``NAME.2:``
_DEFINITION = re.compile(r"\s*([?!]?)([A-Za-z_][A-Za-z0-9_]*)(\.-?\d+)?\s*:(?!:)")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_COMMENT = re.compile(r"(//|#).*$")
#: a double-quoted string (a GBNF rule's ``::=`` is never in one: it follows the rule's name)
_STRING = re.compile(r'"(?:[^"\\\n]|\\.)*"')
#: the ``..`` of a range ``"a".."z"``, spaces allowed around it
_RANGE_DOTS = re.compile(r"[ \t]*\.\.[ \t]*")
#: regex class escapes outside ``[...]``, as GBNF classes
_REGEX_CLASSES = {
    "d": "[0-9]",
    "D": "[^0-9]",
    "w": "[a-zA-Z0-9_]",
    "W": "[^a-zA-Z0-9_]",
    "s": "[ \\t\\n\\r\\f\\v]",
    "S": "[^ \\t\\n\\r\\f\\v]",
}
#: the same inside ``[...]`` (no negations there)
_CLASS_RANGES = {"d": "0-9", "w": "a-zA-Z0-9_", "s": " \\t\\n\\r\\f\\v"}
#: regex escapes of control characters GBNF writes the same way
_CONTROL_ESCAPES = set("nrtfv0")
#: regex escapes of a code point by its hexadecimal digits (as many as each needs), which
#: GBNF writes the same way
_HEX_ESCAPE = re.compile(r"\\(?:x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8})")


def is_lark(text: str) -> bool:
    """Whether the grammar ``text`` looks like Lark: no ``::=`` on any line outside
    strings and comments, and some line that defines a rule or terminal with ``name:``."""
    lines = [_COMMENT.sub("", _STRING.sub('""', line)) for line in text.splitlines()]
    if any("::=" in line for line in lines):
        return False
    return any(_DEFINITION.match(line) for line in lines)


def lark_to_gbnf(text: str) -> str:
    """The GBNF grammar of the Lark grammar ``text`` (see the module docstring); a
    ``ValueError`` naming the line for what is not supported."""
    definitions: list[tuple[str, int, list[str]]] = []  # (name, line, body lines)
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith(("//", "#")):
            if definitions:  # (kept, so that the body's lines keep their numbers)
                definitions[-1][2].append(line)
            continue
        stripped = line.strip()
        if stripped.startswith("%"):
            directive = stripped.split()[0]
            hint = (
                ": it lets ignored text appear between any two terminals; write it into "
                "the rules instead"
                if directive == "%ignore"
                else ""
            )
            raise ValueError(f"Lark grammar line {number}: {directive} is not supported{hint}")
        match = _DEFINITION.match(line)
        if match is not None:
            name = match.group(2)
            if match.group(3):
                raise ValueError(
                    f"Lark grammar line {number}: priorities ({name}{match.group(3)}) are "
                    "not supported"
                )
            if name == "root":
                raise ValueError(
                    f"Lark grammar line {number}: a rule named 'root' is not supported (the "
                    "start rule is 'start')"
                )
            definitions.append((name, number, [line[match.end() :]]))
        else:
            if not definitions:
                raise ValueError(f"Lark grammar line {number}: expected a rule 'name: ...'")
            definitions[-1][2].append(line)
    if not any(name == "start" for name, _, _ in definitions):
        raise ValueError("the Lark grammar has no 'start' rule (its start rule)")
    # each definition on its own line, so that the GBNF parser's messages name the
    # user's lines (their columns are the translation's)
    gbnf = ""
    for name, line, chunks in definitions:
        gbnf += "\n" * (line - 1 - gbnf.count("\n"))  # (at least one: the rule before ends)
        gbnf += f"{_gbnf_name(name)} ::= {_Body(name, line, chunks).translate()}"
    return gbnf


def _gbnf_name(name: str) -> str:
    return "root" if name == "start" else name


class _Body:
    """The translation of one definition's expansions (its ``chunks``: the rest of its
    first line, then its continuation lines)."""

    def __init__(self, name: str, line: int, chunks: list[str]) -> None:
        self.name = name
        self.line = line
        self.text = "\n".join(chunks)
        self.pos = 0

    def error(self, message: str) -> ValueError:
        line = self.line + self.text.count("\n", 0, self.pos)
        return ValueError(f"Lark grammar line {line} (rule {self.name!r}): {message}")

    def translate(self) -> str:
        out: list[str] = []
        closers: list[str] = []  # what each open '(' or '[' closes with
        text = self.text
        while self.pos < len(text):
            char = text[self.pos]
            if char == "\n":  # (kept: the translation keeps the Lark grammar's lines)
                out.append(char)
                self.pos += 1
            elif char.isspace():
                self.pos += 1
            elif text.startswith("//", self.pos) or char == "#":
                end = text.find("\n", self.pos)
                self.pos = len(text) if end < 0 else end
            elif char == '"':
                out.append(self.string())
            elif char == "/":
                out.append(self.regex())
            elif char in "([":
                out.append("(")
                closers.append(")" if char == "(" else "]")
                self.pos += 1
            elif char in ")]":
                if not closers or closers[-1] != char:
                    raise self.error(f"unbalanced {char!r}")
                closers.pop()
                out.append(")" if char == ")" else ")?")
                self.pos += 1
            elif char in "|*+?":
                out.append(char)
                self.pos += 1
            elif char == "~":
                self.pos += 1
                out.append(self.bounds())
            elif text.startswith("->", self.pos):
                self.pos += 2
                while self.pos < len(text) and text[self.pos] in " \t":
                    self.pos += 1
                alias = _NAME.match(text, self.pos)
                if alias is None:
                    raise self.error("expected a name after '->'")
                self.pos = alias.end()  # (an alias only names a parse-tree node)
            else:
                name = _NAME.match(text, self.pos)
                if name is None:
                    raise self.error(f"unexpected {char!r}")
                self.pos = name.end()
                if text.startswith("{", self.pos):
                    raise self.error("templates (name{...}) are not supported")
                if name.group() == "root":
                    raise self.error("a rule named 'root' is not supported")
                out.append(_gbnf_name(name.group()))
        if closers:
            raise self.error(f"a bracket is never closed (expected {closers[-1]!r})")
        return re.sub(r" *\n *", "\n", " ".join(out))

    def string(self) -> str:
        """A ``"..."`` string (kept as GBNF writes it), or a range ``"a".."z"``."""
        start = self.pos
        literal = self._quoted()
        if self.text.startswith("i", self.pos) and not _NAME.match(self.text, self.pos + 1):
            raise self.error('case-insensitive strings ("..."i) are not supported')
        dots = _RANGE_DOTS.match(self.text, self.pos)
        if dots is not None:  # (Lark allows spaces around '..')
            self.pos = dots.end()
            if not self.text.startswith('"', self.pos):
                raise self.error("expected a string after '..'")
            high = self._quoted()
            if not (_one_char(literal) and _one_char(high)):
                raise self.error(f"a range {literal}..{high} needs one character each side")
            return f"[{_class_char(literal)}-{_class_char(high)}]"
        return self.text[start : self.pos]

    def _quoted(self) -> str:
        """The ``"..."`` at ``pos``, as written (escapes kept)."""
        end = self.pos + 1
        while end < len(self.text) and self.text[end] != '"':
            end += 2 if self.text[end] == "\\" else 1
        if end >= len(self.text):
            raise self.error("unterminated string")
        literal = self.text[self.pos : end + 1]
        self.pos = end + 1
        return literal

    def bounds(self) -> str:
        """``~ n`` or ``~ m..n`` as GBNF's ``{n}`` / ``{m,n}``."""
        match = re.compile(r"\s*(\d+)(?:\s*\.\.\s*(\d+))?").match(self.text, self.pos)
        if match is None:
            raise self.error("expected a number after '~'")
        self.pos = match.end()
        low, high = match.groups()
        return f"{{{low}}}" if high is None else f"{{{low},{high}}}"

    def regex(self) -> str:
        """A ``/.../`` terminal as a GBNF group."""
        out: list[str] = ["("]
        pos = self.pos + 1
        text = self.text
        while True:
            if pos >= len(text) or text[pos] == "\n":
                raise self.error("unterminated regex /.../")
            char = text[pos]
            if char == "/":
                pos += 1
                break
            if char == "\\":
                escaped = text[pos + 1 : pos + 2]
                hex_escape = _HEX_ESCAPE.match(text, pos)
                pos += 2
                if hex_escape is not None:
                    out.append(f'"{hex_escape.group()}"')
                    pos = hex_escape.end()
                elif escaped in _REGEX_CLASSES:
                    out.append(_REGEX_CLASSES[escaped])
                elif escaped in _CONTROL_ESCAPES:
                    out.append(f'"\\{escaped}"')
                elif escaped and not escaped.isalnum():
                    out.append(_quote(escaped))
                else:
                    raise self.error(f"regex escape \\{escaped} is not supported")
            elif char == "[":
                pos = self._regex_class(pos, out)
            elif char == "(":
                if text.startswith("(?:", pos):
                    pos += 3
                elif text.startswith("(?", pos):
                    raise self.error("regex groups (?...) other than (?:...) are not supported")
                else:
                    pos += 1
                out.append("(")
            elif char in ")|*+?":
                out.append(char)
                pos += 1
            elif char == "{":
                end = text.find("}", pos)
                if end < 0 or not re.fullmatch(r"\d+(,\d*)?|,\d+", text[pos + 1 : end]):
                    raise self.error("bad regex repetition {...}")
                out.append(text[pos : end + 1])
                pos = end + 1
            elif char == ".":
                out.append("[^\\n]")
                pos += 1
            elif char in "^$":
                raise self.error("regex anchors (^ $) are not supported")
            else:
                out.append(_quote(char))
                pos += 1
        if _NAME.match(text, pos):
            raise self.error("regex flags (/.../flags) are not supported")
        self.pos = pos
        out.append(")")
        return " ".join(out)

    def _regex_class(self, pos: int, out: list[str]) -> int:
        """Translate the regex class ``[...]`` at ``pos`` into ``out``; returns its end."""
        text = self.text
        parts = ["["]
        pos += 1
        if text.startswith("^", pos):
            parts.append("^")
            pos += 1
        first = True
        while True:
            if pos >= len(text) or text[pos] == "\n":
                raise self.error("a regex class [... is never closed")
            char = text[pos]
            if char == "]" and not first:
                pos += 1
                break
            first = False
            if char == "\\":
                escaped = text[pos + 1 : pos + 2]
                hex_escape = _HEX_ESCAPE.match(text, pos)
                pos += 2
                if hex_escape is not None:
                    parts.append(hex_escape.group())
                    pos = hex_escape.end()
                elif escaped in _CLASS_RANGES:
                    parts.append(_CLASS_RANGES[escaped])
                elif escaped in _CONTROL_ESCAPES or (
                    escaped
                    and escaped.isascii()
                    and escaped.isprintable()
                    and not escaped.isalnum()
                ):
                    parts.append(f"\\{escaped}")
                elif escaped and not escaped.isalnum():  # (a non-ASCII character: itself)
                    parts.append(escaped)
                else:
                    raise self.error(f"regex escape \\{escaped} in a class is not supported")
            elif char in '[]\\"':
                parts.append(f"\\{char}")
                pos += 1
            else:
                parts.append(char)
                pos += 1
        out.append("".join(parts) + "]")
        return pos


def _quote(char: str) -> str:
    """``char`` as a GBNF string."""
    return '"\\\\"' if char == "\\" else ('"\\""' if char == '"' else f'"{char}"')


def _one_char(literal: str) -> bool:
    """Whether the string ``literal`` (``"a"``, escapes kept) is one character."""
    inner = literal[1:-1]
    return len(inner) == 1 or bool(
        inner.startswith("\\") and (len(inner) == 2 or _HEX_ESCAPE.fullmatch(inner))
    )


def _class_char(literal: str) -> str:
    """The one character of the string ``literal`` (``"a"``, escapes kept) for a class."""
    inner = literal[1:-1]
    if inner in ("]", "[", "^", "-"):
        return f"\\{inner}"
    return inner
