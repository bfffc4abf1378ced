"""DeepSeek-V3 / R1 (``deepseekv3``) and DeepSeek-V3.1 (``deepseekv31``): calls between
``<｜tool▁calls▁begin｜>`` and ``<｜tool▁calls▁end｜>``, each between ``<｜tool▁call▁begin｜>`` and
``<｜tool▁call▁end｜>``. V3 writes ``function<｜tool▁sep｜>NAME\\n```json\\n{ARGS}\\n```````; V3.1
writes ``NAME<｜tool▁sep｜>{ARGS}``. Text before the calls is content.
"""

from __future__ import annotations

from rollout.tool_parsers.base import (
    Malformed,
    ParsedTurn,
    ToolCall,
    check_name,
    dump_json,
    parse_delimited,
    read_arguments,
    register_parser,
    register_renderer,
    skip_space,
    snippet_at,
)

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE_OPEN, FENCE_CLOSE = "```json", "```"


def _find_sep(text: str, position: int) -> int:
    """The ``<｜tool▁sep｜>`` of the call whose header starts at ``position`` (raises ``Malformed``)."""
    call_end = text.find(CALL_END, position)
    sep = text.find(SEP, position, call_end)
    if sep < 0:
        raise Malformed(f"no <｜tool▁sep｜> in the tool call: {snippet_at(text, position, call_end)}")
    return sep


def _read_v3(text: str, position: int) -> tuple[ToolCall, int]:
    """``function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>`` at ``position``."""
    sep = _find_sep(text, position)
    newline = text.find("\n", sep, text.find(CALL_END, sep))
    if newline < 0:
        raise Malformed(f"expected a newline and ```json after the tool name: {snippet_at(text, sep + len(SEP))}")
    name = check_name(text[sep + len(SEP) : newline], "function<｜tool▁sep｜>NAME")
    fence = skip_space(text, newline)
    if not text.startswith(FENCE_OPEN, fence):
        raise Malformed(f"expected ```json after the name of tool call {name!r}: {snippet_at(text, fence)}", name)
    call, end = read_arguments(text, fence + len(FENCE_OPEN), name, CALL_END)
    if end >= 0 and call.error is None:
        end = skip_space(text, end)
        if not text.startswith(FENCE_CLOSE, end):
            raise Malformed(f"expected ``` after the arguments of tool call {name!r}: {snippet_at(text, end)}", name)
        end += len(FENCE_CLOSE)
    return call, end


def _read_v31(text: str, position: int) -> tuple[ToolCall, int]:
    """``NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`` at ``position``."""
    sep = _find_sep(text, position)
    name = check_name(text[position:sep], "<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>")
    return read_arguments(text, sep + len(SEP), name, CALL_END)


@register_parser("deepseekv3")
def parse_deepseekv3(text: str) -> ParsedTurn:
    """DeepSeek-V3 / R1 calls (arguments in a ```json fence)."""
    return parse_delimited(text, CALLS_BEGIN, CALL_BEGIN, CALL_END, _read_v3)


@register_parser("deepseekv31")
def parse_deepseekv31(text: str) -> ParsedTurn:
    """DeepSeek-V3.1 calls (``NAME<｜tool▁sep｜>{ARGS}``)."""
    return parse_delimited(text, CALLS_BEGIN, CALL_BEGIN, CALL_END, _read_v31)


@register_renderer("deepseekv3")
def render_deepseekv3(content: str, calls: list[tuple[str, dict]]) -> str:
    """As DeepSeek-V3's template writes an assistant turn: calls one per line after the content."""
    if not calls:
        return content
    blocks = [f"{CALL_BEGIN}function{SEP}{name}\n{FENCE_OPEN}\n{dump_json(args)}\n{FENCE_CLOSE}{CALL_END}"
              for name, args in calls]  # fmt: skip
    return content + CALLS_BEGIN + "\n".join(blocks) + CALLS_END


@register_renderer("deepseekv31")
def render_deepseekv31(content: str, calls: list[tuple[str, dict]]) -> str:
    """As DeepSeek-V3.1's template writes an assistant turn: calls back to back after the content."""
    if not calls:
        return content
    blocks = "".join(f"{CALL_BEGIN}{name}{SEP}{dump_json(args)}{CALL_END}" for name, args in calls)
    return f"{content}{CALLS_BEGIN}{blocks}{CALLS_END}"
