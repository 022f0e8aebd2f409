"""How request fields become one structured-output constraint, and the 400s for bad ones
(no engine: serve/structured_request.py, the protocol models and SamplingParams)."""

from __future__ import annotations

import json

import msgspec
import numpy as np
import pytest

from chassis import SamplingParams
from chassis.core.structured_output import StructuredOutputsParams
from chassis.core.structured_output_manager import pack_mask, unpack_masks
from chassis.serve.errors import APIError
from chassis.serve.protocol import ChatCompletionRequest, CompletionRequest

MESSAGES = [{"role": "user", "content": "hi"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def chat(**fields) -> SamplingParams:
    return ChatCompletionRequest(messages=MESSAGES, **fields).to_sampling_params()


def api_error(fn, *args, **kwargs) -> APIError:
    with pytest.raises(APIError) as info:
        fn(*args, **kwargs)
    assert info.value.status == 400
    return info.value


def test_response_format_json_schema_keeps_the_property_order() -> None:
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    params = chat(
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    )
    assert params.structured_outputs == StructuredOutputsParams(json=json.dumps(schema))
    assert list(json.loads(params.structured_outputs.json)["properties"]) == ["b", "a"]


@pytest.mark.parametrize(
    "fields,expected",
    [
        ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
        ({"response_format": {"type": "text"}}, None),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            StructuredOutputsParams(json_object=True),
        ),
        ({"structured_outputs": {"regex": "[ab]+"}}, StructuredOutputsParams(regex="[ab]+")),
        (
            {"structured_outputs": {"choice": ["yes", "no"]}},
            StructuredOutputsParams(choice=["yes", "no"]),
        ),
        ({"guided_choice": ["yes", "no"]}, StructuredOutputsParams(choice=["yes", "no"])),
        ({"guided_regex": "x+"}, StructuredOutputsParams(regex="x+")),
        ({"guided_json": {"type": "integer"}}, StructuredOutputsParams(json='{"type": "integer"}')),
        (
            {"guided_json": '{"type": "integer"}'},
            StructuredOutputsParams(json='{"type": "integer"}'),
        ),
    ],
)
def test_each_way_of_asking(fields, expected) -> None:
    assert chat(**fields).structured_outputs == expected
    completion = CompletionRequest(prompt="x", **fields).to_sampling_params()
    assert completion.structured_outputs == expected


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"response_format": {"type": "xml"}}, "response_format type must be"),
        ({"response_format": {"type": "json_schema"}}, "needs a json_schema object"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}},
            "must be a JSON schema",
        ),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one of"),
        ({"structured_outputs": {"grammar": ""}}, "grammar must be a non-empty string"),
        ({"structured_outputs": {}}, "exactly one of"),
        ({"guided_grammar": "root ::= x", "guided_regex": "a"}, "at most one"),
        ({"guided_choice": []}, "non-empty list"),
        ({"guided_json": "{not json"}, "not valid JSON"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "at most one"),
        ({"structured_outputs": {"json_object": True}, "min_tokens": 3}, "min_tokens"),
        (
            {"structured_outputs": {"regex": "a+", "disable_any_whitespace": True}},
            "disable_any_whitespace applies to JSON constraints only",
        ),
        (
            {"guided_choice": ["a"], "structured_outputs": {"whitespace_pattern": "[ ]?"}},
            "whitespace_pattern applies to JSON constraints only",
        ),
        (
            {"structured_outputs": {"json_object": True, "whitespace_pattern": 3}},
            "whitespace_pattern must be a string",
        ),
        (
            {
                "structured_outputs": {
                    "json_object": True,
                    "whitespace_pattern": " ",
                    "disable_any_whitespace": True,
                }
            },
            "not both",
        ),
        (
            {
                "response_format": {"type": "json_object"},
                "structured_outputs": {"disable_any_whitespace": True, "colour": 1},
            },
            "unknown field colour",
        ),
        ({"structured_outputs": {"disable_any_whitespace": True}}, "exactly one of"),
        (
            {"structured_outputs": {"json_object": True, "disable_any_whitespace": "yes"}},
            "disable_any_whitespace must be true or false",
        ),
        (
            {"structured_outputs": {"json_object": True, "disable_fallback": "yes"}},
            "disable_fallback must be true or false",
        ),
    ],
)
def test_bad_constraints_are_400s_that_say_why(fields, message) -> None:
    assert message in api_error(chat, **fields).message


