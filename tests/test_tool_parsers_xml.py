"""The ``qwen3_coder``, ``glm45`` and ``deepseek_v3`` tool-call parsers: what they find in
whole messages (calls, the content around them, malformed calls), Qwen3-Coder's and GLM's
conversion of argument values by the request's ``tools``, that calls stream as early as the
contract allows, that the result never depends on how the message was cut into pieces, and
each parser end to end through ``/v1/chat/completions`` with the fake engine."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import pytest
from fake_engine import FakeAsyncLLM
from fastapi.testclient import TestClient
from parser_splits import random_pieces
from test_server_chat_parsing import calls_content_finish
from test_server_routes import sse_events

from chassis.builtin_plugins.parsers import chassis_register_tool_parsers
from chassis.builtin_plugins.parsers.deepseek_v3 import (
    CALL_BEGIN,
    CALL_END,
    CALLS_BEGIN,
    CALLS_END,
    SEP,
    DeepSeekV3ToolParser,
)
from chassis.builtin_plugins.parsers.glm45 import Glm45ToolParser
from chassis.builtin_plugins.parsers.qwen3_coder import Qwen3CoderToolParser
from chassis.builtin_plugins.parsers.tag_values import ValueStream
from chassis.plugins.registry import Registry
from chassis.serve.app import build_app
from chassis.serve.settings import ServerSettings
from chassis.serve.tool_parser import ToolCall, ToolCallFragment, ToolDelta, ToolParser

Calls = list[tuple[str, Any]]


def _tool(name: str, **types: Any) -> dict[str, Any]:
    properties = {key: ({"type": kind} if kind is not None else {}) for key, kind in types.items()}
    return {
        "type": "function",
        "function": {"name": name, "parameters": {"type": "object", "properties": properties}},
    }


TOOLS = [
    _tool("get_weather", city="string", days="integer", metric="boolean"),
    _tool(
        "f",
        i="integer",
        n="number",
        b="boolean",
        o="object",
        a="array",
        s="string",
        e="enum",
        u=["integer", "null"],
        c="custom",
        plain=None,
    ),
]


# -- running a parser every way -----------------------------------------------------------------


def _run(cls: type[ToolParser], pieces: list[str], tools: list[dict[str, Any]]) -> ToolDelta:
    """Everything a fresh parser returns for ``pieces`` then finish, its fragments checked:
    each call starts once, before its arguments, and calls do not interleave."""
    parser = cls(None, tools)
    total = ToolDelta()
    for piece in pieces:
        total += parser.feed(piece)
    total += parser.finish()
    assert not total.calls, "these parsers stream their calls"
    started: list[int] = []
    for fragment in total.fragments:
        if fragment.starts_call:
            assert fragment.index == len(started), "calls are numbered in order"
            started.append(fragment.index)
        else:
            assert started and fragment.index == started[-1], "calls do not interleave"
    return ToolDelta(total.content, total.whole_calls())


def _decoded(delta: ToolDelta) -> tuple[str, Calls]:
    """(content, [(name, arguments decoded, or as text when they are not JSON)])."""
    calls: Calls = []
    for call in delta.calls:
        try:
            calls.append((call.name, json.loads(call.arguments, parse_constant=_no_constant)))
        except ValueError:
            calls.append((call.name, call.arguments))
    return delta.content, calls


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON a client can read")


def _first_call(*arguments: str, name: str | None = None) -> ToolDelta:
    """A feed's result that adds only to the message's first call: its start when ``name``
    is given, then the ``arguments`` pieces."""
    start = [ToolCallFragment(0, "", name)] if name is not None else []
    return ToolDelta(fragments=start + [ToolCallFragment(0, piece) for piece in arguments])


def _every_way(
    cls: type[ToolParser], text: str, tools: list[dict[str, Any]] | None = None, splits: int = 40
) -> tuple[str, Calls]:
    """The result for ``text`` whole, after checking that :meth:`parse`, one-character pieces
    and many random cuts all give exactly the same (arguments text included)."""
    tools = tools if tools is not None else TOOLS
    whole = _run(cls, [text], tools)
    assert cls(None, tools).parse(text) == whole
    assert _run(cls, list(text), tools) == whole, "one-character pieces"
    rng = random.Random(f"{cls.__name__}:{text}")
    for _ in range(splits):
        pieces = random_pieces(text, rng)
        assert _run(cls, pieces, tools) == whole, f"pieces {pieces!r}"
    return _decoded(whole)


# -- qwen3_coder ---------------------------------------------------------------------------------


def qwen_call(name: str, *params: tuple[str, str]) -> str:
    """A call as Qwen3-Coder's template writes it."""
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


