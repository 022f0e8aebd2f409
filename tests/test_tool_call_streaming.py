"""Tool calls streamed in pieces (``ToolCallFragment``): the canonical JSON re-writer, the
streaming parsers' fragments against their own non-streamed result for random cuts of valid
and damaged messages, and :class:`ChoiceParser`'s numbering, ids and
``parallel_tool_calls`` over fragments and whole calls."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from parser_splits import random_pieces, split_ways
from test_tool_parsers_more import _llama3_message, _mistral_message

from chassis.builtin_plugins.parsers.hermes import HermesToolParser
from chassis.builtin_plugins.parsers.json_rewrite import MAX_DEPTH, JsonRewriter
from chassis.builtin_plugins.parsers.llama3_json import Llama3JsonToolParser
from chassis.builtin_plugins.parsers.mistral import MistralToolParser
from chassis.builtin_plugins.parsers.pythonic import PythonicToolParser
from chassis.serve.chat_parsing import ChoiceParser, tool_call_delta_json
from chassis.serve.forced_tool_calls import NamedToolCallParser, RequiredToolCallsParser
from chassis.serve.tool_parser import (
    ToolCall,
    ToolCallFragment,
    ToolDelta,
    ToolParser,
    join_fragments,
)

# -- the re-writer -----------------------------------------------------------------------------


def _random_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(8 if depth < 3 else 5)
    if kind == 0:
        return rng.choice([None, True, False])
    if kind == 1:
        return rng.choice([0, -7, 12345678901234567890, 2.5, -0.125, 1e-7, 3e20])
    if kind in (2, 3, 4):
        return "".join(rng.choice('ab é"\\/\n\t\x01世😀') for _ in range(rng.randrange(6)))
    if kind in (5, 6):
        return {f"k{i}": _random_value(rng, depth + 1) for i in range(rng.randrange(4))}
    return [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]


def _loose_json(value: Any, rng: random.Random) -> str:
    """``value`` as JSON a model might write: odd spacing, escaped or raw characters."""
    space = lambda: rng.choice(["", " ", "\n  ", "\t"])  # noqa: E731
    if isinstance(value, dict):
        items = [
            f"{space()}{_loose_json(k, rng)}{space()}:{space()}{_loose_json(v, rng)}"
            for k, v in value.items()
        ]
        return "{" + ",".join(items) + space() + "}"
    if isinstance(value, list):
        return "[" + ",".join(space() + _loose_json(v, rng) for v in value) + space() + "]"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=rng.random() < 0.5).replace("\\n", "\n", 1)
    return json.dumps(value)


def _rewrite(pieces: list[str]) -> tuple[str, JsonRewriter]:
    rewriter = JsonRewriter()
    return "".join(rewriter.feed(piece) for piece in pieces), rewriter


def test_rewriting_random_objects_gives_what_json_dumps_gives() -> None:
    rng = random.Random("rewriter")
    for _ in range(150):
        value = {f"key{i}": _random_value(rng) for i in range(rng.randrange(4))}
        suffix = rng.choice(["", " </tool_call>", "; {"])
        text = _loose_json(value, rng) + suffix
        expected = json.dumps(value, ensure_ascii=False)
        for pieces in (list(text), random_pieces(text, rng), [text]):
            out, rewriter = _rewrite(pieces)
            assert out == expected, text
            assert rewriter.done and not rewriter.failed
            assert rewriter.rest == suffix


@pytest.mark.parametrize(
    ("text", "out", "rest"),
    [
        ('{"x": NaN}', '{"x": ', "NaN}"),
        ('{"x": -Infinity}', '{"x": ', "-Infinity}"),
        ('{"x": 1e400}', '{"x": ', "1e400}"),
        ('{"x": 01}', '{"x": ', "01}"),
        ('{"x": tru}', '{"x": ', "tru}"),
        ('{"x": "\\q"}', '{"x": "', '\\q"}'),
        ('{"x": 1,}', '{"x": 1, ', "}"),
        ("[1]", "", "[1]"),
        ('{"a": ' * (MAX_DEPTH + 1), '{"a": ' * MAX_DEPTH, '{"a": '),
    ],
)
def test_rewriting_stops_at_what_is_not_json(text: str, out: str, rest: str) -> None:
    for pieces in split_ways(text, 5):
        got, rewriter = _rewrite(pieces)
        assert (got, rewriter.failed, rewriter.rest) == (out, True, rest)


def test_cut_short_values_are_pending_not_lost() -> None:
    for text, out, pending in [
        ('{"a": 12', '{"a": ', "12"),
        ('{"a": fal', '{"a": ', "fal"),
        ('{"a": "x\\u00', '{"a": "x', "\\u00"),
        ('{"a": "\\ud83d', '{"a": "', "\\ud83d"),  # the low half may still come
    ]:
        got, rewriter = _rewrite([text])
        assert (got, rewriter.pending(), rewriter.done, rewriter.failed) == (
            out,
            pending,
            False,
            False,
        )


# -- streaming parsers: fragments against the whole result --------------------------------------

TOOLS = [{"type": "function", "function": {"name": "get_weather"}}]


def _stream(cls: type[ToolParser], pieces: list[str]) -> tuple[str, list[ToolCallFragment]]:
    parser = cls(None, TOOLS)
    total = ToolDelta()
    for piece in pieces:
        total += parser.feed(piece)
    total += parser.finish()
    assert not total.calls, "a streaming parser reports every call as fragments"
    return total.content, total.fragments


def _check_fragments(fragments: list[ToolCallFragment]) -> None:
    """Calls start in index order, each before its pieces, and do not interleave."""
    current = -1
    for fragment in fragments:
        if fragment.starts_call:
            assert fragment.index == current + 1, fragments
            current = fragment.index
        else:
            assert fragment.index == current, fragments


def _check_every_way(cls: type[ToolParser], text: str, ways: list[list[str]]) -> ToolDelta:
    whole = cls(None, TOOLS).parse(text)
    for pieces in ways:
        content, fragments = _stream(cls, pieces)
        _check_fragments(fragments)
        assert (content, join_fragments(fragments)) == (whole.content, whole.calls), pieces
    return whole


def _hermes_message(rng: random.Random) -> tuple[str, int]:
    calls = [
        '{"name": "f", "arguments": {"x": 1, "s": "a\\"b</tool_call>"}}',
        '{"name":"g","arguments":{ "l" : [true, null, -2.5e3] }}',
        '{"arguments": {}, "name": "h"}',
        '{"name": "k", "arguments": "{\\"y\\": 2}"}',
    ]
    text, count = rng.choice(["", "Sure. ", "I <b>will</b>\n"]), 0
    for _ in range(rng.randint(1, 3)):
        text += "<tool_call>" + rng.choice(["", "\n"]) + rng.choice(calls)
        text += rng.choice(["</tool_call>", "\n</tool_call>\n"])
        count += 1
    return text + rng.choice(["", "done", " "]), count


def _required_message(rng: random.Random) -> tuple[str, int]:
    calls = ['{"name": "a", "parameters": {"u": "c"}}', '{"name":"b","parameters":{}}']
    count = rng.randint(1, 3)
    return "[" + ", ".join(rng.choice(calls) for _ in range(count)) + "]", count


def _named_message(rng: random.Random) -> tuple[str, int]:
    return json.dumps({"city": rng.choice(["Paris", "Zürich 😀", 'a"b\n'])}), 1


_NOISE = [" ", "x", "{", "}", "[", "]", ";", ",", '"', ":", "\\", "[TOOL_CALLS]", "</tool_call>"]


@pytest.mark.parametrize(
    ("cls", "make"),
    [
        (HermesToolParser, _hermes_message),
        (Llama3JsonToolParser, _llama3_message),
        (MistralToolParser, _mistral_message),
        (RequiredToolCallsParser, _required_message),
        (NamedToolCallParser, _named_message),
    ],
)
def test_streamed_fragments_add_up_to_the_whole_result(cls: type[ToolParser], make: Any) -> None:
    """Valid and damaged messages (a fragment inserted, the end cut off), cut at random: the
    content and the fragments joined equal :meth:`parse`'s result, and valid messages give
    all their calls."""
    rng = random.Random(f"streamed:{cls.__name__}")
    for _ in range(120):
        text, count = make(rng)
        damaged = rng.random() < 0.4
        if damaged:
            at = rng.randint(0, len(text))
            if rng.random() < 0.5:
                text = text[:at] + rng.choice(_NOISE) + text[at:]
            else:
                text = text[:at]
        ways = [list(text), *(random_pieces(text, rng) for _ in range(4))]
        whole = _check_every_way(cls, text, ways)
        if not damaged:
            assert len(whole.calls) == count, text


@pytest.mark.parametrize(
    ("cls", "text"),
    [
        (HermesToolParser, '<tool_call>{"name": "f", "arguments": {"code": "print(1)\\n"}}'),
        (Llama3JsonToolParser, '{"name": "f", "parameters": {"code": "print(1)\\n"}}'),
        (MistralToolParser, '[TOOL_CALLS]f[ARGS]{"code": "print(1)\\n"}'),
        (MistralToolParser, '[TOOL_CALLS][{"name": "f", "arguments": {"code": "print(1)\\n"}}]'),
        (RequiredToolCallsParser, '[{"name": "f", "parameters": {"code": "print(1)\\n"}}]'),
        (NamedToolCallParser, '{"code": "print(1)\\n"}'),
    ],
)
def test_arguments_stream_as_they_are_written(cls: type[ToolParser], text: str) -> None:
    """Fed a character at a time, the call starts before its arguments end, and the
    arguments come in many pieces."""
    content, fragments = _stream(cls, list(text))
    assert content == ""
    assert len([f for f in fragments if f.starts_call]) == 1
    pieces = [f.arguments for f in fragments if not f.starts_call]
    assert len(pieces) > 10 and "".join(pieces) == '{"code": "print(1)\\n"}'


def test_whole_call_parsers_keep_reporting_whole_calls() -> None:
    """pythonic converts Python to JSON, so its calls are reported whole, at the end."""
    parser = PythonicToolParser(None, [])
    assert parser.feed("[f(a=1), g()]") == ToolDelta()
    assert parser.finish().calls == [ToolCall("f", '{"a": 1}'), ToolCall("g", "{}")]


def test_add_whole_calls_numbers_on_from_the_first_index() -> None:
    """The helper the built-ins share (review: each parser had its own loop for this)."""
    delta = ToolDelta()
    calls = [ToolCall("f", "{}"), ToolCall("g", '{"a": 1}', "id-g")]
    assert delta.add_whole_calls(2, calls) == 4
    assert delta.add_whole_calls(4, []) == 4
    assert delta.fragments == [
        ToolCallFragment(2, "{}", "f"),
        ToolCallFragment(3, '{"a": 1}', "g", "id-g"),
    ]


# -- ChoiceParser --------------------------------------------------------------------------


class _WholeCalls(ToolParser):
    """A third-party style parser: every line ``call NAME`` is a whole call."""

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]]) -> None:
        super().__init__(tokenizer, tools)
        self._held = ""

    def feed(self, text: str) -> ToolDelta:
        self._held += text
        out = ToolDelta()
        while "\n" in self._held:
            line, self._held = self._held.split("\n", 1)
            if line.startswith("call "):
                out.calls.append(ToolCall(line[5:], "{}"))
            else:
                out.content += line + "\n"
        return out

    def finish(self) -> ToolDelta:
        held, self._held = self._held, ""
        return ToolDelta(content=held)


def _choice_stream(parser: ChoiceParser, pieces: list[str]) -> list[dict[str, Any]]:
    items = []
    for piece in pieces:
        items += [tool_call_delta_json(f) for f in parser.feed(piece).fragments]
    return items + [tool_call_delta_json(f) for f in parser.finish().fragments]


def _accumulate(items: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """(id, name, arguments) per call, put together as an OpenAI client does."""
    calls: dict[int, list[str]] = {}
    for item in items:
        if "id" in item:
            assert item["index"] == len(calls) and item["type"] == "function"
            calls[item["index"]] = [item["id"], item["function"]["name"], ""]
        calls[item["index"]][2] += item["function"]["arguments"]
    return [(c[0], c[1], c[2]) for c in calls.values()]


TWO_HERMES = (
    '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>'
    '<tool_call>{"arguments": {}, "name": "b"}</tool_call>'
    '<tool_call>{"name": "c", "arguments": {"y": [2]}}</tool_call>'
)


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize(
    ("cls", "text", "names"),
    [
        (HermesToolParser, TWO_HERMES, ["a", "b", "c"]),
        (MistralToolParser, '[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[ARGS]{}', ["a", "b"]),
        (_WholeCalls, "hi\ncall a\ncall b\n", ["a", "b"]),
    ],
)
def test_choice_parser_numbers_and_ids_streamed_and_whole_calls(
    cls: type[ToolParser], text: str, names: list[str], parallel: bool
) -> None:
    whole_parser = ChoiceParser(None, cls(None, []), parallel_tool_calls=parallel)
    whole = whole_parser.parse(text)
    expected = names if parallel else names[:1]
    assert [c.name for c in whole.calls] == expected
    assert whole_parser.num_calls == len(expected)
    for pieces in split_ways(text, 10):
        parser = ChoiceParser(None, cls(None, []), parallel_tool_calls=parallel)
        calls = _accumulate(_choice_stream(parser, pieces))
        assert [(name, arguments) for _, name, arguments in calls] == [
            (c.name, c.arguments) for c in whole.calls
        ]
        assert parser.num_calls == len(expected)
        assert len({call_id for call_id, _, _ in calls}) == len(calls)
        if cls is MistralToolParser:
            assert all(len(call_id) == 9 and call_id.isalnum() for call_id, _, _ in calls)


def test_the_first_streamed_item_names_the_call_later_ones_only_add_arguments() -> None:
    parser = ChoiceParser(None, HermesToolParser(None, []))
    items = _choice_stream(parser, ["<tool_call>", '{"name": "f", "arguments": {"a"', ": 1}}"])
    first, second = items
    assert first["id"].startswith("call_")
    assert first == {
        "index": 0,
        "id": first["id"],
        "type": "function",
        "function": {"name": "f", "arguments": '{"a"'},
    }
    assert second == {"index": 0, "function": {"arguments": ": 1}"}}


def test_a_parser_breaking_the_contract_is_named() -> None:
    class Bad(_WholeCalls):
        def feed(self, text: str) -> ToolDelta:
            return ToolDelta(fragments=[ToolCallFragment(3, "{}")])

    with pytest.raises(ValueError, match="Bad sent arguments of call 3 before its start"):
        ChoiceParser(None, Bad(None, [])).feed("x")
