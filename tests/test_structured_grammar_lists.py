"""Separated lists in grammars (grammar_lists.py): ``item (sep item)*`` and its kin are built
with one copy of the item, accept and refuse what the grammar as written does, keep its
nesting count, and grow the automaton linearly with nested lists."""

from __future__ import annotations

import itertools
import random

import pytest
from ir_matcher import ir_sample
from test_structured_grammar import JSON_GBNF

from chassis.builtin_plugins.structured_output import grammar as grammar_module
from chassis.builtin_plugins.structured_output import ir
from chassis.builtin_plugins.structured_output.automaton import Automaton
from chassis.builtin_plugins.structured_output.grammar import grammar_to_ir
from chassis.builtin_plugins.structured_output.grammar_lark import lark_to_gbnf
from chassis.builtin_plugins.structured_output.grammar_lists import separated_lists
from chassis.builtin_plugins.structured_output.grammar_parser import (
    Literal,
    RuleRef,
    SeparatedRepetition,
    parse_grammar,
)


def lists_of(text: str) -> list[SeparatedRepetition]:
    """The separated repetitions the rewrite makes of the GBNF ``text``'s rules."""
    found = []
    stack = [rule.body for rule in separated_lists(parse_grammar(text)).values()]
    while stack:
        expr = stack.pop()
        if isinstance(expr, SeparatedRepetition):
            found.append(expr)
        stack.extend(grammar_module.children(expr))
    return found


# -- what is recognised ----------------------------------------------------------------------


def test_the_shapes_are_recognised_whatever_the_rules_are_called() -> None:
    [listed] = lists_of('root ::= "[" elem (sep elem)* "]"\nelem ::= "e"\nsep ::= ";"')
    assert listed == SeparatedRepetition(
        (RuleRef("elem", 1, 14),), (RuleRef("sep", 1, 20),), 1, None
    )
    # the longest item that matches: json.gbnf's members are `string ":" ws value`
    members = [x for x in lists_of(JSON_GBNF) if len(x.item) == 4]
    assert [x.separator for x in members] == [(Literal(","), RuleRef("ws", 8, 10))]
    assert len(lists_of(JSON_GBNF)) == 2  # (its arrays' values and its objects' members)
    # + ? {m,n}, a group as the item, no separator at all
    [plus] = lists_of('root ::= ("a" | "b") ("," ("a" | "b"))+')
    assert (plus.min, plus.max, plus.separator) == (2, None, (Literal(","),))
    [bounded] = lists_of('root ::= x ("," x){0,3}\nx ::= "x"')
    assert (bounded.min, bounded.max) == (1, 4)
    [bare] = lists_of('root ::= "x" "x"*')
    assert (bare.min, bare.max, bare.separator) == (1, None, ())
    # a Lark list, [item ("," item)*], as the translation writes it
    [lark] = lists_of(lark_to_gbnf('start: "[" [item ("," item)*] "]"\nitem: "i"'))
    assert [ref.name for ref in lark.item] == ["item"]  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "text",
    [
        'root ::= x ("," y)*\nx ::= "x"\ny ::= "x"',  # two rules that happen to agree
        'root ::= x ("," x "!")*\nx ::= "x"',  # the item does not end the group
        'root ::= x "," (x)*\nx ::= "x"',  # nothing before the group is the item
        'root ::= "a" ("," "a"*)*',
    ],
)
def test_other_shapes_are_left_as_written(text: str) -> None:
    assert lists_of(text) == []
    assert separated_lists(parse_grammar(text)) == parse_grammar(text)


# -- the same language as written -----------------------------------------------------------

NAMES = ["elem", "Value_2", "x-y", "thing", "member", "a1"]
SEPARATORS = ['","', '", "', "sep", "", '";" ws', '(ws | "|")']
LIST_FORMS = [
    "{x} ({s} {x})*",
    "{x} ({s} {x})+",
    "{x} ({s} {x})?",
    "{x} ({s} {x}){{0,2}}",
    "{x} ({s} {x}){{1,}}",
    "({x} ({s} {x})*)?",
    '"[" ({x} ({s} {x})*)? "]"',
    '"<" {x} ({s} {x})* ">"',
]