WEATHER = qwen_call("get_weather", ("city", "Paris"), ("days", "3"))
NOW = qwen_call("now")

QWEN_CASES: list[tuple[str, str, Calls]] = [
    ("Just text, <b>tags</b> and < signs.", "Just text, <b>tags</b> and < signs.", []),
    (WEATHER, "", [("get_weather", {"city": "Paris", "days": 3})]),
    (
        "I'll check.\n\n" + WEATHER,
        "I'll check.",
        [("get_weather", {"city": "Paris", "days": 3})],
    ),
    (NOW, "", [("now", {})]),
    # text on both sides of the calls keeps the whitespace that followed a call
    (
        "First. " + WEATHER + " Then. " + NOW + " Done.",
        "First. Then. Done.",
        [("get_weather", {"city": "Paris", "days": 3}), ("now", {})],
    ),
    (WEATHER + "\n" + NOW + "\n", "", [("get_weather", {"city": "Paris", "days": 3}), ("now", {})]),
    # two functions in one block
    (
        "<tool_call>\n<function=a>\n</function>\n<function=b>\n<parameter=x>\n1\n</parameter>\n"
        "</function>\n</tool_call>",
        "",
        [("a", {}), ("b", {"x": "1"})],
    ),
    # values: one newline trimmed at each end, everything else kept as written
    (
        qwen_call("py", ("code", "def f():\n    return '<b>' + \"\\\\\"\n")),
        "",
        [("py", {"code": "def f():\n    return '<b>' + \"\\\\\"\n"})],
    ),
    (
        "<tool_call><function=f><parameter=s>Zürich 世界 😀</parameter></function></tool_call>",
        "",
        [("f", {"s": "Zürich 世界 😀"})],
    ),
    (qwen_call("f", ("s", "\n")), "", [("f", {"s": "\n"})]),
    (qwen_call("f", ("s", "")), "", [("f", {"s": ""})]),
    # null, in any case, is null; a word that starts like it is text
    (
        qwen_call("f", ("s", "null"), ("plain", "NULL"), ("t", "nullable"), ("v", "nul")),
        "",
        [("f", {"s": None, "plain": None, "t": "nullable", "v": "nul"})],
    ),
    # forgotten end tags: </parameter>, </function>, </tool_call>
    (
        "<tool_call>\n<function=g>\n<parameter=a>\n1\n<parameter=b>\n2\n</function>\n</tool_call>",
        "",
        [("g", {"a": "1", "b": "2"})],
    ),
    (
        "<tool_call>\n<function=g>\n<parameter=a>\n1\n</parameter>\n</tool_call> ok",
        "ok",
        [("g", {"a": "1"})],
    ),
    (
        "<tool_call>\n<function=a>\n</function>\n<tool_call>\n<function=b>\n</function>\n</tool_call>",
        "",
        [("a", {}), ("b", {})],
    ),
    (
        "<tool_call>\n<function=a>\n<parameter=x>\n1\n</parameter>\n<function=b>\n</function>",
        "",
        [("a", {"x": "1"}), ("b", {})],
    ),
    # cut short by the end of generation, once committed: what was written, valid JSON
    (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
        "",
        [("get_weather", {"city": "Par"})],
    ),
    ("<tool_call>\n<function=f>\n<parameter=i>\n4", "", [("f", {"i": 4})]),
    ("<tool_call>\n<function=f>\n<parameter=ci", "", [("f", {})]),
    ("<tool_call>\n<function=f>", "", [("f", {})]),
    # ... and before: text
    ("ok <tool_call>\n<function=get_wea", "ok <tool_call>\n<function=get_wea", []),
    ("ends with <tool_c", "ends with <tool_c", []),
    ("<tool_call>\n", "<tool_call>\n", []),
    # a block that is not a function call: text, as written
    (
        'See:\n<tool_call>\n{"name": "x"}\n</tool_call> ok',
        'See:\n<tool_call>\n{"name": "x"}\n</tool_call> ok',
        [],
    ),
    ("<tool_call></tool_call>", "<tool_call></tool_call>", []),
    (
        "a <tool_call><function=>x</function></tool_call>",
        "a <tool_call><function=>x</function></tool_call>",
        [],
    ),
    ("<tool_call><function=a\nb>x</tool_call>", "<tool_call><function=a\nb>x</tool_call>", []),
    # text in a call that is no parameter is dropped, as are broken parameters
    (
        "<tool_call>\n<function=g>\nnoise <b>\n<parameter=a\nb>x</parameter>\n<parameter=c>\n1\n"
        "</parameter>\nmore</function>\ntrailing</tool_call>",
        "",
        [("g", {"c": "1"})],
    ),
    # a <function= outside a block is text
    ("<function=a>\n</function>", "<function=a>\n</function>", []),
    ("trailing space  ", "trailing space  ", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), QWEN_CASES)
