"""Re-writing one JSON value as it streams in, in the form ``json.dumps(value,
ensure_ascii=False)`` writes it, so that a call's arguments can be sent piece by piece.

Tool parsers send arguments as canonical JSON: the text a client gets is valid, compact,
strict JSON whatever liberties the model took (raw newlines in strings, odd whitespace,
``\\u`` escapes of plain characters). Re-writing token by token gives the same text as
decoding the whole value and dumping it (what the parsers do for calls they report whole), for
every value without a repeated key (a repeated key is kept twice here; ``json.loads`` keeps the
last value). Where the two could not agree on a value streamed before the problem shows, the
value is *malformed* here: ``NaN``, infinities, numbers too large for a float, nesting deeper
than :data:`MAX_DEPTH`. A lone UTF-16 surrogate escape (which no client could decode) becomes
U+FFFD.
"""

from __future__ import annotations

import enum
import json
import math
import re

#: deeper values are malformed (Python's own decoder gives up near 1000 levels)
MAX_DEPTH = 500

_WHITESPACE = " \t\n\r"
#: a run of string characters that are written as they are
_PLAIN = re.compile(r'[^"\\\x00-\x1f]+')
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_LITERALS = {"t": "true", "f": "false", "n": "null"}
#: escapes written as they are read (``\/`` is written ``/``, as ``json.dumps`` does)
_SHORT_ESCAPES = {
    '"': '\\"',
    "\\": "\\\\",
    "/": "/",
    "b": "\\b",
    "f": "\\f",
    "n": "\\n",
    "r": "\\r",
    "t": "\\t",
}
#: what may follow a high surrogate's escape, cut short, when it is a low surrogate's escape
_LOW_SURROGATE_START = re.compile(r"(?:\\(?:u(?:[dD](?:[c-fC-F][0-9a-fA-F]{0,2})?)?)?)?")
_HEX4 = re.compile(r"[0-9a-fA-F]{4}")


def _escaped(char: str) -> str:
    """``char`` as ``json.dumps(..., ensure_ascii=False)`` writes it inside a string."""
    if char == '"':
        return '\\"'
    if char == "\\":
        return "\\\\"
    if ord(char) < 0x20:
        return {"\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(
            char, f"\\u{ord(char):04x}"
        )
    return char


class _State(enum.Enum):
    VALUE = "value"
    VALUE_OR_END = "value-or-end"  # right after "["
    KEY_OR_END = "key-or-end"  # right after "{"
    KEY = "key"  # after "," in an object
    COLON = "colon"
    COMMA_OR_END = "comma-or-end"
    STRING = "string"
    DONE = "done"
    FAILED = "failed"


