"""JSON Schemas (and "any JSON object") compiled to the structured-output byte IR.

:func:`schema_to_ir` returns the JSON texts a model may write for a schema. Every text it
accepts parses with ``json.loads`` and is valid against the schema; it does not accept
every valid text, only the natural ones:

- properties come in the order ``properties`` declares them (required ones always, the
  others at most once), and only declared properties are written, even when
  ``additionalProperties`` allows more; with no ``properties`` at all, an object takes any
  keys (``additionalProperties`` absent or ``true``: any values; a schema: its values);
- whitespace runs (at most :data:`~json_syntax.MAX_WHITESPACE` bytes) may follow ``{ [ , :``
  and precede ``} ] , :``, so compact, ``", "``/``": "`` and pretty-printed output all pass;
  there is none before or after the top-level value (the default: a constraint may ask for
  none or for its own runs, :mod:`.json_whitespace`);
- ``enum``/``const`` scalars are written as ``json.dumps(value, ensure_ascii=False)``
  writes them; their arrays and objects keep their items and keys in order, with
  whitespace wherever JSON allows it; property names are written the same way;
- integers are canonical (no leading zeros, no fraction or exponent); numbers with bounds
  have no exponent, and their bounds must be whole numbers (``minimum: 0.5`` is refused);
- a ``pattern`` must match a string's whole content (as if anchored), and patterned
  strings are written without escapes: the pattern's quotes, backslashes and control
  characters are removed from what it may generate;
- ``format`` is asserted for ``date``, ``time``, ``date-time``, ``uuid``, ``ipv4`` and
  ``email``; other formats are annotations (as JSON Schema says by default) and ignored;
- ``oneOf`` is compiled as ``anyOf``: a text valid for two of its branches is accepted;
- recursion through ``$ref`` is unrolled :data:`MAX_RECURSION_DEPTH` times; past that the
  recursive branch matches nothing, so optional or empty alternatives end the recursion.

Nesting is limited twice: the schema's subschemas inside each other (``properties``,
``items``, ``anyOf`` members, ``allOf``..., a ``$ref``'s target counting as nested where it
is used, so that a chain of ``$ref`` is bounded too) to
:data:`~chassis.core.structured_nesting.MAX_NESTING_DEPTH` levels (a forced tool call's
wrapper not counted), and the schema's arrays and objects (as JSON) to
:data:`~chassis.core.structured_nesting.MAX_JSON_TEXT_DEPTH`.

Refused with ``ValueError`` (naming the keyword and its location, e.g.
``#/properties/tags``): ``not``, ``if``/``then``/``else``, ``patternProperties``,
``propertyNames``, ``dependentRequired``/``dependentSchemas``/``dependencies``,
``contains``, ``uniqueItems: true`` (unless at most one item), ``multipleOf`` (unless
every integer satisfies it), ``minProperties``/``maxProperties`` beyond what the required
and declared properties imply, remote ``$ref``, schemas with no finite instance, bounds
above :data:`MAX_STRING_LENGTH` (``minLength``/``maxLength``) and :data:`MAX_ITEMS`
(``minItems``/``maxItems``), and schemas whose automaton would be too large. Annotations
(``title``, ``description``, ``examples``, ``default``, ``$schema``, ``$id``,
``$comment``, ``deprecated``, ``readOnly``, ``writeOnly`` ...) and unknown keywords are
ignored.

Sizes: the automaton copies each shared sub-tree, so free-form values (``true``,
``{"type": "object"}``) and recursion grow quickly with depth. When a schema's automaton
would exceed :data:`~.automaton.MAX_NFA_STATES`, the free-form depth and the recursion depth are lowered
together (down to 1) until it fits.
"""

from __future__ import annotations

from typing import Any