def test_qwen3_coder(text: str, content: str, calls: Calls) -> None:
    assert _every_way(Qwen3CoderToolParser, text) == (content, calls)


QWEN_CONVERSIONS: list[tuple[str, str, Any]] = [
    # (parameter of f, value as written, value in the arguments)
    ("i", "42", 42),
    ("i", "-7", -7),
    ("i", "4.5", "4.5"),
    ("i", "many", "many"),
    ("n", "2.50", 2.5),
    ("n", "3.0", 3),
    ("n", "1e3", 1000),
    ("n", "1e400", "1e400"),  # no finite JSON number: text
    ("n", "nan", "nan"),
    ("b", "True", True),
    ("b", "false", False),
    ("b", "yes", False),  # vLLM's reading: anything but true is false
    ("o", '{"a": [1, 2.5, null], "s": "x\ny"}', {"a": [1, 2.5, None], "s": "x\ny"}),
    ("o", "{'a': (1, None)}", {"a": [1, None]}),  # a Python literal
    ("o", "not json", "not json"),
    ("o", "NaN", "NaN"),  # no JSON form: text
    ("o", "{1, 2}", "{1, 2}"),  # a set: text
    ("a", "[1, 2]", [1, 2]),
    ("s", "42", "42"),
    ("e", "42", "42"),
    ("plain", "42", "42"),  # declared without a type: a string
    ("undeclared", "42", "42"),
    ("u", "7", 7),  # ["integer", "null"]: an integer
    ("u", "null", None),
    ("c", "(1, 'x')", [1, "x"]),  # another type: a Python literal
    ("c", "hello", "hello"),
    ("i", "Null", None),
]


@pytest.mark.parametrize(("param", "written", "value"), QWEN_CONVERSIONS)
def test_qwen3_coder_converts_values_by_the_declared_type(
    param: str, written: str, value: Any
) -> None:
    text = qwen_call("f", (param, written))
    assert _every_way(Qwen3CoderToolParser, text, splits=10) == ("", [("f", {param: value})])


def test_qwen3_coder_values_of_an_undeclared_function_are_text() -> None:
    text = qwen_call("get_weather", ("days", "3"), ("metric", "true"))
    assert _every_way(Qwen3CoderToolParser, text, tools=[]) == (
        "",
        [("get_weather", {"days": "3", "metric": "true"})],
    )
    converted = _every_way(Qwen3CoderToolParser, text)
    assert converted == ("", [("get_weather", {"days": 3, "metric": True})])


def test_qwen3_coder_streams_a_call_once_its_function_is_written() -> None:
    parser = Qwen3CoderToolParser(None, TOOLS)
    assert parser.feed("Sure. <tool") == ToolDelta(content="Sure.")
    assert parser.feed("_call>\n<function=get_wea") == ToolDelta()  # not committed yet
    assert parser.feed("ther>\n<parameter=ci") == _first_call("{", name="get_weather")
    assert parser.feed("ty>\nPa") == _first_call('"city": ', '"Pa')
    # a text value streams as it is written; its last newline may be the trimmed one
    assert parser.feed('ris "1"\n') == _first_call('ris \\"1\\"')
    assert parser.feed("</parameter>\n<parameter=days>\n3") == _first_call('"', ', "days": ')
    # a typed value is sent when it is complete
    assert parser.feed("0\n</parameter>\n</function>") == _first_call("30", "}")
    assert parser.feed("\n</tool_call>") == ToolDelta()
    assert parser.finish() == ToolDelta()


# -- glm45 ---------------------------------------------------------------------------------------


