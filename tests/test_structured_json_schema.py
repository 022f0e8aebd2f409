"""JSON schema -> structured-output IR: what a model may write, checked with the IR matcher.

Valid instances, serialized the ways a model writes JSON (compact, ``", "``/``": "`` and
pretty-printed), must be accepted; invalid texts rejected; unsupported schemas refused with
a message naming the keyword and where it is. Random texts drawn from the IR are checked to
be valid JSON and (when ``jsonschema`` is installed) valid against the schema.
"""

from __future__ import annotations

import datetime
import itertools
import json
import random
from fractions import Fraction
from typing import Any

import pytest
from ir_matcher import ir_fullmatch, ir_sample

from chassis.builtin_plugins.structured_output import ir
from chassis.builtin_plugins.structured_output.automaton import (
    MAX_NFA_STATES,
    estimated_nfa_states,
)
from chassis.builtin_plugins.structured_output.json_numbers import integer_range, number_range
from chassis.builtin_plugins.structured_output.json_schema import (
    ANY_JSON_DEPTH,
    JSON_OBJECT_DEPTH,
    MAX_RECURSION_DEPTH,
    any_json_object,
    check_schema,
    schema_to_ir,
)
from chassis.builtin_plugins.structured_output.json_syntax import MAX_WHITESPACE

try:
    import jsonschema
except ImportError:  # the cross-check is optional
    jsonschema = None


def texts_of(value: Any) -> list[str]:
    """The ways a model serializes ``value``: default, compact and pretty-printed."""
    return [
        json.dumps(value, ensure_ascii=False),
        json.dumps(value, ensure_ascii=False, separators=(",", ":")),
        json.dumps(value, ensure_ascii=False, indent=2),
    ]


def validate(schema: Any, value: Any) -> None:
    """Raise if ``value`` is not valid against ``schema`` (skipped without jsonschema)."""
    if jsonschema is not None:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        cls(schema, format_checker=cls.FORMAT_CHECKER).validate(value)


def assert_accepts(schema: Any, *values: Any) -> ir.Node:
    node = schema_to_ir(schema)
    for value in values:
        validate(schema, value)  # the test's own instance must be valid
        for text in texts_of(value):
            assert ir_fullmatch(node, text), text
    return node


def assert_rejects(node: ir.Node, *texts: str) -> None:
    for text in texts:
        assert not ir_fullmatch(node, text), text


def sample(node: ir.Node, rng: random.Random) -> bytes:
    """A random text matched by ``node`` (short repetitions)."""
    return ir_sample(node, rng, extra=2)


def assert_samples_valid(schema: Any, count: int = 60, seed: int = 0) -> None:
    node = schema_to_ir(schema)
    rng = random.Random(seed)
    for _ in range(count):
        text = sample(node, rng).decode("utf-8")
        value = json.loads(text)
        validate(schema, value)
        assert text == text.strip()


# -- objects -------------------------------------------------------------------------------

FLAT = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
        "nothing": {"type": "null"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city"],
        },
    },
    "required": ["name", "age"],
}


def test_flat_object_with_every_type():
    node = assert_accepts(
        FLAT,
        {"name": "Ada", "age": 36},
        {"name": "", "age": -3, "score": 1.5, "active": True, "nothing": None},
        {"name": "é ü", "age": 0, "tags": ["a", "b"], "address": {"city": "Paris"}},
        {"name": "x", "age": 1, "tags": [], "address": {"city": "a", "zip": "75"}},
        {"name": 'q"\\', "age": 7, "score": -2e-3, "active": False},
    )
    assert_rejects(
        node,
        '{"age": 36}',  # missing required
        '{"name": "Ada"}',
        '{"name": 1, "age": 2}',  # wrong type
        '{"name": "a", "age": 1.5}',
        '{"name": "a", "age": "1"}',
        '{"name": "a", "age": 1, "extra": 1}',  # undeclared property
        '{"age": 1, "name": "a"}',  # properties come in declared order
        '{"name": "a", "age": 1,}',  # trailing comma
        '{, "name": "a", "age": 1}',
        '{"name": "a", "age": 1}x',  # trailing text
        ' {"name": "a", "age": 1}',  # whitespace around the top level
        '{"name": "a", "age": 1}\n',
        '{"name": "a", "age": 01}',
        '{"name": "a", "age": 1, "address": {"zip": "1"}}',
        "{'name': 'a', 'age': 1}",
    )


def test_every_subset_of_optional_properties_in_order():
    names = ["a", "b", "c", "d"]
    schema = {"type": "object", "properties": {n: {"type": "integer"} for n in names}}
    node = schema_to_ir(schema)
    for size in range(len(names) + 1):
        for subset in itertools.combinations(names, size):
            for text in texts_of({n: 1 for n in subset}):
                assert ir_fullmatch(node, text), text
    assert_rejects(
        node, '{"a": 1, "a": 1}', '{"b": 1, "a": 1}', '{"a": 1 "b": 1}', '{"a": 1,, "b": 1}'
    )


def test_optional_properties_grow_quadratically_not_exponentially():
    schema = {"type": "object", "properties": {f"p{i}": {"type": "boolean"} for i in range(40)}}
    node = schema_to_ir(schema)
    assert estimated_nfa_states(node) < MAX_NFA_STATES
    value = {f"p{i}": True for i in range(0, 40, 7)}
    assert ir_fullmatch(node, json.dumps(value))


