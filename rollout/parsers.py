"""Tool-call parsers: assistant text in, its content and tool calls (a malformed call carries its error) out.

The Qwen2.5 / Hermes format is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
any number per turn. Other formats register a function under a name in ``PARSERS``. Parsers never raise.
"""

from __future__ import annotations

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
PARSERS: dict[str, Parser] = {}


def register_parser(name: str) -> Callable[[Parser], Parser]:
    """Decorator: make a parser available under ``name`` (for ``RolloutConfig.tool_parser``)."""

    def wrap(fn: Parser) -> Parser:
        PARSERS[name] = fn
        return fn

    return wrap


def get_parser(name: str) -> Parser:
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}; known: {', '.join(sorted(PARSERS))}") from None


OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_CLOSING_TAG_RETRIES = 4
"""Later closing tags tried when a call's body is not valid JSON (bounds the work on hostile text)."""
_MAX_ERROR_SNIPPET = 120
MAX_ARGUMENT_DEPTH = 100
"""Deepest nesting of lists and objects accepted in a call's arguments; deeper ones cannot be
written to the rollout JSONL (orjson stops at 255 levels) or checked against a schema."""


def _snippet(text: str) -> str:
    text = text.strip()
    text = text if len(text) <= _MAX_ERROR_SNIPPET else text[:_MAX_ERROR_SNIPPET] + "..."
    return text.encode("utf-8", "backslashreplace").decode("utf-8")  # lone surrogates: an error must serialise


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


def parse_call_json(body: str) -> ToolCall:
    """Read one ``{"name": ..., "arguments": {...}}`` object (``error`` set when malformed)."""
    try:
        obj = orjson.loads(body.strip())
    except (orjson.JSONDecodeError, UnicodeEncodeError) as exc:
        return ToolCall("", None, f"invalid JSON in tool call ({exc}): {_snippet(body)}")
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


@register_parser("qwen25")
@register_parser("hermes")
def parse_hermes(text: str) -> ParsedTurn:
    """Qwen2.5 / Hermes: ``<tool_call>{json}</tool_call>`` blocks; text before the first is content.

    A ``</tool_call>`` inside a JSON string (``{"text": "say </tool_call>"}``) does not end the
    call: when the body up to the first closing tag is not valid JSON, the next few closing tags
    are tried before the call is reported as malformed.
    """
    start = text.find(OPEN)
    if start < 0:
        return ParsedTurn(content=text)
    turn = ParsedTurn(content=text[:start].rstrip())
    position = start
    while position >= 0:
        body_start = position + len(OPEN)
        end = text.find(CLOSE, body_start)
        if end < 0:
            body = text[body_start:]
            turn.calls.append(ToolCall("", None, f"unclosed <tool_call> (no </tool_call>): {_snippet(body)}"))
            break
        call = parse_call_json(text[body_start:end])
        later = end
        for _ in range(MAX_CLOSING_TAG_RETRIES):  # a closing tag inside a string cut the body short?
            if call.error is None or not call.error.startswith("invalid JSON"):
                break
            later = text.find(CLOSE, later + len(CLOSE))
            if later < 0:
                break
            candidate = parse_call_json(text[body_start:later])
            if candidate.error is None:
                call, end = candidate, later
                break
        turn.calls.append(call)
        position = text.find(OPEN, end + len(CLOSE))
    return turn
