"""The ``granite``, ``seed_oss``, ``kimi_k2`` and ``deepseek_v31`` tool-call parsers (vLLM's
names): what they find in whole messages (calls, the content around them, malformed and cut
short calls), that calls stream as soon as they are committed, that the result never depends
on how the message was cut into pieces (damaged messages included), and each parser end to
end through ``/v1/chat/completions`` with the fake engine."""

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
from chassis.builtin_plugins.parsers.deepseek_v3 import CALL_BEGIN as DS_CALL_BEGIN
from chassis.builtin_plugins.parsers.deepseek_v3 import CALL_END as DS_CALL_END
from chassis.builtin_plugins.parsers.deepseek_v3 import CALLS_BEGIN as DS_CALLS_BEGIN
from chassis.builtin_plugins.parsers.deepseek_v3 import CALLS_END as DS_CALLS_END
from chassis.builtin_plugins.parsers.deepseek_v3 import SEP
from chassis.builtin_plugins.parsers.deepseek_v31 import DeepSeekV31ToolParser
from chassis.builtin_plugins.parsers.granite import GraniteToolParser
from chassis.builtin_plugins.parsers.kimi_k2 import (
    ARGUMENT_BEGIN,
    CALL_BEGIN,
    CALL_END,
    SECTION_BEGIN,
    SECTION_BEGIN_SINGULAR,
    SECTION_END,
    SECTION_END_SINGULAR,
    KimiK2ToolParser,
    name_of_call_id,
)
from chassis.builtin_plugins.parsers.seed_oss import SeedOssToolParser
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
    _tool("get_weather", city="string", days="integer"),
    _tool("f", i="integer", n="number", b="boolean", o="object", a="array", s="string"),
]


# -- running a parser every way -------------------------------------------------------------------


def _run(cls: type[ToolParser], pieces: list[str], tools: list[dict[str, Any]]) -> ToolDelta:
    """Everything a fresh parser returns for ``pieces`` then finish, its fragments checked:
    each call starts once, in order, before its arguments, and calls do not interleave."""
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


def _whole(
    cls: type[ToolParser], text: str, tools: list[dict[str, Any]] | None = None
) -> ToolDelta:
    """The result for ``text``, after checking that :meth:`parse`, one-character pieces and
    random cuts all give exactly the same (arguments text and ids included)."""
    tools = TOOLS if tools is None else tools
    whole = _run(cls, [text], tools)
    assert cls(None, tools).parse(text) == whole
    assert _run(cls, list(text), tools) == whole, "one-character pieces"
    rng = random.Random(f"{cls.__name__}:{text}")
    for _ in range(30):
        pieces = random_pieces(text, rng)
        assert _run(cls, pieces, tools) == whole, f"pieces {pieces!r}"
    return whole


def _every_way(
    cls: type[ToolParser], text: str, tools: list[dict[str, Any]] | None = None
) -> tuple[str, Calls]:
    return _decoded(_whole(cls, text, tools))


def _first_call(*arguments: str, name: str | None = None, call_id: str | None = None) -> ToolDelta:
    """A feed's result that adds only to the message's first call: its start when ``name``
    is given, then the ``arguments`` pieces."""
    start = [ToolCallFragment(0, "", name, call_id)] if name is not None else []
    return ToolDelta(fragments=start + [ToolCallFragment(0, piece) for piece in arguments])


# -- granite -------------------------------------------------------------------------------------

G_WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
G_NOW = '{"name": "now", "arguments": {}}'

