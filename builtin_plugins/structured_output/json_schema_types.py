"""The type-specific keywords of a JSON schema, compiled to byte IR.

One function per JSON type (integer, number, string, array, object); the keywords of other
types are ignored, as JSON Schema says (``minimum`` says nothing about a string). The
sub-schemas of arrays and objects go back to the :class:`SchemaCompiler` that called. See
:mod:`~chassis.builtin_plugins.structured_output.json_schema` for what is generated.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from chassis.builtin_plugins.structured_output import ir
from chassis.builtin_plugins.structured_output.json_formats import FORMATS
from chassis.builtin_plugins.structured_output.json_numbers import (
    any_number,
    integer_range,
    number_range,
)
from chassis.builtin_plugins.structured_output.json_syntax import (
    NOTHING,
    STRING_CHAR,
    UNESCAPED_FORBIDDEN,
    any_object,
    array,
    either,
    free_object,
    join,
    object_members,
    quoted,
    repeat,
)

if TYPE_CHECKING:
    from chassis.builtin_plugins.structured_output.json_schema_compiler import SchemaCompiler

__all__ = [
    "MAX_ITEMS",
    "MAX_STRING_LENGTH",
    "array_ir",
    "integer_ir",
    "number_ir",
    "object_ir",
    "pointer_token",
    "string_ir",
    "unsupported",
]

#: the largest ``minLength``/``maxLength`` (each character is a copy in the automaton)
MAX_STRING_LENGTH = 1000
#: the largest ``minItems``/``maxItems``
MAX_ITEMS = 100


def integer_ir(schema: dict[str, Any], path: str) -> ir.Node:
    """Integers within ``minimum``/``maximum``/``exclusive*`` (exactly), canonical decimal."""
    lo, lo_exclusive, hi, hi_exclusive = _bounds(schema, path)
    step = _multiple_of(schema, path)
    if step is not None and (1 / step).denominator != 1:
        raise ValueError(unsupported(
            "multipleOf", path, "(only a multipleOf that every integer satisfies, like 1)"
        ))  # fmt: skip
    low = None if lo is None else (math.floor(lo) + 1 if lo_exclusive else math.ceil(lo))
    high = None if hi is None else (math.ceil(hi) - 1 if hi_exclusive else math.floor(hi))
    if low is not None and high is not None and low > high:
        raise ValueError(f"the bounds at {path} allow no integer ({low} > {high})")
    return integer_range(low, high)


def number_ir(schema: dict[str, Any], path: str) -> ir.Node:
    """Numbers: any JSON number without bounds; with whole-number bounds, decimals (no
    exponent) whose parsed value is within them. ``multipleOf: 1`` means integers."""
    step = _multiple_of(schema, path)
    if step == 1:
        return integer_ir(schema, path)
    if step is not None:
        raise ValueError(unsupported(
            "multipleOf", path, 'on numbers (use "type": "integer" for whole numbers)'
        ))  # fmt: skip
    lo, lo_exclusive, hi, hi_exclusive = _bounds(schema, path)
    if lo is None and hi is None:
        return any_number()
    for name, bound in (("lower", lo), ("upper", hi)):
        if bound is not None and bound.denominator != 1:
            raise ValueError(
                f"the {name} bound {float(bound)} at {path} is not supported: bounds on "
                '"type": "number" must be whole numbers (e.g. minimum 0, maximum 1)'
            )
    if (
        lo is not None
        and hi is not None
        and (lo > hi or (lo == hi and (lo_exclusive or hi_exclusive)))
    ):
        raise ValueError(f"the bounds at {path} allow no number")
    return number_range(
        None if lo is None else int(lo),
        lo_exclusive,
        None if hi is None else int(hi),
        hi_exclusive,
    )


def string_ir(schema: dict[str, Any], path: str) -> ir.Node:
    """Strings: ``minLength``/``maxLength`` in characters, or an asserted ``format``, or a
    ``pattern`` (whole content, no escapes)."""
    min_length = _count(schema, "minLength", path, MAX_STRING_LENGTH) or 0
    max_length = _count(schema, "maxLength", path, MAX_STRING_LENGTH)
    if max_length is not None and max_length < min_length:
        raise ValueError(f"minLength {min_length} is above maxLength {max_length} at {path}")
    fmt = schema.get("format")
    fmt = FORMATS.get(fmt) if isinstance(fmt, str) else None
    if "pattern" in schema:
        if fmt is not None or min_length or max_length is not None:
            raise ValueError(unsupported(
                "pattern", path, "together with format/minLength/maxLength; put the "
                "length into the pattern instead (e.g. ^[a-z]{1,20}$)"
            ))  # fmt: skip
        return quoted(_pattern_content(schema["pattern"], path))
    if fmt is not None:
        if min_length > fmt.min_length or (
            max_length is not None and (fmt.max_length is None or max_length < fmt.max_length)
        ):
            raise ValueError(unsupported(
                "minLength/maxLength", path, f"together with format {schema['format']!r}"
            ))  # fmt: skip
        return quoted(fmt.content())
    return quoted(repeat(STRING_CHAR, min_length, max_length))


def _pattern_content(pattern: Any, path: str) -> ir.Node:
    """The raw content (no escapes) of strings matching ``pattern``."""
    from chassis.builtin_plugins.structured_output.regex import regex_to_ir

    if not isinstance(pattern, str):
        raise ValueError(f"pattern at {path} must be a string")
    try:
        node = _without_escaped_bytes(regex_to_ir(pattern), {})
    except ValueError as exc:
        raise ValueError(f"pattern at {path}: {exc}") from None
    if node == NOTHING:
        raise ValueError(
            f"pattern at {path} only matches strings that need escapes (quotes, "
            "backslashes or control characters), which patterned strings never contain"
        )
    return node


def array_ir(compiler: SchemaCompiler, schema: dict[str, Any], path: str) -> ir.Node:
    """Arrays: ``prefixItems`` (or a draft-4 ``items`` list) then ``items``, with
    ``minItems``/``maxItems``; without ``items``, any values."""
    min_items = _count(schema, "minItems", path, MAX_ITEMS) or 0
    max_items = _count(schema, "maxItems", path, MAX_ITEMS)
    if max_items is not None and max_items < min_items:
        raise ValueError(f"minItems {min_items} is above maxItems {max_items} at {path}")
    if schema.get("uniqueItems", False) is not False and (max_items is None or max_items > 1):
        raise ValueError(unsupported(
            "uniqueItems", path, "(distinct items cannot be enforced); drop it or set "
            "maxItems to 1"
        ))  # fmt: skip
    for keyword in ("contains", "minContains", "maxContains"):
        if keyword in schema:
            raise ValueError(unsupported(keyword, path, "; list the items with prefixItems"))
    items = schema.get("items")
    prefix_schemas = schema.get("prefixItems", [])
    rest_key = "items"
    if isinstance(items, list):  # draft 4-7 tuple form
        prefix_schemas, items, rest_key = (
            items,
            schema.get("additionalItems"),
            "additionalItems",
        )
    if not isinstance(prefix_schemas, list):
        raise ValueError(f"prefixItems at {path} must be an array of schemas")
    unevaluated = schema.get("unevaluatedItems")
    if isinstance(unevaluated, dict):
        raise ValueError(unsupported("unevaluatedItems", path, "as a schema; use items"))
    if items is None and unevaluated is False:
        items = False
    prefix = [compiler.compile(s, f"{path}/prefixItems/{i}") for i, s in enumerate(prefix_schemas)]
    if items is None:  # absent: any value, one level shallower than the array
        rest = compiler.free_value(compiler.free_depth - 1)
    else:
        rest = compiler.compile(items, f"{path}/{rest_key}")
    return array(prefix, rest, min_items, max_items)


def object_ir(compiler: SchemaCompiler, schema: dict[str, Any], path: str) -> ir.Node:
    """Objects: the declared properties in order (required ones always), or any keys when
    no property is declared and ``additionalProperties`` is not false."""
    for keyword in ("patternProperties", "propertyNames", "dependentRequired",
                    "dependentSchemas", "dependencies"):  # fmt: skip
        if schema.get(keyword):
            raise ValueError(unsupported(
                keyword, path, "; list the allowed properties under 'properties'"
            ))  # fmt: skip
    properties = schema.get("properties", {})
    if not isinstance(properties, dict):
        raise ValueError(f"properties at {path} must be an object mapping names to schemas")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ValueError(f"required at {path} must be an array of property names")
    extra = schema.get("additionalProperties")
    unevaluated = schema.get("unevaluatedProperties")
    if isinstance(unevaluated, dict):
        raise ValueError(unsupported(
            "unevaluatedProperties", path, "as a schema; use additionalProperties"
        ))  # fmt: skip
    if extra is None and unevaluated is False:
        extra = False
    if extra is not None and not isinstance(extra, bool | dict):
        raise ValueError(f"additionalProperties at {path} must be a boolean or a schema")
    min_properties = _count(schema, "minProperties", path, None) or 0
    max_properties = _count(schema, "maxProperties", path, None)
    declared = [
        (name, sub, f"{path}/properties/{pointer_token(name)}") for name, sub in properties.items()
    ]
    for name in dict.fromkeys(required):
        if name not in properties:
            if extra is False:
                raise ValueError(
                    f"required property {name!r} at {path} is not in 'properties' while "
                    "additionalProperties is false, so no object is valid; declare it "
                    "under 'properties'"
                )
            declared.append(
                (name, True if extra is None else extra, f"{path}/additionalProperties")
            )
    if not declared and extra is not False:
        if max_properties is not None or min_properties > 1:
            raise ValueError(unsupported(
                "minProperties/maxProperties", path, "on an object without 'properties'"
            ))  # fmt: skip
        if extra is None or extra is True:
            compiler.depth_sensitive = True
            return (
                any_object(compiler.free_depth)
                if min_properties == 0
                else free_object(compiler.free_value(compiler.free_depth - 1), 1)
            )
        return free_object(compiler.compile(extra, f"{path}/additionalProperties"), min_properties)
    num_required = sum(1 for name, _, _ in declared if name in required)
    if min_properties > num_required or (
        max_properties is not None and max_properties < len(declared)
    ):
        raise ValueError(unsupported(
            "minProperties/maxProperties", path, "beyond what 'required' and 'properties' "
            "imply; mark properties as required instead"
        ))  # fmt: skip
    members = [
        (name, compiler.compile(sub, sub_path), name in required)
        for name, sub, sub_path in declared
    ]
    return object_members(members)


# -- helpers ---------------------------------------------------------------------------------


def unsupported(keyword: str, path: str, advice: str) -> str:
    """The message refusing ``keyword`` at ``path``, with ``advice`` for the user."""
    return f"JSON schema keyword '{keyword}' at {path} is not supported {advice}".replace(" ;", ";")


def pointer_token(name: str) -> str:
    """``name`` escaped as one JSON-pointer token (``~0``, ``~1``)."""
    return name.replace("~", "~0").replace("/", "~1")


def _count(schema: dict[str, Any], key: str, path: str, cap: int | None) -> int | None:
    """A non-negative whole-number keyword (``None`` when absent), at most ``cap``."""
    if key not in schema:
        return None
    value = schema[key]
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or value < 0
        or value != int(value)
    ):
        raise ValueError(f"{key} at {path} must be a non-negative integer, not {value!r}")
    if cap is not None and value > cap:
        raise ValueError(f"{key} {int(value)} at {path} is above the supported maximum of {cap}")
    return int(value)


def _number(schema: dict[str, Any], key: str, path: str) -> Fraction | None:
    if key not in schema:
        return None
    value = schema[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{key} at {path} must be a finite number, not {value!r}")
    return Fraction(value)


def _bounds(
    schema: dict[str, Any], path: str
) -> tuple[Fraction | None, bool, Fraction | None, bool]:
    """(lower, lower is exclusive, upper, upper is exclusive) from minimum/maximum and
    exclusiveMinimum/exclusiveMaximum (numbers, or draft-4 booleans)."""
    out: list[Any] = []
    for plain, exclusive, stricter in (
        ("minimum", "exclusiveMinimum", max),
        ("maximum", "exclusiveMaximum", min),
    ):
        bound, is_exclusive = _number(schema, plain, path), False
        flag = schema.get(exclusive)
        if isinstance(flag, bool):  # draft 4: a flag on minimum/maximum
            is_exclusive = flag and bound is not None
        elif flag is not None:
            value = _number(schema, exclusive, path)
            if bound is None or stricter(value, bound) != bound or value == bound:
                bound, is_exclusive = value, True
        out += [bound, is_exclusive]
    return out[0], out[1], out[2], out[3]


def _multiple_of(schema: dict[str, Any], path: str) -> Fraction | None:
    step = _number(schema, "multipleOf", path)
    if step is not None and step <= 0:
        raise ValueError(f"multipleOf at {path} must be greater than 0")
    return step


def _without_escaped_bytes(node: ir.Node, memo: dict[int, ir.Node]) -> ir.Node:
    """``node`` without the bytes a JSON string holds only escaped (``"``, ``\\``, control
    characters): so a pattern's matches can be written raw between the quotes."""
    known = memo.get(id(node))
    if known is not None:
        return known
    if isinstance(node, ir.Bytes):
        out = NOTHING if any(b in UNESCAPED_FORBIDDEN for b in node.value) else node
    elif isinstance(node, ir.ByteSet):
        out = ir.ByteSet(node.allowed - UNESCAPED_FORBIDDEN)
    elif isinstance(node, ir.Seq):
        out = join(*(_without_escaped_bytes(item, memo) for item in node.items))
    elif isinstance(node, ir.Alt):
        out = either(*(_without_escaped_bytes(option, memo) for option in node.options))
    elif isinstance(node, ir.Repeat):
        separator = node.separator
        if separator is not None:
            separator = _without_escaped_bytes(separator, memo)
        out = repeat(_without_escaped_bytes(node.item, memo), node.min, node.max, separator)
    else:  # (ir.Separated: JSON objects' members, which no regex compiles to)
        raise TypeError(f"not an IR node of a pattern: {type(node).__name__}")
    memo[id(node)] = out
    return out
