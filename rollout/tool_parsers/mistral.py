"""Mistral: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`` (v3 and v7 tokenizers) and
``[TOOL_CALLS]NAME[ARGS]{...}`` repeated (v11+, optionally ``[CALL_ID]ID`` before ``[ARGS]``).

Both are read; the first is written. Text before the first ``[TOOL_CALLS]`` is content.
"""

from __future__ import annotations

import orjson

from rollout.tool_parsers.base import (
    Malformed,
    ParsedTurn,
    ToolCall,
    _snippet,
    call_from_object,
    check_name,
    dump_json,
    json_span,
    read_arguments,
    register_parser,
    register_renderer,
    skip_space,
    snippet_at,
)

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"


def _read_array(text: str, position: int) -> tuple[list[ToolCall], int]:
    """The calls in the JSON array at ``position`` and the index after it (-1: unreadable)."""
    end = json_span(text, position)
    if end is None:
        return [ToolCall("", None, f"unclosed [TOOL_CALLS] array (no closing ']'): {snippet_at(text, position)}")], -1
    body = text[position:end]
    try:
        calls = orjson.loads(body)
    except (orjson.JSONDecodeError, UnicodeEncodeError) as exc:
        return [ToolCall("", None, f"invalid JSON in [TOOL_CALLS] ({exc}): {_snippet(body)}")], -1
    if not isinstance(calls, list):
        return [ToolCall("", None, f"[TOOL_CALLS] must be followed by a JSON array of calls: {_snippet(body)}")], end
    return [call_from_object(call, body) for call in calls], end


def _read_compact(text: str, position: int) -> tuple[ToolCall, int]:
    """The ``NAME[ARGS]{...}`` call at ``position`` and the index after it (-1: unreadable)."""
    following = text.find(TOOL_CALLS, position)
    args = text.find(ARGS, position, len(text) if following < 0 else following)
    if args < 0:
        raise Malformed(
            f"expected [ARGS] after the tool name in [TOOL_CALLS]NAME[ARGS]{{...}}: {snippet_at(text, position)}"
        )
    call_id = text.find(CALL_ID, position, args)
    name = check_name(text[position : args if call_id < 0 else call_id], "[TOOL_CALLS]NAME[ARGS]")
    return read_arguments(text, args + len(ARGS), name, TOOL_CALLS)


@register_parser("mistral")
def parse_mistral(text: str) -> ParsedTurn:
    """Mistral's calls, in either form; text before the first ``[TOOL_CALLS]`` is content."""
    marker = text.find(TOOL_CALLS)
    if marker < 0:
        return ParsedTurn(content=text)
    turn = ParsedTurn(content=text[:marker].rstrip())
    while marker >= 0:
        position = skip_space(text, marker + len(TOOL_CALLS))
        end = -1
        if text.startswith("[", position) and not text.startswith((ARGS, CALL_ID), position):
            calls, end = _read_array(text, position)
            turn.calls.extend(calls)
        else:
            try:
                call, end = _read_compact(text, position)
                turn.calls.append(call)
                end = end if call.error is None else -1  # the end of invalid JSON is a guess
            except Malformed as exc:
                turn.calls.append(ToolCall(exc.name, None, str(exc)))
        marker = text.find(TOOL_CALLS, max(end, position))
    return turn


@register_renderer("mistral")
def render_mistral(content: str, calls: list[tuple[str, dict]]) -> str:
    """The JSON-array form, as the v3 template writes it (without the call ids the client adds)."""
    if not calls:
        return content
    items = ", ".join(f'{{"name": {dump_json(name)}, "arguments": {dump_json(args)}}}' for name, args in calls)
    return f"{content}{TOOL_CALLS} [{items}]"


def render_mistral_compact(content: str, calls: list[tuple[str, dict]]) -> str:
    """The v11+ form: ``[TOOL_CALLS]NAME[ARGS]{...}`` per call."""
    return content + "".join(f"{TOOL_CALLS}{name}{ARGS}{dump_json(args)}" for name, args in calls)
