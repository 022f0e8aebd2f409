"""The structure of a JSON schema: references, combinators and enums, compiled to byte IR.

:class:`SchemaCompiler` walks one schema: it resolves local ``$ref`` (unrolling recursion
to a fixed depth), merges ``allOf`` (:mod:`json_schema_merge`), turns ``anyOf``/``oneOf``
and type lists into alternatives and ``enum``/``const`` into literals, and hands each JSON
type to :mod:`json_schema_types`. See
:mod:`~chassis.builtin_plugins.structured_output.json_schema` for the contract.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

from chassis.builtin_plugins.structured_output import ir
from chassis.builtin_plugins.structured_output.json_schema_merge import (
    json_equal,
    merge_schemas,
    normalize,
)
from chassis.builtin_plugins.structured_output.json_schema_types import (
    array_ir,
    integer_ir,
    number_ir,
    object_ir,
    string_ir,
    unsupported,
)
from chassis.builtin_plugins.structured_output.json_syntax import (
    NOTHING,
    any_value,
    either,
    json_literal,
)
from chassis.core.structured_nesting import MAX_NESTING_DEPTH, nested_too_deeply

__all__ = ["SchemaCompiler"]

#: keywords that validate (all others are annotations or unknown, and ignored)
_VALIDATION = frozenset(
    {"type", "enum", "const", "nullable", "$ref", "allOf", "anyOf", "oneOf", "not", "if",
     "then", "else", "$dynamicRef", "$recursiveRef", "minimum", "maximum",
     "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minLength", "maxLength",
     "pattern", "format", "items", "prefixItems", "additionalItems", "minItems", "maxItems",
     "uniqueItems", "contains", "minContains", "maxContains", "unevaluatedItems",
     "properties", "required", "additionalProperties", "patternProperties",
     "propertyNames", "minProperties", "maxProperties", "dependentRequired",
     "dependentSchemas", "dependencies", "unevaluatedProperties"}
)  # fmt: skip

#: refused wherever they appear, with what to do instead
_REFUSED = {
    "not": "; describe the allowed values directly (e.g. with enum or anyOf)",
    "if": "; use anyOf with one branch per case",
    "then": "; use anyOf with one branch per case",
    "else": "; use anyOf with one branch per case",
    "$dynamicRef": "; use a plain $ref to a definition under $defs",
    "$recursiveRef": "; use a plain $ref to a definition under $defs",
}

_TYPES = ("null", "boolean", "integer", "number", "string", "array", "object")
#: keywords that imply a type when "type" is absent (restricting to it keeps outputs valid)
_IMPLIED_TYPE = {
    "string": ("minLength", "maxLength", "pattern", "format"),
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
    "array": ("items", "prefixItems", "additionalItems", "minItems", "maxItems", "contains",
              "uniqueItems", "unevaluatedItems"),
    "object": ("properties", "required", "additionalProperties", "patternProperties",
               "propertyNames", "minProperties", "maxProperties", "unevaluatedProperties",
               "dependentRequired", "dependentSchemas", "dependencies"),
}  # fmt: skip


class SchemaCompiler:
    """One compilation of the schema ``root``.

    ``ref_depth``: how many times a ``$ref`` may be expanded inside itself (deeper, it
    matches nothing); ``free_depth``: how deep arrays and objects nest in free-form values
    (``true``, ``{}``, objects without ``properties``). :meth:`compile` raises
    ``ValueError`` for what is not supported. After it, :attr:`cut` and
    :attr:`depth_sensitive` say whether the depths mattered.
    """

    def __init__(
        self,
        root: dict[str, Any] | bool,
        ref_depth: int,
        free_depth: int,
        wrapper_levels: int = 0,
    ) -> None:
        self.root = root
        self.ref_depth = ref_depth
        self.free_depth = free_depth
        #: how many times each $ref target is being expanded right now
        self.active: dict[str, int] = {}
        #: each compiled ``$ref`` target: its IR and its height (the levels it nests below
        #: the ``$ref``), so that a target met again deeper is refused as compiling it there
        #: would be, whichever use came first
        self.memo: dict[tuple[Any, ...], tuple[ir.Node, int]] = {}
        #: $ref targets whose recursion was cut at the depth limit
        self.cut: list[str] = []
        #: whether a smaller depth would give a smaller result
        self.depth_sensitive = False
        #: subschemas being compiled now, each inside the one before (a ``$ref``'s target
        #: inside the schema that refers to it): at most MAX_NESTING_DEPTH, besides the
        #: ``wrapper_levels`` around the user's schemas (a forced tool call's), which start
        #: below 0
        self.level = -wrapper_levels
        #: the deepest :attr:`level` reached (for the heights of ``$ref`` targets)
        self.reached = self.level

    def no_instance_error(self) -> ValueError:
        """The error for a schema that compiled to nothing at all."""
        if self.cut:
            return ValueError(
                f"the JSON schema has no finite instance: the recursion through $ref "
                f"'{self.cut[0]}' never ends; make the recursive part optional (an optional "
                "property, an anyOf branch with null, or an array that may be empty)"
            )
        return ValueError(
            "no JSON value is valid against the schema (a required property or item whose "
            "schema is false, or anyOf branches that are all impossible)"
        )

    # -- dispatch ------------------------------------------------------------------------

    def compile(self, schema: Any, path: str) -> ir.Node:
        """The IR of ``schema`` (found at ``path``, for messages). Each call inside another
        is one level of nesting (``properties``, ``items``, ``anyOf`` members, a merged
        ``allOf``...; a ``$ref`` and its target are one level together, unless the target
        is itself a ``$ref``): deeper than :data:`MAX_NESTING_DEPTH` (plus the
        wrapper's levels) is refused."""
        if self.level >= MAX_NESTING_DEPTH:
            raise nested_too_deeply(f"the JSON schema at {_short_path(path)}: its subschemas are")
        self.level += 1
        self.reached = max(self.reached, self.level)
        try:
            return self._compile(schema, path)
        finally:
            self.level -= 1

    def _compile(self, schema: Any, path: str) -> ir.Node:
        if schema is True:
            return self.free_value(self.free_depth)
        if schema is False:
            return NOTHING
        if not isinstance(schema, dict):
            raise ValueError(
                f"the schema at {path} must be an object or a boolean, not {_kind(schema)}"
            )
        for keyword, advice in _REFUSED.items():
            if keyword in schema:
                raise ValueError(unsupported(keyword, path, advice))
        if "$ref" in schema:
            return self.ref(schema, path)
        if "allOf" in schema:
            return self.all_of(schema, path)
        schema = normalize(schema, path)
        if "anyOf" in schema:
            return self.any_of(schema, path)
        if "enum" in schema or "const" in schema:
            return self.enum(schema, path)
        return self.typed(schema, path)

    def free_value(self, depth: int) -> ir.Node:
        """Any JSON value, arrays and objects nested at most ``depth`` deep."""
        self.depth_sensitive = True
        return any_value(max(0, depth))

    # -- references and combinators --------------------------------------------------------

    def ref(self, schema: dict[str, Any], path: str) -> ir.Node:
        """A schema with ``$ref``: its target (counted, so recursion stays bounded), merged
        with the keywords next to it, if any."""
        siblings = {k: v for k, v in schema.items() if k in _VALIDATION and k != "$ref"}
        if siblings:  # (draft 2019+) $ref next to other keywords: both apply
            return self.all_of({"allOf": [{"$ref": schema["$ref"]}, siblings]}, path)
        target_path, target = self.resolve(schema["$ref"], path)
        count = self.active.get(target_path, 0)
        if count:
            self.depth_sensitive = True
        if count >= self.ref_depth:
            self.cut.append(target_path)
            return NOTHING
        key = (target_path, tuple(sorted(self.active.items())))
        known = self.memo.get(key)
        if known is None:
            self.active[target_path] = count + 1
            outer, self.reached = self.reached, self.level
            try:
                if isinstance(target, dict) and "$ref" in target:
                    # a reference to a reference: each one counts, so a chain of them is
                    # bounded (in levels, and in the frames of this recursion)
                    node = self.compile(target, target_path)
                else:  # a target shares its reference's level: a level, like plain nesting
                    node = self._compile(target, target_path)
                known = self.memo[key] = (node, self.reached - self.level)
            finally:
                self._leave(target_path)
                self.reached = max(outer, self.reached)
        node, height = known
        if self.level + height > MAX_NESTING_DEPTH:  # (met again, deeper than before)
            raise nested_too_deeply(
                f"the JSON schema at {_short_path(target_path)} (used at {_short_path(path)}): "
                "its subschemas are"
            )
        self.reached = max(self.reached, self.level + height)
        return node

    def _leave(self, target_path: str) -> None:
        """One expansion of ``target_path`` is over (entries at zero are dropped so that
        memo keys stay equal for equal situations)."""
        self.active[target_path] -= 1
        if not self.active[target_path]:
            del self.active[target_path]

    def resolve(self, ref: Any, path: str) -> tuple[str, Any]:
        """The JSON pointer and the schema that a local ``$ref`` names."""
        if not isinstance(ref, str):
            raise ValueError(f"$ref at {path} must be a string")
        root_id = self.root.get("$id") if isinstance(self.root, dict) else None
        if isinstance(root_id, str) and root_id and ref.startswith(root_id.split("#")[0] + "#"):
            ref = ref[len(root_id.split("#")[0]) :]
        if not ref.startswith("#"):
            raise ValueError(
                f"$ref {ref!r} at {path} is not supported: only references inside the schema "
                "('#', '#/$defs/Name', '#/definitions/Name') are; inline the remote schema "
                "under $defs"
            )
        fragment = unquote(ref[1:])
        if fragment and not fragment.startswith("/"):
            raise ValueError(
                f"$ref {ref!r} at {path} names an anchor, which is not supported; use a JSON "
                "pointer such as '#/$defs/Name'"
            )
        node: Any = self.root
        for token in fragment.split("/")[1:]:
            token = token.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and token in node:
                node = node[token]
            elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
                node = node[int(token)]
            else:
                raise ValueError(f"$ref {ref!r} at {path} points to nothing in the schema")
        return "#" + fragment, node

    def all_of(self, schema: dict[str, Any], path: str) -> ir.Node:
        """``allOf`` (and ``$ref`` with siblings): the members merged into one schema, their
        references resolved (and counted, so recursion through them stays bounded)."""
        refs: list[str] = []
        merged = self.inline(schema, path, refs, ())
        if any(self.active.get(r, 0) for r in refs):
            self.depth_sensitive = True
        if any(self.active.get(r, 0) >= self.ref_depth for r in refs):
            self.cut.extend(refs)
            return NOTHING
        for r in refs:
            self.active[r] = self.active.get(r, 0) + 1
        try:
            return self.compile(merged, path)
        finally:
            for r in refs:
                self._leave(r)

    def inline(self, schema: Any, path: str, refs: list[str], chain: tuple[str, ...]) -> Any:
        """``schema`` with its top-level ``$ref`` and ``allOf`` merged in; the targets of the
        references followed are added to ``refs`` (``chain``: those being followed now)."""
        if isinstance(schema, bool):
            return schema
        if not isinstance(schema, dict):
            raise ValueError(
                f"the schema at {path} must be an object or a boolean, not {_kind(schema)}"
            )
        out = {k: v for k, v in schema.items() if k not in ("$ref", "allOf")}
        parts: list[tuple[Any, str, tuple[str, ...]]] = []
        if "$ref" in schema:
            target_path, target = self.resolve(schema["$ref"], path)
            if target_path in chain:
                raise ValueError(f"$ref '{target_path}' at {path} refers to itself through allOf")
            if target_path not in refs:
                refs.append(target_path)
            parts.append((target, target_path, (*chain, target_path)))
        if "allOf" in schema:
            members = schema["allOf"]
            if not isinstance(members, list) or not members:
                raise ValueError(f"allOf at {path} must be a non-empty array of schemas")
            parts += [(m, f"{path}/allOf/{i}", chain) for i, m in enumerate(members)]
        for member, member_path, member_chain in parts:
            member = self.inline(member, member_path, refs, member_chain)
            if member is False:
                return False
            if member is not True:
                out = merge_schemas(out, member, path)
        return out

    def any_of(self, schema: dict[str, Any], path: str) -> ir.Node:
        """``anyOf`` (and ``oneOf``, normalized into it): one alternative per member."""
        members = schema["anyOf"]
        if not isinstance(members, list) or not members:
            raise ValueError(f"anyOf/oneOf at {path} must be a non-empty array of schemas")
        siblings = {k: v for k, v in schema.items() if k in _VALIDATION and k != "anyOf"}
        options = []
        for i, member in enumerate(members):
            member_path = f"{path}/anyOf/{i}"
            if siblings:  # the keywords next to anyOf apply to every branch
                member = {"allOf": [siblings, member]}
            options.append(self.compile(member, member_path))
        return either(*options)

    def enum(self, schema: dict[str, Any], path: str) -> ir.Node:
        """``enum``/``const``: their values of the allowed types, as JSON literals."""
        values = schema.get("enum")
        if values is not None and (not isinstance(values, list) or not values):
            raise ValueError(f"enum at {path} must be a non-empty array")
        if "const" in schema:
            const = schema["const"]
            values = [v for v in values if json_equal(v, const)] if values is not None else [const]
        others = [k for k in schema if k in _VALIDATION and k not in ("enum", "const", "type")]
        if others:
            raise ValueError(unsupported(
                others[0], path, "next to enum/const; list only the allowed values in enum"
            ))  # fmt: skip
        types = self.types(schema, path)
        kept = [v for v in values if types is None or _json_type(v, types)]
        if not kept:
            raise ValueError(f"enum/const at {path} has no value of the allowed type(s) {types}")
        return either(*(json_literal(v) for v in kept))

    # -- one type at a time ----------------------------------------------------------------

    def types(self, schema: dict[str, Any], path: str) -> list[str] | None:
        """The types ``schema`` allows (``None``: any)."""
        if "type" not in schema:
            return None
        value = schema["type"]
        types = value if isinstance(value, list) else [value]
        for t in types:
            if t not in _TYPES:
                raise ValueError(
                    f"type {t!r} at {path} is not a JSON Schema type (one of {', '.join(_TYPES)})"
                )
        return types

    def typed(self, schema: dict[str, Any], path: str) -> ir.Node:
        """One alternative per allowed type (without ``type``: the types its keywords
        imply, or any value)."""
        types = self.types(schema, path)
        if types is None:
            types = [t for t, keys in _IMPLIED_TYPE.items() if any(k in schema for k in keys)]
            if not types:
                return self.free_value(self.free_depth)
        compile_type = {
            "null": lambda: ir.Bytes(b"null"),
            "boolean": lambda: ir.alt(ir.Bytes(b"true"), ir.Bytes(b"false")),
            "integer": lambda: integer_ir(schema, path),
            "number": lambda: number_ir(schema, path),
            "string": lambda: string_ir(schema, path),
            "array": lambda: array_ir(self, schema, path),
            "object": lambda: object_ir(self, schema, path),
        }
        return either(*(compile_type[t]() for t in types))


def _short_path(path: str) -> str:
    """``path`` cut to its first and last 40 characters (a deep path is long)."""
    return path if len(path) <= 90 else f"{path[:40]}...{path[-40:]}"


def _kind(value: Any) -> str:
    return type(value).__name__


def _json_type(value: Any, types: list[str]) -> bool:
    """Whether the JSON value ``value`` has one of ``types``."""
    if value is None:
        kind = {"null"}
    elif isinstance(value, bool):
        kind = {"boolean"}
    elif isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        kind = {"integer", "number"}
    elif isinstance(value, float):
        kind = {"number"}
    elif isinstance(value, str):
        kind = {"string"}
    elif isinstance(value, list):
        kind = {"array"}
    else:
        kind = {"object"}
    return bool(kind & set(types))
