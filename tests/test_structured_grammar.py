"""Grammar constraints (GBNF) and vLLM's older ``structural_tag``: the parser, the language
the automaton accepts (against Python's ``re`` or a reference scanner), generation on a tiny
random model with the SmolLM2 tokenizer, and the API server's routes."""

from __future__ import annotations

import json
import random
import re

import pytest
from fastapi.testclient import TestClient

from chassis import LLM, SamplingParams
from chassis.builtin_plugins.structured_output.automaton import DEAD, Automaton
from chassis.builtin_plugins.structured_output.backend import constraint_automaton
from chassis.builtin_plugins.structured_output.grammar import (
    MAX_RECURSION_DEPTH,
    grammar_to_ir,
)
from chassis.builtin_plugins.structured_output.grammar_parser import (
    AnyChar,
    CharClass,
    Choice,
    Literal,
    Repetition,
    RuleRef,
    Sequence,
    parse_grammar,
)
from chassis.builtin_plugins.structured_output.grammar_structural_tag import (
    structural_tag_to_ir,
)
from chassis.core.async_llm import AsyncLLM
from chassis.core.config import EngineConfig
from chassis.core.structured_output import StructuredOutputsParams
from chassis.serve.app import build_app
from chassis.serve.settings import ServerSettings

#: llama.cpp's grammars/json.gbnf
JSON_GBNF = r"""
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws

object ::=
  "{" ws (
            string ":" ws value
    ("," ws string ":" ws value)*
  )? "}" ws

array  ::=
  "[" ws (
            value
    ("," ws value)*
  )? "]" ws

string ::=
  "\"" (
    [^"\\\x7F\x00-\x1F] |
    "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4}) # escapes
  )* "\"" ws

number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws

# Optional space: by convention, applied in this grammar after literal chars when allowed
ws ::= | " " | "\n" [ \t]{0,20}
"""

#: vLLM's documentation example
SQL_GBNF = """
    root ::= select_statement

    select_statement ::= "SELECT " column " from " table " where " condition

    column ::= "col_1 " | "col_2 "

    table ::= "table_1 " | "table_2 "

    condition ::= column "= " number

    number ::= "1 " | "2 "
"""

#: bounded output (recursion is unrolled), so a random model must reach the end
LIST_GBNF = r"""
root ::= "[" item ("," item){0,3} "]"
item ::= "1" | "22" | "(" item ")"   # nested at most MAX_RECURSION_DEPTH deep
"""


def automaton(grammar: str) -> Automaton:
    return constraint_automaton(StructuredOutputsParams(grammar=grammar))


def accepts(auto: Automaton, text: str) -> bool:
    return auto.fullmatch(text.encode("utf-8"))


# -- parser --------------------------------------------------------------------------------


def test_the_parser_builds_rules_of_expressions() -> None:
    rules = parse_grammar('root ::= "a" [b-d]* | (x "y"){2,3} . [^\\n]?\n  x ::= "\\x41"+')
    assert list(rules) == ["root", "x"]
    assert rules["root"].body == Choice(
        (
            Sequence((Literal("a"), Repetition(CharClass(((98, 100),)), 0, None))),
            Sequence(
                (
                    Repetition(Sequence((RuleRef("x", 1, 24), Literal("y"))), 2, 3),
                    AnyChar(),
                    Repetition(CharClass(((10, 10),), negated=True), 0, 1),
                )
            ),
        )
    )
    assert rules["x"].body == Repetition(Literal("A"), 1, None) and rules["x"].line == 2


def test_escapes_comments_and_multi_line_rules() -> None:
    rules = parse_grammar(
        'root ::= "\\x41\\u00e9\\U0001F600\\n\\t\\"\\\\\\[" # a comment\n'
        "  | 'single' # another\n"
        "  | [\\]\\-a-c\\u00e0-\\u00ff]{,2} x{3,}\n"
        "x ::= ( \n 'y' \n )\n"
    )
    options = rules["root"].body.options
    assert options[0] == Literal('Aé😀\n\t"\\[')
    assert options[1] == Literal("single")
    assert options[2] == Sequence(
        (
            Repetition(CharClass(((93, 93), (45, 45), (97, 99), (0xE0, 0xFF))), 0, 2),
            Repetition(RuleRef("x", 3, 32), 3, None),
        )
    )
    assert rules["x"].body == Literal("y")
    assert parse_grammar("root ::= | 'a'")["root"].body == Choice((Sequence(()), Literal("a")))


