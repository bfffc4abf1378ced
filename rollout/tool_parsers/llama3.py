"""Llama 3.1-3.3 (JSON): ``{"name": NAME, "parameters": {...}}``, optionally after ``<|python_tag|>``,
several separated by ``;``. Text before the first call is content.

Without ``<|python_tag|>``, a call is a JSON object with a ``name`` and ``parameters`` (or
``arguments``): prose with braces stays prose. A malformed object at the very start of the turn, or
anything after ``<|python_tag|>``, is a malformed call.
"""

from __future__ import annotations

import re

import orjson

from rollout.tool_parsers.base import (
    ParsedTurn,
    ToolCall,
    dump_json,
    json_span,
    parse_call_json,
    register_parser,
    register_renderer,
    skip_space,
    snippet_at,
)

PYTHON_TAG = "<|python_tag|>"
MAX_CANDIDATES = 16
"""JSON objects in prose tried as the first call; together they may span about the text once more
(bounds the work on hostile text such as ``{"{"{"...``)."""
_CANDIDATE = re.compile(r'\{\s*"')
_CALL_START = re.compile(r'\s*\{\s*"name"\s*:')


def _read_object(text: str, position: int) -> tuple[ToolCall, int]:
    """The call written as the JSON object at ``position`` and the index after it (-1: never closes)."""
    end = json_span(text, position)
    if end is None:
        message = f"unclosed tool call (the JSON object never closes): {snippet_at(text, position)}"
        return ToolCall("", None, message), -1
    return parse_call_json(text[position:end]), end


def _first_call(text: str) -> int:
    """Where the first call starts in text without ``<|python_tag|>`` (-1: none)."""
    if _CALL_START.match(text):  # the turn opens with a call: a call, however malformed
        return skip_space(text, 0)
    position, budget = 0, len(text) + 4096
    for _ in range(MAX_CANDIDATES):
        match = _CANDIDATE.search(text, position)
        if match is None or budget < 0:
            return -1
        start = match.start()
        end = json_span(text, start)
        budget -= (len(text) if end is None else end) - start
        if end is None:
            position = start + 1
            continue
        try:
            obj = orjson.loads(text[start:end])
        except orjson.JSONDecodeError:
            position = start + 1
            continue
        if isinstance(obj, dict) and "name" in obj and ("parameters" in obj or "arguments" in obj):
            return start
        position = end  # a JSON object in prose: the objects inside it are not calls either
    return -1


@register_parser("llama3")
def parse_llama3(text: str) -> ParsedTurn:
    """Llama 3's JSON calls; text before the first call (or ``<|python_tag|>``) is content."""
    tag = text.find(PYTHON_TAG)
    if tag >= 0:
        start, position = tag, skip_space(text, tag + len(PYTHON_TAG))
    else:
        start = position = _first_call(text)
        if start < 0:
            return ParsedTurn(content=text)
    turn = ParsedTurn(content=text[:start].rstrip())
    if tag >= 0 and not text.startswith("{", position):
        message = "expected a JSON object with 'name' and 'parameters' after <|python_tag|>"
        turn.calls.append(ToolCall("", None, f"{message}: {snippet_at(text, position)}"))
        return turn
    while True:
        call, end = _read_object(text, position)
        turn.calls.append(call)
        if end < 0:
            return turn
        position = skip_space(text, end)
        if text.startswith(";", position):
            position = skip_space(text, position + 1)
        if not text.startswith("{", position):
            return turn


@register_renderer("llama3")
def render_llama3(content: str, calls: list[tuple[str, dict]]) -> str:
    """As Llama 3's template writes a call (``{"name": ..., "parameters": ...}``), ``; `` between
    calls, a blank line after any content."""
    calls_text = "; ".join(f'{{"name": {dump_json(name)}, "parameters": {dump_json(args)}}}' for name, args in calls)
    return f"{content}\n\n{calls_text}" if content and calls_text else content or calls_text
