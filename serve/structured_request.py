"""The request fields that ask for structured output, turned into one constraint.

OpenAI's ``response_format`` (``json_object``, ``json_schema``, and vLLM's older
``structural_tag``), vLLM's ``structured_outputs`` and its older ``guided_json`` /
``guided_regex`` / ``guided_choice`` / ``guided_grammar``, and, on chat, a
``tool_choice`` of ``"required"`` or a named function (the output is then the calls' JSON).
At most one of them may be given; each mistake is a 400 naming the field.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec

from chassis.core.structured_nesting import FORCED_TOOL_CALL_LEVELS
from chassis.core.structured_output import (
    CONSTRAINT_FIELDS,
    NO_OP_OPTIONS,
    StructuredOutputsParams,
)
from chassis.serve.errors import APIError, bad_request, from_value_error

_T = TypeVar("_T")

#: ``parameters`` of a function that declares none: the empty object only
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


def from_request_fields(
    response_format: dict[str, Any] | None,
    structured_outputs: dict[str, Any] | None,
    guided: dict[str, Any],
    *,
    forced_tool_call: bool = False,
) -> StructuredOutputsParams | None:
    """The constraint the fields ask for, or ``None``; ``guided`` maps the ``guided_*`` field
    names to their values (``None`` when absent). A ``structured_outputs`` that names no
    constraint but vLLM's options (``disable_any_whitespace``...) applies them to the
    constraint another field asks for (:func:`whitespace_options`); with none, it is a 400
    unless ``forced_tool_call`` (the chat route then applies them to the calls' JSON)."""
    asked: list[tuple[str, StructuredOutputsParams]] = []
    if response_format is not None:
        from_format = _from_response_format(response_format)
        if from_format is not None:
            asked.append(("response_format", from_format))
    if structured_outputs is not None:
        if not isinstance(structured_outputs, dict):
            raise bad_request("structured_outputs must be an object", "structured_outputs")
        if _names_constraint(structured_outputs):
            asked.append(("structured_outputs", _params("structured_outputs", structured_outputs)))
    for name, value in guided.items():
        if value is None:
            continue
        key = name.removeprefix("guided_")
        asked.append((name, _params(name, {key: value})))
    if len(asked) > 1:
        names = ", ".join(name for name, _ in asked)
        raise bad_request(
            f"give at most one structured-output constraint; got {names}", asked[1][0]
        )
    options = whitespace_options(structured_outputs)  # (checks an options-only field)
    if not asked:
        if structured_outputs is not None and not forced_tool_call:
            _params("structured_outputs", structured_outputs)  # (a 400: no constraint named)
        return None
    return with_options(asked[0][1], options)


def with_options(
    params: StructuredOutputsParams, options: dict[str, Any]
) -> StructuredOutputsParams:
    """``params`` with ``options`` (:func:`whitespace_options`) added; a 400 naming
    ``structured_outputs`` when they do not apply (not a JSON constraint)."""
    if not options:
        return params
    try:
        return msgspec.structs.replace(params, **options)
    except ValueError as exc:
        raise bad_request(str(exc), "structured_outputs") from None


def whitespace_options(structured_outputs: Any) -> dict[str, Any]:
    """vLLM's whitespace options in a ``structured_outputs`` that names no constraint, as
    keyword arguments of :class:`StructuredOutputsParams`: such a field shapes the JSON
    another field asks for (``response_format``, ``guided_json``, a forced tool call), as in
    vLLM. Empty when it names a constraint or is not an object; a key that is not one of
    vLLM's options is a 400."""
    if not isinstance(structured_outputs, dict) or _names_constraint(structured_outputs):
        return {}
    values, whitespace = _options("structured_outputs", structured_outputs)
    if values:
        raise bad_request(
            f"structured_outputs: unknown field {', '.join(sorted(values))} (or name one "
            f"constraint: {', '.join(CONSTRAINT_FIELDS)})",
            "structured_outputs",
        )
    return whitespace


def _names_constraint(values: dict[str, Any]) -> bool:
    return any(values.get(name) not in (None, False) for name in CONSTRAINT_FIELDS)


def for_tool_choice(
    tool_choice: str | dict[str, Any], tools: list[dict[str, Any]], parallel_tool_calls: bool
) -> StructuredOutputsParams:
    """The JSON the model must write for ``tool_choice`` ``"required"`` or a named function:
    the named function's arguments object, or an array of ``{"name", "parameters"}`` objects,
    one per call (at most one without ``parallel_tool_calls``)."""
    named = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
    arguments: dict[str, dict[str, Any]] = {}  # the callable functions' arguments schemas
    for i, tool in enumerate(tools):
        function = tool["function"]
        if named is None or function["name"] == named:
            arguments[function["name"]] = _object_parameters(function, i)
    if named is not None:
        return StructuredOutputsParams(json=arguments[named])
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "parameters": schema},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, schema in arguments.items()
    ]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    # (the array, its items and a call object wrap each parameters schema: not counted
    # against the nesting limit, so parameters may nest as deep as a schema)
    return StructuredOutputsParams(json=schema, json_wrapper_levels=FORCED_TOOL_CALL_LEVELS)