@pytest.mark.parametrize(
    "grammar,message",
    [
        ('root ::= "a"\nother ::= "b" missing', "line 2, column 15: rule 'missing' is not defined"),
        ('start ::= "a"', "no 'root' rule"),
        ('root ::= "abc', "line 1, column 10: unterminated string"),
        ("root ::= [a-", "line 1, column 10: missing ']'"),
        ('root ::= "a"{3,1}', "line 1, column 13: bad repetition bounds"),
        ('root ::= "a"{x}', "a repetition is"),
        ('root ::= "a"{2000}', "at most 1000"),
        ("root: 'a'", "not ':' (Lark syntax"),
        ('root ::= (= "a") "a"', "lookahead"),
        ('root ::= "a"\nroot ::= "b"', "line 2, column 1: rule 'root' is defined twice"),
        ('root ::= ("a" "b"', "line 1, column 10: this '(' is never closed"),
        ('root ::= ("a"\nx ::= "b"', "line 1, column 10: this '(' is not closed before"),
        ('root ::= "a")', "unbalanced ')'"),
        ('root ::= "\\q"', "unknown escape \\q"),
        ('root ::= "\\x4"', "\\x needs 2 hexadecimal digits"),
        ('root ::= "\\uD800"', "not a Unicode character"),
        ("root ::= [z-a]", "reversed"),
        ("root ::= /[a-z]+/", "regex terminals"),
        ('%import common.WS\nroot ::= "a"', "line 1, column 1: expected a rule name"),
        ('root ::= "a" @', "line 1, column 14: unexpected '@'"),
    ],
)
def test_syntax_errors_name_the_line_and_column(grammar: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_grammar(grammar)
    assert message in str(info.value)


# -- the language --------------------------------------------------------------------------

#: (grammar, the equivalent Python regex)
AS_REGEX = [
    ('root ::= "a" [b-d]* | ("x" "y"){2,3}', r"a[b-d]*|(xy){2,3}"),
    ('root ::= word (" " word)*\nword ::= [a-z]+', r"[a-z]+( [a-z]+)*"),
    ("root ::= [^a-c]? .", r"[^a-c]?[\s\S]"),
    ('root ::= "é"+ [à-ÿ] "😀"?', r"é+[à-ÿ]😀?"),
    ('root ::= ws\nws ::= | " " | "\\n" [ \\t]{0,3}', r"| |\n[ \t]{0,3}"),
    ('root ::= a b\na ::= "x"{2}\nb ::= "y"{1,}', r"x{2}y+"),
]
ALPHABET = ["a", "b", "c", "d", "x", "y", " ", "\n", "\t", "é", "ÿ", "😀", "z"]


@pytest.mark.parametrize("grammar,pattern", AS_REGEX)
def test_regular_grammars_accept_what_the_equivalent_regex_does(grammar, pattern) -> None:
    auto = automaton(grammar)
    rng = random.Random(0)
    samples = ["".join(rng.choices(ALPHABET, k=rng.randint(0, 6))) for _ in range(1500)]
    samples += [
        "abbd",
        "xyxy",
        "xyxyxy",
        "xyxyxyxy",
        "ab cd",
        "éé😀",
        "éÿ😀",
        "ééÿ",
        "é",
        " ",
        "\n \t\t",
        "xxy",
        "xxyyy",
    ]
    matched = 0
    for text in samples:
        expected = re.fullmatch(pattern, text) is not None
        assert accepts(auto, text) == expected, (grammar, text)
        matched += expected
    assert matched >= 2  # the samples exercise the accepting side too


def test_llama_cpp_json_grammar() -> None:
    auto = automaton(JSON_GBNF)
    for text in ["{}", '{"a": [1, 2.5e3, {"b": null}], "c": "\\u00e9\\n"} ', '{ "x" : true }']:
        assert accepts(auto, text), text
        json.loads(text)
    for text in ['{"a":}', "[1]", '{"a": 01}', '{"a" 1}', '{"a": "\x01"}']:
        assert not accepts(auto, text), text
    nested = '{"a": ' * 3 + "1" + "}" * 3
    assert accepts(auto, nested)


def test_vllm_documentation_grammar() -> None:
    auto = automaton(SQL_GBNF)
    assert accepts(auto, "SELECT col_1  from table_2  where col_2 = 1 ")
    assert not accepts(auto, "SELECT col_3  from table_2  where col_2 = 1 ")


def test_recursion_is_unrolled_to_a_bounded_depth() -> None:
    parens = automaton('root ::= "(" root ")" root | ""')
    for depth in range(MAX_RECURSION_DEPTH):
        assert accepts(parens, "(" * depth + ")" * depth + "()")
    assert not accepts(parens, "(" * MAX_RECURSION_DEPTH + ")" * MAX_RECURSION_DEPTH)
    assert not accepts(parens, "(()") and not accepts(parens, "())(")
    # left recursion too, and mutual recursion through several rules
    arithmetic = automaton(
        'root ::= expr\nexpr ::= expr "+" term | term\nterm ::= term "*" factor | factor\n'
        'factor ::= [0-9]+ | "(" expr ")"'
    )
    for text in ["1+2*3", "(1+2)*3", "((4))", "12*(3+(4*5))+6"]:
        assert accepts(arithmetic, text), text
    for text in ["1+", "(1", "1++2", "()", ""]:
        assert not accepts(arithmetic, text), text


def test_recursion_that_never_ends_is_refused() -> None:
    with pytest.raises(ValueError, match=r"recurses forever \(rules that can never finish: root\)"):
        grammar_to_ir('root ::= "a" root')
    with pytest.raises(ValueError, match=r"never finish: root, a"):
        grammar_to_ir('root ::= "x" a\na ::= "y" a | a "z"')
    # an alternative that cannot finish just drops out
    assert accepts(automaton('root ::= "ok" | loop\nloop ::= "x" loop'), "ok")


def test_grammars_too_large_are_refused_or_unrolled_less() -> None:
    with pytest.raises(ValueError, match="too large to enforce"):
        grammar_to_ir("root ::= ([a-z]{1000}){1000}")
    # a recursion that grows fast is unrolled less deeply, so it still fits
    wide = automaton('root ::= t\nt ::= "[" (t | "x") (t | "x") (t | "x") (t | "x") "]"')

    def nested(depth: int) -> str:
        return "[" * depth + "xxxx" + "]xxx" * (depth - 1) + "]"

    assert accepts(wide, nested(1)) and accepts(wide, nested(3))
    assert not accepts(wide, nested(MAX_RECURSION_DEPTH))  # allowed if unrolled fully


@pytest.mark.timeout(120)  # a hang guard, not a speed figure (each case took 3-20 s before)
def test_big_or_tangled_grammars_compile() -> None:
    """A grammar is request input, compiled with the GIL held: huge rule bodies, long rule
    chains and tangled recursion compile (or are refused) instead of running away; their cost
    used to grow quadratically with size and exponentially with recursion."""
    many_refs = "root ::= " + "\n".join(["a"] * 200_000) + '\na ::= "x"\n'
    assert parse_grammar(many_refs)["root"].body.items[-1] == RuleRef("a", 200_000, 1)
    chain = "root ::= r0\n" + "\n".join(f"r{i} ::= r{i + 1}" for i in range(6000))
    with pytest.raises(ValueError, match=r"nested too deeply \(limit \d+\)"):
        grammar_to_ir(chain + '\nr6000 ::= "a"')
    tangled = 'root ::= (b a)*\na ::= root c\nc ::= ("b"* "c"?)* | "b"* root "c"?\nb ::= a root | b'
    assert grammar_to_ir(tangled) != grammar_to_ir('root ::= "a"')


# -- structural tags -----------------------------------------------------------------------

INT = {"type": "integer"}


def tag(structures, triggers) -> str:
    return json.dumps({"type": "structural_tag", "structures": structures, "triggers": triggers})


def test_structural_tag_semantics() -> None:
    point = {
        "type": "object",
        "properties": {"x": INT},
        "required": ["x"],
        "additionalProperties": False,
    }
    auto = Automaton.from_ir(
        structural_tag_to_ir(
            tag(
                [
                    {"begin": "<function=f>", "schema": point, "end": "</function>"},
                    {"begin": "<tool>", "schema": INT, "end": "</tool>"},
                ],
                ["<function=", "<tool>"],
            )
        )
    )
    good = [
        "",
        "free text, a < b, <fun, <toolx",
        'call <function=f>{"x": 1}</function> then <tool>7</tool><tool>-2</tool> done',
        '<<function=f>{"x":3}</function><',
    ]
    bad = [
        '<function=g>{"x": 1}</function>',  # no structure starts "<function=g"
        '<function=f>{"x": 1}',  # ends inside a structure
        '<function=f> {"x": 1}</function>',  # the JSON starts right after begin
        "<tool>x</tool>",  # not valid against the schema
        "text <function=",  # a trigger must go on as a structure
        "<tool>",
    ]
    for text in good:
        assert accepts(auto, text), text
    for text in bad:
        assert not accepts(auto, text), text


def reference_structural_tag(text: str, triggers: list[str], structures: list[str]) -> bool:
    """The documented semantics, scanned directly: free text until the first trigger, which
    must start one of ``structures`` (Python regexes, each matching uniquely), and so on."""
    pos = 0
    while True:
        starts = [i for i in (text.find(t, pos) for t in triggers) if i >= 0]
        if not starts:
            return True
        start = min(starts)
        for structure in structures:
            match = re.compile(structure).match(text, start)
            if match:
                pos = match.end()
                break
        else:
            return False


def test_structural_tag_matches_a_reference_scanner_on_random_text() -> None:
    triggers = ["<t", "[x"]
    spec = tag(
        [
            {"begin": "<t>", "schema": INT, "end": "</t>"},
            {"begin": "<tx>", "schema": INT, "end": "</t>"},
            {"begin": "[x]", "schema": {"enum": [1, 2]}, "end": ""},
        ],
        triggers,
    )
    structures = [r"<t>-?(0|[1-9][0-9]*)</t>", r"<tx>-?(0|[1-9][0-9]*)</t>", r"\[x\][12]"]
    auto = Automaton.from_ir(structural_tag_to_ir(spec))
    pieces = ["a", "<", "<t", "<t>", "<tx>", "1", "12", "0", "</t>", "x", ">", "-", "[", "[x]"]
    rng = random.Random(1)
    verdicts = set()
    for _ in range(3000):
        text = "".join(rng.choices(pieces, k=rng.randint(0, 7)))
        expected = reference_structural_tag(text, triggers, structures)
        assert accepts(auto, text) == expected, text
        verdicts.add((expected, "<t" in text))
    assert verdicts == {(True, True), (True, False), (False, True), (False, False)}


@pytest.mark.parametrize(
    "spec,message",
    [
        (tag([{"begin": "<a>", "schema": INT, "end": ""}], ["<b"]), "does not start with any"),
        (tag([{"begin": "<a>", "schema": INT}], ["<a", "<a>"]), "is a prefix of trigger"),
        (tag([{"begin": "<a>", "schema": INT}], ["<a<"]), "may not appear inside"),
        (tag([{"begin": "<a>", "end": ""}], ["<a"]), "needs a JSON schema"),
        (tag([{"begin": "<a>", "schema": {"not": {}}}], ["<a"]), "structures[0].schema"),
        (tag([], ["<a"]), "non-empty list"),
        (json.dumps({"type": "structural_tag", "format": {}}), "'format' shape"),
    ],
)
def test_bad_structural_tags_say_why(spec: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        structural_tag_to_ir(spec)
    assert message in str(info.value)


# -- generation and the server ---------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    engine = AsyncLLM.from_engine_config(
        EngineConfig(
            model=str(tiny_llama_dir), dtype="float32", max_model_len=256, num_kv_blocks=128
        )
    )
    yield engine
    engine.shutdown_sync()


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(build_app(engine, ServerSettings(shutdown_engine_on_exit=False))) as c:
        yield c


def test_offline_generation_follows_the_grammar(tiny_llama_dir) -> None:
    """A random-weight model follows nothing by itself: what it writes is the grammar's."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256, num_kv_blocks=64)
    try:
        auto = automaton(LIST_GBNF)
        for temperature in (0.0, 1.0):
            params = SamplingParams(
                structured_outputs={"grammar": LIST_GBNF},
                temperature=temperature,
                seed=5,
                max_tokens=120,
                n=3,
            )
            for output in llm.generate(["Hello", "1 2 3", "Write a list:"], params):
                for completion in output.outputs:
                    assert completion.finish_reason == "stop", completion.text
                    assert accepts(auto, completion.text), completion.text
        # a structural tag: the model is pushed to write "<" and "n", so it keeps reaching
        # the trigger "<n", and each time the constraint makes it finish the structure
        spec = {
            "structures": [{"begin": "<n>", "schema": {"enum": [1, 2, 3]}, "end": "</n>"}],
            "triggers": ["<n"],
        }
        tag_automaton = constraint_automaton(StructuredOutputsParams(structural_tag=spec))
        tokenizer = llm.get_tokenizer()
        bias = {token: 30.0 for token in tokenizer.convert_tokens_to_ids(["<", "n"])}
        params = SamplingParams(
            structured_outputs={"structural_tag": spec}, logit_bias=bias, seed=2, max_tokens=40
        )
        [output] = llm.generate(["Hello"], params)
        text = output.outputs[0].text
        assert tag_automaton.walk(tag_automaton.start, text.encode()) != DEAD, text
        assert re.search(r"<n>[123]</n>", text), text
        free = re.sub(r"<n>[123]</n>", "", text)
        if output.outputs[0].finish_reason == "length":  # possibly cut inside a structure
            free = re.sub(r"<n[^<]*(<(/(n>?)?)?)?$", "", free)
        assert "<n" not in free, text
        with pytest.raises(ValueError, match="rule 'nope' is not defined"):
            llm.generate(["x"], SamplingParams(structured_outputs={"grammar": "root ::= nope"}))
    finally:
        llm.shutdown()


def test_server_routes_take_grammars(client) -> None:
    auto = automaton(LIST_GBNF)
    completion = client.post(
        "/v1/completions",
        json={"prompt": "List:", "guided_grammar": LIST_GBNF, "max_tokens": 120, "seed": 1},
    )
    assert completion.status_code == 200, completion.text
    choice = completion.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and accepts(auto, choice["text"])
    chat = client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "A list, please."}],
            "structured_outputs": {"grammar": LIST_GBNF},
            "max_tokens": 120,
            "temperature": 0,
        },
    )
    assert chat.status_code == 200, chat.text
    assert accepts(auto, chat.json()["choices"][0]["message"]["content"])


def test_server_routes_take_structural_tags(client) -> None:
    spec = {
        "type": "structural_tag",
        "structures": [{"begin": "<n>", "schema": {"enum": [1, 2, 3]}, "end": "</n>"}],
        "triggers": ["<n"],
    }
    auto = constraint_automaton(StructuredOutputsParams(structural_tag=spec))
    pattern = re.compile(r"([^<]|<(?!n))*(<n>[123]</n>([^<]|<(?!n))*)*", re.S)
    for route, body in [
        ("/v1/completions", {"prompt": "Go"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Go"}]}),
    ]:
        response = client.post(
            route, json={**body, "response_format": spec, "max_tokens": 40, "seed": 3}
        )
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        text = choice["text"] if "text" in choice else choice["message"]["content"]
        if choice["finish_reason"] == "stop":
            assert pattern.fullmatch(text), text
        else:  # cut by max_tokens: still on the way to a match
            assert auto.walk(auto.start, text.encode()) != DEAD, text


@pytest.mark.parametrize(
    "fields,message",
    [
        (
            {"guided_grammar": 'root ::= "a"\nx ::= (b'},
            "grammar line 2, column 7: this '(' is never closed",
        ),
        ({"structured_outputs": {"grammar": "root ::= root"}}, "recurses forever"),
        ({"guided_grammar": 'start ::= "a"'}, "no 'root' rule"),
        (
            {"response_format": {"type": "structural_tag", "structures": [], "triggers": ["<"]}},
            "non-empty list",
        ),
    ],
)
def test_bad_grammars_are_400s_naming_the_parameter(client, fields, message) -> None:
    for route, body in [
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ]:
        response = client.post(route, json={**body, **fields, "max_tokens": 5})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert message in error["message"], error
        assert error["param"] == "structured_outputs"
