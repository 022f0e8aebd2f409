"""The third batch of vLLM-named parsers: tool parsers ``minimax_m2``, ``llama4_pythonic``,
``phi4_mini_json``, ``xlam``, ``internlm``, ``jamba`` and ``granite-20b-fc``, reasoning
parsers ``minimax_m2``, ``minimax_m2_append_think`` and ``mistral``. Each message is read whole,
one character at a time and cut at random places, and every way must give the same content
and calls (:func:`parser_splits.split_ways`); malformed calls stay content; the formats run
end to end through ``/v1/chat/completions`` with the fake engine, streamed and not."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fake_engine import FakeAsyncLLM
from fastapi.testclient import TestClient
from parser_splits import run_reasoning_parser, split_ways
from test_server_chat_parsing import calls_content_finish
from test_server_routes import sse_events

from chassis.builtin_plugins.parsers.hermes_variants import (
    Granite20bFCToolParser,
    InternLMToolParser,
    JambaToolParser,
)
from chassis.builtin_plugins.parsers.minimax_m2 import (
    MiniMaxM2ToolParser,
    minimax_m2_value,
    schema_types,
)
from chassis.builtin_plugins.parsers.minimax_m2_reasoning import (
    MiniMaxM2AppendThinkReasoningParser,
)
from chassis.builtin_plugins.parsers.phi4_mini import Phi4MiniJsonToolParser
from chassis.builtin_plugins.parsers.pythonic import Llama4PythonicToolParser
from chassis.builtin_plugins.parsers.think_tags import (
    MiniMaxM2ReasoningParser,
    MistralReasoningParser,
)
from chassis.builtin_plugins.parsers.xlam import XLamToolParser
from chassis.plugins.registries import get_registries
from chassis.serve.app import build_app
from chassis.serve.reasoning_parser import ReasoningParser
from chassis.serve.settings import ServerSettings
from chassis.serve.tool_parser import ToolDelta, ToolParser

Calls = list[tuple[str, Any]]


def _tool(name: str, **types: str | None) -> dict[str, Any]:
    properties = {key: ({"type": kind} if kind else {}) for key, kind in types.items()}
    return {
        "type": "function",
        "function": {"name": name, "parameters": {"type": "object", "properties": properties}},
    }


TOOLS = [
    _tool("get_weather", location="string", unit="string", city="string", days="integer"),
    _tool("f", i="integer", n="number", b="boolean", o="object", a="array", s="string", t=None),
]


def _run(cls: type[ToolParser], pieces: list[str]) -> ToolDelta:
    """A fresh parser's content and calls (whole) for ``pieces``; streamed calls' fragments
    are checked to start once each, in order, and not to interleave."""
    parser = cls(None, TOOLS)
    total = ToolDelta()
    for piece in pieces:
        total += parser.feed(piece)
    total += parser.finish()
    assert not (total.calls and total.fragments), "one way of reporting calls per message"
    started: list[int] = []
    for fragment in total.fragments:
        if fragment.starts_call:
            assert fragment.index == len(started)
            started.append(fragment.index)
        else:
            assert started and fragment.index == started[-1]
    return ToolDelta(total.content, total.whole_calls())


def every_way(cls: type[ToolParser], text: str) -> tuple[str, Calls]:
    """(content, [(name, decoded arguments)]) of ``text``, the same however it is cut."""
    whole = _run(cls, [text])
    assert cls(None, TOOLS).parse(text) == whole
    for pieces in split_ways(text):
        assert _run(cls, pieces) == whole, f"pieces {pieces!r}"
    return whole.content, [(c.name, json.loads(c.arguments)) for c in whole.calls]


# -- minimax_m2 -----------------------------------------------------------------------------------


def mm_call(name: str, *params: tuple[str, str]) -> str:
    body = "".join(f'<parameter name="{k}">{v}</parameter>\n' for k, v in params)
    return f'<invoke name="{name}">\n{body}</invoke>\n'


def mm_block(*calls: str) -> str:
    return "<minimax:tool_call>\n" + "".join(calls) + "</minimax:tool_call>"


# MiniMax's tool-calling guide's example output (reasoning already split off)
MM_GUIDE = mm_block(mm_call("get_weather", ("location", "San Francisco, CA"), ("unit", "celsius")))

MINIMAX_CASES: list[tuple[str, str, Calls]] = [
    (MM_GUIDE, "", [("get_weather", {"location": "San Francisco, CA", "unit": "celsius"})]),
    (
        "Let me check.\n\n" + MM_GUIDE + "\n",
        "Let me check.",
        [("get_weather", {"location": "San Francisco, CA", "unit": "celsius"})],
    ),
    (  # two calls in one block, values typed by the tools' schema, whitespace stripped
        mm_block(
            mm_call("get_weather", ("city", " Paris "), ("days", "3")),
            mm_call(
                "f",
                ("i", "7"),
                ("n", "2.0"),
                ("b", "1"),
                ("o", '{"k": [1, 2]}'),
                ("a", "[1, 2]"),
                ("s", "null"),
                ("t", "[3]"),
                ("u", "42"),
            ),
        ),
        "",
        [
            ("get_weather", {"city": "Paris", "days": 3}),
            (
                "f",
                # "t" has no type: undeclared types stay text; "u" is not in the schema
                {"i": 7, "n": 2, "b": True, "o": {"k": [1, 2]}, "a": [1, 2], "s": None}
                | {"t": "[3]", "u": "42"},
            ),
        ],
    ),
    (  # values that do not convert stay text
        mm_block(mm_call("f", ("i", "seven"), ("n", "inf"), ("o", "{bad"))),
        "",
        [("f", {"i": "seven", "n": "inf", "o": "{bad"})],
    ),
    (  # unquoted and single-quoted names
        "<minimax:tool_call><invoke name=get_weather><parameter name='city'>Rome</parameter>"
        "</invoke></minimax:tool_call>",
        "",
        [("get_weather", {"city": "Rome"})],
    ),
    (  # two blocks with text between
        "A " + mm_block(mm_call("g")) + " B " + mm_block(mm_call("h")) + " C",
        "A B C",
        [("g", {}), ("h", {})],
    ),
    (  # cut short by the end of generation: what was written is kept
        '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Par',
        "",
        [("get_weather", {"city": "Par"})],
    ),
    ("No calls, just <invoke> talk.", "No calls, just <invoke> talk.", []),
]

MINIMAX_MALFORMED = [
    "<minimax:tool_call>hello</minimax:tool_call>",  # no invoke: content as written
    'x <minimax:tool_call>\n<invoke name="">\n</invoke></minimax:tool_call>',  # empty name
    "<minimax:tool_call><invoke name=\nget_weather>",  # broken name
    "<minimax:tool_call>",
]


@pytest.mark.parametrize(("text", "content", "calls"), MINIMAX_CASES)
def test_minimax_m2_calls(text: str, content: str, calls: Calls) -> None:
    assert every_way(MiniMaxM2ToolParser, text) == (content, calls)


@pytest.mark.parametrize("text", MINIMAX_MALFORMED)
def test_minimax_m2_malformed_blocks_are_content(text: str) -> None:
    assert every_way(MiniMaxM2ToolParser, text) == (text, [])


def test_minimax_m2_streams_a_call_as_it_is_written() -> None:
    parser = MiniMaxM2ToolParser(None, TOOLS)
    head = parser.feed('Hi.\n<minimax:tool_call>\n<invoke name="get_weather">\n')
    assert head.content == "Hi."
    assert [(f.index, f.name, f.arguments) for f in head.fragments] == [
        (0, "get_weather", ""),
        (0, None, "{"),
    ]
    value = parser.feed('<parameter name="city">San Fran')
    assert "".join(f.arguments for f in value.fragments) == '"city": "San Fran'


def test_minimax_m2_value_conversion() -> None:
    for word in ("NULL", "None", "nil"):
        assert minimax_m2_value(word, {"string"}) is None
    assert minimax_m2_value("3.5", {"number"}) == 3.5
    assert minimax_m2_value("TRUE", {"bool"}) is True
    assert minimax_m2_value("off", {"boolean"}) is False
    assert minimax_m2_value("maybe", {"boolean"}) == "maybe"
    assert minimax_m2_value("3", {"integer", "string"}) == 3  # integer is tried first
    assert minimax_m2_value("abc", {"integer", "string"}) == "abc"
    assert minimax_m2_value('{"a": 1}', {"custom"}) == {"a": 1}
    assert minimax_m2_value("plain", {"custom"}) == "plain"
    assert schema_types(None) == {"string"}
    assert schema_types({"type": ["Integer", "null"]}) == {"integer", "null"}
    assert schema_types({"enum": [1, "a", None]}) == {"integer", "string", "null"}
    assert schema_types({"anyOf": [{"type": "number"}, {"oneOf": [{"type": "array"}]}]}) == {
        "number",
        "array",
    }


def test_minimax_m2_types_from_the_schema() -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "g",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "n": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
                        "e": {"enum": [1, 2]},
                        "s": {"type": "string"},
                    },
                },
            },
        }
    ]
    text = mm_block(mm_call("g", ("n", "12"), ("e", "2"), ("s", "Nil"), ("x", "Nobody")))
    for pieces in split_ways(text):
        parser = MiniMaxM2ToolParser(None, tools)
        total = ToolDelta()
        for piece in pieces:
            total += parser.feed(piece)
        total += parser.finish()
        [call] = total.whole_calls()
        assert json.loads(call.arguments) == {"n": 12, "e": 2, "s": None, "x": "Nobody"}


# -- whole-message formats: llama4_pythonic, phi4_mini_json, xlam -------------------------------

W = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
T = '{"name": "get_time", "arguments": {"zones": [["UTC", 0]]}}'
PARIS = ("get_weather", {"city": "Paris"})
TIME = ("get_time", {"zones": [["UTC", 0]]})

WHOLE_CASES: list[tuple[type[ToolParser], str, str, Calls]] = [
    (
        Llama4PythonicToolParser,
        '<|python_start|>[get_weather(city="Paris")]<|python_end|>',
        "",
        [PARIS],
    ),
    (Llama4PythonicToolParser, '[get_weather(city="Paris"), now()]', "", [PARIS, ("now", {})]),
    (Llama4PythonicToolParser, "Hello there.", "Hello there.", []),
    (Llama4PythonicToolParser, "[not a call]", "[not a call]", []),
    (Phi4MiniJsonToolParser, f"functools[{W}]", "", [PARIS]),
    (Phi4MiniJsonToolParser, f" functools [{W}, {T}]\n", "", [PARIS, TIME]),  # nested lists
    (Phi4MiniJsonToolParser, "functional code is fun", "functional code is fun", []),
    (Phi4MiniJsonToolParser, "functools[{bad json}]", "functools[{bad json}]", []),
    (Phi4MiniJsonToolParser, f"functools{W}", f"functools{W}", []),  # not a list
    (Phi4MiniJsonToolParser, f"Sure: functools[{W}]", f"Sure: functools[{W}]", []),
    (XLamToolParser, f"[{W}, {T}]", "", [PARIS, TIME]),
    (XLamToolParser, f" \n[{W}]\n", "", [PARIS]),
    (XLamToolParser, f"Sure.\n```json\n[{W}]\n```", "Sure.", [PARIS]),
    (XLamToolParser, f"Sure.\n```\n[{W}]\n```\nAnything else?", "Sure.\nAnything else?", [PARIS]),
    (XLamToolParser, f"Sure. [TOOL_CALLS][{W}]\nMore?", "Sure.\nMore?", [PARIS]),
    (XLamToolParser, f"<tool_call>[{W}]</tool_call>", "", [PARIS]),
    (XLamToolParser, f"<tool_call>{W}</tool_call> done", "done", [PARIS]),  # one object
    (XLamToolParser, f"<think>Paris, so...</think>\n[{W}]", "<think>Paris, so...</think>", [PARIS]),
    (XLamToolParser, f"Sure.\n```json\n[{W}]", "Sure.", [PARIS]),  # fence left open
    # not calls: content, as written
    (XLamToolParser, "[1, 2, 3]", "[1, 2, 3]", []),
    (
        XLamToolParser,
        "Code:\n```python\nprint(1)\n```\nDone.",
        "Code:\n```python\nprint(1)\n```\nDone.",
        [],
    ),
    (XLamToolParser, "x [TOOL_CALLS][{broken\ny", "x [TOOL_CALLS][{broken\ny", []),
    (XLamToolParser, f'[{W}, {{"name": "x"}}', f'[{W}, {{"name": "x"}}', []),
]


@pytest.mark.parametrize(("cls", "text", "content", "calls"), WHOLE_CASES)
def test_whole_message_formats(
    cls: type[ToolParser], text: str, content: str, calls: Calls
) -> None:
    assert every_way(cls, text) == (content, calls)


def test_xlam_streams_text_and_holds_only_a_block() -> None:
    parser = XLamToolParser(None, TOOLS)
    assert parser.feed("Sure, here it is.").content == "Sure, here it is."
    assert parser.feed("\n``").content == ""  # maybe a fence
    assert parser.feed(f"`json\n[{W}]").content == ""
    [call] = parser.feed("\n```").calls  # reported as soon as the fence closes
    assert (call.name, json.loads(call.arguments)) == PARIS


# -- hermes variants: internlm, jamba, granite-20b-fc ---------------------------------------------

HERMES_CASES: list[tuple[type[ToolParser], str, str, Calls]] = [
    (  # InternLM2's chat-format documentation
        InternLMToolParser,
        "Sure, I will search for the weather of Shanghai.<|action_start|><|plugin|>\n"
        '{"name": "get_weather", "parameters": {"location": "Shanghai"}}<|action_end|>',
        "Sure, I will search for the weather of Shanghai.",
        [("get_weather", {"location": "Shanghai"})],
    ),
    (
        InternLMToolParser,
        '<|action_start|><|plugin|>{"name": "a", "parameters": {}}<|action_end|>'
        '<|action_start|><|plugin|>{"name": "b", "parameters": {"x": 1}}<|action_end|>',
        "",
        [("a", {}), ("b", {"x": 1})],
    ),
    (JambaToolParser, f"<tool_calls>[{W}, {T}]</tool_calls>", "", [PARIS, TIME]),
    (JambaToolParser, f"Checking.\n<tool_calls>\n{W}\n</tool_calls>", "Checking.", [PARIS]),
    (
        Granite20bFCToolParser,
        f"<function_call> {W} <function_call> {T}",
        "",
        [PARIS, TIME],
    ),
    (Granite20bFCToolParser, f"Sure.\n<function_call> {W}\n", "Sure.", [PARIS]),
]

HERMES_MALFORMED: list[tuple[type[ToolParser], str]] = [
    (InternLMToolParser, "<|action_start|><|plugin|>{broken}<|action_end|> after"),
    (JambaToolParser, "<tool_calls>[1, 2]</tool_calls>"),
    (JambaToolParser, '<tool_calls>[{"name": "x", "arguments": NaN}]'),
    (Granite20bFCToolParser, '<function_call> {"name": "x", "arguments": '),
    (Granite20bFCToolParser, "Talking about <function_call> tags."),
]


@pytest.mark.parametrize(("cls", "text", "content", "calls"), HERMES_CASES)
def test_hermes_variants(cls: type[ToolParser], text: str, content: str, calls: Calls) -> None:
    assert every_way(cls, text) == (content, calls)


@pytest.mark.parametrize(("cls", "text"), HERMES_MALFORMED)
def test_hermes_variants_malformed_calls_are_content(cls: type[ToolParser], text: str) -> None:
    assert every_way(cls, text) == (text, [])


# -- reasoning ------------------------------------------------------------------------------------

M2_PROMPT = "]~b]ai\n<think>\n"  # MiniMax-M2's template leaves the think block open

REASONING_CASES: list[tuple[type[ReasoningParser], str, str, str, str]] = [
    (
        MiniMaxM2ReasoningParser,
        M2_PROMPT,
        "The user asks.\n</think>\n\nHello!",
        "The user asks.",
        "Hello!",
    ),
    (MiniMaxM2ReasoningParser, "", "<think>M2.5 thinks.</think>Hi", "M2.5 thinks.", "Hi"),
    (MiniMaxM2ReasoningParser, "", "Still thinking", "Still thinking", ""),
    (
        MiniMaxM2AppendThinkReasoningParser,
        M2_PROMPT,
        "The user asks.\n</think>\n\nHello!",
        "",
        "<think>The user asks.\n</think>\n\nHello!",
    ),
    (MiniMaxM2AppendThinkReasoningParser, M2_PROMPT, "", "", "<think>"),
    (
        MistralReasoningParser,
        "",
        "[THINK]2+2 is 4.[/THINK]The answer is 4.",
        "2+2 is 4.",
        "The answer is 4.",
    ),
    (MistralReasoningParser, "", "The answer is 4.", "", "The answer is 4."),
    (MistralReasoningParser, "", "[THINK]Cut short", "Cut short", ""),
    (  # Magistral's system prompt shows the tags: they do not open the reasoning
        MistralReasoningParser,
        "[SYSTEM_PROMPT]Think in [THINK]...[/THINK] first.[/SYSTEM_PROMPT][INST]Hi[/INST]",
        "Hello [THINK] there",
        "",
        "Hello [THINK] there",
    ),
]


@pytest.mark.parametrize(("cls", "prompt", "output", "reasoning", "content"), REASONING_CASES)
def test_reasoning_split(
    cls: type[ReasoningParser], prompt: str, output: str, reasoning: str, content: str
) -> None:
    for pieces in split_ways(output):
        delta = run_reasoning_parser(cls, prompt, pieces)
        assert (delta.reasoning, delta.content) == (reasoning, content), pieces


# -- registration, special tokens, end to end ----------------------------------------------------


def test_registered_by_vllm_names() -> None:
    registries = get_registries()
    tools = registries.tool_parsers
    assert tools.get("minimax_m2") is MiniMaxM2ToolParser
    assert tools.get("llama4_pythonic") is Llama4PythonicToolParser
    assert tools.get("phi4_mini_json") is Phi4MiniJsonToolParser
    assert tools.get("xlam") is XLamToolParser
    assert tools.get("internlm") is InternLMToolParser
    assert tools.get("jamba") is JambaToolParser
    assert tools.get("granite-20b-fc") is Granite20bFCToolParser
    reasoning = registries.reasoning_parsers
    assert reasoning.get("minimax_m2") is MiniMaxM2ReasoningParser
    assert reasoning.get("minimax_m2_append_think") is MiniMaxM2AppendThinkReasoningParser
    assert reasoning.get("mistral") is MistralReasoningParser
    special = {MiniMaxM2ToolParser, InternLMToolParser, JambaToolParser}
    for cls in special | {Llama4PythonicToolParser, Phi4MiniJsonToolParser, XLamToolParser}:
        assert cls.needs_special_tokens is (cls in special), cls


E2E_TOOLS = [_tool("get_weather", city="string", days="integer")]
E2E_CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Rome"})]
P = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
R = '{"name": "get_weather", "arguments": {"city": "Rome"}}'
E2E_SCRIPTS = {  # (model output, content)
    "minimax_m2": (
        "Checking both.\n"
        + mm_block(
            mm_call("get_weather", ("city", "Paris"), ("days", "3")),
            mm_call("get_weather", ("city", "Rome")),
        ),
        "Checking both.",
    ),
    "llama4_pythonic": ('[get_weather(city="Paris", days=3), get_weather(city="Rome")]', ""),
    "phi4_mini_json": (f"functools[{P}, {R}]", ""),
    "xlam": (f"Checking both.\n```json\n[{P}, {R}]\n```", "Checking both."),
    "internlm": (
        f"Checking both.<|action_start|><|plugin|>{P}<|action_end|>"
        f"<|action_start|><|plugin|>{R}<|action_end|>",
        "Checking both.",
    ),
    "jamba": (f"Checking both.\n<tool_calls>[{P}, {R}]</tool_calls>", "Checking both."),
    "granite-20b-fc": (f"Checking both. <function_call> {P} <function_call> {R}", "Checking both."),
}


def _client(settings: ServerSettings, script: str) -> Iterator[TestClient]:
    with TestClient(build_app(FakeAsyncLLM(script=script, max_model_len=1024), settings)) as client:
        yield client


def _post(client: TestClient, stream: bool, **extra: Any) -> Any:
    body = {
        "messages": [{"role": "user", "content": "Weather in Paris and Rome?"}],
        "tools": E2E_TOOLS,
        "stream": stream,
        **extra,
    }
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("parser", sorted(E2E_SCRIPTS))
def test_tool_parsers_through_the_chat_route(parser: str, stream: bool) -> None:
    script, content = E2E_SCRIPTS[parser]
    settings = ServerSettings(enable_auto_tool_choice=True, tool_call_parser=parser)
    for client in _client(settings, script):
        calls, got_content, finish = calls_content_finish(_post(client, stream), stream)
        assert got_content == content and finish == "tool_calls"
        decoded = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
        assert decoded == E2E_CALLS
        assert all(c["id"].startswith("call_") for c in calls)
        # tool_choice "none": the output is text, as written
        response = _post(client, stream, tool_choice="none")
        calls, got_content, finish = calls_content_finish(response, stream)
        assert not calls and got_content == script and finish == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_minimax_m2_reasoning_and_calls_through_the_chat_route(stream: bool) -> None:
    call = mm_block(mm_call("get_weather", ("city", "Paris"), ("days", "3")))
    script = f"They want Paris.\n</think>\n\nChecking.\n{call}"
    settings = ServerSettings(
        enable_auto_tool_choice=True, tool_call_parser="minimax_m2", reasoning_parser="minimax_m2"
    )
    for client in _client(settings, script):
        response = _post(client, stream)
        calls, content, finish = calls_content_finish(response, stream)
        assert content == "Checking." and finish == "tool_calls"
        assert [json.loads(c["function"]["arguments"]) for c in calls] == [E2E_CALLS[0][1]]
        if stream:
            deltas = [e["choices"][0]["delta"] for e in sse_events(response.text) if e["choices"]]
            reasoning = "".join(d.get("reasoning") or "" for d in deltas)
        else:
            reasoning = response.json()["choices"][0]["message"]["reasoning"]
        assert reasoning == "They want Paris."