def glm_call(name: str, *pairs: tuple[str, str]) -> str:
    """A call as GLM-4.5's template writes it."""
    body = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in pairs)
    return f"<tool_call>{name}\n{body}</tool_call>"


GLM_WEATHER = glm_call("get_weather", ("city", "Paris"), ("days", "3"))

GLM_CASES: list[tuple[str, str, Calls]] = [
    ("Just text, <b>tags</b> and < signs.", "Just text, <b>tags</b> and < signs.", []),
    (GLM_WEATHER, "", [("get_weather", {"city": "Paris", "days": 3})]),
    (
        "Let me check.\n" + GLM_WEATHER,
        "Let me check.",
        [("get_weather", {"city": "Paris", "days": 3})],
    ),
    (
        "First. " + GLM_WEATHER + " Then. " + glm_call("now") + " Done.",
        "First. Then. Done.",
        [("get_weather", {"city": "Paris", "days": 3}), ("now", {})],
    ),
    # no arguments; pairs on the name's line (as GLM-4.7 writes them)
    ("<tool_call>now</tool_call>", "", [("now", {})]),
    (
        "<tool_call>g<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",
        "",
        [("g", {"a": 1})],
    ),
    # values not declared a string are JSON, else a Python literal, else text
    (
        glm_call(
            "g",
            ("n", "3"),
            ("t", "true"),
            ("o", '{"a": [1, null]}'),
            ("l", "[1, 'x', None]"),
            ("w", "Paris"),
            ("nan", "NaN"),
            ("q", '"quoted"'),
        ),
        "",
        [
            (
                "g",
                {
                    "n": 3,
                    "t": True,
                    "o": {"a": [1, None]},
                    "l": [1, "x", None],
                    "w": "Paris",
                    "nan": "NaN",
                    "q": "quoted",
                },
            )
        ],
    ),
    # ... and declared strings are text, stripped
    (
        glm_call("get_weather", ("city", "\n  42 <b>\n\tZürich  \n"), ("days", " 2 ")),
        "",
        [("get_weather", {"city": "42 <b>\n\tZürich", "days": 2})],
    ),
    (glm_call("get_weather", ("city", "")), "", [("get_weather", {"city": ""})]),
    # two calls, the first's end tag forgotten
    (
        "<tool_call>a\n<arg_key>x</arg_key>\n<arg_value>1</arg_value>\n<tool_call>b\n</tool_call>",
        "",
        [("a", {"x": 1}), ("b", {})],
    ),
    # a value whose end tag is forgotten ends with the call
    (
        "<tool_call>a\n<arg_key>x</arg_key><arg_value>yes</tool_call> ok",
        "ok",
        [("a", {"x": "yes"})],
    ),
    # text that is no pair, a key without a value, a key holding "<": dropped
    (
        "<tool_call>a\nnoise\n<arg_key>lost</arg_key> junk <arg_value>1</arg_value>\n"
        "<arg_key>b<c</arg_key><arg_value>2</arg_value><arg_key> k </arg_key>\n"
        "<arg_value>3</arg_value></tool_call>",
        "",
        [("a", {"k": 3})],
    ),
    # cut short once committed: what was written, valid JSON
    (
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par",
        "",
        [("get_weather", {"city": "Par"})],
    ),
    ("<tool_call>a\n<arg_key>x</arg_key>\n<arg_value>[1, 2", "", [("a", {"x": "[1, 2"})]),
    ("<tool_call>a\n<arg_key>x", "", [("a", {})]),
    ("<tool_call>a\n", "", [("a", {})]),
    # ... and before: text
    ("ok <tool_call>get_wea", "ok <tool_call>get_wea", []),
    ("<tool_call>", "<tool_call>", []),
    # a block whose first line is no function name: text, as written
    ("<tool_call>Just kidding</tool_call> ok", "<tool_call>Just kidding</tool_call> ok", []),
    (
        '<tool_call>\n{"name": "a"}\n</tool_call>',
        '<tool_call>\n{"name": "a"}\n</tool_call>',
        [],
    ),
    ("<tool_call></tool_call>", "<tool_call></tool_call>", []),
    ("trailing space  ", "trailing space  ", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), GLM_CASES)
def test_glm45(text: str, content: str, calls: Calls) -> None:
    assert _every_way(Glm45ToolParser, text) == (content, calls)


