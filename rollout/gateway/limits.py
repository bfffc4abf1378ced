"""What one call or session may send the agent gateway, checked before anything is rendered or kept
(``GatewayConfig``'s caps, docs/gateway.md "Limits and refusals"): each refusal names the field and the
cap, 413 for a byte cap, 400 for anything else."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from rollout.gateway.errors import GatewayError
from rollout.gateway_config import GatewayConfig
from rollout.serve.http import BadRequest, json_body
from rollout.serve.openai_requests import check_depth, stop_strings

SESSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
"""A session id: it is a path segment of the session's base URL and its API key, so only letters,
digits and ``. _ : -``, starting with a letter or digit, at most 128 characters, no ``..``."""
MAX_STOP = 64
"""Most stop strings of one call."""
MAX_STOP_CHARS = 512
"""Longest stop string, in characters (each decoded token is searched for every stop string)."""
SEED_RANGE = (-(2**63), 2**64 - 1)
"""Seeds an engine takes (a 64-bit generator seed)."""


async def read_json(request: web.Request, required: bool = False, limit: int | None = None) -> dict[str, Any]:
    """The JSON object of a request body ({} for none unless ``required``) of at most ``limit`` bytes
    (default ``max_body_mb``) and ``max_json_items`` values (counted by the guard before parsing): a
    longer one is a ``TooLarge``, 413 (``rollout.serve.http.json_body``)."""
    if not request.can_read_body:
        if required:
            raise BadRequest("the request has no body: send a JSON object", "schema")
        return {}
    return await json_body(request, required, limit)


def check_session_id(sid: Any) -> str:
    """``sid`` if it is a safe session id (``SESSION_ID``), else a 400 naming ``session_id``."""
    if not isinstance(sid, str) or SESSION_ID.fullmatch(sid) is None or ".." in sid:
        shown = repr(sid)[:80] + ("..." if len(repr(sid)) > 80 else "")
        raise GatewayError(400, f"session_id: expected 1 to 128 letters, digits, '.', '_', ':' or '-' (starting "
                                f"with a letter or digit, no '..'), got {shown}", "invalid_session_id")  # fmt: skip
    return sid


def json_bytes(value: Any, name: str, sort_keys: bool = False) -> bytes:
    """The compact JSON of ``value`` (what its size is measured on)."""
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS if sort_keys else None)
    except orjson.JSONEncodeError as exc:  # nested past orjson's 254 levels
        raise BadRequest(f"{name}: cannot be measured as JSON ({exc})") from None


def history_bytes(messages: list[Any], at_most: int) -> int:
    """Bytes of the JSON of ``messages`` (``at_most``, a bound known from the body, when that is within
    the cap), each message nested at most 64 levels (the field named where one is deeper)."""
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            continue
        check_depth(message.get("content"), f"messages[{i}].content")
        calls = message.get("tool_calls")
        for call in calls if isinstance(calls, list) else []:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict):
                check_depth(function.get("arguments"), f"messages[{i}].tool_calls: arguments")
        check_depth(message, f"messages[{i}]")
    return at_most if at_most >= 0 else len(json_bytes(messages, "messages"))


def check_bytes(name: str, size: int, limit: int, setting: str, code: str) -> None:
    if size > limit:
        raise GatewayError(413, f"{name}: {size} bytes of JSON, over this gateway's limit of {limit} bytes "
                                f"(gateway.{setting})", code)  # fmt: skip


def session_fields(body: dict[str, Any], config: GatewayConfig) -> dict[str, Any]:
    """The optional fields of ``POST /sessions``, typed, nested at most 64 levels, and their bytes within
    ``max_metadata_bytes``."""
    fields = {}
    for name, kind in (("prompt_index", int), ("sample_index", int), ("ground_truth", str), ("data_source", str),
                       ("metadata", dict)):  # fmt: skip
        value = body.get(name)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            shown = repr(value)[:80]
            raise BadRequest(f"{name}: expected {kind.__name__}, got {shown}")
        fields[name] = value
    check_depth(fields["metadata"], "metadata")
    kept = {name: fields[name] for name in ("metadata", "ground_truth", "data_source") if fields[name] is not None}
    check_bytes("metadata, ground_truth and data_source", len(json_bytes(kept, "metadata")),
                config.max_metadata_bytes, "max_metadata_bytes", "metadata_too_large")  # fmt: skip
    return fields


@dataclass
class CallInput:
    """A chat call's fields, checked against the caps (``call_input``)."""

    messages: list[Any]
    tools: list[dict[str, Any]] | None
    tools_key: str  # the tools' JSON ("" for none): a session's calls extend it only with the same tools
    max_tokens: int | None
    stop: list[str]
    verbatim_chars: int  # characters every chat template renders (``verbatim_chars``, the tools' ``string_chars``)