GRANITE_CASES: list[tuple[str, str, Calls]] = [
    ("Just text, [brackets] and <tags>.", "Just text, [brackets] and <tags>.", []),
    # Granite 3.0's token, Granite 3.1's string, both, neither
    (f"<|tool_call|>[{G_WEATHER}]", "", [("get_weather", {"city": "Paris"})]),
    (f"<tool_call>[{G_WEATHER}]", "", [("get_weather", {"city": "Paris"})]),
    (f" \n<|tool_call|> <tool_call>\n[{G_WEATHER}]\n", "", [("get_weather", {"city": "Paris"})]),
    (f"[{G_WEATHER}, {G_NOW}]", "", [("get_weather", {"city": "Paris"}), ("now", {})]),
    # arguments re-written as canonical JSON; non-ASCII as is
    (
        '<|tool_call|>[{"name":"f","arguments":{ "s" :"Zürich 世界","a":[1 ,2.50]}}]',
        "",
        [("f", {"s": "Zürich 世界", "a": [1, 2.5]})],
    ),
    # calls written otherwise are read whole at the end: arguments first, as a string,
    # "parameters", a later element
    (
        '<|tool_call|>[{"arguments": {"city": "Rome"}, "name": "get_weather"}]',
        "",
        [("get_weather", {"city": "Rome"})],
    ),
    ('[{"name": "f", "arguments": "{\\"i\\": 1}"}]', "", [("f", {"i": 1})]),
    ('[{"name": "f", "parameters": {"i": 1}}]', "", [("f", {"i": 1})]),
    (f'[{G_NOW}, {{"arguments": {{}}, "name": "b"}}]', "", [("now", {}), ("b", {})]),
    # text after the array is content, its leading whitespace dropped
    (f"<|tool_call|>[{G_NOW}]\n\nDone.", "Done.", [("now", {})]),
    ('[{"arguments": {}, "name": "a"}] ok', "ok", [("a", {})]),
    # text before the calls: the whole message is content, as in vLLM
    (f"Sure. <|tool_call|>[{G_NOW}]", f"Sure. <|tool_call|>[{G_NOW}]", []),
    # not calls: content, as written
    ("[1, 2]", "[1, 2]", []),
    ("[link](https://x.y) [{", "[link](https://x.y) [{", []),
    ("<|tool_call|>[]", "<|tool_call|>[]", []),
    ("<|tool_call|>not json", "<|tool_call|>not json", []),
    ('[{"name": "", "arguments": {}}]', '[{"name": "", "arguments": {}}]', []),
    ('[{"arguments": {"a": NaN}, "name": "f"}]', '[{"arguments": {"a": NaN}, "name": "f"}]', []),
    # cut short before the call's head: content; after: what was written
    ('<|tool_call|>[{"name": "get_w', '<|tool_call|>[{"name": "get_w', []),
    ("<|tool_c", "<|tool_c", []),
    (
        '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Pa',
        "",
        [("get_weather", '{"city": "Pa')],
    ),
    # committed arguments that stop being JSON get the rest of the message, as written
    (
        '[{"name": "f", "arguments": {"i": 1 oops}}] tail',
        "",
        [("f", '{"i": 1oops}}] tail')],
    ),
    # an element after a streamed call that is no call ends the calls: text
    (f"[{G_NOW}, 5]", ", 5]", [("now", {})]),
    ("", "", []),
    ("  ", "  ", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), GRANITE_CASES)
def test_granite(text: str, content: str, calls: Calls) -> None:
    assert _every_way(GraniteToolParser, text) == (content, calls)


def test_granite_streams_a_call_once_its_head_is_written() -> None:
    parser = GraniteToolParser(None, TOOLS)
    assert parser.feed(" <|tool_") == ToolDelta()  # may be the tag: held
    assert parser.feed('call|>[{"name": "get_weather", "argu') == ToolDelta()
    assert parser.feed('ments": {"city": "Pa') == _first_call('{"city": "Pa', name="get_weather")
    assert parser.feed('ris"}}, {"name": "now", "arguments": {') == ToolDelta(
        fragments=[
            ToolCallFragment(0, 'ris"}'),
            ToolCallFragment(1, "", "now"),
            ToolCallFragment(1, "{"),
        ]
    )
    assert parser.feed("}}]") == ToolDelta(fragments=[ToolCallFragment(1, "}")])
    assert parser.finish() == ToolDelta()


def test_granite_content_streams_as_it_comes() -> None:
    parser = GraniteToolParser(None, TOOLS)
    assert parser.feed("  ") == ToolDelta()
    assert parser.feed("The answer") == ToolDelta(content="  The answer")
    assert parser.feed(" is [4]") == ToolDelta(content=" is [4]")
    assert parser.finish() == ToolDelta()


def test_granite_a_bracket_without_a_call_object_streams_as_content() -> None:
    parser = GraniteToolParser(None, TOOLS)
    assert parser.feed("[ ") == ToolDelta()  # may still be an array of calls
    assert parser.feed("See](https://x.y) for") == ToolDelta(content="[ See](https://x.y) for")
    assert parser.feed(" more.") == ToolDelta(content=" more.")
    assert parser.finish() == ToolDelta()


