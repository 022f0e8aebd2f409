"""The nesting limit of structured outputs: every front end counts its own nesting, so a
constraint's acceptance never depends on Python's recursion limit (torch.compile raises it
to 2000 in an engine that compiled a model; core/structured_nesting.py)."""

from __future__ import annotations

import inspect
import json
import sys
from collections.abc import Callable, Iterator
from typing import Optional

import pydantic
import pytest
from fastapi.testclient import TestClient

from chassis.builtin_plugins.structured_output.backend import (
    ChassisStructuredOutputBackend,
    constraint_automaton,
)
from chassis.builtin_plugins.structured_output.grammar_parser import parse_grammar
from chassis.core.async_llm import AsyncLLM
from chassis.core.config import EngineConfig
from chassis.core.structured_nesting import MAX_JSON_TEXT_DEPTH as TEXT_LIMIT
from chassis.core.structured_nesting import MAX_NESTING_DEPTH as LIMIT
from chassis.core.structured_nesting import json_text_depth
from chassis.core.structured_output import StructuredOutputsParams
from chassis.serve.app import build_app
from chassis.serve.settings import ServerSettings
from chassis.serve.structured_request import for_tool_choice

REFUSED = rf"nested too deeply \(limit {LIMIT}\)"
TEXT_REFUSED = rf"nested too deeply \(limit {TEXT_LIMIT}\)"


@pytest.fixture(params=[1000, 10000], ids=["recursionlimit-1000", "recursionlimit-10000"])
def recursion_limit(request: pytest.FixtureRequest) -> Iterator[int]:
    """Python's default recursion limit, then a raised one (as after torch.compile)."""
    saved = sys.getrecursionlimit()
    sys.setrecursionlimit(request.param)
    try:
        yield request.param
    finally:
        sys.setrecursionlimit(saved)


# -- constraints nested exactly `levels` deep, with a text each accepts ----------------------


def regex(levels: int) -> tuple[dict, str]:
    """Groups (each one level) that nest alternations and repetitions: ``(a|(a|...)b)*c``."""
    pattern, text = "x", "x"
    for _ in range(levels):
        pattern, text = f"(a|{pattern}b)*c", f"a{text}bc"
    return {"regex": pattern}, text


def grammar_groups(levels: int) -> tuple[dict, str]:
    """Repeated groups (one level each) around repetitions: ``("a" | ("a" | ... "b")* "b")*``."""
    body, text = '"x"', "x"
    for _ in range(levels):
        body, text = f'("a" | {body} "b")*', f"{text}b"
    return {"grammar": f"root ::= {body}"}, text


def grammar_rules(levels: int) -> tuple[dict, str]:
    """A chain of rules, each expanded inside the one before (one level each)."""
    rules = [f'r{i} ::= "a" r{i + 1} | "b"' for i in range(1, levels)]
    grammar = "root ::= r1\n" + "\n".join(rules) + f'\nr{levels} ::= "x"'
    return {"grammar": grammar}, "a" * (levels - 1) + "x"


def json_properties(levels: int) -> tuple[dict, str]:
    """A schema whose subschemas nest ``levels`` deep: objects in objects (a level each, two
    levels of its JSON text) around an integer."""
    schema: dict = {"type": "integer"}
    for _ in range(levels - 1):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return {"json": schema}, '{"a":' * (levels - 1) + "7" + "}" * (levels - 1)


def json_text(levels: int) -> tuple[dict, str]:
    """A schema whose JSON text nests ``levels`` deep (its subschemas do not): a ``const``
    of lists in lists."""
    value: list = [7]
    for _ in range(levels - 2):
        value = [value]
    schema = {"const": value}
    assert json_text_depth(json.dumps(schema)) == levels
    return {"json": schema}, json.dumps(value, separators=(",", ":"))