def call_input(body: dict[str, Any], config: GatewayConfig, body_bytes: int | None = None) -> CallInput:
    """The messages, tools, ``max_tokens`` and stop strings of a chat call, each typed and within its cap
    (``body_bytes``: the length of the body, when known: messages within the cap need no measuring then)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages: required, a non-empty list of messages")
    if len(messages) > config.max_messages:
        raise BadRequest(f"messages: {len(messages)} messages, over this gateway's limit of {config.max_messages} "
                         "(gateway.max_messages)")  # fmt: skip
    bound = body_bytes if body_bytes is not None and body_bytes <= config.max_history_bytes else -1
    check_bytes("messages", history_bytes(messages, bound), config.max_history_bytes, "max_history_bytes",
                "history_too_large")  # fmt: skip
    n = body.get("n")
    if n is not None and (type(n) is not int or n != 1):
        raise BadRequest(f"n: a session records one conversation (n must be 1, got {str(n)[:40]}); open one "
                         "session per sample")  # fmt: skip
    tools = body.get("tools") if body.get("tool_choice") != "none" else None
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise BadRequest("tools: expected a list of tool objects")
    for i, tool in enumerate(tools or []):
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            shown = repr(tool)[:200]
            raise BadRequest(f'tools[{i}]: expected {{"type": "function", "function": {{"name": ..., '
                             f'"parameters": ...}}}}, got {shown}')  # fmt: skip
    tools = tools or None
    tools_key = ""
    if tools is not None:
        check_depth(tools, "tools")
        raw = json_bytes(tools, "tools", sort_keys=True)
        check_bytes("tools", len(raw), config.max_tools_bytes, "max_tools_bytes", "tools_too_large")
        tools_key = raw.decode()
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
        raise BadRequest(f"max_tokens: expected a positive integer, got {str(max_tokens)[:40]}")
    stop = stop_strings(body)
    if len(stop) > MAX_STOP:
        raise BadRequest(f"stop: {len(stop)} strings, over this gateway's limit of {MAX_STOP}")
    for i, text in enumerate(stop):
        if len(text) > MAX_STOP_CHARS:
            raise BadRequest(f"stop[{i}]: {len(text)} characters, over this gateway's limit of {MAX_STOP_CHARS}")
    seed = body.get("seed")
    if type(seed) is int and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise BadRequest(f"seed: must be a 64-bit integer ({SEED_RANGE[0]}..{SEED_RANGE[1]}), got {seed}")
    return CallInput(messages, tools, tools_key, max_tokens, stop, verbatim_chars(messages) + string_chars(tools))


def verbatim_chars(messages: list[Any]) -> int:
    """Characters of the messages' text that chat templates render as it is: all of it but an answer's
    reasoning (before its last ``</think>``, which Qwen3's and DeepSeek-R1's drop from past turns)."""
    total = 0
    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in ("user", "system", "tool", "assistant"):
            continue
        content = message.get("content")
        if isinstance(content, str) and message.get("role") == "assistant":  # (the reasoning may be dropped)
            total += len(content.rsplit("</think>", 1)[-1])
        elif isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return total


def string_chars(value: Any) -> int:
    """Characters of the strings (keys and values) in ``value``: what any rendering of a tool list keeps
    (the names, descriptions and types a model needs), whatever it does with the JSON around them."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            total += sum(len(key) for key in item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return total