def test_glm45_streams_a_call_once_its_name_is_written() -> None:
    parser = Glm45ToolParser(None, TOOLS)
    assert parser.feed("Sure.\n<tool_call>get_wea") == ToolDelta(content="Sure.")
    assert parser.feed("ther\n<arg_key>ci") == _first_call("{", name="get_weather")
    assert parser.feed("ty</arg_key>\n<arg_value> Pa") == _first_call('"city": ', '"Pa')
    assert parser.feed("ris  ") == _first_call("ris")
    assert parser.feed("</arg_value><arg_key>days</arg_key><arg_value>1") == _first_call(
        '"', ', "days": '
    )
    assert parser.feed("2</arg_value>\n</tool_call>") == _first_call("12", "}")
    assert parser.finish() == ToolDelta()


# -- deepseek_v3 -------------------------------------------------------------------------------


def ds_call(name: str, arguments: str, kind: str = "function") -> str:
    """A call as DeepSeek-V3's template writes it."""
    return f"{CALL_BEGIN}{kind}{SEP}{name}\n```json\n{arguments}\n```{CALL_END}"


def ds_calls(*calls: str) -> str:
    return CALLS_BEGIN + "\n".join(calls) + CALLS_END


DS_WEATHER = ds_call("get_weather", '{"city": "Paris"}')
DS_NOW = ds_call("now", "{}")

DS_CASES: list[tuple[str, str, Calls]] = [
    ("Just text, <b>tags</b> and <｜ signs.", "Just text, <b>tags</b> and <｜ signs.", []),
    (ds_calls(DS_WEATHER), "", [("get_weather", {"city": "Paris"})]),
    ("Let me check." + ds_calls(DS_WEATHER), "Let me check.", [("get_weather", {"city": "Paris"})]),
    (
        "Let me check.\n\n" + ds_calls(DS_WEATHER, DS_NOW) + "\nDone.",
        "Let me check.\nDone.",
        [("get_weather", {"city": "Paris"}), ("now", {})],
    ),
    # arguments are re-written as canonical JSON; fences in strings are part of them
    (
        ds_calls(ds_call("f", '{ "a" :[1 ,2.50],\n "code": "```py\\nx\\n```", "s": "é"}')),
        "",
        [("f", {"a": [1, 2.5], "code": "```py\nx\n```", "s": "é"})],
    ),
    # lenient where nothing is lost: another type, a bare fence, spacing, a forgotten end
    (ds_calls(ds_call("f", "{}", kind="tool")), "", [("f", {})]),
    (CALLS_BEGIN + f"{CALL_BEGIN}function{SEP}f\n```\n{{}}\n```{CALL_END}", "", [("f", {})]),
    (
        ds_calls(DS_WEATHER) + ds_calls(DS_NOW),
        "",
        [("get_weather", {"city": "Paris"}), ("now", {})],
    ),
    (CALLS_BEGIN + DS_NOW + " Done.", "Done.", [("now", {})]),
    # a call that is not written so is text, as written; the section is read on
    (
        CALLS_BEGIN + ds_call("f", "[1]") + "\n" + DS_NOW + CALLS_END,
        CALLS_BEGIN + ds_call("f", "[1]"),
        [("now", {})],
    ),
    (
        ds_calls(DS_NOW, f"{CALL_BEGIN}function{SEP}g\nno json{CALL_END}"),
        f"\n{CALL_BEGIN}function{SEP}g\nno json{CALL_END}",
        [("now", {})],
    ),
    # a section without a call is text, markers included
    (CALLS_BEGIN + CALLS_END, CALLS_BEGIN + CALLS_END, []),
    ("x " + CALLS_BEGIN + " y", "x " + CALLS_BEGIN + " y", []),
    (
        "a " + ds_calls(ds_call("f", "oops")) + " b",
        "a " + ds_calls(ds_call("f", "oops")) + " b",
        [],
    ),
    # a call marker outside a section is text
    (DS_NOW, DS_NOW, []),
    # committed arguments: cut short as written; malformed: the rest up to the fence
    (
        CALLS_BEGIN + f'{CALL_BEGIN}function{SEP}f\n```json\n{{"city": "Pa',
        "",
        [("f", '{"city": "Pa')],
    ),
    (ds_calls(ds_call("f", '{"a": NaN}')), "", [("f", '{"a": NaN}')]),
    (ds_calls(ds_call("f", '{"a": 1}}')), "", [("f", {"a": 1})]),
    # cut short before: text
    (
        "ok " + CALLS_BEGIN + CALL_BEGIN + "function" + SEP + "get_w",
        "ok " + CALLS_BEGIN + CALL_BEGIN + "function" + SEP + "get_w",
        [],
    ),
    ("ends with <｜tool▁calls", "ends with <｜tool▁calls", []),
    ("trailing space  ", "trailing space  ", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), DS_CASES)