# -- seed_oss ------------------------------------------------------------------------------------


def seed_call(name: str, *params: tuple[str, str]) -> str:
    """A call as Seed-OSS's template writes it."""
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in params)
    return f"<seed:tool_call>\n<function={name}>\n{body}</function>\n</seed:tool_call>"


S_WEATHER = seed_call("get_weather", ("city", "Paris"), ("days", "3"))

SEED_CASES: list[tuple[str, str, Calls]] = [
    ("Just text, <b>tags</b> and < signs.", "Just text, <b>tags</b> and < signs.", []),
    (S_WEATHER, "", [("get_weather", {"city": "Paris", "days": 3})]),
    ("I'll check.\n\n" + S_WEATHER, "I'll check.", [("get_weather", {"city": "Paris", "days": 3})]),
    (
        "First. " + S_WEATHER + " Then. " + seed_call("now") + " Done.",
        "First. Then. Done.",
        [("get_weather", {"city": "Paris", "days": 3}), ("now", {})],
    ),
    # two functions in one block; values typed by the tools' schema
    (
        "<seed:tool_call>\n<function=now>\n</function>\n<function=f>\n"
        "<parameter=i>\n7\n</parameter>\n<parameter=n>\n2.5\n</parameter>\n"
        '<parameter=b>\nTrue\n</parameter>\n<parameter=o>\n{"k": [1, null]}\n</parameter>\n'
        "<parameter=a>\n[1, 'x']\n</parameter>\n<parameter=s>\n42\n</parameter>\n"
        "<parameter=x>\n42\n</parameter>\n</function>\n</seed:tool_call>",
        "",
        [
            ("now", {}),
            (
                "f",
                {
                    "i": 7,
                    "n": 2.5,
                    "b": True,
                    "o": {"k": [1, None]},
                    "a": [1, "x"],
                    "s": "42",
                    "x": "42",
                },
            ),
        ],
    ),
    (
        seed_call("f", ("i", "null"), ("s", "line\n\nnext")),
        "",
        [("f", {"i": None, "s": "line\n\nnext"})],
    ),
    # forgotten end tags
    (
        "<seed:tool_call>\n<function=g>\n<parameter=a>\n1\n</function>\n<seed:tool_call>"
        "<function=h></function></seed:tool_call>",
        "",
        [("g", {"a": "1"}), ("h", {})],
    ),
    # cut short once committed: what was written, valid JSON
    (
        "<seed:tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
        "",
        [("get_weather", {"city": "Par"})],
    ),
    # ... and before: text
    ("ok <seed:tool_call>\n<function=get_wea", "ok <seed:tool_call>\n<function=get_wea", []),
    ("ends with <seed:tool", "ends with <seed:tool", []),
    # a block that is no function call: text, as written
    (
        '<seed:tool_call>{"name": "x"}</seed:tool_call> ok',
        '<seed:tool_call>{"name": "x"}</seed:tool_call> ok',
        [],
    ),
    # Qwen's tag is not Seed's: text
    (
        "<tool_call>\n<function=a>\n</function>\n</tool_call>",
        "<tool_call>\n<function=a>\n</function>\n</tool_call>",
        [],
    ),
]


@pytest.mark.parametrize(("text", "content", "calls"), SEED_CASES)
def test_seed_oss(text: str, content: str, calls: Calls) -> None:
    assert _every_way(SeedOssToolParser, text) == (content, calls)


def test_seed_oss_streams_a_call_once_its_function_is_written() -> None:
    parser = SeedOssToolParser(None, TOOLS)
    assert parser.feed("Sure. <seed:tool") == ToolDelta(content="Sure.")
    assert parser.feed("_call>\n<function=get_wea") == ToolDelta()
    assert parser.feed("ther>\n<parameter=city>\nPa") == _first_call(
        "{", '"city": ', '"Pa', name="get_weather"
    )
    assert parser.feed("ris\n</parameter>\n<parameter=days>\n3") == _first_call(
        'ris"', ', "days": '
    )
    assert parser.feed("\n</parameter>\n</function>\n</seed:tool_call>") == _first_call("3", "}")
    assert parser.finish() == ToolDelta()


# -- kimi_k2 -------------------------------------------------------------------------------------