def test_whitespace_is_allowed_where_json_allows_it_and_bounded():
    schema = {
        "type": "object",
        "properties": {"a": {"type": "array", "items": {"type": "integer"}}},
    }
    node = schema_to_ir(schema)
    ok = ['{"a":[1,2]}', '{ "a" : [ 1 , 2 ] }', '{\n\t"a":\r\n[\n  1,\n  2\n]\n}', "{}", "{ }"]
    for text in ok:
        assert ir_fullmatch(node, text), text
    run = " " * MAX_WHITESPACE
    assert ir_fullmatch(node, '{"a":' + run + "[]}")
    assert_rejects(node, '{"a":' + run + " []}", '{"a":[1 2]}', "{\f}", '{"a":[1,]}', '{"a":[,1]}')


def test_nested_objects_and_arrays():
    schema = {
        "type": "object",
        "properties": {
            "matrix": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
            "people": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string"},
                        "kids": {"type": "array", "items": {"type": "string"}},
                    },
                    "required": ["name", "kids"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["matrix", "people"],
        "additionalProperties": False,
    }
    node = assert_accepts(
        schema,
        {"matrix": [], "people": []},
        {"matrix": [[1, 2.5], [], [-3e2]], "people": [{"name": "a", "kids": ["b", "c"]}]},
    )
    assert_rejects(
        node, '{"matrix": [1], "people": []}', '{"matrix": [], "people": [{"name": "a"}]}'
    )
    assert_samples_valid(schema)


def test_property_names_needing_escapes_are_written_as_json_dumps_does():
    schema = {
        "type": "object",
        "properties": {'a"b': {"type": "integer"}, "naïve/x": {"type": "integer"}},
        "required": ['a"b', "naïve/x"],
    }
    assert_accepts(schema, {'a"b': 1, "naïve/x": 2})


def test_additional_properties_cases():
    # no properties, additionalProperties absent or true: any object
    for schema in ({"type": "object"}, {"type": "object", "additionalProperties": True}):
        node = assert_accepts(schema, {}, {"k": [1, {"x": None}], "": "v", "n": {"m": True}})
        assert_rejects(node, "[]", '"s"', '{"a" 1}', '{"a": 1,}')
    # a schema: any keys, values of that schema
    typed = {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0}}
    node = assert_accepts(typed, {}, {"a": 1, "b": 20})
    assert_rejects(node, '{"a": -1}', '{"a": "x"}', '{"a": 1.5}')
    # with properties: only the declared ones are written, even if more are allowed
    for extra in (True, {"type": "string"}, None):
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
        if extra is not None:
            schema["additionalProperties"] = extra
        node = assert_accepts(schema, {}, {"a": 1})
        assert_rejects(node, '{"a": 1, "b": "x"}', '{"b": "x"}')
    # required names missing from properties take additionalProperties' schema
    schema = {"type": "object", "required": ["id"], "additionalProperties": {"type": "integer"}}
    node = assert_accepts(schema, {"id": 3})
    assert_rejects(node, "{}", '{"id": "x"}')
    node = assert_accepts({"type": "object", "required": ["id"]}, {"id": [1]}, {"id": "x"})
    assert_rejects(node, "{}")
    # an empty object only
    node = assert_accepts({"type": "object", "additionalProperties": False}, {})
    assert_rejects(node, '{"a": 1}')
    # a property whose schema is false is never written
    node = assert_accepts({"properties": {"a": False, "b": {"type": "null"}}}, {}, {"b": None})
    assert_rejects(node, '{"a": 1}')


def test_min_properties_implied_by_required_is_accepted():
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a"],
        "minProperties": 1,
        "maxProperties": 2,
    }
    assert_accepts(schema, {"a": 1}, {"a": 1, "b": 2})
    node = assert_accepts({"type": "object", "minProperties": 1}, {"a": 1})
    assert_rejects(node, "{}")


# -- arrays --------------------------------------------------------------------------------


def test_min_and_max_items():
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3}
    node = assert_accepts(schema, [1], [1, 2], [1, 2, 3])
    assert_rejects(node, "[]", "[1, 2, 3, 4]", '["a"]', "[1,]")
    node = assert_accepts({"type": "array", "maxItems": 0}, [])
    assert_rejects(node, "[1]")
    node = assert_accepts(
        {"type": "array", "items": {"type": "boolean"}, "minItems": 2}, [True, False]
    )
    assert_rejects(node, "[true]", "[]")
    assert ir_fullmatch(node, "[" + ", ".join(["true"] * 12) + "]")


def test_prefix_items_then_items():
    schema = {
        "type": "array",
        "prefixItems": [{"type": "string"}, {"type": "integer"}],
        "items": False,
    }
    node = assert_accepts(schema, [], ["a"], ["a", 1])
    assert_rejects(node, '["a", "b"]', "[1]", '["a", 1, 2]')
    schema = {
        "type": "array",
        "prefixItems": [{"const": "op"}],
        "items": {"type": "number"},
        "minItems": 2,
    }
    node = assert_accepts(schema, ["op", 1], ["op", 1, 2.5, 3])
    assert_rejects(node, '["op"]', "[]", '["op", "x"]')
    # draft 4-7: items as a list, then additionalItems
    schema = {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "type": "array",
        "items": [{"type": "integer"}, {"type": "null"}],
        "additionalItems": False,
    }
    node = assert_accepts(schema, [1, None], [2])
    assert_rejects(node, "[1, null, 1]", "[null]")
    # an item that cannot exist makes the array as short as it must be
    node = schema_to_ir({"type": "array", "items": False})
    assert ir_fullmatch(node, "[]") and not ir_fullmatch(node, "[1]")