from chassis.builtin_plugins.structured_output import ir
from chassis.builtin_plugins.structured_output.automaton import (
    MAX_NFA_STATES,
    estimated_nfa_states,
)
from chassis.builtin_plugins.structured_output.json_schema_compiler import SchemaCompiler
from chassis.builtin_plugins.structured_output.json_schema_types import (
    MAX_ITEMS,
    MAX_STRING_LENGTH,
)
from chassis.builtin_plugins.structured_output.json_syntax import NOTHING, any_object
from chassis.core.structured_nesting import check_json_value_nesting

__all__ = [
    "ANY_JSON_DEPTH",
    "JSON_OBJECT_DEPTH",
    "MAX_ITEMS",
    "MAX_RECURSION_DEPTH",
    "MAX_STRING_LENGTH",
    "any_json_object",
    "check_schema",
    "schema_to_ir",
]

#: how deep arrays and objects nest at most in a free-form value of a schema (the value
#: itself is level 1). Each level about doubles the automaton (a value is an array or an
#: object of values of the level below; see :mod:`json_syntax`): 5 levels are 7,505 NFA
#: states. Lower than :data:`JSON_OBJECT_DEPTH` because a schema may hold many free-form
#: values, each its own copy, and one whose automaton is too large has its free-form depth
#: and its ``$ref`` unrolling lowered together.
ANY_JSON_DEPTH = 5
#: how deep arrays and objects nest in "any JSON object" (``json_object``; the object is
#: level 1): 8 levels are 61,377 NFA states (9 would be 122,945, 10 past
#: :data:`~.automaton.MAX_NFA_STATES`; tests/perf/structured_output_cost.py prints the
#: sizes and build times), fewer than the 147,411 that 5 levels were before arrays and
#: objects were built with one copy of their item.
JSON_OBJECT_DEPTH = 8
#: how many times a ``$ref`` may be expanded inside itself
MAX_RECURSION_DEPTH = 5


def any_json_object() -> ir.Node:
    """Any JSON object (OpenAI's ``json_object``): keys are any JSON strings, values any
    JSON values, arrays and objects nested at most :data:`JSON_OBJECT_DEPTH` deep."""
    return any_object(JSON_OBJECT_DEPTH)


def check_schema(schema: dict[str, Any] | bool) -> None:
    """Raise ``ValueError`` (naming the keyword and where it is) if :func:`schema_to_ir`
    cannot compile ``schema``."""
    schema_to_ir(schema)


def schema_to_ir(schema: dict[str, Any] | bool, wrapper_levels: int = 0) -> ir.Node:
    """The JSON texts a model may write for ``schema``: each is valid JSON and valid against
    the schema (see the module docstring for what is generated, refused and ignored).
    ``wrapper_levels``: the subschema levels of ``schema`` that wrap the user's schemas (a
    forced tool call's array of calls), not counted against the nesting limit."""
    if schema is False:
        raise ValueError("the JSON schema is false: no value is valid against it")
    if not isinstance(schema, dict | bool):
        raise ValueError(
            f"a JSON schema must be an object or a boolean, not {type(schema).__name__}"
        )
    check_json_value_nesting(schema, "the JSON schema")
    states = 0
    for shrink in range(max(MAX_RECURSION_DEPTH, ANY_JSON_DEPTH)):
        compiler = SchemaCompiler(
            schema,
            ref_depth=max(1, MAX_RECURSION_DEPTH - shrink),
            free_depth=max(1, ANY_JSON_DEPTH - shrink),
            wrapper_levels=wrapper_levels,
        )
        node = compiler.compile(schema, "#")
        if node == NOTHING:
            raise compiler.no_instance_error()
        states = estimated_nfa_states(node)
        if states <= MAX_NFA_STATES or not compiler.depth_sensitive:
            break
    if states > MAX_NFA_STATES:
        raise ValueError(
            f"the JSON schema is too large to enforce: its automaton would need about "
            f"{states} states, more than {MAX_NFA_STATES}; lower maxLength/minLength/maxItems/"
            "minItems, shorten long enums, "
            "or nest less"
        )
    return node