def random_item(rng: random.Random, depth: int, refs: list[str]) -> str:
    """A random GBNF expression: literals, classes, references, groups, nested lists."""
    kinds = ["literal", "class"] + ["ref"] * bool(refs) + ["seq", "alt", "list"] * (depth > 0)
    kind = rng.choice(kinds)
    if kind == "literal":
        return rng.choice(['"a"', '"bc"', '"é"', '""'])
    if kind == "class":
        return rng.choice(["[a-c]", "[0-9]", "[^,;<>\\[\\]]"])
    if kind == "ref":
        return rng.choice(refs)
    if kind == "seq":
        return f"{random_item(rng, depth - 1, refs)} {random_item(rng, depth - 1, refs)}"
    if kind == "alt":
        return f"({random_item(rng, depth - 1, refs)} | {random_item(rng, depth - 1, refs)})"
    return f"({random_list(rng, depth - 1, refs)})"


def random_list(rng: random.Random, depth: int, refs: list[str]) -> str:
    item = random_item(rng, depth, refs)
    return rng.choice(LIST_FORMS).format(x=item, s=rng.choice(SEPARATORS))


def random_grammar(rng: random.Random) -> str:
    """A root list over rules with random names, one of them recursive (``"(" ... ")"``)
    some of the time, nested lists inside."""
    names = rng.sample(NAMES, 3)
    recursive = rng.random() < 0.5
    inner = f'"(" {names[0]} ")" | ' if recursive else ""
    return "\n".join(
        [
            f"root ::= {random_list(rng, 2, names[:2])}",
            f"{names[0]} ::= {inner}{random_list(rng, 1, names[1:2])}",
            f"{names[1]} ::= {random_item(rng, 1, [])}",
            f'{names[2]} ::= "unused"',
            'sep ::= "," " "?',
            'ws ::= | " "',
        ]
    )


PIECES = [b"a", b"bc", "é".encode(), b"0", b",", b", ", b";", b" ", b"[", b"]", b"<", b">"]
PIECES += [b"(", b")", b"|"]


def compare(grammar: str, rng: random.Random, samples: int) -> tuple[int, int]:
    """Check that the grammar built with separated lists and as written accept the same
    texts: samples of both IRs, each with a byte cut out and a comma put in, and random
    texts. Returns (accepted, refused)."""
    old_ir, new_ir = grammar_to_ir(grammar, lists=False), grammar_to_ir(grammar)
    old, new = Automaton.from_ir(old_ir), Automaton.from_ir(new_ir)
    texts = [b"".join(rng.choices(PIECES, k=rng.randint(0, 6))) for _ in range(samples)]
    for node in (old_ir, new_ir):
        for _ in range(samples):
            try:
                text = ir_sample(node, rng)
            except IndexError:  # (the sample met a part that matches nothing)
                continue
            cut = rng.randint(0, len(text))
            texts += [text, text[:cut] + text[cut + 1 :], text[:cut] + b"," + text[cut:]]
    counts = [0, 0]
    for text in texts:
        accepted = old.fullmatch(text)
        assert new.fullmatch(text) == accepted, (grammar, text)
        counts[not accepted] += 1
    return counts[0], counts[1]


def test_random_grammars_with_lists_accept_what_they_did_as_written(monkeypatch) -> None:
    """Random grammars (lists of every form, nested, under random names, recursion
    unrolled 3 deep so both constructions fit the automaton at the same depth) accept and
    refuse the same texts with separated lists as compiled as written."""
    monkeypatch.setattr(grammar_module, "MAX_RECURSION_DEPTH", 3)
    rng = random.Random(3)
    accepted = refused = recognised = 0
    for _ in range(150):
        text = random_grammar(rng)
        recognised += bool(lists_of(text))
        a, r = compare(text, rng, 6)
        accepted, refused = accepted + a, refused + r
    assert recognised >= 140
    assert accepted > 1000 and refused > 1000, (accepted, refused)