def test_array_samples_are_valid():
    for schema in (
        {
            "type": "array",
            "items": {"type": "integer", "minimum": -3, "maximum": 12},
            "maxItems": 4,
        },
        {"type": "array", "prefixItems": [{"type": "boolean"}, {"enum": ["x", 1]}], "minItems": 1},
        {"type": "array", "uniqueItems": True, "maxItems": 1},
    ):
        assert_samples_valid(schema)


# -- enums and consts ----------------------------------------------------------------------


def test_enum_and_const():
    schema = {"enum": ["red", "green", 3, 2.5, None, True, "é"]}
    node = assert_accepts(schema, "red", "green", 3, 2.5, None, True, "é")
    assert_rejects(node, '"blue"', "4", "false", '"RED"', '"red" ')
    schema = {"enum": [{"a": 1, "b": [1, 2]}, [1, "x"]]}
    node = assert_accepts(schema, {"a": 1, "b": [1, 2]}, [1, "x"])
    assert not ir_fullmatch(node, json.dumps({"b": [1, 2], "a": 1}))
    assert_accepts({"const": "fixed"}, "fixed")
    assert_accepts({"const": {"k": None}}, {"k": None})
    # type filters enum values; const and enum intersect
    node = assert_accepts({"type": "string", "enum": ["a", 1, None]}, "a")
    assert_rejects(node, "1", "null")
    node = assert_accepts({"type": ["string", "null"], "enum": ["a", 1, None]}, "a", None)
    node = assert_accepts({"enum": [1, 2, 3], "const": 2}, 2)
    assert_rejects(node, "1", "3")
    node = assert_accepts({"type": "integer", "enum": [1, 1.0, 1.5]}, 1)
    assert_rejects(node, "1.5")


# -- numbers -------------------------------------------------------------------------------

INTEGER_RANGES = [
    (None, None),
    (0, None),
    (1, None),
    (None, 0),
    (None, -1),
    (-5, 5),
    (7, 7),
    (10, 99),
    (9, 100),
    (0, 255),
    (-128, 127),
    (-1000, -10),
    (123, 4567),
    (18, 120),
    (1, 12),
    (-99, None),
    (None, 250),
]


@pytest.mark.parametrize(("lo", "hi"), INTEGER_RANGES)
def test_integer_ranges_are_exact(lo, hi):
    node = integer_range(lo, hi)
    center = [lo or 0, hi or 0]
    window = set(range(min(center) - 130, max(center) + 130))
    window |= {10**k + d for k in range(1, 7) for d in (-1, 0, 1)}
    window |= {-n for n in window}
    for n in window:
        inside = (lo is None or n >= lo) and (hi is None or n <= hi)
        assert ir_fullmatch(node, str(n)) == inside, (lo, hi, n)
    for text in ("01", "-0", "1.0", "+1", "1e2", "", "-", "00"):
        assert not ir_fullmatch(node, text), text


def test_integer_range_with_large_bounds():
    lo, hi = 10**12 - 7, 2**53 + 5
    node = integer_range(lo, hi)
    rng = random.Random(1)
    probes = [lo - 1, lo, lo + 1, hi - 1, hi, hi + 1, 10**12, 10**15, 10**16, 10**17]
    probes += [rng.randint(lo - 10**6, hi + 10**6) for _ in range(300)]
    for n in probes:
        assert ir_fullmatch(node, str(n)) == (lo <= n <= hi), n


def test_integer_schema_bounds():
    cases = [
        ({"minimum": 1}, 1, None),
        ({"exclusiveMinimum": 0}, 1, None),
        ({"exclusiveMinimum": 0.5, "maximum": 4.9}, 1, 4),
        ({"minimum": -3, "exclusiveMaximum": 3}, -3, 2),
        ({"minimum": 2, "exclusiveMinimum": 2}, 3, None),
        (
            {"$schema": "http://json-schema.org/draft-04/schema#", "minimum": 5, "maximum": 9}
            | {"exclusiveMinimum": True, "exclusiveMaximum": True},
            6,
            8,
        ),
        ({"maximum": 1e2}, None, 100),
    ]
    for bounds, lo, hi in cases:
        schema = {"type": "integer", **bounds}
        node = schema_to_ir(schema)
        for n in range(-20, 130):
            inside = (lo is None or n >= lo) and (hi is None or n <= hi)
            assert ir_fullmatch(node, str(n)) == inside, (bounds, n)
            if inside:
                validate(schema, n)
    node = schema_to_ir({"type": "integer", "multipleOf": 1})
    assert ir_fullmatch(node, "-12") and not ir_fullmatch(node, "1.5")


def _number_texts() -> list[str]:
    texts = []
    for hundredths in range(-1300, 1301, 5):
        value = Fraction(hundredths, 100)
        texts.append(f"{float(value):.2f}")
        if value.denominator == 1:
            texts += [str(int(value)), f"{int(value)}.0"]
        else:
            texts.append(f"{float(value):g}")
    return texts


