"""Lark grammars (builtin_plugins/structured_output/grammar_lark.py): detected, translated to
GBNF, and so accepting and refusing exactly what their GBNF twins do."""

from __future__ import annotations

import itertools
import random

import pytest

from chassis import LLM, SamplingParams
from chassis.builtin_plugins.structured_output.backend import constraint_automaton
from chassis.builtin_plugins.structured_output.grammar_lark import is_lark, lark_to_gbnf
from chassis.core.structured_output import StructuredOutputsParams

#: (Lark grammar, its GBNF twin written by hand, strings to try besides random ones)
TWINS = [
    (
        r"""
// a list of numbers and words
?start: "[" [item ("," item)*] "]"   -> list
item: NUMBER
    | WORD
    | "a".."c" ~ 2..3
NUMBER: /-?\d+(\.\d+)?/
WORD: /[a-z_]\w*/
""",
        r"""
root ::= "[" (item ("," item)*)? "]"
item ::= number | word | [a-c]{2,3}
number ::= "-"? [0-9]+ ("." [0-9]+)?
word ::= [a-z_] [a-zA-Z0-9_]*
""",
        ["[]", "[1,-2.5,abc_1,ab]", "[1,]", "[a]", "[Abc]", "[ab,bca,cccc]", "[-]", "[1.]"],
    ),
    (
        r"""
start: greeting (" " name)+ "!"?
greeting: "hi" | "hello"
name: /(?:[A-Z][a-z]{1,3}|x\/y)/
""",
        r"""
root ::= greeting (" " name)+ "!"?
greeting ::= "hi" | "hello"
name ::= [A-Z] [a-z]{1,3} | "x/y"
""",
        ["hi Bob", "hello Ann Eve!", "hi x/y!", "hi bob", "hi Bobby", "hi", "hello  Ann"],
    ),
    (
        r"""
start: pair ("\n" pair)*
pair: KEY "=" VALUE
KEY: /[^=\n\s]+/
VALUE: /"[^"]*"|\d+|.{0,2}/
""",
        r"""
root ::= pair ("\n" pair)*
pair ::= [^=\n \t\r\f\v]+ "=" ("\"" [^"]* "\"" | [0-9]+ | [^\n]{0,2})
""",
        ['a="b c"', "k=12\nv=x", "k=", "=1", 'a="\n"', "k=abc", "k=ab\nj=1"],
    ),
    (  # bounded: a random-weight model finishes it
        r"""
start: "[" [item ("," item) ~ 0..3] "]"
item: /-?\d{1,3}/ | "a".."c" ~ 2..3
""",
        r"""
root ::= "[" (item ("," item){0,3})? "]"
item ::= "-"? [0-9]{1,3} | [a-c]{2,3}
""",
        ["[]", "[1,-22,abc]", "[1,2,3,4]", "[1,2,3,4,5]", "[1234]", "[-]", "[a]"],
    ),
]


def automaton(grammar: str):
    return constraint_automaton(StructuredOutputsParams(grammar=grammar))


@pytest.mark.parametrize("lark,gbnf,tries", TWINS, ids=["list", "names", "pairs", "bounded"])
def test_a_lark_grammar_accepts_and_refuses_what_its_gbnf_twin_does(
    lark: str, gbnf: str, tries: list[str]
) -> None:
    assert is_lark(lark) and not is_lark(gbnf)
    from_lark, from_gbnf = automaton(lark), automaton(gbnf)
    alphabet = sorted({c for text in tries for c in text} | set("az09 .-"))
    rng = random.Random(3)
    randoms = ["".join(rng.choices(alphabet, k=rng.randint(0, 8))) for _ in range(3000)]
    short = ["".join(p) for n in range(4) for p in itertools.product("[]1a,b", repeat=n)]
    accepted = 0
    for text in [*tries, *randoms, *short]:
        expected = from_gbnf.fullmatch(text.encode())
        assert from_lark.fullmatch(text.encode()) == expected, text
        accepted += expected
    assert accepted >= 3  # (the tries include accepted texts)


def test_the_translation_is_gbnf() -> None:
    lark = '?start: "a" [b] -> x\nb: /[0-9]/ ~ 2'
    assert lark_to_gbnf(lark) == 'root ::= "a" ( b )?\nb ::= ( [0-9] ) {2}'


