"""regex_to_ir against Python's re.fullmatch (with re.ASCII, the documented meaning of \\d \\w
\\s), through both the test IR matcher and the byte automaton."""

from __future__ import annotations

import random
import re

import pytest
from ir_matcher import ir_fullmatch, ir_sample

from chassis.builtin_plugins.structured_output import ir
from chassis.builtin_plugins.structured_output.automaton import Automaton
from chassis.builtin_plugins.structured_output.regex import MAX_REPEAT, regex_to_ir

PATTERNS = [
    r"abc",
    r"a|b|",
    r"(ab)*c?",
    r"[a-c]+x{2,3}",
    r"[^a-c\d]{1,2}",
    r"-?\d+(\.\d+)?([eE][+-]?\d+)?",
    r"\w+@\w+\.com",
    r"\s*\S+",
    r".{2}",
    r".*\n",
    r"[\]\-^]+",
    r"[a-z-0]+",
    r"[-a]b[a-]",
    r"é+ñ?",
    r"[à-ÿ]+",
    r"[^à-ÿ]",
    r"\u00e9\x41\N{BULLET}\U0001F600",
    r"^(yes|no)$",
    r"\A(?:y|n)\Z",
    r"^^a$$|^b\Z",
    r"a{,2}b{3,}",
    r"a{}",
    r"a{x}",
    r"a{2,",
    r"(?P<n>a|bc)+?",
    r"(?:x|y)*?z",
    r"a??b*?c+?d{1,2}?",
    r"\0\012\101",
    r"[\1\12\b]",
    r"\.\*\\\{\}\(\)\[\]\|\?\+\$\^",
    r"[.]",
    r"a{0}b",
    r"(a*)*b",
    r"(|a)+",
    r"[\D]",
    r"[^\W]",
    r"\W",
    r"[\s\d]x",
    r"[^\s\d]",
    "(?#hi)a(?#x)+",
    r"[😀-😂]x",
    r"[\x00-\x1f\"]",
    r'"([^"\\]|\\.)*"',
    r"(0|[1-9][0-9]*)(,(0|[1-9][0-9]*)){0,3}",
    r"[\u0100-\uffff]+",
    r"((a|b)c|d)e?",
    r"\t\n\r\f\v\a",
]

# characters the random strings are made of: ASCII specials, Latin-1, multi-byte, emoji
ALPHABET = list("abcdexyz019.-^]\\ \n\t\r\x0b\x0c\x07\x00\x01\x08\x1f\"'{}()[]|?+*$@_E")
ALPHABET += ["é", "ñ", "à", "ÿ", "•", "Ā", "中", "😀", "😁", "😃", "com", "\x7f", "\u0080"]


def sample(node: ir.Node, rng: random.Random) -> bytes:
    """A random string that matches ``node``."""
    return ir_sample(node, rng, extra=3, up_to_bound=True)


def probes(pattern: str, node: ir.Node, rng: random.Random) -> list[str]:
    """Random strings, strings that match, and near misses of those."""
    chars = ALPHABET + [c for c in pattern if c not in ALPHABET]
    out = ["", "\n"]
    out += ["".join(rng.choice(chars) for _ in range(rng.randint(1, 6))) for _ in range(150)]
    for _ in range(60):
        text = sample(node, rng).decode("utf-8")
        out.append(text)
        if text:
            i = rng.randrange(len(text))
            out.append(text[:i] + text[i + 1 :])
            out.append(text[:i] + rng.choice(chars) + text[i:])
            out.append(text[:i] + rng.choice(chars) + text[i + 1 :])
    return out


@pytest.mark.parametrize("pattern", PATTERNS)
def test_matches_like_re_fullmatch(pattern: str) -> None:
    node = regex_to_ir(pattern)
    automaton = Automaton.from_ir(node)
    compiled = re.compile(pattern, re.ASCII)
    rng = random.Random(pattern)
    for text in probes(pattern, node, rng):
        expected = compiled.fullmatch(text) is not None
        assert automaton.fullmatch(text.encode()) == expected, (pattern, text)
        if len(text) <= 12:  # the backtracking test matcher is exponential
            assert ir_fullmatch(node, text) == expected, (pattern, text)


