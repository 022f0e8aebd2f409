"""vLLM's whitespace options for JSON constraints: ``disable_any_whitespace`` (compact JSON)
and ``whitespace_pattern`` (a regex for each run between tokens). The compiled automaton
accepts exactly the layouts asked for, strings keep their spaces, each option is its own
cache entry, and SmolLM2 writes compact JSON end to end."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from chassis import LLM, SamplingParams
from chassis.builtin_plugins.structured_output.backend import (
    ChassisStructuredOutputBackend,
    constraint_automaton,
)
from chassis.core.structured_output import StructuredOutputsParams, TokenVocabulary

SCHEMAS: list[tuple[dict[str, Any], Any]] = [
    (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "tags": {"type": "array", "items": {"type": "integer"}},
                "pet": {"enum": ["cat", {"kind": "dog", "legs": [4]}]},
            },
            "required": ["name", "tags", "pet"],
        },
        {"name": "Ann Lee", "tags": [1, 2], "pet": {"kind": "dog", "legs": [4]}},
    ),
    (
        {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "number"}}}},
        [{"x": 1.5}, {}, {"x": -2}],
    ),
    (  # free-form values: any JSON inside
        {"type": "object", "properties": {"data": {}}, "required": ["data"]},
        {"data": {"a b": [True, None, {"c": "d e"}], "f": []}},
    ),
    (  # $ref recursion
        {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {
                        "v": {"type": "integer"},
                        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}},
                    },
                    "required": ["v"],
                }
            },
            "$ref": "#/$defs/node",
        },
        {"v": 1, "kids": [{"v": 2}, {"v": 3, "kids": []}]},
    ),
]


def compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def spaced(value: Any) -> list[str]:
    """``value`` as writers with whitespace between tokens put it."""
    return [
        json.dumps(value, ensure_ascii=False),
        json.dumps(value, ensure_ascii=False, indent=2),
        compact(value).replace(",", ", ", 1),
        compact(value).replace(":", " :", 1),
    ]


def whitespace_outside_strings(text: str) -> bool:
    """Whether ``text`` (JSON) holds whitespace between its tokens."""
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in " \t\n\r":
            return True
    return False


@pytest.mark.parametrize("schema,value", SCHEMAS)
def test_compact_json_only_under_disable_any_whitespace(schema, value) -> None:
    automaton = constraint_automaton(
        StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    )
    text = compact(value)
    assert automaton.fullmatch(text.encode())
    for layout in spaced(value):
        assert layout != text and not automaton.fullmatch(layout.encode()), layout
    # the default constraint takes both
    default = constraint_automaton(StructuredOutputsParams(json=schema))
    assert all(default.fullmatch(t.encode()) for t in [text, *spaced(value)])


def test_compact_json_object() -> None:
    automaton = constraint_automaton(
        StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    )
    value = {"a": [1, {"b c": None}], "d": "e f"}
    assert automaton.fullmatch(compact(value).encode())
    assert not any(automaton.fullmatch(t.encode()) for t in spaced(value))
    assert not automaton.fullmatch(b'{ "a":1}') and not automaton.fullmatch(b'{"a":1 }')


def test_compact_structural_tag_schemas() -> None:
    tag = {
        "type": "structural_tag",
        "structures": [
            {
                "begin": "<f>",
                "schema": {"type": "object", "properties": {"a": {"type": "integer"}}},
                "end": "</f>",
            }
        ],
        "triggers": ["<f>"],
    }
    automaton = constraint_automaton(
        StructuredOutputsParams(structural_tag=tag, disable_any_whitespace=True)
    )
    assert automaton.fullmatch(b'say <f>{"a":1}</f> done')
    assert not automaton.fullmatch(b'say <f>{"a": 1}</f> done')


def test_whitespace_pattern_is_the_run_between_tokens() -> None:
    schema, value = SCHEMAS[0]
    params = StructuredOutputsParams(json=schema, whitespace_pattern=r"\n? ?")
    automaton = constraint_automaton(params)
    assert automaton.fullmatch(compact(value).encode())
    assert automaton.fullmatch(json.dumps(value).encode())  # ", " and ": "
    assert not automaton.fullmatch(json.dumps(value, indent=2).encode())  # two spaces
    assert automaton.fullmatch(b'{\n "name": "x",\n"tags":[ ],"pet":"cat"\n}')


@pytest.mark.parametrize(
    "pattern,message",
    [
        (r"\s*", "may match only JSON whitespace"),  # \s holds \f and \v
        ("[ ,]", "may match only JSON whitespace"),
        ("(", "whitespace_pattern:"),
    ],
)
def test_a_whitespace_pattern_beyond_json_whitespace_is_refused(pattern, message) -> None:
    params = StructuredOutputsParams(json_object=True, whitespace_pattern=pattern)
    with pytest.raises(ValueError, match=message):
        ChassisStructuredOutputBackend.check(params)


@pytest.mark.parametrize(
    "values,message",
    [
        ({"regex": "a", "disable_any_whitespace": True}, "JSON constraints only"),
        ({"choice": ["a"], "whitespace_pattern": " "}, "JSON constraints only"),
        ({"json_object": True, "disable_any_whitespace": 1}, "true or false"),
        ({"json_object": True, "whitespace_pattern": ""}, "non-empty string"),
        (
            {"json_object": True, "whitespace_pattern": " ", "disable_any_whitespace": True},
            "not both",
        ),
    ],
)
def test_misused_options_are_value_errors(values, message) -> None:
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**values)


def test_each_layout_is_its_own_cache_entry() -> None:
    schema = SCHEMAS[0][0]
    asked = [
        StructuredOutputsParams(json=schema),
        StructuredOutputsParams(json=schema, disable_any_whitespace=True),
        StructuredOutputsParams(json=schema, whitespace_pattern=" ?"),
        StructuredOutputsParams(json=schema, whitespace_pattern="\n?"),
    ]
    assert len({params.cache_key() for params in asked}) == len(asked)
    vocabulary = TokenVocabulary([bytes([b]) for b in range(256)], frozenset())
    backend = ChassisStructuredOutputBackend(vocabulary, work_budget=None)
    grammars = [backend.compile(params) for params in asked]
    assert len({id(grammar) for grammar in grammars}) == len(asked)
    assert backend.compile(asked[1]) is grammars[1]  # (the same options: the same entry)
    text = json.dumps(SCHEMAS[0][1]).encode()
    assert [g.automaton.fullmatch(text) for g in grammars] == [True, False, True, False]


def test_the_options_travel_as_msgpack() -> None:
    params = StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    encoded = msgspec.msgpack.encode(SamplingParams(structured_outputs=params))
    decoded = msgspec.msgpack.decode(encoded, type=SamplingParams)
    assert decoded.structured_outputs == params
    assert decoded.structured_outputs.cache_key() == params.cache_key()


def test_smollm2_writes_compact_json(smollm2_dir) -> None:
    """The same prompts with and without the option: the output has no whitespace between
    tokens and parses, where the default lets the model write its spaces."""
    llm = LLM(str(smollm2_dir), dtype="float32", max_model_len=512, num_kv_blocks=64)
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "country": {"type": "string"},
            "landmarks": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
        },
        "required": ["city", "country", "landmarks"],
        "additionalProperties": False,
    }
    asks = {
        "json": ("Name the capital of France, its country and landmarks, as JSON.", schema),
        "json_object": ("Describe a cat in JSON with its name and colour.", None),
    }
    try:
        texts = {}
        for name, options in (("default", {}), ("compact", {"disable_any_whitespace": True})):
            for kind, (question, constraint) in asks.items():
                constraint_field = {"json": constraint} if constraint else {"json_object": True}
                params = SamplingParams(
                    structured_outputs=StructuredOutputsParams(**constraint_field, **options),
                    temperature=0.0,
                    max_tokens=80,
                )
                [output] = llm.chat([{"role": "user", "content": question}], params)
                texts[name, kind] = output.outputs[0]
    finally:
        llm.shutdown()
    for kind in ("json", "json_object"):
        out = texts["compact", kind]
        assert out.finish_reason == "stop", out.text
        value = json.loads(out.text)
        assert isinstance(value, dict) and not whitespace_outside_strings(out.text), out.text
    assert json.loads(texts["compact", "json"].text)["city"] == "Paris"
    # (what the option changed: the model writes spaces when it may)
    assert whitespace_outside_strings(texts["default", "json"].text)
