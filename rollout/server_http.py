"""HTTP plumbing of ``rallyrl serve``: JSON request bodies, JSON and SSE responses, errors in
SGLang's and OpenAI's shapes, and the served model's ``config.json``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
from aiohttp import web


class BadRequest(ValueError):
    """A request the server cannot serve; answered with HTTP 400 and this message."""


async def json_body(request: web.Request) -> dict[str, Any]:
    if request.method == "GET" or not request.can_read_body:
        return dict(request.query)
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


def error_response(request: web.Request, status: int, message: str) -> web.Response:
    """OpenAI's error object under /v1, SGLang's native ``{"error": {...}}`` elsewhere."""
    if request.path.startswith("/v1/"):
        kind = {400: "BadRequestError", 401: "AuthenticationError"}.get(status, "InternalServerError")
        return json_response(
            {"object": "error", "message": message, "type": kind, "param": None, "code": status}, status
        )
    return json_response({"error": {"message": message}}, status)


async def sse_response(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    return response


def model_config(model_path: str, name: str = "config.json") -> dict[str, Any]:
    """A JSON file of the model directory (``config.json``, ``generation_config.json``); {} when absent."""
    try:
        return orjson.loads((Path(model_path) / name).read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return {}
