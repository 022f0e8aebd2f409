"""The ``llama3_json``, ``mistral`` and ``pythonic`` tool-call parsers: what they find in
whole messages, that they stream content and calls as early as the contract allows, and that
the result never depends on how the message was cut into pieces."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from parser_splits import random_pieces, run_tool_parser

from chassis.builtin_plugins.parsers import chassis_register_tool_parsers
from chassis.builtin_plugins.parsers.llama3_json import Llama3JsonToolParser
from chassis.builtin_plugins.parsers.mistral import MistralToolParser
from chassis.builtin_plugins.parsers.pythonic import PythonicToolParser
from chassis.builtin_plugins.parsers.text_scan import (
    skip_space,
    starts_with_after_tag,
)
from chassis.plugins.registry import Registry
from chassis.serve.tool_parser import (
    ToolCall,
    ToolCallFragment,
    ToolDelta,
    ToolParser,
    join_fragments,
)

Calls = list[tuple[str, dict[str, Any] | str]]


def _result(delta: ToolDelta) -> tuple[str, Calls]:
    """``delta`` as (content, [(name, decoded arguments)]); arguments that are JSON must be
    an object; those that are not (a committed call the model then broke) stay text."""
    calls: Calls = []
    for call in delta.calls:
        try:
            arguments = json.loads(call.arguments)
        except (ValueError, RecursionError):
            calls.append((call.name, call.arguments))
            continue
        assert isinstance(arguments, dict)
        calls.append((call.name, arguments))
    return delta.content, calls


def _run(cls: type[ToolParser], pieces: list[str]) -> tuple[str, Calls]:
    """Feed ``pieces`` to a fresh parser, then finish it; everything it returned."""
    return _result(run_tool_parser(cls, pieces))


def _parse_every_way(cls: type[ToolParser], text: str) -> tuple[str, Calls]:
    """The result for ``text`` whole, after checking that :meth:`parse`, one-character pieces
    and many random cuts all give exactly the same."""
    whole = _run(cls, [text])
    assert _result(cls(None, []).parse(text)) == whole
    assert _run(cls, list(text)) == whole, "one-character pieces"
    rng = random.Random(f"{cls.__name__}:{text}")
    for _ in range(40):
        pieces = random_pieces(text, rng)
        assert _run(cls, pieces) == whole, f"pieces {pieces!r}"
    return whole


# (text, expected content, expected calls)
LLAMA3_CASES: list[tuple[str, str, Calls]] = [
    (
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        "",
        [("get_weather", {"city": "Paris"})],
    ),
    (
        '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}',
        "",
        [("a", {}), ("b", {"x": 1})],
    ),
    (
        ' \n<|python_tag|> {"name": "a", "parameters": {"n": [1, 2.5, null]}} ;\n'
        '{"name": "b", "parameters": {"ok": true}};',
        "",
        [("a", {"n": [1, 2.5, None]}), ("b", {"ok": True})],
    ),
    ('{"name": "s", "arguments": "{\\"x\\": [1, 2]}"}', "", [("s", {"x": [1, 2]})]),
    (
        '{"name": "translate", "parameters": {"text": "héllo → 世界 🌍"}}',
        "",
        [("translate", {"text": "héllo → 世界 🌍"})],
    ),
    ('{"name": "no_args"}', "", [("no_args", {})]),
    # content: not starting with "{"
    ("The weather in Paris is sunny.", "The weather in Paris is sunny.", []),
    ("  It costs {price}.", "  It costs {price}.", []),
    ("<|python_tag|>print('hi')", "<|python_tag|>print('hi')", []),
    ("", "", []),
    (" \n ", " \n ", []),
    ("<|python_ta", "<|python_ta", []),
    ("<|python_tag|>", "<|python_tag|>", []),
    # committed calls stay calls: what follows them that is not a call is content, as
    # written; arguments cut short or malformed keep what was written
    ('{"name": "a", "parameters": {}} and then some words', " and then some words", [("a", {})]),
    ('{"name": "a", "parameters": {"city": "Par', "", [("a", '{"city": "Par')]),
    ('{"name": "a", "parameters": {"x": tru}} ok', "", [("a", '{"x": tru}} ok')]),
    ('{"name": "a", "parameters": {}};; {"name": "b"}', ';; {"name": "b"}', [("a", {})]),
    ('{"name": "a", "parameters": {}} {"name": "b"}', ' {"name": "b"}', [("a", {})]),
    (
        '{"name": "a", "parameters": {}}; {"parameters": {}, "name": "b"}; {"name": "c"};',
        "",
        [("a", {}), ("b", {}), ("c", {})],
    ),
    # invalid: the whole text comes back as content, unchanged
    *(
        (text, text, [])
        for text in [
            '{"foo": 1}',
            '{"parameters": {}, "name": "a"} and then some words',
            '{"name": "a", "parameters": [1]}',
            '{"name": "a", "arguments": "not json"}',
            '<|python_tag|>{"name": "", "parameters": {}}',
            "{not json at all",
        ]
    ),
]

MISTRAL_CASES: list[tuple[str, str, Calls]] = [
    (
        'Let me check. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        "Let me check. ",
        [("get_weather", {"city": "Paris"})],
    ),
    (
        '[TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]',
        "",
        [("a", {"x": 1}), ("b", {})],
    ),
    ('[TOOL_CALLS]{"name": "one", "arguments": {"k": "v"}}', "", [("one", {"k": "v"})]),
    (
        '[TOOL_CALLS][{"name": "s", "arguments": "{\\"x\\": [1, 2]}"}]',
        "",
        [("s", {"x": [1, 2]})],
    ),
    (
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
        "",
        [("get_weather", {"city": "Paris"}), ("get_time", {})],
    ),
    (
        '[TOOL_CALLS]f[CALL_ID]a1b2c3d4e[ARGS] {"x": {"y": [true, null]}}',
        "",
        [("f", {"x": {"y": [True, None]}})],
    ),
    (
        '[TOOL_CALLS]translate[ARGS]{"text": "héllo → 世界 🌍"}',
        "",
        [("translate", {"text": "héllo → 世界 🌍"})],
    ),
    # whitespace after a call is dropped; text after it is content
    ("[TOOL_CALLS]f[ARGS]{}  \n done", "done", [("f", {})]),
    ("[TOOL_CALLS]f[ARGS]{} \n", "", [("f", {})]),
    # a marker that starts no call is content, and the text after it is still read
    (
        "Use [TOOL_CALLS] wisely. [TOOL_CALLS]f[ARGS]{}",
        "Use [TOOL_CALLS] wisely. ",
        [("f", {})],
    ),
    (
        '[TOOL_CALLS][TOOL_CALLS][{"name": "f", "arguments": {}}]',
        "[TOOL_CALLS]",
        [("f", {})],
    ),
    # committed calls stay calls: the text after them is read on; arguments cut short or
    # malformed keep what was written, up to the next marker
    ('[TOOL_CALLS][{"name": "f", "arguments": {}}, 3]', ", 3]", [("f", {})]),
    ('[TOOL_CALLS]f[ARGS]{"x": ', "", [("f", '{"x": ')]),
    (
        'a[TOOL_CALLS]f[ARGS]{"x": 1; 2}[TOOL_CALLS]g[ARGS]{"y":2} b',
        "a b",
        [("f", '{"x": 1; 2}'), ("g", {"y": 2})],
    ),
    (
        '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"arguments": {}, "name": "g"},'
        ' {"name": "h", "parameters": {"b": [true]}, "id": "x"}] ok',
        "ok",
        [("f", {"a": 1}), ("g", {}), ("h", {"b": [True]})],
    ),
    # content only
    ("Just [text] with [TOOL_CA", "Just [text] with [TOOL_CA", []),
    ("", "", []),
    # invalid: the raw text, marker included, is content
    *(
        (text, text, [])
        for text in [
            "[TOOL_CALLS]",
            "[TOOL_CALLS]  ",
            '[TOOL_CALLS][{"name": "f", "argu',
            "[TOOL_CALLS][]",
            "[TOOL_CALLS]f[ARGS][1, 2]",
            "[TOOL_CALLS]f[ARGS]",
            "[TOOL_CALLS]not a name[ARGS]{}",
            "[TOOL_CALLS]get_weather",
            "[TOOL_CALLS]f[CALL_ID][ARGS]{}",
            'Hi [TOOL_CALLS]{"name": "f", "arguments": 7}',
        ]
    ),
]

PYTHONIC_CASES: list[tuple[str, str, Calls]] = [
    ('[get_weather(city="Paris", days=3)]', "", [("get_weather", {"city": "Paris", "days": 3})]),
    (
        '[get_weather(city="Paris"), other(x=[1, 2], y={"k": None}, z=True, w=-1.5, t=(1, "a"))]',
        "",
        [
            ("get_weather", {"city": "Paris"}),
            ("other", {"x": [1, 2], "y": {"k": None}, "z": True, "w": -1.5, "t": [1, "a"]}),
        ],
    ),
    ('<|python_start|>[f(a="x")]<|python_end|>', "", [("f", {"a": "x"})]),
    (' \n<|python_start|> [f(a="x")]', "", [("f", {"a": "x"})]),
    ("  [no_args()]\n", "", [("no_args", {})]),
    (
        '[say(text="héllo → 世界 🌍", raw=\'{"x": 1}\')]',
        "",
        [("say", {"text": "héllo → 世界 🌍", "raw": '{"x": 1}'})],
    ),
    ("[f(\n    a=1,\n    b='two',\n)]", "", [("f", {"a": 1, "b": "two"})]),
    # content: not starting with "["
    ("Sure, here you go.", "Sure, here you go.", []),
    ("  It is f(x=1).", "  It is f(x=1).", []),
    ("<|python_start|>print(1)<|python_end|>", "<|python_start|>print(1)<|python_end|>", []),
    ("", "", []),
    ("<|python_sta", "<|python_sta", []),
    # invalid: the whole text comes back as content, unchanged
    *(
        (text, text, [])
        for text in [
            "[link](http://example.com)",
            "[f(1)]",
            "[obj.f(a=1)]",
            "[f(a=g())]",
            "[f(a=x)]",
            '[f(a=1), "text"]',
            "[f(a=1)",
            "[1, 2]",
            "[]",
            "[f(**kw)]",
            "[f(a=1, a=2)]",
            "[f(a={1, 2})]",
            "[f(a=1e999)]",
            "[f(a=b'x')]",
            "[f(a=1j)]",
            "[f(a={1: 2})]",
            '[f(a=__import__("os").system("echo hi"))]',
            "[f(a=1)] and more",
            "[f(a=true)]",
            "  [f(a=1)]<|python_end|>",
        ]
    ),
]


@pytest.mark.parametrize(("text", "content", "calls"), LLAMA3_CASES)
def test_llama3_json(text: str, content: str, calls: Calls) -> None:
    assert _parse_every_way(Llama3JsonToolParser, text) == (content, calls)


@pytest.mark.parametrize(("text", "content", "calls"), MISTRAL_CASES)
def test_mistral(text: str, content: str, calls: Calls) -> None:
    assert _parse_every_way(MistralToolParser, text) == (content, calls)


@pytest.mark.parametrize(("text", "content", "calls"), PYTHONIC_CASES)
def test_pythonic(text: str, content: str, calls: Calls) -> None:
    assert _parse_every_way(PythonicToolParser, text) == (content, calls)


def test_arguments_are_json_objects() -> None:
    """``arguments`` is JSON text of an object, with non-ASCII kept as written."""
    llama = Llama3JsonToolParser(None, []).parse('{"name": "f", "parameters": {"t": "é"}}')
    mistral = MistralToolParser(None, []).parse('[TOOL_CALLS]f[ARGS]{"t": "é"}')
    pythonic = PythonicToolParser(None, []).parse('[f(t="é")]')
    for delta in (llama, mistral, pythonic):
        assert [call.arguments for call in delta.calls] == ['{"t": "é"}']


def test_llama3_json_streams_content_and_holds_calls() -> None:
    parser = Llama3JsonToolParser(None, [])
    assert parser.feed(" \n<|pyth").content == ""  # may still be the python tag
    assert parser.feed("on_tag|>Hello").content == " \n<|python_tag|>Hello"
    assert parser.feed(" world").content == " world"
    assert parser.finish() == ToolDelta()

    parser = Llama3JsonToolParser(None, [])
    assert parser.feed('{"name": "f", "param') == ToolDelta()  # not committed yet
    assert parser.feed('eters": {"a": [1,') == ToolDelta(
        fragments=[ToolCallFragment(0, "", "f"), ToolCallFragment(0, '{"a": [1, ')]
    )
    assert parser.feed(' 2]};{"name": "g", "parameters": {}}') == ToolDelta(
        fragments=[
            ToolCallFragment(0, "2]}"),
            ToolCallFragment(1, "", "g"),
            ToolCallFragment(1, "{}"),
        ]
    )
    assert parser.finish() == ToolDelta()

    parser = Llama3JsonToolParser(None, [])  # arguments first: read whole, at the end
    assert parser.feed('{"parameters": {}, "name": "f"}') == ToolDelta()
    assert [call.name for call in parser.finish().whole_calls()] == ["f"]


def test_mistral_streams_content_and_calls() -> None:
    parser = MistralToolParser(None, [])
    assert parser.feed("Hello [TOOL").content == "Hello "
    assert parser.feed("_CALLS]get_weather[AR") == ToolDelta()
    assert parser.feed('GS]{"city": "Par') == ToolDelta(
        fragments=[ToolCallFragment(0, "", "get_weather"), ToolCallFragment(0, '{"city": "Par')]
    )
    assert parser.feed('is"}[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{"zone": ') == ToolDelta(
        fragments=[
            ToolCallFragment(0, 'is"}'),
            ToolCallFragment(1, "", "get_time", "a1b2c3d4e"),
            ToolCallFragment(1, '{"zone": '),
        ]
    )
    assert parser.feed('"UTC"}') == ToolDelta(fragments=[ToolCallFragment(1, '"UTC"}')])
    assert parser.finish() == ToolDelta()


def test_mistral_array_calls_stream_one_after_another() -> None:
    parser = MistralToolParser(None, [])
    assert parser.feed('[TOOL_CALLS][{"name": "f", "arguments": {"a"') == ToolDelta(
        fragments=[ToolCallFragment(0, "", "f"), ToolCallFragment(0, '{"a"')]
    )
    delta = parser.feed(': 1}}, {"name": "g", "arguments": {}}]')
    assert join_fragments(delta.fragments[1:]) == [ToolCall("g", "{}")]
    assert delta.fragments[0] == ToolCallFragment(0, ": 1}")


def test_mistral_gives_up_early_on_a_marker_that_cannot_start_a_call() -> None:
    """A marker followed by prose streams as content at once, not at the end."""
    parser = MistralToolParser(None, [])
    assert parser.feed("[TOOL_CALLS] hello there").content == "[TOOL_CALLS] hello there"


def test_pythonic_streams_content_and_holds_calls() -> None:
    parser = PythonicToolParser(None, [])
    assert parser.feed("  ").content == ""
    assert parser.feed("Hi").content == "  Hi"
    assert parser.finish() == ToolDelta()

    parser = PythonicToolParser(None, [])
    assert parser.feed("[f(a=1)]") == ToolDelta()
    assert [call.name for call in parser.finish().calls] == ["f"]


def test_start_helpers() -> None:
    tag = "<|python_tag|>"
    assert starts_with_after_tag("", tag, "{") is None
    assert starts_with_after_tag(" \n<|py", tag, "{") is None
    assert starts_with_after_tag(" <|python_tag|> ", tag, "{") is None
    assert starts_with_after_tag(" <|python_tag|> {", tag, "{") is True
    assert starts_with_after_tag(" <|python_tag|>x", tag, "{") is False
    assert starts_with_after_tag("<|pyx", tag, "{") is False
    assert starts_with_after_tag("{", tag, "{") is True
    assert skip_space("a  b", 1) == 3
    assert skip_space("a  ", 1) == 3


def test_special_token_needs() -> None:
    assert Llama3JsonToolParser.needs_special_tokens is True
    assert MistralToolParser.needs_special_tokens is True
    # Llama 4's wrapper tokens may be dropped: the bare list parses the same
    assert PythonicToolParser.needs_special_tokens is False


def test_registered_by_name() -> None:
    registry: Registry[Any] = Registry(
        "tool-call parser", base="chassis.serve.tool_parser:ToolParser"
    )
    chassis_register_tool_parsers(registry=registry)
    assert registry.get("llama3_json") is Llama3JsonToolParser
    assert registry.get("mistral") is MistralToolParser
    assert registry.get("pythonic") is PythonicToolParser


def _llama3_message(rng: random.Random) -> tuple[str, int]:
    objects = [
        '{"name": "f", "parameters": {"x": 1}}',
        '{"name": "g", "arguments": {}}',
        '{"name": "h", "arguments": "{\\"y\\": [1, \\"é\\"]}"}',
    ]
    count = rng.randint(1, 3)
    body = rng.choice([";", "; ", " ;\n"]).join(rng.choice(objects) for _ in range(count))
    prefix = rng.choice(["", " ", "\n", "<|python_tag|>", " <|python_tag|> "])
    return prefix + body + rng.choice(["", ";", " "]), count


def _mistral_message(rng: random.Random) -> tuple[str, int]:
    forms = [
        '[{"name": "f", "arguments": {"x": 1}}]',
        '[{"name": "f", "arguments": {}}, {"name": "g", "arguments": "{}"}]',
        'f[ARGS]{"y": [1, "é"]}',
        "g[CALL_ID]abc123xyz[ARGS] {}",
        '{"name": "h", "arguments": {"z": null}}',
    ]
    text, count = rng.choice(["", "Sure. ", "a [b] c\n"]), 0
    for _ in range(rng.randint(1, 3)):
        form = rng.choice(forms)
        text += "[TOOL_CALLS]" + form + rng.choice(["", " ", "\n"])
        count += 2 if form.count('"name"') == 2 else 1
    return text + rng.choice(["", "done"]), count


def _pythonic_message(rng: random.Random) -> tuple[str, int]:
    calls = ["f(x=1)", 'g(s="é", l=[1, None], d={"k": True})', "h()", "k(t=(1, 2.5))"]
    count = rng.randint(1, 3)
    body = "[" + rng.choice([",", ", ", ",\n "]).join(rng.choice(calls) for _ in range(count)) + "]"
    if rng.random() < 0.3:
        body = "<|python_start|>" + body + rng.choice(["", "<|python_end|>"])
    return rng.choice(["", " ", "\n"]) + body + rng.choice(["", "\n"]), count


_NOISE = [" ", "x", "{", "}", "[", "]", ";", ",", '"', "(", ")", "[TOOL_CALLS]", "[ARGS]", "<|"]


@pytest.mark.parametrize(
    ("cls", "make"),
    [
        (Llama3JsonToolParser, _llama3_message),
        (MistralToolParser, _mistral_message),
        (PythonicToolParser, _pythonic_message),
    ],
)
def test_random_messages_are_chunk_invariant(cls: type[ToolParser], make: Any) -> None:
    """Generated messages, valid or damaged (a fragment inserted, the end cut off), give the
    same result however they are cut; valid ones give all their calls."""
    rng = random.Random(f"random-messages:{cls.__name__}")
    num_with_calls = 0
    for _ in range(150):
        text, count = make(rng)
        damaged = rng.random() < 0.4
        if damaged:
            at = rng.randint(0, len(text))
            if rng.random() < 0.5:
                text = text[:at] + rng.choice(_NOISE) + text[at:]
            else:
                text = text[:at]
        content, calls = _run(cls, [text])
        if not damaged:
            assert len(calls) == count, text
        if not calls:
            assert content == text, "nothing may be lost when nothing was a call"
        num_with_calls += bool(calls)
        for _ in range(5):
            assert _run(cls, random_pieces(text, rng)) == (content, calls), text
        assert _run(cls, list(text)) == (content, calls), text
    assert num_with_calls > 50


@pytest.mark.parametrize(
    ("cls", "text"),
    [
        (Llama3JsonToolParser, '{"name": "f", "parameters": ' + "[" * 5000),
        (MistralToolParser, "[TOOL_CALLS]" + "[" * 5000),
        (PythonicToolParser, "[f(a=" + "[" * 5000 + ")]"),
    ],
)
def test_deep_nesting_is_content_not_an_error(cls: type[ToolParser], text: str) -> None:
    """Python's decoders give up on ~1000 levels (a model stuck repeating a bracket): the
    message is then not a call, and comes back as written."""
    assert _run(cls, [text]) == (text, [])
    assert _run(cls, [text[:3000], text[3000:]]) == (text, [])


def test_deep_nesting_after_a_committed_call() -> None:
    """After a call streamed, deep nesting is no error either: text after the call, or the
    rest of the arguments as written (they are too deep to re-write)."""
    text = '{"name": "f", "parameters": {"a": 1}}; ' + "{" * 5000
    assert _run(Llama3JsonToolParser, [text]) == ("; " + "{" * 5000, [("f", {"a": 1})])
    assert _run(Llama3JsonToolParser, [text[:3000], text[3000:]]) == _run(
        Llama3JsonToolParser, [text]
    )
    deep = '[TOOL_CALLS]f[ARGS]{"a": ' + "[" * 5000 + "]" * 5000 + "}"
    content, [(name, arguments)] = _run(MistralToolParser, [deep])
    assert (content, name) == ("", "f")
    assert arguments == '{"a": ' + "[" * 5000 + "]" * 5000 + "}"  # as written: no spaces
    assert _run(MistralToolParser, [deep[:3000], deep[3000:]]) == (content, [(name, arguments)])


def test_mistral_ids_fit_its_templates_and_written_ids_are_kept() -> None:
    parser = MistralToolParser(None, [])
    ids = {parser.new_call_id() for _ in range(50)}
    assert len(ids) == 50
    assert all(len(i) == 9 and i.isalnum() and i.isascii() for i in ids)
    [written] = parser.parse("[TOOL_CALLS]f[CALL_ID]abc123xyz[ARGS]{}").calls
    assert (written.name, written.id) == ("f", "abc123xyz")
    [keyed] = MistralToolParser(None, []).parse('[TOOL_CALLS][{"name": "f", "id": "k9"}]').calls
    assert keyed.id == "k9"


def test_mistral_keeps_the_text_around_a_call_apart() -> None:
    text = "Sure.[TOOL_CALLS]f[ARGS]{} and [TOOL_CALLS]g[ARGS]{} ok"
    content, calls = _parse_every_way(MistralToolParser, text)
    assert content == "Sure. and  ok"
    assert [name for name, _ in calls] == ["f", "g"]


def test_llama3_json_python_tag_before_each_call() -> None:
    text = '<|python_tag|>{"name": "a", "parameters": {}}; <|python_tag|>{"name": "b"}'
    assert _parse_every_way(Llama3JsonToolParser, text) == ("", [("a", {}), ("b", {})])


@pytest.mark.parametrize(
    ("cls", "text"),
    [
        (PythonicToolParser, '[f(c="\\ud83d")]'),
        (PythonicToolParser, "[f(x=1e400)]"),
        (Llama3JsonToolParser, '{"parameters": {"x": Infinity}, "name": "f"}'),
        (MistralToolParser, '[TOOL_CALLS][{"arguments": {"c": "\\ud83d"}, "name": "f"}]'),
    ],
)
def test_arguments_a_client_cannot_decode_stay_text(cls: type[ToolParser], text: str) -> None:
    """Calls read whole (pythonic, or not written name first) are refused."""
    assert _parse_every_way(cls, text) == (text, [])


@pytest.mark.parametrize(
    ("cls", "text", "calls"),
    [
        (
            Llama3JsonToolParser,
            '{"name": "f", "parameters": {"x": Infinity}}',
            [("f", '{"x": Infinity}}')],
        ),
        (
            Llama3JsonToolParser,
            '{"name": "f", "parameters": {"x": 1e400}}',
            [("f", '{"x": 1e400}}')],
        ),
        (MistralToolParser, '[TOOL_CALLS]f[ARGS]{"c": "\\ud83d"}', [("f", {"c": "\ufffd"})]),
    ],
)
def test_streamed_arguments_a_client_cannot_decode(
    cls: type[ToolParser], text: str, calls: Calls
) -> None:
    """A streamed call is committed before such a value shows: its arguments keep the rest
    as written (invalid JSON, as vLLM would stream it); a lone surrogate becomes U+FFFD."""
    assert _parse_every_way(cls, text) == ("", calls)