def test_vllm_options_that_change_nothing_are_accepted() -> None:
    """vLLM's disable_fallback and disable_additional_properties (true or false), and
    disable_any_whitespace false and whitespace_pattern null, ask for what the built-in
    backend does anyway: the constraint is the one without them."""
    options = {
        "disable_fallback": True,
        "disable_additional_properties": False,
        "disable_any_whitespace": False,
        "whitespace_pattern": None,
    }
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for constraint in ({"json": schema}, {"regex": "a+"}):
        asked = chat(structured_outputs={**constraint, **options}).structured_outputs
        assert asked == StructuredOutputsParams(**constraint)


@pytest.mark.parametrize(
    "option", [{"disable_any_whitespace": True}, {"whitespace_pattern": "[ ]?"}]
)
def test_whitespace_options_reach_the_constraint_from_every_field(option) -> None:
    """disable_any_whitespace / whitespace_pattern in structured_outputs with the constraint,
    or alone there to shape the JSON response_format, guided_json or a forced tool call asks
    for (as vLLM merges them), on chat and completions."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    ways = [
        ({"structured_outputs": {"json": schema, **option}}, StructuredOutputsParams(json=schema)),
        (
            {
                "response_format": {"type": "json_schema", "json_schema": {"schema": schema}},
                "structured_outputs": option,
            },
            StructuredOutputsParams(json=schema),
        ),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": option},
            StructuredOutputsParams(json_object=True),
        ),
        (
            {"guided_json": schema, "structured_outputs": option},
            StructuredOutputsParams(json=schema),
        ),
    ]
    for fields, plain in ways:
        expected = msgspec.structs.replace(plain, **option)
        assert chat(**fields).structured_outputs == expected
        completion = CompletionRequest(prompt="x", **fields).to_sampling_params()
        assert completion.structured_outputs == expected
    forced = chat(
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        structured_outputs=option,
    ).structured_outputs
    assert forced == msgspec.structs.replace(
        chat(
            tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}
        ).structured_outputs,
        **option,
    )


def test_a_named_tool_choice_constrains_to_its_arguments() -> None:
    params = chat(
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    assert json.loads(params.structured_outputs.json) == WEATHER["function"]["parameters"]
    no_parameters = chat(
        tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}
    )
    assert json.loads(no_parameters.structured_outputs.json) == {
        "type": "object",
        "properties": {},
        "additionalProperties": False,
    }


def test_required_tool_choice_constrains_to_an_array_of_calls() -> None:
    schema = json.loads(chat(tools=[WEATHER, TIME], tool_choice="required").structured_outputs.json)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    names = [option["properties"]["name"]["const"] for option in schema["items"]["anyOf"]]
    assert names == ["get_weather", "get_time"]
    single = json.loads(
        chat(
            tools=[WEATHER], tool_choice="required", parallel_tool_calls=False
        ).structured_outputs.json
    )
    assert single["maxItems"] == 1


def test_forced_tool_calls_and_another_constraint_conflict() -> None:
    error = api_error(
        chat, tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}
    )
    assert error.param == "tool_choice"


def test_structured_outputs_params_travel_as_msgpack() -> None:
    params = SamplingParams(structured_outputs={"json": {"type": "object", "properties": {}}})
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert decoded.structured_outputs == params.structured_outputs
    assert params.structured_outputs.kind == "json"
    assert StructuredOutputsParams(choice=["a", "b"]).cache_key() == ("choice", ("a", "b"))
    with pytest.raises(ValueError, match=r"unknown_field|Unexpected keyword"):
        SamplingParams(structured_outputs={"unknown_field": 1})


def test_masks_pack_to_bits_and_back() -> None:
    rng = np.random.default_rng(0)
    masks = [rng.random(1001) < p for p in (0.0, 0.5, 1.0)]
    packed = [pack_mask(m) for m in masks]
    assert all(len(p) == 126 for p in packed)  # ceil(1001 / 8)
    assert np.array_equal(unpack_masks(packed, 1001), np.stack(masks))