NUMBER_RANGES = [
    ({"minimum": 0, "maximum": 1}, 0, False, 1, False),
    ({"exclusiveMinimum": 0}, 0, True, None, False),
    ({"minimum": -5, "maximum": -2}, -5, False, -2, False),
    ({"exclusiveMinimum": -3, "exclusiveMaximum": 10}, -3, True, 10, True),
    ({"maximum": 0}, None, False, 0, False),
    ({"exclusiveMaximum": 0}, None, False, 0, True),
    ({"minimum": 2, "exclusiveMaximum": 3}, 2, False, 3, True),
    ({"exclusiveMinimum": 4, "exclusiveMaximum": 5}, 4, True, 5, True),
    ({"minimum": 7.0, "maximum": 7}, 7, False, 7, False),
    ({"minimum": 0}, 0, False, None, False),
]


@pytest.mark.parametrize(("bounds", "lo", "lo_x", "hi", "hi_x"), NUMBER_RANGES)
def test_number_ranges_are_exact(bounds, lo, lo_x, hi, hi_x):
    schema = {"type": "number", **bounds}
    node = schema_to_ir(schema)

    def inside(x: float) -> bool:
        above = lo is None or (x > lo if lo_x else x >= lo)
        below = hi is None or (x < hi if hi_x else x <= hi)
        return above and below

    for text in _number_texts():
        if text.startswith("-0") and float(text) == 0:
            continue  # "-0" is valid but not written
        assert ir_fullmatch(node, text) == inside(float(text)), (bounds, text)
    # rounding: a text accepted here never parses to a float outside the range
    edges = [b for b in (lo, hi) if b is not None]
    for edge in edges:
        for sign in ("", "-"):
            for digits in range(1, 20):
                for base in (edge, edge - 1, edge + 1):
                    for frac in ("9" * digits, "0" * (digits - 1) + "1"):
                        text = f"{sign}{abs(base)}.{frac}"
                        if ir_fullmatch(node, text):
                            assert inside(json.loads(text)), (bounds, text)
                            validate(schema, json.loads(text))
    assert_samples_valid(schema, count=80)


def test_number_range_helper_rejects_large_bounds():
    with pytest.raises(ValueError, match="too large"):
        number_range(0, False, 10**16, False)


def test_unbounded_numbers_take_fractions_and_exponents():
    node = assert_accepts({"type": "number"}, 0, -1, 2.5, 1e-7, 6.02e23)
    for text in ("1E5", "-0.0e+1", "12.5e-3"):
        assert ir_fullmatch(node, text), text
    assert_rejects(node, ".5", "1.", "01", "+1", "1e", "NaN", "Infinity", "0x1")


# -- strings -------------------------------------------------------------------------------


def test_string_lengths_count_characters_and_escapes_as_one():
    schema = {"type": "string", "minLength": 2, "maxLength": 4}
    node = assert_accepts(schema, "ab", "abcd", "é😀", "\n\t", 'a"\\')
    for text in (r'"\n\t"', r'"\u00e9a"', r'"\ud83d\ude00x"', r'"\/\/"'):
        assert ir_fullmatch(node, text), text
    assert_rejects(node, '"a"', '"abcde"', '""', r'"\ud83da"', '"a\nb"', r'"\x41b"', r'"\ab"')
    node = schema_to_ir({"type": "string"})
    for raw in ["", "plain", "tab\tinside", "\x00"]:
        # control characters must be escaped; json.dumps does so
        assert ir_fullmatch(node, json.dumps(raw)) and ir_fullmatch(
            node, json.dumps(raw, ensure_ascii=False)
        )
    assert_rejects(node, '"\t"', '"\x00"', "'a'", '"a', 'a"')
    assert_samples_valid({"type": "string", "maxLength": 3}, count=150)


def test_string_formats():
    cases = {
        "date": (
            ["2024-02-29", "2000-02-29", "1999-12-31", "0001-01-01"],
            ["2023-02-29", "1900-02-29", "2023-04-31", "2023-13-01", "0000-01-01", "2023-1-01"],
        ),
        "time": (
            ["12:30:00Z", "23:59:59.123+05:30", "00:00:00-08:00"],
            ["24:00:00Z", "12:60:00Z", "12:30:00", "12:30Z"],
        ),
        "date-time": (
            ["2024-01-15T10:20:30Z", "1970-01-01T00:00:00.5+01:00"],
            ["2024-01-15 10:20:30Z", "2024-01-15T10:20:30"],
        ),
        "uuid": (
            ["123e4567-e89b-12d3-a456-426614174000", "ABCDEF01-2345-6789-ABCD-EF0123456789"],
            ["123e4567e89b12d3a456426614174000", "123e4567-e89b-12d3-a456-42661417400g"],
        ),
        "ipv4": (
            ["192.168.0.1", "0.0.0.0", "255.255.255.255"],
            ["256.1.1.1", "01.2.3.4", "1.2.3", "1.2.3.4.5"],
        ),
        "email": (
            ["a@b.co", "first.last+tag@mail.example.org"],
            ["a@b", "@b.co", "a b@c.de", "a@-b.co"],
        ),
    }
    for fmt, (good, bad) in cases.items():
        schema = {"type": "string", "format": fmt}
        node = assert_accepts(schema, *good)
        assert_rejects(node, *(json.dumps(t) for t in bad))
        assert_samples_valid(schema, count=40)
    # formats that are not asserted are annotations
    node = schema_to_ir({"type": "string", "format": "uri"})
    assert ir_fullmatch(node, '"not a uri"')
    # a fixed-length format inside length bounds that allow it
    assert_accepts(
        {"type": "string", "format": "date", "minLength": 10, "maxLength": 10}, "2020-01-01"
    )


