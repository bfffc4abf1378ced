"""Reading the requests of ``rallyrl serve``'s OpenAI-compatible routes (``openai_routes.py``): the
body, ``n``, the sampling numbers and stop strings, the fields the engine cannot honour (refused with
a 400 naming them, as docs/engines.md lists), and chat messages as the chat template takes them."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from rollout.serve.http import BadRequest, json_body
from rollout.tool_parsers import get_renderer


async def request_body(request: web.Request) -> dict[str, Any]:
    """The JSON body of a ``/v1`` POST; as in SGLang, only ``Content-Type: application/json``."""
    if request.content_type != "application/json":
        raise BadRequest(f"Content-Type: only application/json is accepted, got {request.content_type!r}", "schema")
    return await json_body(request, required=True)


def sample_count(body: dict[str, Any]) -> int:
    n = body.get("n")
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise BadRequest(f"n: expected a positive integer, got {n!r}", "schema")
    return n


NOT_IMPLEMENTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "presence_penalty": ((0,), "the engine applies no penalties"),
    "frequency_penalty": ((0,), "the engine applies no penalties"),
    "repetition_penalty": ((1,), "the engine applies no penalties"),
    "min_p": ((0,), "the engine samples with temperature, top_p and top_k only"),
    "logit_bias": (({},), "the engine applies no logit bias"),
    "min_tokens": ((0,), "the engine cannot hold back its stop tokens"),
    "min_new_tokens": ((0,), "the engine cannot hold back its stop tokens"),
    "top_logprobs": ((0,), "only the sampled token's logprob is returned"),
    "best_of": ((1,), "there is no best-of search: ask for n samples"),
}
"""OpenAI (and SGLang/vLLM extension) fields the engine cannot honour: the values that change nothing
(null too) and why any other is refused with a 400 naming the field (never ignored)."""
MAX_JSON_DEPTH = 64
"""Deepest nesting of tool-call arguments and tool schemas (deeper ones would overflow the renderer)."""


def check_not_implemented(body: dict[str, Any]) -> None:
    """A 400 naming the first field of ``NOT_IMPLEMENTED`` that would change the generation, and for a
    ``top_k`` that is neither -1 (no cut) nor at least 1."""
    for name, (neutral, why) in NOT_IMPLEMENTED.items():
        value = body.get(name)
        if value is not None and not any(value == v and type(value) is not bool for v in neutral):
            shown = " or ".join(json.dumps(v) for v in neutral)
            raise BadRequest(f"{name}: only {shown} (or null) is supported by rallyrl serve ({why}), got {value!r}")
    top_k = body.get("top_k")
    if isinstance(top_k, int) and not isinstance(top_k, bool) and (top_k == 0 or top_k < -1):
        raise BadRequest(f"top_k: must be -1 (no cut) or at least 1, got {top_k}")


def json_depth(value: Any) -> int:
    """How deeply ``value`` nests lists and objects (0 for a scalar), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if depth <= MAX_JSON_DEPTH:  # deeper is refused anyway
                stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def check_depth(value: Any, name: str) -> None:
    if (depth := json_depth(value)) > MAX_JSON_DEPTH:
        raise BadRequest(f"{name}: nested over {min(depth, MAX_JSON_DEPTH + 1) - 1} levels deep, at most "
                         f"{MAX_JSON_DEPTH}")  # fmt: skip


def sampling_numbers(body: dict[str, Any]) -> dict[str, Any]:
    """The request's ``temperature``, ``top_p``, ``top_k`` and ``seed`` (None where not given), their
    JSON types checked."""
    numbers = {name: body.get(name) for name in ("temperature", "top_p", "top_k", "seed")}
    for name, value in numbers.items():
        kind = int if name in ("top_k", "seed") else (int, float)
        if value is not None and (isinstance(value, bool) or not isinstance(value, kind)):
            raise BadRequest(f"{name}: expected {'an integer' if kind is int else 'a number'}, got {value!r}",
                             "schema")  # fmt: skip
    return numbers


def stop_strings(body: dict[str, Any]) -> list[str]:
    stops = body.get("stop") or []
    stops = [stops] if isinstance(stops, str) else stops
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise BadRequest("stop: expected a string or a list of strings", "schema")
    return [s for s in stops if s]


def template_message(message: Any, index: int, tool_parser: str = "qwen25") -> dict[str, Any]:
    """An OpenAI chat message as the chat template takes it: assistant tool calls written back in the
    model's own format (``tool_parser``'s renderer; Qwen2.5's ``<tool_call>`` lines by default),
    content parts joined into text."""
    if not isinstance(message, dict) or message.get("role") not in ("system", "user", "assistant", "tool"):
        raise BadRequest(f"messages[{index}]: expected an object with role system, user, assistant or tool", "schema")
    content = message.get("content") or ""
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        texts = [part.get("text") or "" for part in content if isinstance(part, dict)]
        if not all(isinstance(text, str) for text in texts):
            raise BadRequest(f"messages[{index}].content: a part's text must be a string", "schema")
        content = "".join(texts)
    if not isinstance(content, str):
        raise BadRequest(f"messages[{index}].content: expected a string or a list of text parts", "schema")
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list) or not all(isinstance(call, dict) for call in calls):
        raise BadRequest(f"messages[{index}].tool_calls: expected a list of tool call objects", "schema")
    written: list[tuple[str, dict[str, Any]]] = []
    for call in calls:
        function = call.get("function") or {}
        if not isinstance(function, dict):
            raise BadRequest(f"messages[{index}].tool_calls: a call's function must be an object", "schema")
        arguments = function.get("arguments", "{}")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except (json.JSONDecodeError, RecursionError):
            raise BadRequest(f"messages[{index}].tool_calls: arguments are not valid JSON") from None
        check_depth(arguments, f"messages[{index}].tool_calls: arguments")
        if tool_parser not in ("qwen25", "hermes"):
            written.append((str(function.get("name")), arguments if isinstance(arguments, dict) else {}))
            continue
        text = json.dumps({"name": function.get("name"), "arguments": arguments}, separators=(",", ":"))
        content += ("\n" if content else "") + f"<tool_call>\n{text}\n</tool_call>"
    if written:
        content = get_renderer(tool_parser)(content, written)
    return {"role": message["role"], "content": content}