def kimi_call(call_id: str, arguments: str) -> str:
    """A call as Kimi K2's template writes it."""
    return f"{CALL_BEGIN}{call_id}{ARGUMENT_BEGIN}{arguments}{CALL_END}"


def kimi_calls(*calls: str) -> str:
    return SECTION_BEGIN + "".join(calls) + SECTION_END


K_WEATHER = kimi_call("functions.get_weather:0", '{"city": "Paris"}')
K_NOW = kimi_call("functions.now:1", "{}")

KIMI_CASES: list[tuple[str, str, list[tuple[str, Any, str]]]] = [
    ("Just text, <|tags|> and <| signs.", "Just text, <|tags|> and <| signs.", []),
    (kimi_calls(K_WEATHER), "", [("get_weather", {"city": "Paris"}, "functions.get_weather:0")]),
    (
        "Let me check.\n" + kimi_calls(K_WEATHER, K_NOW) + "\nDone.",
        "Let me check.\nDone.",
        [
            ("get_weather", {"city": "Paris"}, "functions.get_weather:0"),
            ("now", {}, "functions.now:1"),
        ],
    ),
    # whitespace around the id and the arguments; an id without "functions."
    (
        SECTION_BEGIN
        + f"\n{CALL_BEGIN} get_time:3 {ARGUMENT_BEGIN}\n{{ }}\n{CALL_END}\n"
        + SECTION_END,
        "",
        [("get_time", {}, "get_time:3")],
    ),
    # the singular spellings of the section's markers
    (
        SECTION_BEGIN_SINGULAR + K_NOW + SECTION_END_SINGULAR + " ok",
        "ok",
        [("now", {}, "functions.now:1")],
    ),
    # arguments re-written as canonical JSON
    (
        kimi_calls(kimi_call("functions.f:0", '{ "a" :[1 ,2.50],\n "s": "é <|tool_call_end|>"}')),
        "",
        [("f", {"a": [1, 2.5], "s": "é <|tool_call_end|>"}, "functions.f:0")],
    ),
    # a forgotten section end: text after the calls ends the section
    (SECTION_BEGIN + K_NOW + " Done.", "Done.", [("now", {}, "functions.now:1")]),
    # a call that is not written so is text, as written; the section is read on
    (
        SECTION_BEGIN + kimi_call("functions.f:0", "[1]") + K_NOW + SECTION_END,
        SECTION_BEGIN + kimi_call("functions.f:0", "[1]"),
        [("now", {}, "functions.now:1")],
    ),
    (
        kimi_calls(kimi_call("no_index", "{}")),
        kimi_calls(kimi_call("no_index", "{}")),
        [],
    ),
    # a section without a call is text, markers included
    (SECTION_BEGIN + SECTION_END, SECTION_BEGIN + SECTION_END, []),
    ("x " + SECTION_BEGIN + " y", "x " + SECTION_BEGIN + " y", []),
    # a call marker outside a section is text
    (K_NOW, K_NOW, []),
    # committed arguments: cut short as written; malformed: the rest up to the next marker
    (
        SECTION_BEGIN + CALL_BEGIN + "functions.f:0" + ARGUMENT_BEGIN + '{"city": "Pa',
        "",
        [("f", '{"city": "Pa', "functions.f:0")],
    ),
    (
        kimi_calls(kimi_call("functions.f:0", '{"a": NaN}'), K_NOW),
        "",
        [("f", '{"a": NaN}', "functions.f:0"), ("now", {}, "functions.now:1")],
    ),
    # cut short before the arguments: text
    (
        "ok " + SECTION_BEGIN + CALL_BEGIN + "functions.get_w",
        "ok " + SECTION_BEGIN + CALL_BEGIN + "functions.get_w",
        [],
    ),
    ("ends with <|tool_calls_sec", "ends with <|tool_calls_sec", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), KIMI_CASES)
def test_kimi_k2(text: str, content: str, calls: list[tuple[str, Any, str]]) -> None:
    whole = _whole(KimiK2ToolParser, text)
    found, decoded = _decoded(whole)
    ids = [call.id for call in whole.calls]
    assert (found, [(n, a, i) for (n, a), i in zip(decoded, ids, strict=True)]) == (
        content,
        calls,
    )


