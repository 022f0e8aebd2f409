"""The built-in ``qwen3`` / ``deepseek_r1`` reasoning parsers, the ``hermes`` tool parser, and
their combination per choice (``serve/chat_parsing.py``).

Every case is checked whole (:meth:`parse`, the non-streamed path) and streamed in random
pieces, one character at a time included: the streamed deltas must add up to the whole
result, whatever the pieces.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from parser_splits import run_reasoning_parser, run_tool_parser, split_ways

from chassis.builtin_plugins.parsers.hermes import HermesToolParser
from chassis.builtin_plugins.parsers.text_scan import held_prefix_len
from chassis.builtin_plugins.parsers.think_tags import (
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
)
from chassis.plugins.registries import get_registries
from chassis.serve.chat_parsing import ChoiceParser
from chassis.serve.reasoning_parser import ReasoningDelta, ReasoningParser
from chassis.serve.tool_parser import ToolCall, ToolCallFragment, ToolDelta, join_fragments


def test_held_prefix_len() -> None:
    assert held_prefix_len("ok <tool", "<tool_call>") == 5
    assert held_prefix_len("ok", "<tool_call>") == 0
    assert held_prefix_len("<", "<tool_call>") == 1
    assert held_prefix_len("x<tool_call>", "<tool_call>") == 0  # a whole marker is not held


def test_parsers_are_registered_like_plugins() -> None:
    registries = get_registries()
    assert registries.reasoning_parsers.get("qwen3") is Qwen3ReasoningParser
    assert registries.reasoning_parsers.get("deepseek_r1") is DeepSeekR1ReasoningParser
    assert registries.tool_parsers.get("hermes") is HermesToolParser


# -- reasoning ------------------------------------------------------------------------------

QWEN_PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
QWEN_NO_THINK = QWEN_PROMPT + "<think>\n\n</think>\n\n"
R1_PROMPT = "<｜User｜>hi<｜Assistant｜><think>\n"

REASONING_CASES = [
    # (parser, prompt, output, reasoning, content)
    (
        Qwen3ReasoningParser,
        QWEN_PROMPT,
        "<think>\nLet me see.\n</think>\n\nParis.",
        "Let me see.",
        "Paris.",
    ),
    (Qwen3ReasoningParser, QWEN_PROMPT, "Paris.", "", "Paris."),
    (
        Qwen3ReasoningParser,
        QWEN_NO_THINK,
        "Paris, <think> is a tag.",
        "",
        "Paris, <think> is a tag.",
    ),
    (
        Qwen3ReasoningParser,
        QWEN_PROMPT,
        "<think>\nstill thinking when cut",
        "still thinking when cut",
        "",
    ),
    (Qwen3ReasoningParser, QWEN_PROMPT, "  <thi", "", "<thi"),
    (Qwen3ReasoningParser, QWEN_PROMPT, "<think>a </thin b</think>c", "a </thin b", "c"),
    (Qwen3ReasoningParser, QWEN_PROMPT, "<think></think>", "", ""),
    # cut inside the end tag: the whitespace before the tag's start is the reasoning's own
    (Qwen3ReasoningParser, QWEN_PROMPT, "<think>a \n</thi", "a \n</thi", ""),
    (Qwen3ReasoningParser, QWEN_PROMPT, "<think>a \n", "a", ""),
    (Qwen3ReasoningParser, QWEN_PROMPT, "", "", ""),
    # the prompt opened the block: no opening tag in the output
    (Qwen3ReasoningParser, QWEN_PROMPT + "<think>\n", "hmm\n</think>\nOK", "hmm", "OK"),
    (
        DeepSeekR1ReasoningParser,
        R1_PROMPT,
        "Think 2+2.\n</think>\n\n**4**\n",
        "Think 2+2.",
        "**4**\n",
    ),
    (DeepSeekR1ReasoningParser, "", "<think>x</think>y", "x", "y"),
    # R1 starts in reasoning even without a tag in the prompt or the output
    (DeepSeekR1ReasoningParser, "", "no end tag at all", "no end tag at all", ""),
    (DeepSeekR1ReasoningParser, "", "a</think>b</think>c", "a", "b</think>c"),
    (DeepSeekR1ReasoningParser, R1_PROMPT, "ü 世界\n\n</think>\n\nünï", "ü 世界", "ünï"),
]


@pytest.mark.parametrize(("cls", "prompt", "output", "reasoning", "content"), REASONING_CASES)
def test_reasoning_split(
    cls: type[ReasoningParser], prompt: str, output: str, reasoning: str, content: str
) -> None:
    assert cls(None, prompt).parse(output) == ReasoningDelta(reasoning, content)
    for parts in split_ways(output):
        assert run_reasoning_parser(cls, prompt, parts) == ReasoningDelta(reasoning, content), parts


def test_reasoning_streams_before_the_end_tag() -> None:
    parser = Qwen3ReasoningParser(None, QWEN_PROMPT)
    assert parser.feed("<thi") == ReasoningDelta()  # may be the tag: held
    assert parser.feed("nk>\nStep one") == ReasoningDelta(reasoning="Step one")
    assert parser.feed(", two </") == ReasoningDelta(reasoning=", two")  # " </" held
    assert parser.feed("think>\n\nAn") == ReasoningDelta(content="An")
    assert parser.feed("swer") == ReasoningDelta(content="swer")
    assert parser.finish() == ReasoningDelta()


# -- hermes tool calls -------------------------------------------------------------------------


def call(name: str, **arguments: object) -> ToolCall:
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TIME = '<tool_call>\n{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}\n</tool_call>'

HERMES_CASES = [
    # (output, content, calls)
    ("Just text, <b>tags</b> and < signs.", "Just text, <b>tags</b> and < signs.", []),
    (WEATHER, "", [call("get_weather", city="Paris")]),
    ("Let me check.\n\n" + WEATHER, "Let me check.", [call("get_weather", city="Paris")]),
    (
        WEATHER + "\n" + TIME + "\n",
        "",
        [call("get_weather", city="Paris"), call("get_time", tz="CET")],
    ),
    (WEATHER + "\nDone.", "Done.", [call("get_weather", city="Paris")]),
    # parameters instead of arguments, no arguments, unicode
    (
        '<tool_call>{"name": "f", "parameters": {"q": "Zürich 世界"}}</tool_call>',
        "",
        [call("f", q="Zürich 世界")],
    ),
    ('<tool_call>{"name": "now"}</tool_call>', "", [call("now")]),
    # not a call: kept as written, whitespace included
    ("See:\n<tool_call>not json</tool_call> ok", "See:\n<tool_call>not json</tool_call> ok", []),
    (
        'x <tool_call>{"arguments": {}}</tool_call>',
        'x <tool_call>{"arguments": {}}</tool_call>',
        [],
    ),
    (
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        [],
    ),
    # cut short by the end of generation
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n', "", [call("f", a=1)]),
    ('ok <tool_call>\n{"name": "f", "argu', 'ok <tool_call>\n{"name": "f", "argu', []),
    ("ends with <tool_c", "ends with <tool_c", []),
    # text on both sides of a call keeps the whitespace that followed the call
    (
        "Paris first. " + WEATHER + " Then the time. " + TIME + " Done.",
        "Paris first. Then the time. Done.",
        [call("get_weather", city="Paris"), call("get_time", tz="CET")],
    ),
    (
        "Line one.\n" + WEATHER + "\nLine two.",
        "Line one.\nLine two.",
        [call("get_weather", city="Paris")],
    ),
    # the end tag inside a JSON string does not end the block
    (
        '<tool_call>{"name": "echo", "arguments": {"s": "a</tool_call>b \\" </tool_call>"}}</tool_call>',
        "",
        [call("echo", s='a</tool_call>b " </tool_call>')],
    ),
    # lenient where nothing is lost: raw newlines in strings, null arguments, a list
    (
        '<tool_call>{"name": "py", "arguments": {"code": "a\n\tb"}}</tool_call>',
        "",
        [call("py", code="a\n\tb")],
    ),
    ('<tool_call>{"name": "now", "arguments": null}</tool_call>', "", [call("now")]),
    ('<tool_call>[{"name": "a"}, {"name": "b"}]</tool_call>', "", [call("a"), call("b")]),
    # a forgotten end tag between parallel calls; prose that mentions the tag
    ('<tool_call>{"name": "a"}\n<tool_call>{"name": "b"}</tool_call>', "", [call("a"), call("b")]),
    (
        'Use <tool_call> tags. <tool_call>{"name": "a"}</tool_call>',
        "Use <tool_call> tags. ",
        [call("a")],
    ),
    # what a client could not decode: a call committed before it shows keeps the rest of
    # its block as written (invalid JSON, as vLLM streams it); a lone surrogate is U+FFFD
    (
        '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call> ok',
        "ok",
        [ToolCall("f", '{"x": NaN}}')],
    ),
    (
        '<tool_call>{"name": "f", "arguments": {"c": "\\ud83d"}}</tool_call>',
        "",
        [call("f", c="\ufffd")],
    ),
    # ... and a call not committed yet stays text
    (
        '<tool_call>{"arguments": {"x": NaN}, "name": "f"}</tool_call>',
        '<tool_call>{"arguments": {"x": NaN}, "name": "f"}</tool_call>',
        [],
    ),
    # an id the model wrote is kept
    ('<tool_call>{"name": "f", "id": "c1"}</tool_call>', "", [ToolCall("f", "{}", "c1")]),
    # deep nesting (a model repeating "[") is not a call, and not an error
    ("<tool_call>" + "[" * 5000 + "</tool_call>", "<tool_call>" + "[" * 5000 + "</tool_call>", []),
    ("trailing space  ", "trailing space  ", []),
]


@pytest.mark.parametrize(("output", "content", "calls"), HERMES_CASES)
def test_hermes_calls(output: str, content: str, calls: list[ToolCall]) -> None:
    assert HermesToolParser(None, []).parse(output) == ToolDelta(content, calls)
    for parts in split_ways(output):
        assert run_tool_parser(HermesToolParser, parts) == ToolDelta(content, calls), parts


def test_hermes_streams_a_call_once_its_head_is_written() -> None:
    parser = HermesToolParser(None, [])
    assert parser.feed("Sure. <tool") == ToolDelta(content="Sure.")
    assert parser.feed('_call>{"name": "f", "argum') == ToolDelta()  # not committed yet
    assert parser.feed('ents": {"city": "Pa') == ToolDelta(
        fragments=[ToolCallFragment(0, "", "f"), ToolCallFragment(0, '{"city": "Pa')]
    )
    assert parser.feed('ris"}}') == ToolDelta(fragments=[ToolCallFragment(0, 'ris"}')])
    assert parser.feed("</tool_call>") == ToolDelta()
    assert parser.finish() == ToolDelta()


def test_hermes_whole_calls_and_streamed_calls_share_the_indices() -> None:
    text = TIME + WEATHER + '<tool_call>[{"name": "a"}]</tool_call>' + WEATHER
    fragments = [f for part in split_ways(text)[1:2] for f in _fragments(part)]
    assert [(f.index, f.name) for f in fragments if f.starts_call] == [
        (0, "get_time"),
        (1, "get_weather"),
        (2, "a"),
        (3, "get_weather"),
    ]


def _fragments(pieces: list[str]) -> list[ToolCallFragment]:
    parser = HermesToolParser(None, [])
    total = ToolDelta()
    for piece in pieces:
        total += parser.feed(piece)
    total += parser.finish()
    return total.fragments


HERMES_MALFORMED = [
    # (output, content, calls): once committed, a call is not taken back
    # arguments cut short by the end of generation: as streamed
    ('<tool_call>{"name": "f", "arguments": {"a": [1, tr', "", [ToolCall("f", '{"a": [1, tr')]),
    ('<tool_call>{"name": "f", "arguments": {"a": 12', "", [ToolCall("f", '{"a": 12')]),
    ('<tool_call>{"name": "f", "arguments": {"s": "x\\u00', "", [ToolCall("f", '{"s": "x\\u00')]),
    # not JSON any more: the rest of the block, as written
    (
        '<tool_call>{"name": "f", "arguments": {"a": 1,, "b": 2}}\n</tool_call>\nok',
        "ok",
        [ToolCall("f", '{"a": 1, , "b": 2}}\n')],
    ),
    (
        '<tool_call>{"name": "f", "arguments": {"a": 1</tool_call><tool_call>{"name": "g"}',
        "",
        [ToolCall("f", '{"a": 1'), call("g")],
    ),
    # the object's closing brace forgotten, or other keys after the arguments: dropped
    ('<tool_call>{"name": "f", "arguments": {}</tool_call> ok', "ok", [call("f")]),
    ('<tool_call>{"name": "f", "arguments": {}, "id": 3} x</tool_call>', "", [call("f")]),
    # canonical JSON whatever the model's spacing and escapes
    (
        '<tool_call>{"name":"f","arguments":{ "a" :[1 ,2.50,-0],"s":"\\u00e9\\/\t"}}</tool_call>',
        "",
        [ToolCall("f", '{"a": [1, 2.5, 0], "s": "é/\\t"}')],
    ),
]


@pytest.mark.parametrize(("output", "content", "calls"), HERMES_MALFORMED)
def test_hermes_committed_calls(output: str, content: str, calls: list[ToolCall]) -> None:
    assert HermesToolParser(None, []).parse(output) == ToolDelta(content, calls)
    for parts in split_ways(output):
        assert run_tool_parser(HermesToolParser, parts) == ToolDelta(content, calls), parts


# -- both, per choice ----------------------------------------------------------------------


def test_calls_inside_the_reasoning_are_not_calls() -> None:
    output = "<think>I could " + WEATHER + "</think>\n" + TIME
    parser = ChoiceParser(Qwen3ReasoningParser(None, QWEN_PROMPT), HermesToolParser(None, []))
    parsed = parser.parse(output)
    assert parsed.reasoning == "I could " + WEATHER
    assert parsed.content == ""
    [made] = parsed.calls  # the server gives each call an id
    assert made.id and made.id.startswith("call_")
    assert dataclasses.replace(made, id=None) == call("get_time", tz="CET")
    assert parser.num_calls == 1
    for parts in split_ways(output):
        streamed = ChoiceParser(Qwen3ReasoningParser(None, QWEN_PROMPT), HermesToolParser(None, []))
        deltas = [streamed.feed(p) for p in parts] + [streamed.finish()]
        assert "".join(d.reasoning for d in deltas) == parsed.reasoning
        assert "".join(d.content for d in deltas) == parsed.content
        fragments = [f for d in deltas for f in d.fragments]
        assert [(c.name, c.arguments) for c in join_fragments(fragments)] == [
            (made.name, made.arguments)
        ]


def test_include_reasoning_false_drops_it() -> None:
    parser = ChoiceParser(Qwen3ReasoningParser(None, QWEN_PROMPT), None, include_reasoning=False)
    parsed = parser.parse("<think>secret</think>answer")
    assert (parsed.reasoning, parsed.content, parsed.calls) == ("", "answer", [])
