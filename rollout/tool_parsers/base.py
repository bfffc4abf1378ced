"""What every tool-call format shares: the parsed types, the registries, JSON and XML-value helpers.

A parser takes an assistant turn's text (special tokens kept, the final stop token removed) and
returns its content and calls; it never raises: a malformed call carries its error, which the model
reads as the call's tool message. A renderer writes content and calls as the model would.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson


@dataclass
class ToolCall:
    """One call as the model wrote it. ``error`` is set (and ``arguments`` may be None) when it
    could not be read; the loop answers such a call with the error as its tool message."""

    name: str
    arguments: dict[str, Any] | None
    error: str | None = None


@dataclass
class ParsedTurn:
    """An assistant turn split into its text and its calls, malformed ones included, in order."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)


Parser = Callable[[str], ParsedTurn]
Renderer = Callable[[str, list[tuple[str, dict]]], str]
PARSERS: dict[str, Callable[..., ParsedTurn]] = {}
"""Parsers by name; one that takes a ``tools`` keyword reads argument types from the tool schemas."""
RENDERERS: dict[str, Renderer] = {}


def register_parser(*names: str) -> Callable[[Parser], Parser]:
    """Decorator: make a parser available under each of ``names`` (for ``RolloutConfig.tool_parser``)."""

    def wrap(fn: Parser) -> Parser:
        for name in names:
            PARSERS[name] = fn
        return fn

    return wrap


def register_renderer(*names: str) -> Callable[[Renderer], Renderer]:
    """Decorator: make a renderer available under each of ``names``."""

    def wrap(fn: Renderer) -> Renderer:
        for name in names:
            RENDERERS[name] = fn
        return fn

    return wrap


MAX_CLOSING_TAG_RETRIES = 4
"""Later closing tags tried when a call's body is not valid JSON (bounds the work on hostile text)."""
_MAX_ERROR_SNIPPET = 120
MAX_ARGUMENT_DEPTH = 100
"""Deepest nesting of lists and objects accepted in a call's arguments; deeper ones cannot be
written to the rollout JSONL (orjson stops at 255 levels) or checked against a schema."""


class Malformed(Exception):
    """Raised inside a parser for one malformed call (caught there: parsers never raise)."""

    def __init__(self, message: str, name: str = "") -> None:
        super().__init__(message)
        self.name = name