@pytest.mark.parametrize(
    "lark,message",
    [
        ('start: "a"\n%ignore " "', "line 2: %ignore is not supported"),
        ("%import common.WS\nstart: WS", "line 1: %import is not supported"),
        ('start: "a"i', "case-insensitive"),
        ("start: /a/i", "regex flags"),
        ("start: /^a/", "anchors"),
        ("start: /(?=a)a/", "(?:...)"),
        ('start: A\nA.2: "a"', "line 2: priorities"),
        ('start: sep{"a"}', "templates"),
        ('item: "a"', "no 'start' rule"),
        ('start: root\nroot: "a"', "'root' is not supported"),
        ('start: ("a"', "never closed"),
        ('start: "a"]', "unbalanced"),
        ("start: missing", "translated to GBNF: grammar line 1, column 10: rule 'missing'"),
    ],
)
def test_what_is_not_supported_is_refused_naming_the_line(lark: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        automaton(lark)
    assert message in str(info.value)


def test_gbnf_stays_gbnf() -> None:
    """``::=`` anywhere means GBNF, so a GBNF grammar with a ':' in a string is not Lark."""
    assert not is_lark('root ::= "a: b"\n# start: "x"')
    assert automaton('root ::= "a: b"').fullmatch(b"a: b")


def test_generation_follows_a_lark_grammar(tiny_llama_dir) -> None:
    """A random-weight model follows nothing by itself: what it writes is the grammar's,
    as its GBNF twin accepts it."""
    lark, gbnf, _ = TWINS[-1]
    twin = automaton(gbnf)
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256, num_kv_blocks=64)
    try:
        params = SamplingParams(
            structured_outputs={"grammar": lark}, temperature=1.0, seed=4, max_tokens=60, n=3
        )
        texts: list[str] = []
        for output in llm.generate(["Hello", "Write a list:"], params):
            for completion in output.outputs:
                assert completion.finish_reason == "stop", completion.text
                assert twin.fullmatch(completion.text.encode()), completion.text
                texts.append(completion.text)
        assert any("," in text for text in texts), texts  # (not only the shortest)
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    "lark,gbnf",
    [
        (r"start: /\x41+\u00e9?/", r'root ::= "A"+ "é"?'),
        (r"start: /[\x41-\x43\u00e0-\u00ff]+/", r"root ::= [A-Cà-ÿ]+"),
        (r"start: /\U0001F600|[\U0001F601-\U0001F602]/", r"root ::= [😀-😂]"),
        (r'start: "\u00e0".."\u00e2"', r"root ::= [à-â]"),
    ],
)
def test_regex_hex_and_unicode_escapes(lark: str, gbnf: str) -> None:
    """``\\xHH``, ``\\uHHHH`` and ``\\UHHHHHHHH`` in regex terminals, inside and outside
    classes, are the code points they name (as in Python's ``re``, which Lark uses)."""
    from_lark, from_gbnf = automaton(lark), automaton(gbnf)
    tries = ["A", "AAé", "é", "x41", "ABCàÿ", "D", "á", "ä", "😀", "😂", "😃", "\\x41", ""]
    for text in tries:
        assert from_lark.fullmatch(text.encode()) == from_gbnf.fullmatch(text.encode()), text
    assert any(from_lark.fullmatch(text.encode()) for text in tries)  # (not all refused)


def test_a_range_of_longer_strings_is_refused() -> None:
    with pytest.raises(ValueError, match=r'line 2 \(rule .item.\): a range "ab".."z" needs one'):
        automaton('start: item\nitem: "ab".."z"')


def test_messages_name_the_lark_line_past_comments_and_blank_lines() -> None:
    """Comment and blank lines inside and between definitions keep the line numbers, both
    in the translator's messages and in the GBNF parser's after the translation."""
    lark = '// header\n\nstart: a\n   // mid: x\n\n   | b\n\nb: "b"\n\n\na: "a" missing\n'
    with pytest.raises(ValueError, match=r"grammar line 11, column .*'missing'"):
        automaton(lark)
    with pytest.raises(ValueError, match=r"Lark grammar line 4 \(rule 'start'\): unbalanced"):
        automaton('start: "a"\n// c: d\n\n  | )')
    assert automaton('start: "a"\n// c: d\n\n  | "b"').fullmatch(b"b")


def test_a_range_may_have_spaces_around_its_dots() -> None:
    assert lark_to_gbnf('start: "a" .. "c"') == "root ::= [a-c]"


@pytest.mark.parametrize("repetition", ["{}", "{,}"])
def test_a_regex_repetition_without_bounds_is_named(repetition: str) -> None:
    """Refused by the translator, naming the Lark line (not a column of the translation)."""
    with pytest.raises(ValueError, match=r"^Lark grammar line 2 .*bad regex repetition"):
        automaton(f"start: A\nA: /a{repetition}/")


def test_a_lark_grammar_may_write_gbnf_s_arrow_in_a_string() -> None:
    """``::=`` inside a string is no GBNF rule (a GBNF rule's ``::=`` follows its name)."""
    lark = 'start: "a" b\nb: "::=" | "x\\"::="'
    assert is_lark(lark)
    assert automaton(lark).fullmatch(b"a::=") and automaton(lark).fullmatch(b'ax"::=')
    assert not is_lark('root ::= ["] "::="\n# start: x')


@pytest.mark.parametrize(
    "lark,message",
    [
        ('start: a\na: a "x"', "every way through rule 'start' recurses forever (rules that "),
        ('start: "a"\nstart: "b"', "line 2, column 1: rule 'start' is defined twice"),
    ],
)
def test_messages_call_the_start_rule_start(lark: str, message: str) -> None:
    """A Lark grammar has no rule 'root' (refused): messages name its start rule as written."""
    with pytest.raises(ValueError) as info:
        automaton(lark)
    assert message in str(info.value) and "root" not in str(info.value)