def test_every_date_is_checked_like_datetime_does():
    node = schema_to_ir({"type": "string", "format": "date"})
    for year in (1900, 2000, 2023, 2024, 2100, 2400):
        for month in range(0, 14):
            for day in range(0, 33):
                text = f"{year:04d}-{month:02d}-{day:02d}"
                try:
                    datetime.date.fromisoformat(text)
                    valid = True
                except ValueError:
                    valid = False
                assert ir_fullmatch(node, json.dumps(text)) == valid, text


def test_patterns():
    node = assert_accepts({"type": "string", "pattern": "^[a-z]+-[0-9]{2}$"}, "ab-12", "z-00")
    assert_rejects(node, '"AB-12"', '"ab-1"', '"ab-123"', '""')
    # quotes, backslashes and control characters are never generated inside a pattern
    node = schema_to_ir({"type": "string", "pattern": '^(a|"|\\\\|\\n)$'})
    assert ir_fullmatch(node, '"a"')
    assert_rejects(node, r'"\""', r'"\\"', r'"\n"', '"\n"')
    node = assert_accepts({"pattern": "^\\d{3}$"}, "123")
    assert_rejects(node, "123", '"12"')
    assert_samples_valid({"type": "string", "pattern": "^[A-Z][a-z]{0,3}( [0-9]+)?$"})


# -- combinators, nullable, type lists -----------------------------------------------------


def test_type_lists_nullable_and_any_of():
    node = assert_accepts({"type": ["string", "null"], "maxLength": 2}, "ab", None)
    assert_rejects(node, '"abc"', "1", "true")
    node = schema_to_ir({"type": "integer", "nullable": True, "minimum": 1})  # OpenAPI
    assert ir_fullmatch(node, "1") and ir_fullmatch(node, "null")
    assert_rejects(node, "0", '"1"')
    schema = {"anyOf": [{"type": "string"}, {"type": "integer", "maximum": 3}, {"type": "null"}]}
    node = assert_accepts(schema, "x", 3, None)
    assert_rejects(node, "4", "[]", "{}")
    # oneOf is compiled as anyOf (exclusive branches: a discriminated union)
    schema = {
        "oneOf": [
            {
                "type": "object",
                "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer"}},
                "required": ["kind", "lives"],
                "additionalProperties": False,
            },
            {
                "type": "object",
                "properties": {"kind": {"const": "dog"}, "good": {"type": "boolean"}},
                "required": ["kind", "good"],
                "additionalProperties": False,
            },
        ]
    }
    node = assert_accepts(schema, {"kind": "cat", "lives": 9}, {"kind": "dog", "good": True})
    assert_rejects(node, '{"kind": "cat", "good": true}')


def test_any_of_siblings_apply_to_every_branch():
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "anyOf": [{"required": ["a"]}, {"required": ["b"]}],
        "additionalProperties": False,
    }
    node = assert_accepts(schema, {"a": 1}, {"b": 2}, {"a": 1, "b": 2})
    assert_rejects(node, "{}")


def test_all_of_merges_members():
    schema = {
        "allOf": [
            {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 0}},
                "required": ["id"],
            },
            {
                "properties": {"id": {"maximum": 9}, "name": {"type": "string"}},
                "required": ["name"],
            },
        ]
    }
    node = assert_accepts(schema, {"id": 0, "name": "a"}, {"id": 9, "name": ""})
    assert_rejects(node, '{"id": 10, "name": "a"}', '{"id": 1}', '{"name": "a"}')
    schema = {
        "$defs": {
            "base": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}
        },
        "allOf": [{"$ref": "#/$defs/base"}, {"properties": {"y": {"type": "boolean"}}}],
        "description": "extends base",
    }
    assert_accepts(schema, {"x": 1}, {"x": 1.5, "y": False})
    # a $ref next to other keywords: both apply
    schema = {"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "maxLength": 1}
    node = assert_accepts(schema, "a", "")
    assert_rejects(node, '"ab"')
    # additionalProperties false on one side rules out the other side's extra names
    schema = {
        "allOf": [
            {"properties": {"a": {"type": "integer"}}, "additionalProperties": False},
            {"properties": {"b": {"type": "integer"}}},
        ]
    }
    node = assert_accepts(schema, {}, {"a": 1})
    assert_rejects(node, '{"b": 1}')


# -- references and recursion --------------------------------------------------------------

TREE = {
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "value": {"type": "integer"},
                "children": {"type": "array", "items": {"$ref": "#/$defs/node"}},
            },
            "required": ["value", "children"],
            "additionalProperties": False,
        }
    },
    "$ref": "#/$defs/node",
}


def _tree(depth: int) -> dict[str, Any]:
    return {"value": depth, "children": [_tree(depth - 1)] if depth > 1 else []}


