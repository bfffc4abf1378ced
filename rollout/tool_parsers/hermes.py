"""Qwen2.5 / Hermes: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number per turn."""

from __future__ import annotations

from rollout.tool_parsers.base import (
    MAX_CLOSING_TAG_RETRIES,
    ParsedTurn,
    ToolCall,
    _snippet,
    dump_json,
    parse_call_json,
    register_parser,
    register_renderer,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@register_parser("qwen25", "hermes")
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


@register_renderer("qwen25", "hermes")
def render_hermes(content: str, calls: list[tuple[str, dict]]) -> str:
    """As Qwen2.5's template writes an assistant turn: content, then each call on its own lines."""
    blocks = [f'{OPEN}\n{{"name": {dump_json(name)}, "arguments": {dump_json(args)}}}\n{CLOSE}' for name, args in calls]
    return "\n".join([content, *blocks] if content else blocks)
