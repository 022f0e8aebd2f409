"""``allOf``: merging two JSON schemas into one that allows exactly what both allow.

Only what merges exactly is merged: keywords present on one side are kept, equal values
stay, and the keywords below combine by their meaning (``type`` intersects, ``required``
unites, bounds take the stricter value, ``enum`` intersects, sub-schemas become an
``allOf`` of both, two ``anyOf`` lists become the ``anyOf`` of every pair). Anything else
that differs (two patterns, two formats) raises ``ValueError``: its intersection is not a
schema this compiler can write. ``$ref`` and nested ``allOf`` are resolved by the caller.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["json_equal", "merge_schemas", "normalize"]

_LOWER_BOUNDS = ("minimum", "minLength", "minItems", "minProperties")
_UPPER_BOUNDS = ("maximum", "maxLength", "maxItems", "maxProperties")
_NUMERIC_TYPES = frozenset({"integer", "number"})
#: the most branches an ``anyOf`` x ``anyOf`` merge may produce
_MAX_PRODUCT = 64


def normalize(schema: dict[str, Any], path: str) -> dict[str, Any]:
    """``schema`` with OpenAPI's ``nullable: true`` folded into ``type`` and ``oneOf``
    folded into ``anyOf`` (the compiler treats them alike); both keys are removed."""
    if "nullable" not in schema and "oneOf" not in schema:
        return schema
    out = {k: v for k, v in schema.items() if k not in ("nullable", "oneOf")}
    if schema.get("nullable") is True and "type" in out:
        types = _types(out["type"])
        out["type"] = [*types, "null"] if "null" not in types else types
    if "oneOf" in schema:
        one_of = schema["oneOf"]
        if "anyOf" in out and isinstance(one_of, list) and isinstance(out["anyOf"], list):
            out["anyOf"] = _merge_keyword("anyOf", out["anyOf"], one_of, path)
        else:
            out["anyOf"] = one_of
    return out


def merge_schemas(a: dict[str, Any], b: dict[str, Any], path: str) -> dict[str, Any]:
    """One schema whose instances are those of both ``a`` and ``b`` (``ValueError`` naming
    the keyword and ``path`` when that is not expressible by merging keywords)."""
    a, b = normalize(a, path), normalize(b, path)
    out = dict(a)
    _merge_object_keywords(out, a, b, path)
    for key, value in b.items():
        if key in ("properties", "additionalProperties"):
            continue
        if key not in out:
            out[key] = value
        elif not json_equal(out[key], value):
            out[key] = _merge_keyword(key, out[key], value, path)
    return out


def _merge_object_keywords(
    out: dict[str, Any], a: dict[str, Any], b: dict[str, Any], path: str
) -> None:
    """Properties of both sides: a name declared on one side only must also satisfy the
    other side's ``additionalProperties``."""
    if not any(k in s for s in (a, b) for k in ("properties", "additionalProperties")):
        return
    props_a, props_b = a.get("properties", {}), b.get("properties", {})
    if not isinstance(props_a, dict) or not isinstance(props_b, dict):
        raise ValueError(f"'properties' at {path} must be an object mapping names to schemas")
    extra_a, extra_b = a.get("additionalProperties", True), b.get("additionalProperties", True)
    merged: dict[str, Any] = {}
    for name in [*props_a, *(n for n in props_b if n not in props_a)]:
        merged[name] = _all_of(props_a.get(name, extra_a), props_b.get(name, extra_b))
    out.pop("properties", None)
    out.pop("additionalProperties", None)
    if merged:
        out["properties"] = merged
    extra = _all_of(extra_a, extra_b)
    if extra is not True:
        out["additionalProperties"] = extra


def _all_of(x: Any, y: Any) -> Any:
    """The sub-schema allowing what both ``x`` and ``y`` allow (``True``/``False`` folded)."""
    if x is True or json_equal(x, y):
        return y
    if y is True:
        return x
    if x is False or y is False:
        return False
    return {"allOf": [x, y]}


def _merge_keyword(key: str, x: Any, y: Any, path: str) -> Any:
    if key == "type":
        return _merge_types(_types(x), _types(y))
    if key == "required" and isinstance(x, list) and isinstance(y, list):
        return [*x, *(name for name in y if name not in x)]
    if key == "const" or (key == "enum" and isinstance(x, list) and isinstance(y, list)):
        xs = [x] if key == "const" else x
        ys = {_canonical(v) for v in ([y] if key == "const" else y)}
        kept = [v for v in xs if _canonical(v) in ys]
        return kept[0] if key == "const" and kept else kept
    if key in _LOWER_BOUNDS + _UPPER_BOUNDS and _is_number(x) and _is_number(y):
        return max(x, y) if key in _LOWER_BOUNDS else min(x, y)
    if key in ("exclusiveMinimum", "exclusiveMaximum") and _is_number(x) and _is_number(y):
        return max(x, y) if key == "exclusiveMinimum" else min(x, y)
    sub_schemas = ("items", "additionalItems", "unevaluatedItems", "unevaluatedProperties")
    if key in sub_schemas and not isinstance(x, list) and not isinstance(y, list):
        return _all_of(x, y)  # (a list is a draft-4 tuple: merged only when equal)
    if key == "uniqueItems" and isinstance(x, bool) and isinstance(y, bool):
        return x or y
    if key == "anyOf" and isinstance(x, list) and isinstance(y, list):
        if len(x) * len(y) > _MAX_PRODUCT:
            raise ValueError(
                f"allOf at {path}: combining two anyOf/oneOf lists of {len(x)} and {len(y)} "
                f"schemas gives more than {_MAX_PRODUCT} branches; merge them by hand"
            )
        return [_all_of(p, q) for p in x for q in y]
    if key in _ANNOTATION_LIKE:
        return x
    raise ValueError(
        f"allOf at {path}: its members give '{key}' two different values ({_short(x)} and "
        f"{_short(y)}), which cannot be combined; write one schema with a single '{key}'"
    )


#: keys whose differing values do not matter when merging (annotations and containers)
_ANNOTATION_LIKE = frozenset(
    {"title", "description", "examples", "example", "default", "$comment", "$defs",
     "definitions", "$schema", "$id", "deprecated", "readOnly", "writeOnly"}
)  # fmt: skip


def _merge_types(x: list[str], y: list[str]) -> list[str]:
    out = [t for t in x if t in y]
    # an integer is a number: "integer" and "number" intersect as "integer"
    if "integer" in x and "number" in y and "integer" not in out:
        out.append("integer")
    if "number" in x and "integer" in y and "integer" not in out:
        out.append("integer")
    return out


def _types(value: Any) -> list[str]:
    return list(value) if isinstance(value, list) else [value]


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _canonical(value: Any) -> str:
    """A key equal for JSON-equal values (``1`` and ``True`` differ; ``1`` and ``1.0`` not)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def json_equal(x: Any, y: Any) -> bool:
    """Whether ``x`` and ``y`` are the same JSON value (see :func:`_canonical`)."""
    return _canonical(x) == _canonical(y)


def _short(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."