def test_deepseek_v3(text: str, content: str, calls: Calls) -> None:
    assert _every_way(DeepSeekV3ToolParser, text) == (content, calls)


def test_deepseek_v3_streams_a_call_once_its_arguments_start() -> None:
    parser = DeepSeekV3ToolParser(None, [])
    assert parser.feed("Sure." + CALLS_BEGIN[:5]) == ToolDelta(content="Sure.")
    head = CALLS_BEGIN[5:] + CALL_BEGIN + "function" + SEP + "get_weather\n```json\n"
    assert parser.feed(head) == ToolDelta()  # not committed yet
    assert parser.feed('{"city": "Pa') == _first_call('{"city": "Pa', name="get_weather")
    assert parser.feed('ris"}\n```' + CALL_END) == _first_call('ris"}')
    assert parser.feed(CALLS_END) == ToolDelta()
    assert parser.finish() == ToolDelta()


# -- all three -----------------------------------------------------------------------------------


def test_registered_by_name_and_special_tokens() -> None:
    registry: Registry[Any] = Registry(
        "tool-call parser", base="chassis.serve.tool_parser:ToolParser"
    )
    chassis_register_tool_parsers(registry=registry)
    assert registry.get("qwen3_coder") is Qwen3CoderToolParser
    assert registry.get("glm45") is Glm45ToolParser
    assert registry.get("deepseek_v3") is DeepSeekV3ToolParser
    # Qwen's <tool_call> is ordinary text; DeepSeek's markers are special tokens, and vLLM
    # keeps GLM-4.5's tags too
    assert Qwen3CoderToolParser.needs_special_tokens is False
    assert Glm45ToolParser.needs_special_tokens is True
    assert DeepSeekV3ToolParser.needs_special_tokens is True


@pytest.mark.parametrize(
    ("trim", "raw", "expected"),
    [
        ("newline", "\n\nab\n\n", '"\\nab\\n"'),
        ("newline", "\n", '""'),
        ("newline", " x ", '" x "'),
        ("space", " \n x\ty \n", '"x\\ty"'),
        ("space", "  ", '""'),
    ],
)
def test_value_trimming_does_not_depend_on_the_pieces(trim: str, raw: str, expected: str) -> None:
    for pieces in ([raw], list(raw), [raw[:1], "", raw[1:]]):
        stream = ValueStream(trim, text=True)
        assert "".join(stream.feed(p) for p in pieces) + stream.finish() == expected


_VALUE_CHARS = ["a", "b", " ", "\n", "<", ">", "/", '"', "\\", "é", "😀", "n", "u", "l", "=", "`"]


def _random_text(rng: random.Random, forbidden: tuple[str, ...]) -> str:
    while True:
        text = "".join(rng.choice(_VALUE_CHARS) for _ in range(rng.randrange(9)))
        if not any(marker in text for marker in forbidden):
            return text


def _words_then(rng: random.Random, text: str, content: str, tail: str) -> tuple[str, str]:
    """``text`` and ``content`` after some words (maybe none) before the next call: the
    whitespace that followed the last call (``tail``) stays only between texts."""
    words = rng.choice(["", "Well,", "Then: a < b"])
    if words:
        content += (tail if content else "") + words
    return text + words + rng.choice(["", " ", "\n\n"]), content


def _qwen_message(rng: random.Random) -> tuple[str, str, Calls]:
    forbidden = ("</parameter>", "<parameter=", "</function>", "</tool_call>", "<tool_call>")
    text, content, tail, calls = "", "", "", []
    for _ in range(rng.randrange(1, 4)):
        text, content = _words_then(rng, text, content, tail)
        params = []
        for key in rng.sample(["s", "t", "i"], rng.randrange(3)):
            value = str(rng.randrange(-5, 50)) if key == "i" else _random_text(rng, forbidden)
            params.append((key, value))
        tail = rng.choice(["", " ", "\n"])
        text += qwen_call("f", *params) + tail
        expected: dict[str, Any] = {}
        for key, value in params:
            expected[key] = int(value) if key == "i" else value
            if key != "i" and value.lower() == "null":
                expected[key] = None
        calls.append(("f", expected))
    return text, content, calls