@pytest.mark.parametrize("pattern", [r"(a?){3}", r"(a|){2,3}b", r"(x*y?){2}"])
def test_repeated_nullable_groups(pattern: str) -> None:
    """Items that can match nothing, repeated a minimum number of times (automaton only)."""
    automaton = Automaton.from_ir(regex_to_ir(pattern))
    compiled = re.compile(pattern, re.ASCII)
    for n in range(6):
        for text in {"a" * n, "x" * n, "y" * n, "a" * n + "b", "xyxy"[:n]}:
            assert automaton.fullmatch(text.encode()) == (compiled.fullmatch(text) is not None)


def test_ascii_class_meanings() -> None:
    """\\d \\w \\s are ASCII; \\D \\W \\S and negated classes take every other character."""
    assert not ir_fullmatch(regex_to_ir(r"\d"), "٣")  # an Arabic-Indic digit
    assert ir_fullmatch(regex_to_ir(r"\D"), "٣")
    assert not ir_fullmatch(regex_to_ir(r"\w"), "é")
    assert ir_fullmatch(regex_to_ir(r"\W"), "é")
    assert ir_fullmatch(regex_to_ir(r"[^a]"), "\U0010ffff")
    assert not ir_fullmatch(regex_to_ir(r"."), "\n")


@pytest.mark.parametrize(
    ("pattern", "message"),
    [
        (r"(a)\1", "backreference"),
        (r"(?P<x>a)(?P=x)", "backreference"),
        (r"a(?=b)", "lookahead"),
        (r"a(?!b)", "negative lookahead"),
        (r"(?<=a)b", "lookbehind"),
        (r"(?<!a)b", "negative lookbehind"),
        (r"(?>a)", "atomic group"),
        (r"(a)?(?(1)b|c)", "conditional"),
        (r"(?i)a", "inline flags"),
        (r"(?s:a.)", "inline flags"),
        (r"a\bc", "word boundary"),
        (r"\Ba", "word boundary"),
        (r"a^b", "anchor ^"),
        (r"a$b", "anchor $"),
        (r"(^a)", "anchor ^"),
        (r"a*+", "possessive"),
        (r"a{1,2}+", "possessive"),
        (r"a**", "multiple repeat"),
        (r"a{2}{3}", "multiple repeat"),
        (r"*a", "nothing to repeat"),
        (r"a|?", "nothing to repeat"),
        (r"{2}", "nothing to repeat"),
        (r"a{5,2}", "min repeat greater than max repeat"),
        (f"a{{{MAX_REPEAT + 1}}}", "exceeds the limit"),
        (f"a{{0,{MAX_REPEAT + 1}}}", "exceeds the limit"),
        (r"(a", "missing )"),
        (r"a)", "unbalanced parenthesis"),
        (r"[a", "unterminated character set"),
        (r"[]", "unterminated character set"),
        (r"[z-a]", "bad character range"),
        (r"[\d-z]", "bad character range"),
        (r"\q", "bad escape"),
        (r"[\8]", "bad escape"),
        ("\\", "end of pattern"),
        (r"\x4", "bad escape"),
        (r"\N{NO SUCH CHARACTER NAME}", "undefined character name"),
        (r"\ud800", "surrogate"),
        (r"(?P<1>a)", "bad group name"),
        (r"(?#unterminated", "unterminated comment"),
        ("(" * 400 + ")" * 400, "nested too deeply"),
    ],
)
def test_unsupported_or_malformed(pattern: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        regex_to_ir(pattern)
    assert "position" in str(info.value) or "nested" in str(info.value)


def test_error_names_position() -> None:
    with pytest.raises(ValueError, match="at position 3"):
        regex_to_ir(r"abc(?=d)")


def test_large_bounds_are_refused_by_the_automaton() -> None:
    """Nested bounds multiply: the automaton refuses them before building anything."""
    with pytest.raises(ValueError, match="constraint too large"):
        Automaton.from_ir(regex_to_ir(r"(a{1000}){1000}"))
    automaton = Automaton.from_ir(regex_to_ir(r"[a-z]{1000}"))
    assert automaton.fullmatch(b"q" * 1000)
    assert not automaton.fullmatch(b"q" * 999)