def json_refs(levels: int) -> tuple[dict, str]:
    """Subschemas nested through a chain of ``$ref`` (the JSON text stays shallow): the
    root with its ``$ref``'s target, then per definition its ``items`` (a ``$ref`` with its
    target), a level each, and an ``allOf`` at the end when ``levels`` is odd (its merged
    schema is one more)."""
    last = levels - 2 if levels % 2 else levels - 1
    one_item = {"type": "array", "minItems": 1, "maxItems": 1}  # (one copy of its item)
    defs: dict = {f"A{i}": one_item | {"items": {"$ref": f"#/$defs/A{i + 1}"}} for i in range(last)}
    defs[f"A{last}"] = {"allOf": [{"type": "integer"}]} if levels % 2 else {"type": "integer"}
    text = "[" * last + "5" + "]" * last
    return {"json": {"$defs": defs, "$ref": "#/$defs/A0"}}, text


def structural_tag(levels: int) -> tuple[dict, str]:
    """A structural tag whose schema nests through ``$ref`` (its own JSON text is shallow)."""
    constraint, value = json_refs(levels)
    tag = {
        "type": "structural_tag",
        "structures": [{"begin": "<f>", "schema": constraint["json"], "end": "</f>"}],
        "triggers": ["<f"],
    }
    return {"structural_tag": tag}, f"hi <f>{value}</f> bye"


FRONT_ENDS: dict[str, Callable[[int], tuple[dict, str]]] = {
    "regex": regex,
    "grammar-groups": grammar_groups,
    "grammar-rules": grammar_rules,
    "json-properties": json_properties,
    "json-text": json_text,
    "json-refs": json_refs,
    "structural-tag": structural_tag,
}
#: each front end's limit, in its own levels (a JSON text's arrays and objects have theirs)
LIMITS = {"json-text": TEXT_LIMIT}


def compile_constraint(constraint: dict | StructuredOutputsParams):
    """The API server's check, then the engine's compilation (both refuse the same)."""
    params = (
        constraint
        if isinstance(constraint, StructuredOutputsParams)
        else StructuredOutputsParams(**constraint)
    )
    ChassisStructuredOutputBackend.check(params)
    return constraint_automaton(params)


@pytest.mark.timeout(300)  # a hang guard
@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_the_limit_is_accepted_and_one_more_level_refused(
    front_end: str, recursion_limit: int
) -> None:
    make = FRONT_ENDS[front_end]
    limit = LIMITS.get(front_end, LIMIT)
    constraint, text = make(limit)
    automaton = compile_constraint(constraint)
    assert automaton.fullmatch(text.encode())
    # (a structural tag's free text may end in anything: spoil its tagged value instead)
    wrong = text.replace("5]", "?]") if front_end == "structural-tag" else text + "?"
    assert not automaton.fullmatch(wrong.encode())
    deeper, _ = make(limit + 1)
    with pytest.raises(ValueError, match=rf"nested too deeply \(limit {limit}\)"):
        compile_constraint(deeper)


