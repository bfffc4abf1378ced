"""Compatibility names: the tool-call parsers live in ``rollout.tool_parsers`` (one module per format)."""

from __future__ import annotations

from rollout.tool_parsers import PARSERS, RENDERERS, get_parser, get_renderer
from rollout.tool_parsers.base import (
    MAX_ARGUMENT_DEPTH,
    MAX_CLOSING_TAG_RETRIES,
    ParsedTurn,
    Parser,
    Renderer,
    ToolCall,
    parse_call_json,
    register_parser,
    register_renderer,
)
from rollout.tool_parsers.hermes import CLOSE, OPEN, parse_hermes, render_hermes

__all__ = ["CLOSE", "MAX_ARGUMENT_DEPTH", "MAX_CLOSING_TAG_RETRIES", "OPEN", "PARSERS", "RENDERERS", "ParsedTurn",
           "Parser", "Renderer", "ToolCall", "get_parser", "get_renderer", "parse_call_json", "parse_hermes",
           "register_parser", "register_renderer", "render_hermes"]  # fmt: skip
