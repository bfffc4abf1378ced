"""Qwen3-Coder (XML), per call, with newlines between the tags:
``<tool_call> <function=NAME> <parameter=KEY> VALUE </parameter> ... </function> </tool_call>``.

String values are written raw, other values as JSON; the tool schemas (when given) say which is which.
A value cannot contain ``</parameter>``, ``<parameter=``, ``</function>`` or ``</tool_call>`` (they end it).
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
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"


def _read_function(text: str, position: int, end: int, tools: list[dict] | None) -> tuple[ToolCall, int]:
    """The ``<function=...>...</function>`` at ``position`` (within ``end``) and the index after it.

    A value ends at ``</parameter>``, or at the next ``<parameter=`` or ``</function>`` when that
    tag is missing. Raises ``Malformed``."""
    name_end = text.find(">", position, end)
    if name_end < 0:
        raise Malformed(f"unclosed <function= tag (no '>' after the name): {snippet_at(text, position, end)}")
    name = check_name(text[position + len(FUNCTION) : name_end], "<function=NAME>")
    function_end = text.find(FUNCTION_END, name_end, end)
    if function_end < 0:
        raise Malformed(f"unclosed <function={name}> (no </function>): {snippet_at(text, name_end + 1, end)}", name)
    types = parameter_types(tools, name) if tools else {}
    arguments: dict[str, Any] = {}
    position = skip_space(text, name_end + 1)
    while position < function_end:
        if not text.startswith(PARAMETER, position, function_end):
            message = f"expected <parameter=KEY> or </function> in tool call {name!r}"
            raise Malformed(f"{message}: {snippet_at(text, position, function_end)}", name)
        key_end = text.find(">", position, function_end)
        if key_end < 0:
            message = f"unclosed <parameter= tag in tool call {name!r}"
            raise Malformed(f"{message}: {snippet_at(text, position, function_end)}", name)
        key = _safe(text[position + len(PARAMETER) : key_end])
        ends = [e for e in (text.find(m, key_end, function_end) for m in (PARAMETER_END, PARAMETER)) if e >= 0]
        value_end = min(ends, default=function_end)
        raw = text[key_end + 1 : value_end]
        raw = raw[1:] if raw.startswith("\n") else raw
        raw = raw[:-1] if raw.endswith("\n") else raw
        arguments[key] = xml_value(raw, key, name, types.get(key, set()))
        after = value_end + len(PARAMETER_END) if text.startswith(PARAMETER_END, value_end) else value_end
        position = skip_space(text, after)
    return xml_call(name, arguments), function_end + len(FUNCTION_END)


def _read_block(text: str, position: int, end: int, tools: list[dict] | None) -> list[ToolCall]:
    """The calls of the ``<tool_call>`` block whose body is ``text[position:end]`` (raises ``Malformed``)."""
    position = skip_space(text, position)
    if not text.startswith(FUNCTION, position, end):
        raise Malformed(f"expected <function=NAME> after <tool_call>: {snippet_at(text, position, end)}")
    calls = []
    while text.startswith(FUNCTION, position, end):  # several functions in one block: several calls
        call, position = _read_function(text, position, end, tools)
        calls.append(call)
        position = skip_space(text, position)
    if position < end:
        raise Malformed(f"expected </tool_call> after </function>: {snippet_at(text, position, end)}", calls[-1].name)
    return calls


@register_parser("qwen3_coder")
def parse_qwen3_coder(text: str, tools: list[dict] | None = None) -> ParsedTurn:
    """Qwen3-Coder's XML calls; text before the first ``<tool_call>`` is content. With ``tools``,
    each value is read by its parameter's type; a value that does not fit makes the call an error.
    A malformed ``<tool_call>`` block is one error; the last block may lack ``</tool_call>`` if the
    turn ends right after its ``</function>``."""
    start = text.find(OPEN)
    if start < 0:
        return ParsedTurn(content=text)
    turn = ParsedTurn(content=text[:start].rstrip())
    position = start
    while position >= 0:
        inside = position + len(OPEN)
        close = text.find(CLOSE, inside)
        try:
            turn.calls.extend(_read_block(text, inside, len(text) if close < 0 else close, tools))
        except Malformed as exc:
            message = str(exc) if close >= 0 else f"unclosed <tool_call> (no </tool_call>): {exc}"
            turn.calls.append(ToolCall(exc.name, None, message))
        position = -1 if close < 0 else text.find(OPEN, close + len(CLOSE))
    return turn


@register_renderer("qwen3_coder")
def render_qwen3_coder(content: str, calls: list[tuple[str, dict]]) -> str:
    """As Qwen3-Coder's template writes an assistant turn: content, a blank line, the calls."""
    blocks = []
    for name, arguments in calls:
        parameters = "".join(
            f"{PARAMETER}{key}>\n{xml_text(value)}\n{PARAMETER_END}\n" for key, value in arguments.items()
        )
        blocks.append(f"{OPEN}\n{FUNCTION}{name}>\n{parameters}{FUNCTION_END}\n{CLOSE}")
    calls_text = "\n".join(blocks)
    return f"{content}\n\n{calls_text}" if content and calls_text else content or calls_text
