"""Kimi K2: ``<|tool_calls_section_begin|>``, then per call ``<|tool_call_begin|>functions.NAME:INDEX``
``<|tool_call_argument_begin|>{ARGS}<|tool_call_end|>``, then ``<|tool_calls_section_end|>``.

INDEX counts the calls of the conversation; the parser reads the name out of ``functions.NAME:INDEX``.
Text before the section is content.
"""

from __future__ import annotations

import re

from rollout.tool_parsers.base import (
    Malformed,
    ParsedTurn,
    ToolCall,
    _snippet,
    check_name,
    dump_json,
    parse_delimited,
    read_arguments,
    register_parser,
    register_renderer,
    snippet_at,
)

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARGUMENT_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
_CALL_ID = re.compile(r"(?:functions\.)?(?P<name>.+?)(?::\d+)?", re.DOTALL)


def _read_call(text: str, position: int) -> tuple[ToolCall, int]:
    """``functions.NAME:INDEX<|tool_call_argument_begin|>{...}`` at ``position`` (-1: unreadable)."""
    call_end = text.find(CALL_END, position)
    argument_begin = text.find(ARGUMENT_BEGIN, position, call_end)
    if argument_begin < 0:
        raise Malformed(f"no <|tool_call_argument_begin|> in the tool call: {snippet_at(text, position, call_end)}")
    call_id = text[position:argument_begin].strip()
    match = _CALL_ID.fullmatch(call_id)
    if match is None or match["name"].isdigit():
        raise Malformed(f"tool call id {_snippet(call_id)!r} names no function (expected functions.NAME:INDEX)")
    name = check_name(match["name"], "functions.NAME:INDEX")
    return read_arguments(text, argument_begin + len(ARGUMENT_BEGIN), name, CALL_END)


@register_parser("kimi_k2")
def parse_kimi_k2(text: str) -> ParsedTurn:
    """Kimi K2's calls; text before ``<|tool_calls_section_begin|>`` (or the first call) is content."""
    return parse_delimited(text, SECTION_BEGIN, CALL_BEGIN, CALL_END, _read_call)


@register_renderer("kimi_k2")
def render_kimi_k2(content: str, calls: list[tuple[str, dict]]) -> str:
    """As Kimi K2's template writes an assistant turn; INDEX counts from 0 within the turn (the
    renderer does not know the calls of earlier turns)."""
    if not calls:
        return content
    blocks = "".join(f"{CALL_BEGIN}functions.{name}:{index}{ARGUMENT_BEGIN}{dump_json(args)}{CALL_END}"
                     for index, (name, args) in enumerate(calls))  # fmt: skip
    return f"{content}{SECTION_BEGIN}{blocks}{SECTION_END}"