def forced_tool_call(levels: int, tool_choice: str | dict) -> tuple[StructuredOutputsParams, str]:
    """A forced tool call (``tool_choice`` a named function or ``"required"``) of a function
    whose parameters schema nests ``levels`` subschemas deep, beside another function."""
    parameters, arguments = json_properties(levels)
    tools = [
        {"type": "function", "function": {"name": "f", "parameters": parameters["json"]}},
        {"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}},
    ]
    params = for_tool_choice(tool_choice, tools, parallel_tool_calls=True)
    if tool_choice == "required":
        return params, f'[{{"name":"f","parameters":{arguments}}}]'
    return params, arguments


TOOL_CHOICES = {"named": {"type": "function", "function": {"name": "f"}}, "required": "required"}


@pytest.mark.timeout(300)  # a hang guard
@pytest.mark.parametrize("tool_choice", TOOL_CHOICES)
def test_a_tool_call_may_nest_its_parameters_to_the_limit(
    tool_choice: str, recursion_limit: int
) -> None:
    """A forced tool call wraps the parameters in 3 subschema levels and 5 of JSON text
    (``"required"``): neither counts, so parameters nest as deep as any schema."""
    params, text = forced_tool_call(LIMIT, TOOL_CHOICES[tool_choice])
    automaton = compile_constraint(params)
    assert automaton.fullmatch(text.encode())
    assert not automaton.fullmatch(text.replace("7", "x").encode())
    deeper, _ = forced_tool_call(LIMIT + 1, TOOL_CHOICES[tool_choice])
    with pytest.raises(ValueError, match=REFUSED):
        compile_constraint(deeper)


def test_the_wrapper_levels_are_the_servers_own() -> None:
    """A request cannot claim wrapper levels, and the same schema with and without a
    wrapper is cached apart (one is refused, the other not)."""
    from chassis.serve.errors import APIError
    from chassis.serve.structured_request import from_request_fields

    schema, _ = json_properties(LIMIT + 1)
    with pytest.raises(APIError, match="json_wrapper_levels"):
        from_request_fields(None, {**schema, "json_wrapper_levels": 3}, {})
    plain = StructuredOutputsParams(**schema)
    wrapped = StructuredOutputsParams(**schema, json_wrapper_levels=3)
    assert plain.cache_key() != wrapped.cache_key()


def deep_list(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


@pytest.mark.parametrize(
    "constraint",
    [
        {"regex": "(" * 5000 + "a" + ")" * 5000},
        {"grammar": "root ::= " + "(" * 5000 + '"a"' + ")" * 5000},
        {"grammar": 'root ::= "a"' + "*" * 5000},
        {"json": "[" * 5000 + "]" * 5000},
        {"json": {"type": "integer", "x": deep_list(900)}},
        {"structural_tag": '{"structures": ' + "[" * 5000 + "]" * 5000 + "}"},
    ],
    ids=["regex", "grammar-groups", "grammar-repetitions", "json-text", "json-value", "tag"],
)
def test_far_too_deep_is_the_same_clear_refusal(constraint: dict, recursion_limit: int) -> None:
    with pytest.raises(ValueError, match=f"{REFUSED}|{TEXT_REFUSED}"):
        compile_constraint(constraint)


def test_a_grammar_rule_that_nests_too_deeply_is_named() -> None:
    parse_grammar("root ::= " + '"a"' + "?" * LIMIT)
    with pytest.raises(ValueError, match=rf"rule 'root' \(line 1\).*{REFUSED}"):
        parse_grammar("root ::= " + '"a"' + "?" * (LIMIT + 1))
    with pytest.raises(ValueError, match=rf"line 2, column {LIMIT + 10}: groups are {REFUSED}"):
        parse_grammar('x ::= "b"\nroot ::= ' + "(" * (LIMIT + 1) + '"a"' + ")" * (LIMIT + 1))


def test_recursion_is_unrolled_less_to_stay_within_the_limit() -> None:
    """A recursive rule whose unrolling would nest past the limit is unrolled less (as for
    the automaton's size), not refused. ``item`` alone is unrolled fully (9 parentheses);
    at the end of a chain of rules as long as the limit allows, less."""
    item = 'item ::= "x" ("(" item ")")?'
    nested = "x(" * 9 + "x" + ")" * 9
    assert compile_constraint({"grammar": f"root ::= item\n{item}"}).fullmatch(nested.encode())
    chain = "\n".join(f'c{i} ::= "." c{i + 1}' for i in range(1, LIMIT - 8))
    grammar = f"root ::= c1\n{chain}\nc{LIMIT - 8} ::= item\n{item}"
    automaton = compile_constraint({"grammar": grammar})
    prefix = "." * (LIMIT - 9)
    assert automaton.fullmatch(f"{prefix}x(x)".encode())
    assert not automaton.fullmatch(f"{prefix}{nested}".encode())


@pytest.mark.timeout(300)  # a hang guard
@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_the_limit_leaves_half_of_the_default_stack(front_end: str) -> None:
    """What the limit is chosen for: at it, compiling takes fewer than 500 frames beyond
    the caller's, half of Python's default limit. Worst cases too: identical deep
    alternatives (compared when deduplicated) and a deep pattern at the end of a ``$ref``
    chain."""
    worst = {
        "regex": {"regex": regex(LIMIT)[0]["regex"] + "|" + regex(LIMIT)[0]["regex"]},
        "json-refs": {
            "json": {
                "$defs": {
                    **json_refs(LIMIT - 1)[0]["json"]["$defs"],
                    f"A{(LIMIT - 1) // 2}": {"type": "string", "pattern": regex(LIMIT)[0]["regex"]},
                },
                "$ref": "#/$defs/A0",
            }
        },
    }
    constraint = worst.get(front_end, FRONT_ENDS[front_end](LIMITS.get(front_end, LIMIT))[0])
    compile_within(500, constraint)


@pytest.mark.timeout(300)  # a hang guard
def test_a_forced_tool_call_at_the_limit_leaves_half_of_the_default_stack() -> None:
    """The tool-call wrapper's levels are not counted, but they are walked: still within
    500 frames, with parameters at the limit ending in a regex pattern at its limit."""
    parameters: dict = {"type": "string", "pattern": regex(LIMIT)[0]["regex"]}
    for _ in range(LIMIT - 1):
        parameters = {"type": "object", "properties": {"a": parameters}, "required": ["a"]}
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    compile_within(500, for_tool_choice("required", tools, parallel_tool_calls=True))


def compile_within(frames: int, constraint: dict | StructuredOutputsParams) -> None:
    """Compile ``constraint`` with only ``frames`` frames of stack beyond the caller's."""
    saved = sys.getrecursionlimit()
    sys.setrecursionlimit(len(inspect.stack(0)) + frames)
    try:
        compile_constraint(constraint)
    finally:
        sys.setrecursionlimit(saved)


def test_the_server_refusal_names_the_limit(tiny_llama_dir) -> None:
    """The API server checks the constraint before it reaches the engine core: a 400 in
    OpenAI's shape whose ``param`` is ``structured_outputs`` and whose message names the
    limit, whichever field asked."""
    deep_regex, _ = regex(LIMIT + 1)
    deep_schema, _ = json_refs(LIMIT + 1)
    engine = AsyncLLM.from_engine_config(
        EngineConfig(
            model=str(tiny_llama_dir), dtype="float32", max_model_len=128, num_kv_blocks=16
        )
    )
    try:
        app = build_app(engine, ServerSettings(shutdown_engine_on_exit=False))
        with TestClient(app) as client:
            for fields in (
                {"structured_outputs": deep_regex},
                {"guided_json": deep_schema["json"]},
                {
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"name": "d", "schema": deep_schema["json"]},
                    }
                },
            ):
                response = client.post(
                    "/v1/chat/completions",
                    json={
                        "messages": [{"role": "user", "content": "x"}],
                        "max_tokens": 5,
                        **fields,
                    },
                )
                assert response.status_code == 400, response.text
                error = response.json()["error"]
                assert f"nested too deeply (limit {LIMIT})" in error["message"], error
                assert error["param"] == "structured_outputs"
                assert error["type"] == "invalid_request_error", error
            # a forced tool call's constraint is built from tools' parameters: tools it is
            deep_parameters = json_properties(LIMIT + 1)[0]["json"]
            tools = [{"type": "function", "function": {"name": "f", "parameters": deep_parameters}}]
            for route, tool_choice in (
                ("/v1/chat/completions", "required"),
                ("/v1/chat/completions", TOOL_CHOICES["named"]),
                ("/v1/responses", "required"),
            ):
                if route == "/v1/responses":
                    fields = {
                        "input": "x",
                        "max_output_tokens": 5,
                        "tools": [{"type": "function", **tools[0]["function"]}],
                    }
                else:
                    fields = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 5}
                    fields["tools"] = tools
                response = client.post(route, json={**fields, "tool_choice": tool_choice})
                assert response.status_code == 400, (route, response.text)
                error = response.json()["error"]
                assert f"nested too deeply (limit {LIMIT})" in error["message"], error
                assert error["param"] == "tools", (route, error)
                assert error["type"] == "invalid_request_error", error
    finally:
        engine.shutdown_sync()