@pytest.mark.parametrize(
    ("call_id", "name"),
    [
        ("functions.get_weather:0", "get_weather"),
        ("get_weather:12", "get_weather"),
        ("a.b.c:1", "c"),
    ],
)
def test_kimi_k2_name_of_call_id(call_id: str, name: str) -> None:
    assert name_of_call_id(call_id) == name


def test_kimi_k2_streams_a_call_once_its_arguments_start() -> None:
    parser = KimiK2ToolParser(None, [])
    assert parser.feed("Sure." + SECTION_BEGIN[:6]) == ToolDelta(content="Sure.")
    head = SECTION_BEGIN[6:] + CALL_BEGIN + "functions.get_weather:0" + ARGUMENT_BEGIN
    assert parser.feed(head) == ToolDelta()  # not committed yet
    assert parser.feed('{"city": "Pa') == _first_call(
        '{"city": "Pa', name="get_weather", call_id="functions.get_weather:0"
    )
    assert parser.feed('ris"}' + CALL_END) == _first_call('ris"}')
    assert parser.feed(SECTION_END) == ToolDelta()
    assert parser.finish() == ToolDelta()


# -- deepseek_v31 --------------------------------------------------------------------------------


def v31_call(name: str, arguments: str) -> str:
    """A call as DeepSeek-V3.1's template writes it."""
    return f"{DS_CALL_BEGIN}{name}{SEP}{arguments}{DS_CALL_END}"


def v31_calls(*calls: str) -> str:
    return DS_CALLS_BEGIN + "".join(calls) + DS_CALLS_END


V_WEATHER = v31_call("get_weather", '{"city": "Paris"}')
V_NOW = v31_call("now", "{}")

V31_CASES: list[tuple[str, str, Calls]] = [
    ("Just text, <b>tags</b> and <｜ signs.", "Just text, <b>tags</b> and <｜ signs.", []),
    (v31_calls(V_WEATHER), "", [("get_weather", {"city": "Paris"})]),
    ("Let me check." + v31_calls(V_WEATHER), "Let me check.", [("get_weather", {"city": "Paris"})]),
    (
        "Let me check.\n\n" + v31_calls(V_WEATHER, V_NOW) + "\nDone.",
        "Let me check.\nDone.",
        [("get_weather", {"city": "Paris"}), ("now", {})],
    ),
    (
        v31_calls(v31_call("f", '{ "a" :[1 ,2.50],\n "code": "```py\\nx\\n```", "s": "é"}')),
        "",
        [("f", {"a": [1, 2.5], "code": "```py\nx\n```", "s": "é"})],
    ),
    # whitespace between calls and around the name is allowed
    (
        DS_CALLS_BEGIN
        + "\n"
        + DS_CALL_BEGIN
        + " now "
        + SEP
        + "\n{}"
        + DS_CALL_END
        + "\n"
        + DS_CALLS_END,
        "",
        [("now", {})],
    ),
    (DS_CALLS_BEGIN + V_NOW + " Done.", "Done.", [("now", {})]),
    # V3's form (a type, a fence) is not V3.1's: text, as written
    (
        v31_calls(f"{DS_CALL_BEGIN}function{SEP}f\n```json\n{{}}\n```{DS_CALL_END}"),
        v31_calls(f"{DS_CALL_BEGIN}function{SEP}f\n```json\n{{}}\n```{DS_CALL_END}"),
        [],
    ),
    (
        DS_CALLS_BEGIN + v31_call("f", "[1]") + V_NOW + DS_CALLS_END,
        DS_CALLS_BEGIN + v31_call("f", "[1]"),
        [("now", {})],
    ),
    (DS_CALLS_BEGIN + DS_CALLS_END, DS_CALLS_BEGIN + DS_CALLS_END, []),
    (V_NOW, V_NOW, []),
    # committed arguments: cut short as written; malformed: the rest up to the next marker
    (DS_CALLS_BEGIN + DS_CALL_BEGIN + "f" + SEP + '{"city": "Pa', "", [("f", '{"city": "Pa')]),
    (v31_calls(v31_call("f", '{"a": 1 x}'), V_NOW), "", [("f", '{"a": 1x}'), ("now", {})]),
    (v31_calls(v31_call("f", '{"a": 1}}')), "", [("f", {"a": 1})]),
    (
        "ok " + DS_CALLS_BEGIN + DS_CALL_BEGIN + "get_w",
        "ok " + DS_CALLS_BEGIN + DS_CALL_BEGIN + "get_w",
        [],
    ),
]