def _safe(text: str) -> str:
    """``text`` with lone surrogates escaped, so that it serialises."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _snippet(text: str) -> str:
    text = text.strip()
    text = text if len(text) <= _MAX_ERROR_SNIPPET else text[:_MAX_ERROR_SNIPPET] + "..."
    return _safe(text)  # lone surrogates: an error must serialise


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether ``value`` nests lists and objects more than ``limit`` levels (no recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def call_from_object(obj: Any, body: str) -> ToolCall:
    """A call from a decoded ``{"name": ..., "arguments": {...}}`` object (``body``: its text, for errors)."""
    if not isinstance(obj, dict):
        return ToolCall("", None, f"a tool call must be a JSON object with 'name' and 'arguments': {_snippet(body)}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall("", None, f"tool call has no 'name' string: {_snippet(body)}")
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models emit the arguments as a JSON string
        try:
            arguments = orjson.loads(arguments)
        except orjson.JSONDecodeError:
            arguments = None
    if not isinstance(arguments, dict):
        return ToolCall(name, None, f"the arguments of tool call {name!r} must be a JSON object: {_snippet(body)}")
    if _deeper_than(arguments, MAX_ARGUMENT_DEPTH):
        return ToolCall(name, None, f"the arguments of tool call {name!r} nest deeper than {MAX_ARGUMENT_DEPTH} levels")
    return ToolCall(name, arguments)


def parse_call_json(body: str) -> ToolCall:
    """Read one ``{"name": ..., "arguments": {...}}`` object (``error`` set when malformed)."""
    try:
        obj = orjson.loads(body.strip())
    except (orjson.JSONDecodeError, UnicodeEncodeError) as exc:
        return ToolCall("", None, f"invalid JSON in tool call ({exc}): {_snippet(body)}")
    return call_from_object(obj, body)


def arguments_call(name: str, body: str) -> ToolCall:
    """The call ``name`` whose arguments are the JSON object ``body`` (``error`` set when they are not)."""
    try:
        arguments = orjson.loads(body.strip())
    except (orjson.JSONDecodeError, UnicodeEncodeError) as exc:
        return ToolCall(name, None, f"invalid JSON in the arguments of tool call {name!r} ({exc}): {_snippet(body)}")
    if not isinstance(arguments, dict):
        return ToolCall(name, None, f"the arguments of tool call {name!r} must be a JSON object: {_snippet(body)}")
    if _deeper_than(arguments, MAX_ARGUMENT_DEPTH):
        return ToolCall(name, None, f"the arguments of tool call {name!r} nest deeper than {MAX_ARGUMENT_DEPTH} levels")
    return ToolCall(name, arguments)


_JSON_TOKEN = re.compile(r'\\.|["{}\[\]]', re.DOTALL)


def json_span(text: str, start: int) -> int | None:
    """End (exclusive) of the JSON object or array opening at ``text[start]``, brackets inside
    strings skipped; None when it never closes. Only finds the extent: the text may still be invalid."""
    depth, in_string = 0, False
    for match in _JSON_TOKEN.finditer(text, start):
        token = match.group()
        if token[0] == "\\":
            continue
        if token == '"':
            in_string = not in_string
        elif not in_string:
            depth += 1 if token in "{[" else -1
            if depth <= 0:
                return match.end()
    return None


_SPACE = re.compile(r"\s*")


def skip_space(text: str, position: int) -> int:
    """The first index at or after ``position`` that is not whitespace."""
    return _SPACE.match(text, position).end()


def snippet_at(text: str, start: int, end: int | None = None) -> str:
    """``_snippet`` of ``text[start:end]`` without copying the rest of a long text."""
    stop = len(text) if end is None else end
    return _snippet(text[start : min(stop, start + 4 * _MAX_ERROR_SNIPPET)])


def read_arguments(text: str, start: int, name: str, stop: str) -> tuple[ToolCall, int]:
    """The call ``name`` with the JSON object at ``text[start:]`` (whitespace skipped) as arguments,
    and where that object ends; -1 when it could not be delimited (the body then runs to ``stop``)."""
    position = skip_space(text, start)
    end = json_span(text, position) if text.startswith("{", position) else None
    if end is not None:
        return arguments_call(name, text[position:end]), end
    stop_at = text.find(stop, position)
    body = text[position:] if stop_at < 0 else text[position:stop_at]
    if not body.strip():
        return ToolCall(name, None, f"tool call {name!r} has no arguments (expected a JSON object)"), -1
    return arguments_call(name, body), -1  # not an object that closes: an error


def dump_json(value: Any, compact: bool = False) -> str:
    """JSON as chat templates write it (``tojson``: non-ASCII kept; ``compact``: no spaces)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":") if compact else None)


def check_name(name: str, where: str) -> str:
    """A call's name, stripped; raises ``Malformed`` when it is empty."""
    name = _safe(name.strip())
    if not name:
        raise Malformed(f"tool call has no function name in {where}")
    return name


# ----- XML-style values (qwen3_coder, glm45): strings raw, other types as JSON --------------------

_TYPE_CHECKS: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "null": lambda v: v is None,
}
_NOT_JSON = object()


def _schema_types(schema: Any) -> set[str]:
    """The JSON types a parameter's schema allows (``type``, a list of them, ``anyOf``/``oneOf``)."""
    if not isinstance(schema, dict):
        return set()
    declared = schema.get("type")
    if isinstance(declared, str):
        return {declared} & _TYPE_CHECKS.keys()
    if isinstance(declared, list):
        return {t for t in declared if isinstance(t, str)} & _TYPE_CHECKS.keys()
    types: set[str] = set()
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        for option in options if isinstance(options, list) else ():
            types |= _schema_types(option)
    return types or ({"object"} if "properties" in schema else {"array"} if "items" in schema else set())