def optional_model_chain(models: int) -> tuple[dict, str]:
    """The JSON schema pydantic writes for ``models`` models, each (but the first) with an
    ``Optional`` ``child`` of the one before (``anyOf`` [``$ref``, null]), and an instance
    of it with every child present."""
    model = pydantic.create_model("M0", name=(str, ...))
    for d in range(1, models):
        model = pydantic.create_model(
            f"M{d}",
            name=(str, ...),
            child=(Optional[model], None),  # noqa: UP045 (pydantic users write this)
        )
    instance: dict = {"name": "leaf"}
    for d in range(1, models):
        instance = {"name": f"m{d}", "child": instance}
    return model.model_json_schema(), json.dumps(instance)


def test_a_ref_and_its_target_are_one_level() -> None:
    """A ``$ref`` costs no level of its own (its target is the level): a chain of 16
    ``Optional[Model]`` (2 levels a model: the property's ``anyOf``, its member's ``$ref``
    with the model) fits the limit of 32, as 16 nested objects (2 levels each: a property,
    its object) do; 17 do not."""
    schema, text = optional_model_chain(16)
    automaton = compile_constraint({"json": schema})
    assert automaton.fullmatch(text.encode())
    assert automaton.fullmatch(b'{"name": "top", "child": null}')
    assert not automaton.fullmatch(text.replace('"leaf"', "7").encode())
    with pytest.raises(ValueError, match=REFUSED):
        compile_constraint({"json": optional_model_chain(17)[0]})