#: undeclared GLM values, as written and as read
_GLM_UNDECLARED = [
    ("1", 1),
    ("true", True),
    ("[1, 'a']", [1, "a"]),
    ("word", "word"),
    ('{"a": "<b>"}', {"a": "<b>"}),
]


def _glm_message(rng: random.Random) -> tuple[str, str, Calls]:
    forbidden = ("</arg_value>", "</tool_call>", "<tool_call>")
    text, content, tail, calls = "", "", "", []
    for _ in range(rng.randrange(1, 4)):
        text, content = _words_then(rng, text, content, tail)
        pairs, expected = [], {}
        for key in rng.sample(["city", "n", "x"], rng.randrange(3)):
            if key == "city":
                value = _random_text(rng, forbidden)
                expected[key] = value.strip()
            elif key == "n":
                value = str(rng.randrange(99))
                expected[key] = int(value)
            else:
                value, expected[key] = rng.choice(_GLM_UNDECLARED)
            pairs.append((key, rng.choice(["", " ", "\n"]) + value))
        tail = rng.choice(["", " ", "\n"])
        text += glm_call("g", *pairs) + tail
        calls.append(("g", expected))
    return text, content, calls


def test_random_qwen3_coder_messages() -> None:
    rng = random.Random("qwen3_coder messages")
    tools = [_tool("f", s="string", t="text", i="integer")]
    for _ in range(40):
        text, content, calls = _qwen_message(rng)
        assert _every_way(Qwen3CoderToolParser, text, tools, splits=8) == (content, calls), text


def test_random_glm45_messages() -> None:
    rng = random.Random("glm45 messages")
    tools = [_tool("g", city="string", n="integer")]
    for _ in range(40):
        text, content, calls = _glm_message(rng)
        assert _every_way(Glm45ToolParser, text, tools, splits=8) == (content, calls), text


def test_random_deepseek_v3_messages() -> None:
    rng = random.Random("deepseek_v3 messages")
    for _ in range(40):
        expected: Calls = []
        calls = []
        for _ in range(rng.randrange(1, 4)):
            arguments = {"s": _random_text(rng, ()), "n": rng.randrange(99)}
            calls.append(ds_call("f", json.dumps(arguments, ensure_ascii=rng.random() < 0.5)))
            expected.append(("f", arguments))
        text = rng.choice(["", "Sure.", "Sure.\n"]) + ds_calls(*calls)
        content = text[: text.find(CALLS_BEGIN)].strip()
        assert _every_way(DeepSeekV3ToolParser, text, [], splits=8) == (content, expected)


# -- end to end ------------------------------------------------------------------------------------

E2E_TOOLS = [_tool("get_weather", city="string", days="integer")]
E2E_CALLS = [
    ("get_weather", {"city": "Paris", "days": 3}),
    ("get_weather", {"city": "Rome", "days": 1}),
]
E2E_SCRIPTS = {
    "qwen3_coder": "Checking both.\n"
    + qwen_call("get_weather", ("city", "Paris"), ("days", "3"))
    + "\n"
    + qwen_call("get_weather", ("city", "Rome"), ("days", "1")),
    "glm45": "Checking both.\n"
    + glm_call("get_weather", ("city", "Paris"), ("days", "3"))
    + glm_call("get_weather", ("city", "Rome"), ("days", "1")),
    "deepseek_v3": "Checking both."
    + ds_calls(
        ds_call("get_weather", '{"city": "Paris", "days": 3}'),
        ds_call("get_weather", '{"city": "Rome", "days": 1}'),
    ),
}


