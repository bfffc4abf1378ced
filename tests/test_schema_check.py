"""A tool's arguments check (``tools/schema_check.py``): the compiled fast path never accepts what
jsonschema rejects, the messages are jsonschema's, and schemas with keywords whose meaning differs
between the drafts are left to jsonschema alone."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from tools.schema_check import ArgumentsCheck, same_in_both_drafts

SCHEMAS = [
    {"type": "object", "properties": {"expression": {"type": "string", "maxLength": 8}}, "required": ["expression"]},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "exclusiveMaximum": 10}},
     "additionalProperties": False},
    {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "number"}, "uniqueItems": True,
                                             "maxItems": 3}}},
    {"type": "object", "properties": {"mode": {"enum": ["a", "b", 1]}, "flag": {"type": "boolean"},
                                      "v": {"anyOf": [{"type": "null"}, {"type": "string", "pattern": "^x"}]}}},
    {"type": "object", "properties": {"k": {"const": 1}, "o": {"type": "object", "minProperties": 1}}},
]  # fmt: skip

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-20, 20) | st.floats(-20, 20, allow_nan=False) | st.text(max_size=10),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=10,
)
KEYS = st.sampled_from(["expression", "n", "xs", "mode", "flag", "v", "k", "o", "other"])
ARGUMENTS = st.dictionaries(KEYS, JSON, max_size=4)


@pytest.mark.parametrize("schema", SCHEMAS)
def test_the_schemas_of_the_test_take_the_fast_path(schema):
    assert same_in_both_drafts(schema) and ArgumentsCheck(schema, "t").fast is not None


@settings(max_examples=300, deadline=None)
@given(index=st.integers(0, len(SCHEMAS) - 1), arguments=ARGUMENTS)
def test_the_verdict_is_jsonschemas(index, arguments):
    schema = SCHEMAS[index]
    problems = ArgumentsCheck(schema, "t")(arguments)
    assert (problems is None) == Draft202012Validator(schema).is_valid(arguments)


def test_the_message_is_jsonschemas_with_its_path():
    check = ArgumentsCheck(SCHEMAS[1], "t")
    assert check({"n": -1}) == "n: -1 is less than the minimum of 0"
    assert check({"n": 3}) is None
    assert check({"m": 3}) == "Additional properties are not allowed ('m' was unexpected)"


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"x": {"type": "number", "multipleOf": 0.1}}},  # float arithmetic differs
    {"type": "object", "properties": {"d": {"type": "string", "format": "date"}}},  # an annotation in 2020-12
    {"type": "object", "properties": {"t": {"prefixItems": [{"type": "string"}]}}},  # 2020-12 only
    {"type": "object", "dependentRequired": {"a": ["b"]}},  # 2020-12 only
    {"$defs": {"s": {"type": "string"}}, "properties": {"x": {"$ref": "#/$defs/s"}}},
])  # fmt: skip
def test_keywords_that_differ_between_the_drafts_are_jsonschemas_alone(schema):
    assert not same_in_both_drafts(schema)
    check = ArgumentsCheck(schema, "t")
    assert check.fast is None


def test_multiple_of_is_checked_as_jsonschema_checks_it():
    check = ArgumentsCheck({"type": "object", "properties": {"x": {"multipleOf": 0.1}}}, "t")
    assert check({"x": 0.3}) == "x: 0.3 is not a multiple of 0.1"


def test_an_invalid_schema_is_an_error_naming_the_tool():
    with pytest.raises(ValueError, match="tool 'calc': invalid parameters schema"):
        ArgumentsCheck({"type": "object", "properties": {"x": {"type": "no-such-type"}}}, "tool 'calc'")