def test_recursive_tree_is_unrolled_to_a_bounded_depth():
    node = assert_accepts(TREE, _tree(1), _tree(3), {"value": 1, "children": [_tree(2), _tree(1)]})
    assert ir_fullmatch(node, json.dumps(_tree(MAX_RECURSION_DEPTH)))
    assert not ir_fullmatch(node, json.dumps(_tree(MAX_RECURSION_DEPTH + 1)))
    assert_rejects(node, '{"value": 1}', '{"value": 1, "children": [1]}')
    assert_samples_valid(TREE, count=40)


def test_root_recursion_and_pointer_escapes():
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
        },
        "required": ["name", "next"],
    }
    assert_accepts(
        schema, {"name": "a", "next": None}, {"name": "a", "next": {"name": "b", "next": None}}
    )
    schema = {"definitions": {"a/b": {"type": "boolean"}, "m~n": {"type": "null"}},
              "type": "array", "prefixItems": [{"$ref": "#/definitions/a~1b"}, {"$ref": "#/definitions/m~0n"}]}  # fmt: skip
    node = assert_accepts(schema, [True, None])
    assert_rejects(node, "[null]")


def test_recursion_without_a_finite_instance_is_refused():
    schema = {"$defs": {"l": {"type": "object", "properties": {"next": {"$ref": "#/$defs/l"}}, "required": ["next"]}}, "$ref": "#/$defs/l"}  # fmt: skip
    with pytest.raises(ValueError, match=r"no finite instance.*#/\$defs/l"):
        schema_to_ir(schema)


# -- any JSON ------------------------------------------------------------------------------


def _nested(depth: int) -> Any:
    """Arrays and objects alternating, ``depth`` containers deep."""
    value: Any = "leaf"
    for level in range(depth - 1):
        value = [1, value] if level % 2 == 0 else {"k": value, "n": None}
    return {"top": value}


def test_any_json_object():
    node = any_json_object()
    assert estimated_nfa_states(node) <= MAX_NFA_STATES
    values = [{}, {"a": 1}, {"a": [], "b": {}, "c": "é\n", "d": -1.5e-3, "e": [True, False, None]}]
    values.append(_nested(JSON_OBJECT_DEPTH))
    for value in values:
        for text in [*texts_of(value), json.dumps(value)]:
            assert ir_fullmatch(node, text), text
    assert_rejects(
        node,
        json.dumps(_nested(JSON_OBJECT_DEPTH + 1)),
        "[]", '"a"', "1", "null", "", "{", '{"a": 1,}', "{'a': 1}", '{"a": NaN}', '{"a": 1} {}',
        '{a: 1}', '{"a": [1,]}', '{"a":' + " " * (MAX_WHITESPACE + 1) + "1}",
    )  # fmt: skip
    rng = random.Random(3)
    for _ in range(100):
        assert isinstance(json.loads(sample(node, rng)), dict)


def test_true_schema_and_free_form_values_are_any_json():
    node = assert_accepts(True, 1, "s", None, [1, {"a": [2]}], {"x": {"y": [3]}})
    assert estimated_nfa_states(node) <= MAX_NFA_STATES
    node = assert_accepts(
        {"properties": {"data": {}}, "required": ["data"]}, {"data": [1, {"b": None}]}
    )
    assert_rejects(node, "{}")
    assert_samples_valid({"type": "array", "maxItems": 3}, count=40)


def test_automaton_builds_any_json_object():
    automaton = pytest.importorskip("chassis.builtin_plugins.structured_output.automaton")
    auto = automaton.Automaton.from_ir(any_json_object())
    assert auto.fullmatch(json.dumps(_nested(JSON_OBJECT_DEPTH), indent=2).encode())
    assert not auto.fullmatch(json.dumps(_nested(JSON_OBJECT_DEPTH + 1)).encode())
    assert not auto.fullmatch(b'{"a": [1,]}')


def test_free_form_values_of_a_schema_nest_less_than_json_object():
    """A schema's free-form value nests ANY_JSON_DEPTH deep (a schema may hold many, each a
    copy in the automaton), json_object JSON_OBJECT_DEPTH."""
    assert ANY_JSON_DEPTH < JSON_OBJECT_DEPTH
    node = schema_to_ir({"type": "object"})
    assert ir_fullmatch(node, json.dumps(_nested(ANY_JSON_DEPTH)))
    assert not ir_fullmatch(node, json.dumps(_nested(ANY_JSON_DEPTH + 1)))


# -- OpenAI structured-outputs examples ----------------------------------------------------

MATH_REASONING = {
    "type": "object",
    "properties": {
        "steps": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"explanation": {"type": "string"}, "output": {"type": "string"}},
                "required": ["explanation", "output"],
                "additionalProperties": False,
            },
        },
        "final_answer": {"type": "string"},
    },
    "required": ["steps", "final_answer"],
    "additionalProperties": False,
}

UI = {
    "type": "object",
    "properties": {
        "type": {"type": "string", "enum": ["div", "button", "header", "section", "field", "form"]},
        "label": {"type": "string"},
        "children": {"type": "array", "items": {"$ref": "#"}},
        "attributes": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "value": {"type": "string"}},
                "required": ["name", "value"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["type", "label", "children", "attributes"],
    "additionalProperties": False,
}

STRICT_NULLABLE = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "date": {"type": ["string", "null"], "description": "ISO date or null"},
        "participants": {"type": "array", "items": {"type": "string"}},
        "priority": {"type": "string", "enum": ["low", "high"]},
    },
    "required": ["name", "date", "participants", "priority"],
    "additionalProperties": False,
}