@pytest.mark.parametrize(("text", "content", "calls"), V31_CASES)
def test_deepseek_v31(text: str, content: str, calls: Calls) -> None:
    assert _every_way(DeepSeekV31ToolParser, text) == (content, calls)


def test_deepseek_v31_streams_a_call_once_its_arguments_start() -> None:
    parser = DeepSeekV31ToolParser(None, [])
    assert parser.feed("Sure." + DS_CALLS_BEGIN[:5]) == ToolDelta(content="Sure.")
    assert parser.feed(DS_CALLS_BEGIN[5:] + DS_CALL_BEGIN + "get_weather" + SEP) == ToolDelta()
    assert parser.feed('{"city": "Pa') == _first_call('{"city": "Pa', name="get_weather")
    assert parser.feed('ris"}' + DS_CALL_END + DS_CALLS_END) == _first_call('ris"}')
    assert parser.finish() == ToolDelta()


# -- random and damaged messages -----------------------------------------------------------------

_VALUE_CHARS = ["a", " ", "\n", "<", ">", "/", '"', "\\", "é", "😀", "{", "}", "[", "]", ":", "|"]


def _random_text(rng: random.Random) -> str:
    return "".join(rng.choice(_VALUE_CHARS) for _ in range(rng.randrange(8)))


def _message(cls: type[ToolParser], rng: random.Random) -> tuple[str, str, Calls]:
    """A well-formed message of ``cls``'s format: its text, content and calls."""
    calls: Calls = []
    for _ in range(rng.randrange(1, 4)):
        calls.append(("f", {"s": _random_text(rng), "i": rng.randrange(-5, 99)}))
    if cls is GraniteToolParser:
        lead = rng.choice(["", "<|tool_call|>", "<tool_call>", " <|tool_call|>\n"])
        items = [
            json.dumps({"name": n, "arguments": a}, ensure_ascii=rng.random() < 0.5)
            for n, a in calls
        ]
        return lead + "[" + rng.choice([", ", ","]).join(items) + "]", "", calls
    before = rng.choice(["", "Sure.", "Sure.\n"])
    if cls is SeedOssToolParser:
        body = ""
        for name, arguments in calls:
            text = arguments["s"].replace("<", "&")
            arguments["s"] = text if text.lower() != "null" else None
            body += seed_call(name, ("s", text), ("i", str(arguments["i"]))) + rng.choice(
                ["", "\n"]
            )
        return before + body, before.strip(), calls
    dumped = [json.dumps(a, ensure_ascii=rng.random() < 0.5) for _, a in calls]
    if cls is KimiK2ToolParser:
        text = kimi_calls(*(kimi_call(f"functions.f:{i}", d) for i, d in enumerate(dumped)))
    else:
        text = v31_calls(*(v31_call("f", d) for d in dumped))
    return before + text, before.strip(), calls


_PARSERS = [GraniteToolParser, SeedOssToolParser, KimiK2ToolParser, DeepSeekV31ToolParser]

#: what damaging a message may insert, per parser
_DAMAGE: dict[type[ToolParser], list[str]] = {
    GraniteToolParser: ["<|tool_call|>", "<tool_call>", "[", "]", "{", "}", '"', ",", " "],
    SeedOssToolParser: [
        "<seed:tool_call>",
        "</seed:tool_call>",
        "<function=",
        "</function>",
        "<parameter=",
        "</parameter>",
        ">",
        "\n",
    ],
    KimiK2ToolParser: [
        SECTION_BEGIN,
        SECTION_END,
        SECTION_BEGIN_SINGULAR,
        CALL_BEGIN,
        CALL_END,
        ARGUMENT_BEGIN,
        "{",
        "}",
        '"',
        ":0",
    ],
    DeepSeekV31ToolParser: [
        DS_CALLS_BEGIN,
        DS_CALLS_END,
        DS_CALL_BEGIN,
        DS_CALL_END,
        SEP,
        "{",
        "}",
        '"',
    ],
}


@pytest.mark.parametrize("cls", _PARSERS, ids=lambda cls: cls.__name__)
def test_random_messages(cls: type[ToolParser]) -> None:
    rng = random.Random(f"messages {cls.__name__}")
    tools = [_tool("f", s="string", i="integer")]
    for _ in range(30):
        text, content, calls = _message(cls, rng)
        assert _every_way(cls, text, tools) == (content, calls), text


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