def test_json_gbnf_accepts_what_it_did_as_written(monkeypatch) -> None:
    """llama.cpp's json.gbnf, at the depth the old construction fitted (4), accepts and
    refuses the same texts either way (objects and arrays nested 4 deep)."""
    monkeypatch.setattr(grammar_module, "MAX_RECURSION_DEPTH", 4)
    rng = random.Random(1)
    accepted, refused = compare(JSON_GBNF, rng, 200)
    assert accepted > 300 and refused > 300, (accepted, refused)
    nested = b"[" * 3 + b"1, 2" + b"]" * 3
    automaton = Automaton.from_ir(grammar_to_ir(JSON_GBNF))
    assert automaton.fullmatch(b'{"a": ' + nested + b"}")
    assert not automaton.fullmatch(b'{"a": [' + nested + b"]}")


# -- nesting and size ------------------------------------------------------------------------


def list_chain(levels: int) -> str:
    """``levels`` rules of lists nested in lists, each level's rule named differently."""
    rules = [f"root ::= level0\nlevel{levels} ::= [0-9]+"]
    for k in range(levels):
        rules.append(f'level{k} ::= "[" (level{k + 1} ("," " "? level{k + 1})*)? "]"')
    return "\n".join(rules)


def test_a_grammar_is_refused_as_too_deep_exactly_when_it_was_as_written() -> None:
    """The rewrite keeps a grammar's nesting count: chains of lists in lists near the limit
    (32 levels) are accepted or refused either way alike."""
    outcomes = []
    for levels in range(6, 14):
        results = []
        for lists in (False, True):
            try:
                grammar_to_ir(list_chain(levels), lists=lists)
                results.append("accepted")
            except ValueError as exc:
                results.append(str(exc))
        assert results[0] == results[1], levels
        outcomes.append(results[0] == "accepted")
    assert True in outcomes and False in outcomes  # (the range crosses the limit)


def test_nested_lists_grow_linearly_not_as_two_to_the_depth() -> None:
    """Each level of a chain of lists adds the same number of NFA states with separated
    lists; written out, each level about doubled them (the item was copied twice)."""
    new = [Automaton.from_ir(grammar_to_ir(list_chain(d))).nfa_size for d in range(1, 9)]
    old = [
        Automaton.from_ir(grammar_to_ir(list_chain(d), lists=False)).nfa_size for d in range(1, 9)
    ]
    assert len({b - a for a, b in itertools.pairwise(new)}) == 1, new
    assert all(b > 1.9 * a for a, b in itertools.pairwise(old)), old


def test_json_gbnf_s_recursion_grows_by_two_per_level_not_four(monkeypatch) -> None:
    """json.gbnf's value is an array or an object of values: each level of its recursion
    holds two values of the level below, so it still doubles, but with one copy per list
    instead of two (it quadrupled), and it now unrolls 6 levels (the nesting limit) instead
    of 4 (the size limit)."""
    sizes: dict[bool, list[int]] = {False: [], True: []}
    for depth in range(1, 5):
        monkeypatch.setattr(grammar_module, "MAX_RECURSION_DEPTH", depth)
        for lists in (False, True):
            node = grammar_to_ir(JSON_GBNF, lists=lists)
            sizes[lists].append(Automaton.from_ir(node).nfa_size)
    assert all(3.5 * a < b < 4.5 * a for a, b in itertools.pairwise(sizes[False][1:])), sizes
    assert all(1.8 * a < b < 2.6 * a for a, b in itertools.pairwise(sizes[True][1:])), sizes
    monkeypatch.undo()
    nested = b"[" * 5 + b"1" + b"]" * 5  # (6 levels with the object around it)
    automaton = Automaton.from_ir(grammar_to_ir(JSON_GBNF))
    assert automaton.fullmatch(b'{"a": ' + nested + b"}")
    assert not automaton.fullmatch(b'{"a": [' + nested + b"]}")