def parameter_types(tools: list[dict] | None, name: str) -> dict[str, set[str]]:
    """Each parameter's allowed JSON types for tool ``name`` in OpenAI-style ``tools`` ({} when unknown)."""
    for tool in tools or ():
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and function.get("name") == name:
            parameters = function.get("parameters")
            properties = parameters.get("properties") if isinstance(parameters, dict) else None
            if isinstance(properties, dict):
                return {key: _schema_types(schema) for key, schema in properties.items()}
            return {}
    return {}


def xml_value(raw: str, key: str, name: str, types: set[str]) -> Any:
    """A parameter written as text: raw when its type is string, else JSON; without declared types,
    JSON when it parses, else the raw string. Raises ``Malformed`` when it does not fit its type."""
    try:
        raw.encode("utf-8")
    except UnicodeEncodeError:
        raise Malformed(f"parameter {key!r} of tool call {name!r} is not valid UTF-8: {_snippet(raw)}", name) from None
    if types == {"string"}:
        return raw
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        value = _NOT_JSON
    if not types:
        return raw if value is _NOT_JSON else value
    if value is not _NOT_JSON and any(_TYPE_CHECKS[t](value) for t in types):
        return value
    if "boolean" in types and raw.strip() in ("True", "False"):  # Python's str() of a bool, as Jinja writes it
        return raw.strip() == "True"
    if "string" in types:
        return raw
    expected = " or ".join(sorted(types))
    raise Malformed(f"parameter {key!r} of tool call {name!r} must be {expected} (as JSON): {_snippet(raw)}", name)


def xml_call(name: str, arguments: dict[str, Any]) -> ToolCall:
    """The call, or its error when its arguments nest too deep."""
    if _deeper_than(arguments, MAX_ARGUMENT_DEPTH):
        return ToolCall(name, None, f"the arguments of tool call {name!r} nest deeper than {MAX_ARGUMENT_DEPTH} levels")
    return ToolCall(name, arguments)


def xml_text(value: Any) -> str:
    """A parameter value as XML-style templates write it: strings raw, anything else as JSON."""
    return value if isinstance(value, str) else dump_json(value)


def parse_delimited(text: str, section_begin: str, call_begin: str, call_end: str,
                    read_call: Callable[[str, int], tuple[ToolCall, int]]) -> ParsedTurn:  # fmt: skip
    """Calls each between ``call_begin`` and ``call_end`` (inside an optional section opened by
    ``section_begin``); content is the text before the first. ``read_call`` reads one call after its
    ``call_begin`` and returns it with where it ended (-1: resynchronise at the next ``call_end``)."""
    starts = [s for s in (text.find(section_begin), text.find(call_begin)) if s >= 0]
    if not starts:
        return ParsedTurn(content=text)
    turn = ParsedTurn(content=text[: min(starts)].rstrip())
    begin = text.find(call_begin)
    while begin >= 0:
        position = begin + len(call_begin)
        if text.find(call_end, position) < 0:
            message = f"unclosed {call_begin} (no {call_end}): {snippet_at(text, position)}"
            turn.calls.append(ToolCall("", None, message))
            break
        try:
            call, end = read_call(text, position)
            if end >= 0 and call.error is None:
                end = skip_space(text, end)
                if not text.startswith(call_end, end):
                    message = f"expected {call_end} after the arguments of tool call {call.name!r}"
                    raise Malformed(f"{message}: {snippet_at(text, end)}", call.name)
                end += len(call_end)
            turn.calls.append(call)
        except Malformed as exc:
            turn.calls.append(ToolCall(exc.name, None, str(exc)))
            end = -1
        if end < 0 or turn.calls[-1].error is not None:  # resynchronise at the next call
            end = text.find(call_end, position) + len(call_end)
        begin = text.find(call_begin, end)
    return turn