def test_consecutive_refs_each_count() -> None:
    """A ``$ref`` whose target is itself a ``$ref`` counts a level: a chain of references
    alone cannot nest (nor recurse in the compiler) without bound."""
    defs = {f"R{i}": {"$ref": f"#/$defs/R{i + 1}"} for i in range(LIMIT - 1)}
    defs[f"R{LIMIT - 1}"] = {"type": "integer"}
    assert compile_constraint({"json": {"$defs": defs, "$ref": "#/$defs/R0"}}).fullmatch(b"5")
    defs = {f"R{i}": {"$ref": f"#/$defs/R{i + 1}"} for i in range(LIMIT)}
    defs[f"R{LIMIT}"] = {"type": "integer"}
    with pytest.raises(ValueError, match=REFUSED):
        compile_constraint({"json": {"$defs": defs, "$ref": "#/$defs/R0"}})


@pytest.mark.parametrize("deeper", [0, 1])
def test_a_ref_target_counts_wherever_it_is_used_whichever_use_comes_first(deeper: int) -> None:
    """A ``$ref`` target compiled once (shallow) and used again deeper is refused as if it
    were compiled there: acceptance does not depend on the order of ``properties``."""

    def wrap(schema: dict, levels: int) -> dict:
        for _ in range(levels):
            schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
        return schema

    target = wrap({"type": "integer"}, 19)  # 20 levels; deepest use: 1 + 11 + 20 = 32
    uses = {"a": {"$ref": "#/$defs/X"}, "b": wrap({"$ref": "#/$defs/X"}, 11 + deeper)}
    for order in ("ab", "ba"):
        schema = {
            "type": "object",
            "properties": {name: uses[name] for name in order},
            "$defs": {"X": target},
        }
        if deeper:
            with pytest.raises(ValueError, match=REFUSED):
                compile_constraint({"json": schema})
        else:
            compile_constraint({"json": schema})