@pytest.mark.parametrize("cls", _PARSERS, ids=lambda cls: cls.__name__)
def test_damaged_messages_are_chunk_invariant_and_lose_nothing(cls: type[ToolParser]) -> None:
    """Whatever the damage: the same result however the text is cut, well-formed fragments,
    and text that is no call kept: a message without a committed call comes back whole."""
    rng = random.Random(f"damaged {cls.__name__}")
    tools = [_tool("f", s="string", i="integer")]
    for _ in range(80):
        text = _damaged(_message(cls, rng)[0], rng, _DAMAGE[cls])
        whole = _whole(cls, text, tools)
        if not whole.calls:
            assert whole.content == text
        if cls is SeedOssToolParser:  # the parser writes the arguments: always JSON
            assert all(isinstance(json.loads(c.arguments), dict) for c in whole.calls), text


# -- registration, special tokens, end to end ----------------------------------------------------


def test_registered_by_vllm_names_and_special_tokens() -> None:
    registry: Registry[Any] = Registry(
        "tool-call parser", base="chassis.serve.tool_parser:ToolParser"
    )
    chassis_register_tool_parsers(registry=registry)
    assert registry.get("granite") is GraniteToolParser
    assert registry.get("seed_oss") is SeedOssToolParser
    assert registry.get("kimi_k2") is KimiK2ToolParser
    assert registry.get("deepseek_v31") is DeepSeekV31ToolParser
    # Granite's array is read with or without its <|tool_call|> token, as vLLM reads it
    assert GraniteToolParser.needs_special_tokens is False
    assert SeedOssToolParser.needs_special_tokens is True
    assert KimiK2ToolParser.needs_special_tokens is True
    assert DeepSeekV31ToolParser.needs_special_tokens is True


E2E_TOOLS = [_tool("get_weather", city="string", days="integer")]
E2E_CALLS = [
    ("get_weather", {"city": "Paris", "days": 3}),
    ("get_weather", {"city": "Rome", "days": 1}),
]
E2E_SCRIPTS = {
    "granite": '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}},'
    ' {"name": "get_weather", "arguments": {"city": "Rome", "days": 1}}]',
    "seed_oss": "Checking both.\n"
    + seed_call("get_weather", ("city", "Paris"), ("days", "3"))
    + seed_call("get_weather", ("city", "Rome"), ("days", "1")),
    "kimi_k2": "Checking both."
    + kimi_calls(
        kimi_call("functions.get_weather:0", '{"city": "Paris", "days": 3}'),
        kimi_call("functions.get_weather:1", '{"city": "Rome", "days": 1}'),
    ),
    "deepseek_v31": "Checking both."
    + v31_calls(
        v31_call("get_weather", '{"city": "Paris", "days": 3}'),
        v31_call("get_weather", '{"city": "Rome", "days": 1}'),
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
        assert content == ("" if parser == "granite" else "Checking both.")
        assert finish == "tool_calls"
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == (
            E2E_CALLS
        )
        ids = [c["id"] for c in calls]
        if parser == "kimi_k2":  # the model's ids, as Kimi's template wants them back
            assert ids == ["functions.get_weather:0", "functions.get_weather:1"]
        else:
            assert all(i.startswith("call_") for i in ids) and len(set(ids)) == 2
        if stream:  # the arguments come in pieces as they are written
            items = [
                i
                for e in sse_events(response.text)
                if e["choices"]
                for i in e["choices"][0]["delta"].get("tool_calls") or []
            ]
            assert len(items) > 4
    assert engine.requests[0][2].skip_special_tokens is (parser == "granite")


def test_whole_calls_are_not_reported() -> None:
    """These parsers stream: :func:`_run` relies on it (no ``ToolDelta.calls``)."""
    for parser, text in E2E_SCRIPTS.items():
        cls = {
            "granite": GraniteToolParser,
            "seed_oss": SeedOssToolParser,
            "kimi_k2": KimiK2ToolParser,
            "deepseek_v31": DeepSeekV31ToolParser,
        }[parser]
        delta = cls(None, E2E_TOOLS).feed(text)
        assert not delta.calls and delta.fragments
        assert isinstance(delta.whole_calls()[0], ToolCall)