def test_openai_examples():
    node = assert_accepts(
        MATH_REASONING,
        {"steps": [], "final_answer": "x = 1"},
        {
            "steps": [
                {"explanation": "Subtract 7", "output": "8x = -30"},
                {"explanation": "Divide", "output": "x = -3.75"},
            ],
            "final_answer": "x = -3.75",
        },
    )
    assert_rejects(
        node,
        '{"steps": [{"explanation": "a"}], "final_answer": "b"}',
        '{"final_answer": "b", "steps": []}',
    )
    leaf = {
        "type": "button",
        "label": "OK",
        "children": [],
        "attributes": [{"name": "id", "value": "ok"}],
    }
    assert_accepts(
        UI, leaf, {"type": "form", "label": "F", "children": [leaf, leaf], "attributes": []}
    )
    node = assert_accepts(
        STRICT_NULLABLE,
        {"name": "Science fair", "date": None, "participants": ["Alice", "Bob"], "priority": "low"},
        {"name": "x", "date": "Friday", "participants": [], "priority": "high"},
    )
    assert_rejects(node, '{"name": "x", "participants": [], "priority": "low"}')
    for schema in (MATH_REASONING, UI, STRICT_NULLABLE):
        assert_samples_valid(schema, count=30)


def test_annotations_are_ignored():
    bare = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    annotated = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://example.com/thing",
        "title": "Thing",
        "description": "d",
        "$comment": "c",
        "examples": [{"a": 1}],
        "default": {"a": 1},
        "deprecated": False,
        "x-vendor": 1,
        "type": "object",
        "properties": {
            "a": {
                "type": "integer",
                "title": "A",
                "readOnly": True,
                "writeOnly": False,
                "default": 3,
            }
        },
        "required": ["a"],
    }
    assert schema_to_ir(annotated) == schema_to_ir(bare)


# -- refusals ------------------------------------------------------------------------------

REFUSED = [
    ({"not": {"type": "string"}}, "'not' at #"),
    ({"type": "object", "properties": {"a": {"if": {}, "then": {}}}}, "'if' at #/properties/a"),
    ({"type": "object", "patternProperties": {"^x": {}}}, "'patternProperties' at #"),
    ({"type": "object", "propertyNames": {"maxLength": 3}}, "'propertyNames' at #"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "'dependentRequired' at #"),
    ({"type": "array", "contains": {"type": "integer"}}, "'contains' at #"),
    (
        {"type": "array", "items": {"type": "array", "uniqueItems": True}},
        "'uniqueItems' at #/items",
    ),
    ({"type": "integer", "multipleOf": 5}, "'multipleOf' at #"),
    ({"type": "number", "multipleOf": 0.01}, "'multipleOf' at #"),
    ({"type": "number", "minimum": 0.5}, "lower bound 0.5 at #"),
    (
        {"type": "object", "properties": {"a": {}}, "minProperties": 1},
        "'minProperties/maxProperties' at #",
    ),
    ({"type": "object", "maxProperties": 3}, "'minProperties/maxProperties' at #"),
    ({"$ref": "https://example.com/s.json"}, "only references inside the schema"),
    ({"$ref": "#anchor"}, "anchor"),
    ({"$ref": "#/$defs/missing"}, "points to nothing"),
    ({"$defs": {"a": {"allOf": [{"$ref": "#/$defs/a"}]}}, "$ref": "#/$defs/a"}, "refers to itself"),
    (False, "false"),
    ({"type": "text"}, "type 'text' at # is not a JSON Schema type"),
    ({"type": "string", "minLength": 5, "maxLength": 2}, "minLength 5 is above maxLength 2 at #"),
    ({"type": "string", "maxLength": 5000}, "maxLength 5000 at # is above the supported maximum"),
    ({"type": "array", "maxItems": 1000}, "maxItems 1000 at # is above"),
    ({"type": "integer", "minimum": 5, "maximum": 2}, "allow no integer"),
    ({"type": "string", "enum": [1, 2]}, "no value of the allowed type"),
    ({"enum": ["a"], "maxLength": 3}, "'maxLength' at # is not supported next to enum"),
    ({"type": "string", "pattern": "^a", "maxLength": 3}, "'pattern' at #"),
    ({"type": "string", "pattern": "(?=a)a"}, "pattern at #"),
    ({"type": "string", "pattern": '^"$'}, "need escapes"),
    ({"type": "string", "format": "date", "maxLength": 4}, "format 'date'"),
    ({"allOf": [{"pattern": "^a"}, {"pattern": "^b"}]}, "'pattern' two different values"),
    (
        {"type": "object", "required": ["x"], "additionalProperties": False},
        "'x' at # is not in 'properties'",
    ),
    ("string", "must be an object or a boolean"),
    ({"properties": {"a": 3}}, "schema at #/properties/a must be an object or a boolean"),
    ({"type": "array", "minItems": -1}, "minItems at # must be a non-negative integer"),
    (
        {
            "type": "object",
            "properties": {f"p{i}": {"type": "string", "maxLength": 1000} for i in range(5)},
        },
        "too large",
    ),
]


@pytest.mark.parametrize(("schema", "message"), REFUSED)
def test_unsupported_schemas_are_refused_with_a_useful_message(schema, message):
    with pytest.raises(ValueError) as info:
        check_schema(schema)
    assert message in str(info.value), str(info.value)
    with pytest.raises(ValueError):
        schema_to_ir(schema)