def test_an_optional_list_is_a_list_from_zero_items() -> None:
    """``(item ("," item)*)?`` compiles to one separated repetition from 0 items."""
    node = grammar_to_ir('root ::= (x ("," x)*)?\nx ::= "x"')
    assert node == ir.Repeat(ir.Bytes(b"x"), 0, None, ir.Bytes(b","))
    node = grammar_to_ir('root ::= (x ("," x)+)?\nx ::= "x"')  # (2 items or none: kept)
    assert isinstance(node, ir.Repeat) and node.item != ir.Bytes(b"x")


def test_a_rule_that_never_finishes_is_still_found_inside_a_list() -> None:
    with pytest.raises(ValueError, match="matches no text"):
        grammar_to_ir('root ::= loop ("," loop)*\nloop ::= "a" loop')
    # a separator that never finishes matters only from two items on
    automaton = Automaton.from_ir(grammar_to_ir('root ::= "x" (bad "x")*\nbad ::= "b" bad'))
    assert automaton.fullmatch(b"x") and not automaton.fullmatch(b"xbx")


# -- lists by recursion ----------------------------------------------------------------------

RECURSIVE_LISTS = [
    'root ::= "[" things "]"\nthings ::= num ("," " "? things)?\nnum ::= [0-9]+',
    'root ::= "[" things "]"\nthings ::= num | num "," " "? things\nnum ::= [0-9]+',
    'root ::= "[" things "]"\nthings ::= num "," " "? things | num\nnum ::= [0-9]+',
    'root ::= "[" things "]"\nthings ::= things "," " "? num | num\nnum ::= [0-9]+',
]


@pytest.mark.parametrize("grammar", RECURSIVE_LISTS, ids=["optional", "tail", "tail2", "left"])
def test_a_list_by_recursion_is_a_loop_without_the_unrolling_bound(grammar: str) -> None:
    """``x ("," list)?``, ``x | x "," list`` (either order) and ``list "," x | x`` are read
    as ``x ("," x)*``: as written they stopped at MAX_RECURSION_DEPTH items (recursion is
    unrolled); now any number passes, and up to that bound both accept and refuse alike."""
    [listed] = lists_of(grammar)
    assert (listed.min, listed.max) == (1, None)
    new = Automaton.from_ir(grammar_to_ir(grammar))
    old = Automaton.from_ir(grammar_to_ir(grammar, lists=False))
    rng = random.Random(2)
    compared = 0
    for count in range(1, grammar_module.MAX_RECURSION_DEPTH + 1):
        for _ in range(20):
            items = [str(rng.randint(0, 99)) for _ in range(count)]
            text = "[" + "".join(f"{item}{rng.choice([',', ', '])}" for item in items)[:-1]
            for candidate in (text + "]", text + ",]", text + ", ]", text, text + "]]"):
                assert new.fullmatch(candidate.encode()) == old.fullmatch(candidate.encode())
                compared += 1
    assert compared > 500
    long = "[" + ", ".join(str(k) for k in range(200)) + "]"
    assert new.fullmatch(long.encode()) and not old.fullmatch(long.encode())
    assert not new.fullmatch(long[:-1].encode() + b",]")


def test_recursion_that_is_not_a_plain_list_stays_recursion() -> None:
    """A rule whose item or separator references the rule itself is not a list: it is
    unrolled as before (and a list by recursion with an empty item is a plain loop)."""
    for text in ['root ::= "(" root ")" root | ""', 'root ::= "a" root "b" | ""']:
        assert lists_of(text) == []
        assert grammar_to_ir(text) == grammar_to_ir(text, lists=False)
    loop = Automaton.from_ir(grammar_to_ir('root ::= "<" many ">"\nmany ::= | "ab" many'))
    assert loop.fullmatch(b"<" + b"ab" * 40 + b">") and not loop.fullmatch(b"<aba>")
