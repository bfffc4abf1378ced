"""A tool's arguments checked against its parameters schema, compiled once per tool.

jsonschema's ``Draft202012Validator`` is the verdict and writes the messages the model reads, but
walking a schema for every call cost about 45 us (a turn of the whole client costs a few hundred).
So where a schema uses only keywords that mean the same in draft 7 and draft 2020-12, it is also
compiled to Python by ``fastjsonschema`` (about 1 us a call): arguments it accepts are valid; any it
rejects go to jsonschema, which gives the verdict and the message. ``multipleOf`` (fastjsonschema's
float arithmetic accepts 0.3 as a multiple of 0.1, jsonschema does not), ``format``, ``$ref`` and
every other keyword leave the schema to jsonschema alone. Arguments are parsed JSON (lists, dicts,
strings, numbers), which the two read alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import fastjsonschema
from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

ASSERTIONS = {"type", "enum", "const", "required", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
              "minLength", "maxLength", "pattern", "minItems", "maxItems", "uniqueItems", "minProperties",
              "maxProperties"}  # fmt: skip
ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly"}
SUBSCHEMA = {"items", "additionalProperties", "not"}
SUBSCHEMA_LISTS = {"anyOf", "oneOf", "allOf"}
DRAFT7 = "http://json-schema.org/draft-07/schema#"


def same_in_both_drafts(schema: Any) -> bool:
    """Whether ``schema`` uses only keywords that mean the same in draft 7 and in draft 2020-12."""
    if isinstance(schema, bool):
        return True
    if not isinstance(schema, dict):
        return False
    for key, value in schema.items():
        if key in ASSERTIONS or key in ANNOTATIONS:
            if key == "type" and not isinstance(value, str | list):
                return False
        elif key == "properties":
            if not isinstance(value, dict) or not all(same_in_both_drafts(v) for v in value.values()):
                return False
        elif key in SUBSCHEMA:
            if not same_in_both_drafts(value):  # (an "items" list is draft 7's tuple form: not the same)
                return False
        elif key in SUBSCHEMA_LISTS:
            if not isinstance(value, list) or not all(same_in_both_drafts(v) for v in value):
                return False
        else:
            return False
    return True


class ArgumentsCheck:
    """``check(arguments)``: None when they are valid, else what is wrong, one ``path: message`` per
    problem (jsonschema's messages). A schema that is not a valid 2020-12 schema is a ValueError."""

    def __init__(self, parameters: dict[str, Any], where: str):
        try:
            Draft202012Validator.check_schema(parameters)
        except SchemaError as exc:
            raise ValueError(f"{where}: invalid parameters schema: {exc.message}") from None
        self.validator = Draft202012Validator(parameters)
        self.fast: Callable[[Any], Any] | None = None
        if same_in_both_drafts(parameters):
            try:
                self.fast = fastjsonschema.compile({**parameters, "$schema": DRAFT7})
            except Exception:
                self.fast = None  # (what it cannot compile, jsonschema still checks)

    def __call__(self, arguments: Any) -> str | None:
        if self.fast is not None:
            try:
                self.fast(arguments)
                return None
            except fastjsonschema.JsonSchemaValueException:
                pass  # the verdict and the message are jsonschema's
        problems = [
            (f"{'.'.join(map(str, e.absolute_path))}: " if e.absolute_path else "") + e.message
            for e in self.validator.iter_errors(arguments)
        ]
        return "; ".join(problems) or None