class JsonRewriter:
    """Reads one JSON value from text fed in pieces (:meth:`feed`) and returns its canonical
    text as far as it is known; the concatenated output does not depend on the pieces.

    ``top_object`` (default) requires the value to be an object. :meth:`object_rest` makes a
    rewriter for the rest of an object whose earlier members were read elsewhere. Once the
    value is complete :attr:`done` is true, once the text cannot be JSON :attr:`failed` is;
    either way :attr:`rest` is the text not consumed (after the value, or from the first
    character that is not JSON), as written, and later feeds only add to it.
    """

    def __init__(self, top_object: bool = True) -> None:
        self._state = _State.VALUE
        self._stack: list[str] = []  # "{" or "[" per open container
        self._in_key = False
        self._top_object = top_object
        self._held = ""  # text not consumed yet
        #: what follows the value, or the malformed text from its first bad character
        self.rest = ""

    @classmethod
    def object_rest(cls) -> JsonRewriter:
        """A rewriter for what follows a member of an object: more members, then ``}``."""
        rewriter = cls(top_object=False)
        rewriter._stack = ["{"]
        rewriter._state = _State.COMMA_OR_END
        return rewriter

    @property
    def done(self) -> bool:
        """The value is complete."""
        return self._state is _State.DONE

    @property
    def failed(self) -> bool:
        """The text is not (the start of) a JSON value of the expected kind."""
        return self._state is _State.FAILED

    def pending(self) -> str:
        """The text read but not yet rewritten (a number, literal or escape waiting for its
        end), as written: what a parser flushes when generation ends mid-value."""
        return self._held

    def feed(self, text: str) -> str:
        """Read ``text``, the next piece; return the canonical text it completes."""
        if self._state in (_State.DONE, _State.FAILED):
            self.rest += text
            return ""
        held = self._held + text
        out: list[str] = []
        pos = self._run(held, out)
        if self._state in (_State.DONE, _State.FAILED):
            self.rest, self._held = held[pos:], ""
        else:
            self._held = held[pos:]
        return "".join(out)

    # -- the state machine ----------------------------------------------------------------

    def _run(self, text: str, out: list[str]) -> int:
        """Consume ``text`` from 0 as far as it can be decided; the position reached."""
        pos, size = 0, len(text)
        while pos < size and self._state not in (_State.DONE, _State.FAILED):
            state = self._state
            if state is _State.STRING:
                new_pos = self._string(text, pos, out)
                if new_pos is None:
                    break
                pos = new_pos
                continue
            char = text[pos]
            if char in _WHITESPACE:
                pos += 1
                continue
            if state in (_State.VALUE, _State.VALUE_OR_END):
                if state is _State.VALUE_OR_END and char == "]":
                    pos = self._close(pos, out)
                    continue
                new_pos = self._value(text, pos, out)
                if new_pos is None:
                    break
                pos = new_pos
            elif state in (_State.KEY_OR_END, _State.KEY):
                if char == '"':
                    out.append('"')
                    self._in_key = True
                    self._state = _State.STRING
                    pos += 1
                elif char == "}" and state is _State.KEY_OR_END:
                    pos = self._close(pos, out)
                else:
                    self._state = _State.FAILED
            elif state is _State.COLON:
                if char == ":":
                    out.append(": ")
                    self._state = _State.VALUE
                    pos += 1
                else:
                    self._state = _State.FAILED
            else:  # COMMA_OR_END
                top = self._stack[-1]
                if char == ",":
                    out.append(", ")
                    self._state = _State.KEY if top == "{" else _State.VALUE
                    pos += 1
                elif char == ("}" if top == "{" else "]"):
                    pos = self._close(pos, out)
                else:
                    self._state = _State.FAILED
        return pos

    def _after_value(self) -> None:
        self._state = _State.COMMA_OR_END if self._stack else _State.DONE

    def _close(self, pos: int, out: list[str]) -> int:
        out.append("}" if self._stack.pop() == "{" else "]")
        self._after_value()
        return pos + 1

    def _value(self, text: str, pos: int, out: list[str]) -> int | None:
        """Start (or read whole) the value at ``pos``; ``None`` when more text is needed."""
        char = text[pos]
        if self._top_object and not self._stack and char != "{":
            self._state = _State.FAILED
            return pos
        if char in "{[":
            if len(self._stack) >= MAX_DEPTH:
                self._state = _State.FAILED
                return pos
            self._stack.append(char)
            out.append(char)
            self._state = _State.KEY_OR_END if char == "{" else _State.VALUE_OR_END
            return pos + 1
        if char == '"':
            out.append('"')
            self._in_key = False
            self._state = _State.STRING
            return pos + 1
        if char in _LITERALS:
            literal = _LITERALS[char]
            got = text[pos : pos + len(literal)]
            if got == literal:
                out.append(literal)
                self._after_value()
                return pos + len(literal)
            if literal.startswith(got):
                return None  # cut short so far
            self._state = _State.FAILED
            return pos
        if char == "-" or char.isdigit():
            end = pos
            while end < len(text) and text[end] in _NUMBER_CHARS:
                end += 1
            if end == len(text):
                return None  # the number may go on
            number = _canonical_number(text[pos:end])
            if number is None:
                self._state = _State.FAILED
                return pos
            out.append(number)
            self._after_value()
            return end
        self._state = _State.FAILED  # NaN, Infinity, or not JSON at all
        return pos

    def _string(self, text: str, pos: int, out: list[str]) -> int | None:
        """Read string characters from ``pos``; ``None`` when an escape is cut short."""
        plain = _PLAIN.match(text, pos)
        if plain:
            out.append(plain.group())
            return plain.end()
        char = text[pos]
        if char == '"':
            out.append('"')
            if self._in_key:
                self._state = _State.COLON
            else:
                self._after_value()
            return pos + 1
        if char != "\\":
            out.append(_escaped(char))  # a raw control character (lenient decoding)
            return pos + 1
        if pos + 1 >= len(text):
            return None
        kind = text[pos + 1]
        if kind in _SHORT_ESCAPES:
            out.append(_SHORT_ESCAPES[kind])
            return pos + 2
        if kind != "u":
            self._state = _State.FAILED
            return pos
        digits = text[pos + 2 : pos + 6]
        if len(digits) < 4:
            return None
        if not _HEX4.fullmatch(digits):
            self._state = _State.FAILED
            return pos
        code = int(digits, 16)
        if 0xD800 <= code < 0xDC00:  # a high surrogate: one character with the next escape
            after = text[pos + 6 : pos + 12]
            low = int(after[2:], 16) if len(after) == 6 and _is_low_escape(after) else None
            if low is None and len(after) < 6 and _LOW_SURROGATE_START.fullmatch(after):
                return None  # the low half may be coming
            if low is not None:
                out.append(chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)))
                return pos + 12
            out.append("\ufffd")
            return pos + 6
        out.append("\ufffd" if 0xDC00 <= code < 0xE000 else _escaped(chr(code)))
        return pos + 6


def _is_low_escape(text: str) -> bool:
    """``text`` (six characters) is the escape of a low surrogate, ``\\uDC00``-``\\uDFFF``."""
    return (
        text[:2] == "\\u"
        and bool(_HEX4.fullmatch(text[2:]))
        and 0xDC00 <= int(text[2:], 16) < 0xE000
    )


def _canonical_number(text: str) -> str | None:
    """The JSON number ``text`` as ``json.dumps`` writes its value, or ``None`` when it is not
    a number or has no finite JSON value."""
    if not _NUMBER.fullmatch(text):
        return None
    try:
        value = json.loads(text)
        if isinstance(value, float) and not math.isfinite(value):
            return None
        return json.dumps(value)
    except ValueError:  # an integer too long to convert
        return None