def _client(parser: str, engine: FakeAsyncLLM) -> Iterator[TestClient]:
    settings = ServerSettings(enable_auto_tool_choice=True, tool_call_parser=parser)
    with TestClient(build_app(engine, settings)) as client:
        yield client


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("parser", sorted(E2E_SCRIPTS))
def test_through_the_chat_route(parser: str, stream: bool) -> None:
    engine = FakeAsyncLLM(script=E2E_SCRIPTS[parser], max_model_len=1024)
    for client in _client(parser, engine):
        body = {
            "messages": [{"role": "user", "content": "Weather in Paris and Rome?"}],
            "tools": E2E_TOOLS,
            "stream": stream,
        }
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        calls, content, finish = calls_content_finish(response, stream)
        assert content == "Checking both." and finish == "tool_calls"
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == (
            E2E_CALLS
        )
        assert all(c["id"].startswith("call_") for c in calls)
        assert len({c["id"] for c in calls}) == 2
        if stream:  # the arguments come in pieces as they are written
            events = sse_events(response.text)
            items = [
                i
                for e in events
                if e["choices"]
                for i in e["choices"][0]["delta"].get("tool_calls") or []
            ]
            assert len(items) > 4
    needs = parser != "qwen3_coder"
    assert engine.requests[0][2].skip_special_tokens is not needs


def test_a_call_cut_by_max_tokens_keeps_what_was_written() -> None:
    script = E2E_SCRIPTS["qwen3_coder"]
    cut = script.index("Par") + 3
    engine = FakeAsyncLLM(script=script, max_model_len=1024)
    for client in _client("qwen3_coder", engine):
        for stream in (False, True):
            body = {
                "messages": [{"role": "user", "content": "Weather?"}],
                "tools": E2E_TOOLS,
                "stream": stream,
                "max_tokens": cut,
            }
            response = client.post("/v1/chat/completions", json=body)
            calls, content, finish = calls_content_finish(response, stream)
            assert finish == "length" and content == "Checking both."
            assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Par"}]


def test_whole_calls_are_not_reported() -> None:
    """These parsers stream: :func:`_run` relies on it (no ``ToolDelta.calls``)."""
    for cls, text in (
        (Qwen3CoderToolParser, WEATHER),
        (Glm45ToolParser, GLM_WEATHER),
        (DeepSeekV3ToolParser, ds_calls(DS_WEATHER)),
    ):
        delta = cls(None, TOOLS).feed(text)
        assert not delta.calls and delta.fragments
        assert isinstance(delta.whole_calls()[0], ToolCall)


#: what damaging a message may insert, per parser
_DAMAGE = {
    Qwen3CoderToolParser: [
        "<tool_call>",
        "</tool_call>",
        "<function=",
        "</function>",
        "<parameter=",
        "</parameter>",
        ">",
        "\n",
        "null",
    ],
    Glm45ToolParser: [
        "<tool_call>",
        "</tool_call>",
        "<arg_key>",
        "</arg_key>",
        "<arg_value>",
        "</arg_value>",
        "\n",
        " ",
    ],
    DeepSeekV3ToolParser: [
        CALLS_BEGIN,
        CALLS_END,
        CALL_BEGIN,
        CALL_END,
        SEP,
        "\n```",
        "{",
        "}",
        '"',
        "\n",
    ],
}


def _damaged(text: str, rng: random.Random, markers: list[str]) -> str:
    """``text`` with a few cuts, deletions and inserted markers."""
    for _ in range(rng.randrange(1, 5)):
        at = rng.randrange(len(text) + 1)
        kind = rng.randrange(3)
        if kind == 0:
            text = text[:at] + text[at + rng.randrange(1, 6) :]
        elif kind == 1:
            text = text[:at] + rng.choice(markers) + text[at:]
        else:
            text = text[:at]
    return text


@pytest.mark.parametrize("cls", list(_DAMAGE), ids=lambda cls: cls.__name__)
def test_damaged_messages_are_chunk_invariant(cls: type[ToolParser]) -> None:
    """Whatever the damage: the same result however the text is cut, well-formed fragments,
    and (for the tag formats, whose arguments the parser writes) arguments that are JSON."""
    rng = random.Random(f"damaged {cls.__name__}")
    for _ in range(120):
        if cls is Qwen3CoderToolParser:
            text = _qwen_message(rng)[0]
        elif cls is Glm45ToolParser:
            text = _glm_message(rng)[0]
        else:
            text = "Sure." + ds_calls(ds_call("f", '{"s": "a\\nb"}'), DS_NOW)
        text = _damaged(text, rng, _DAMAGE[cls])
        _, calls = _every_way(cls, text, splits=5)
        if cls is not DeepSeekV3ToolParser:
            assert all(isinstance(arguments, dict) for _, arguments in calls), text