# -- random schemas ------------------------------------------------------------------------


def _random_schema(rng: random.Random, depth: int) -> Any:
    """A random schema mixing the supported keywords (``depth`` levels of sub-schemas)."""
    kind = rng.randrange(11 if depth > 0 else 6)
    if kind == 0:
        extra = rng.choice(
            [{}, {"minLength": 1}, {"maxLength": 2}, {"format": rng.choice(["date", "uuid", "email", "uri"])},
             {"pattern": rng.choice(["^[a-c]{1,3}$", "^x(y|z)*$"])}]
        )  # fmt: skip
        return {"type": "string", **extra}
    if kind == 1:
        lo = rng.randint(-20, 20)
        bounds = {rng.choice(["minimum", "exclusiveMinimum"]): lo}
        if rng.random() < 0.7:
            bounds[rng.choice(["maximum", "exclusiveMaximum"])] = lo + rng.randint(2, 40)
        return {"type": rng.choice(["integer", "number"]), **bounds}
    if kind == 2:
        return {"type": rng.choice(["boolean", "null", ["string", "null"], ["integer", "boolean"]])}
    if kind == 3:
        return {"enum": rng.sample(["a", 1, 2.5, None, True, [1, "x"], {"k": [None]}, "é"], 3)}
    if kind == 4:
        return rng.choice([True, {}, {"type": "object"}, {"type": "array", "maxItems": 2}])
    if kind == 5:
        return {"const": rng.choice(["c", 0, {"a": {}}])}
    sub = [_random_schema(rng, depth - 1) for _ in range(3)]
    if kind == 6:
        names = ["a", "b", "c"][: rng.randint(0, 3)]
        schema = {"type": "object", "properties": dict(zip(names, sub, strict=False))}
        schema["required"] = rng.sample(names, rng.randint(0, len(names)))
        if rng.random() < 0.5:
            schema["additionalProperties"] = rng.choice([False, True])
        return schema
    if kind == 7:
        schema = {"type": "array", "items": sub[0], "minItems": rng.randint(0, 2)}
        if rng.random() < 0.5:
            schema["maxItems"] = schema["minItems"] + rng.randint(0, 3)
        if rng.random() < 0.3:
            schema["prefixItems"] = sub[1:]
        return schema
    if kind == 8:
        return {"anyOf": sub[: rng.randint(1, 3)]}
    if kind == 9:
        return {"type": "object", "additionalProperties": sub[0]}
    return {
        "allOf": [{"properties": {"a": sub[0]}, "required": ["a"]}, {"properties": {"b": sub[1]}}]
    }


def test_random_schemas_only_generate_valid_instances():
    rng = random.Random(7)
    for _ in range(60):
        schema = _random_schema(rng, 3)
        node = schema_to_ir(schema)
        for _ in range(10):
            validate(schema, json.loads(sample(node, rng)))


def test_common_large_schemas_fit_the_automaton() -> None:
    """Sized by the automaton's own estimate (one estimator, one limit): the longest string
    the docs promise, and an object of several bounded strings, compile."""
    from chassis.builtin_plugins.structured_output.automaton import Automaton

    longest = {"type": "string", "maxLength": 1000}
    six = {
        "type": "object",
        "properties": {f"p{i}": {"type": "string", "maxLength": 100} for i in range(6)},
    }
    for schema in (longest, six):
        node = schema_to_ir(schema)
        assert estimated_nfa_states(node) <= MAX_NFA_STATES
        assert Automaton.from_ir(node).fullmatch(
            json.dumps({"p0": "x"} if schema is six else "x").encode()
        )


def test_digits_are_bounded_so_a_model_cannot_loop_on_them() -> None:
    from chassis.builtin_plugins.structured_output.json_numbers import (
        MAX_FRACTION_DIGITS,
        MAX_INTEGER_DIGITS,
    )

    number = schema_to_ir({"type": "number"})
    assert ir_fullmatch(number, "1" * MAX_INTEGER_DIGITS + "." + "5" * MAX_FRACTION_DIGITS)
    assert not ir_fullmatch(number, "1" * (MAX_INTEGER_DIGITS + 1))
    assert not ir_fullmatch(number, "1." + "0" * (MAX_FRACTION_DIGITS + 1))
    assert ir_fullmatch(number, "1e308") and not ir_fullmatch(number, "1e3080")
    unit = schema_to_ir({"type": "number", "minimum": 0, "maximum": 1})
    assert ir_fullmatch(unit, "1." + "0" * MAX_FRACTION_DIGITS)
    assert not ir_fullmatch(unit, "1." + "0" * (MAX_FRACTION_DIGITS + 1))
    big = schema_to_ir({"type": "integer", "minimum": 10**25})  # a bound longer than the cap
    assert ir_fullmatch(big, str(10**25)) and ir_fullmatch(big, str(10**26 - 1))
    time = schema_to_ir({"type": "string", "format": "time"})
    assert ir_fullmatch(time, '"12:00:00.123456789Z"')
    assert not ir_fullmatch(time, '"12:00:00.1234567890Z"')


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_nan_and_infinity_are_not_json_values(value: float) -> None:
    for schema in ({"const": value}, {"enum": [1, value]}, {"enum": [[value]]}):
        with pytest.raises(ValueError, match="not a JSON value"):
            schema_to_ir(schema)
