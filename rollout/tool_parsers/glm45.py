"""GLM-4.5: ``<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>\\n...</tool_call>``.

String values are written raw, other values as JSON; the tool schemas (when given) say which is which.
A key cannot contain ``</arg_key>``, a value ``</arg_value>``, and neither ``</tool_call>``; keys are
read stripped.
"""

from __future__ import annotations

from typing import Any

from rollout.tool_parsers.base import (
    Malformed,
    ParsedTurn,
    ToolCall,
    _safe,
    check_name,
    parameter_types,
    register_parser,
    register_renderer,
    skip_space,
    snippet_at,
    xml_call,
    xml_text,
    xml_value,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
KEY, KEY_END = "<arg_key>", "</arg_key>"
VALUE, VALUE_END = "<arg_value>", "</arg_value>"


def _read_call(text: str, position: int, end: int, tools: list[dict] | None) -> ToolCall:
    """The call whose body is ``text[position:end]`` (between the tags; raises ``Malformed``)."""
    tag = text.find("<", position, end)
    tag = end if tag < 0 else tag
    newline = text.find("\n", position, tag)
    name_end = tag if newline < 0 else newline
    name = check_name(text[position:name_end], "<tool_call>NAME")
    types = parameter_types(tools, name) if tools else {}
    arguments: dict[str, Any] = {}
    position = skip_space(text, name_end)
    while position < end:
        if not text.startswith(KEY, position, end):
            raise Malformed(
                f"expected <arg_key> or </tool_call> in tool call {name!r}: {snippet_at(text, position, end)}", name
            )
        key_end = text.find(KEY_END, position, end)
        if key_end < 0:
            raise Malformed(f"unclosed <arg_key> in tool call {name!r} (no </arg_key>)", name)
        key = _safe(text[position + len(KEY) : key_end].strip())
        position = skip_space(text, key_end + len(KEY_END))
        if not text.startswith(VALUE, position, end):
            raise Malformed(f"<arg_key>{key}</arg_key> in tool call {name!r} is not followed by <arg_value>", name)
        value_end = text.find(VALUE_END, position, end)
        if value_end < 0:
            raise Malformed(f"unclosed <arg_value> for {key!r} in tool call {name!r} (no </arg_value>)", name)
        arguments[key] = xml_value(text[position + len(VALUE) : value_end], key, name, types.get(key, set()))
        position = skip_space(text, value_end + len(VALUE_END))
    return xml_call(name, arguments)


@register_parser("glm45")
def parse_glm45(text: str, tools: list[dict] | None = None) -> ParsedTurn:
    """GLM-4.5's calls; text before the first ``<tool_call>`` is content. With ``tools``, each value
    is read by its parameter's type; a value that does not fit makes the call an error."""
    start = text.find(OPEN)
    if start < 0:
        return ParsedTurn(content=text)
    turn = ParsedTurn(content=text[:start].rstrip())
    position = start
    while position >= 0:
        inside = position + len(OPEN)
        close = text.find(CLOSE, inside)
        if close < 0:
            turn.calls.append(ToolCall("", None, f"unclosed <tool_call> (no </tool_call>): {snippet_at(text, inside)}"))
            break
        try:
            turn.calls.append(_read_call(text, inside, close, tools))
        except Malformed as exc:
            turn.calls.append(ToolCall(exc.name, None, str(exc)))
        position = text.find(OPEN, close + len(CLOSE))
    return turn


@register_renderer("glm45")
def render_glm45(content: str, calls: list[tuple[str, dict]]) -> str:
    """As GLM-4.5's template writes an assistant turn after its reasoning: content, then each call."""
    blocks = []
    for name, arguments in calls:
        pairs = "".join(
            f"{KEY}{key}{KEY_END}\n{VALUE}{xml_text(value)}{VALUE_END}\n" for key, value in arguments.items()
        )
        blocks.append(f"\n{OPEN}{name}\n{pairs}{CLOSE}")
    return content + "".join(blocks)