def naming_tools(open_stream: Callable[[], Awaitable[_T]]) -> Callable[[], Awaitable[_T]]:
    """``open_stream`` (the engine's start of a request) for a forced tool call: the
    constraint is built from the ``tools``' ``parameters`` schemas, so one the engine
    refuses (nested too deeply, too large...) is a 400 whose ``param`` is ``tools``, not
    the ``structured_outputs`` the engine names. Other errors pass unchanged."""

    async def opened() -> _T:
        try:
            return await open_stream()
        except (APIError, ValueError) as exc:  # (the engine's refusal arrives as a 400)
            error = exc if isinstance(exc, APIError) else from_value_error(exc)
            if error.status != 400 or error.param != "structured_outputs":
                raise
            detail = error.message.split(": ", 1)[-1]
            raise bad_request(
                "tools: a function's parameters schema cannot constrain the output of "
                f"tool_choice 'required' or a named function: {detail}",
                "tools",
            ) from None

    return opened


def _object_parameters(function: dict[str, Any], index: int) -> dict[str, Any]:
    """The schema of ``function``'s arguments, always an object: none declared takes no
    arguments; a schema without ``type`` (``{}`` included) gets ``type: object``; another
    type is a 400 (OpenAI's function arguments are an object)."""
    parameters = function.get("parameters")
    if parameters is None:
        return _NO_PARAMETERS
    kind = parameters.get("type", "object")
    if kind != "object":
        raise bad_request(
            f"tools[{index}].function.parameters must describe an object (type 'object') for "
            f"tool_choice 'required' or a named function; got type {kind!r}",
            f"tools.{index}.function.parameters",
        )
    return {**parameters, "type": "object"}


def _from_response_format(response_format: dict[str, Any]) -> StructuredOutputsParams | None:
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request(
                "response_format of type 'json_schema' needs a json_schema object "
                "({'name': ..., 'schema': {...}})",
                "response_format",
            )
        schema = spec.get("schema")
        if schema is None:  # OpenAI's schema is optional: then any JSON object
            return StructuredOutputsParams(json_object=True)
        if not isinstance(schema, dict | bool):
            raise bad_request(
                "response_format.json_schema.schema must be a JSON schema (an object)",
                "response_format",
            )
        return _params("response_format", {"json": schema})
    if kind == "structural_tag":  # vLLM's older shape: structures and triggers
        return _params("response_format", {"structural_tag": response_format})
    raise bad_request(
        "response_format type must be 'text', 'json_object', 'json_schema' or "
        f"'structural_tag'; got {kind!r}",
        "response_format",
    )


def _options(field: str, values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``values`` without vLLM's options, and the whitespace options among them that ask for
    something (``disable_any_whitespace: true``, a ``whitespace_pattern``); a 400 for a value
    of the wrong type."""
    values = dict(values)
    for name in NO_OP_OPTIONS:
        if not isinstance(values.pop(name, False), bool):
            raise bad_request(f"{field}.{name} must be true or false", field)
    compact = values.pop("disable_any_whitespace", False)
    if not isinstance(compact, bool):
        raise bad_request(f"{field}.disable_any_whitespace must be true or false", field)
    pattern = values.pop("whitespace_pattern", None)
    if pattern is not None and not isinstance(pattern, str):
        raise bad_request(f"{field}.whitespace_pattern must be a string (a regex)", field)
    whitespace: dict[str, Any] = {}
    if compact:
        whitespace["disable_any_whitespace"] = True
    if pattern is not None:
        whitespace["whitespace_pattern"] = pattern
    return values, whitespace


def _params(field: str, values: dict[str, Any]) -> StructuredOutputsParams:
    if "json_wrapper_levels" in values:  # (the server's own, for forced tool calls)
        raise bad_request(f"{field}: unknown field json_wrapper_levels", field)
    values, whitespace = _options(field, values)
    try:  # (StructuredOutputsParams checks that a schema given as text is JSON)
        return StructuredOutputsParams(**values, **whitespace)
    except TypeError as exc:  # an unknown key
        raise bad_request(f"{field}: {exc}", field) from None
    except ValueError as exc:
        raise bad_request(f"{field}: {exc}", field) from None
