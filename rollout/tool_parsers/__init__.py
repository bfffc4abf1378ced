"""Tool-call parsers and renderers, by SGLang's ``--tool-call-parser`` names.

A parser reads an assistant turn's text into its content and calls (a malformed call carries its
error; parsers never raise); a renderer writes content and calls as the family's model does, so that
parsing the rendering gives them back. Importing this package registers every family.
"""

from __future__ import annotations

import functools
import inspect

from rollout.tool_parsers import deepseek, glm45, gpt_oss, hermes, kimi_k2, llama3, mistral, qwen3_coder  # noqa: F401
from rollout.tool_parsers.base import (
    PARSERS,
    RENDERERS,
    ParsedTurn,
    Parser,
    Renderer,
    ToolCall,
    register_parser,
    register_renderer,
)

__all__ = ["PARSERS", "RENDERERS", "ParsedTurn", "Parser", "Renderer", "ToolCall", "get_parser", "get_renderer",
           "register_parser", "register_renderer"]  # fmt: skip


def get_parser(name: str, tools: list[dict] | None = None) -> Parser:
    """The parser registered as ``name``; ``tools`` (OpenAI-style tool schemas) go to the parsers
    that read argument types from them (qwen3_coder, glm45) and are ignored by the others."""
    try:
        parser = PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}; known: {', '.join(sorted(PARSERS))}") from None
    if tools is not None and _reads_tools(parser):
        return functools.partial(parser, tools=tools)
    return parser


@functools.cache
def _reads_tools(parser: Parser) -> bool:
    """Whether ``parser`` takes the tool schemas (read once per parser: ``inspect.signature`` cost more
    than the rest of a request's setup, once per request)."""
    return "tools" in inspect.signature(parser).parameters


def get_renderer(name: str) -> Renderer:
    """The renderer registered as ``name``."""
    try:
        return RENDERERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call renderer {name!r}; known: {', '.join(sorted(RENDERERS))}") from None
