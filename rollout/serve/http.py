"""HTTP plumbing of ``rallyrl serve``: JSON request bodies, JSON and SSE responses, errors in the
shapes SGLang gives them, and the served model's ``config.json``."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Literal

import orjson
from aiohttp import web

from rollout.serve.guard import BodyTooLarge, TooManyValues, read_limited

ErrorKind = Literal["invalid", "schema", "contract"]


PARSE_OFF_LOOP = 256 * 2**10
"""Bodies at least this long are parsed on a worker thread, so the event loop (``/health``) keeps answering."""


class TooLarge(ValueError):
    """A body over the route's limit: answered with HTTP 413 and this message."""


class TooManyJSONValues(TooLarge):
    """A body with more JSON values than the server takes (413, the message naming the setting)."""


class BadRequest(ValueError):
    """A request the server cannot serve; answered with HTTP 400 and this message, in the body SGLang
    gives that kind of mistake (``error_response``): ``schema``, a body that is not a JSON object or
    a field of the wrong JSON type (FastAPI's validation in SGLang); ``contract``, a sampling
    parameter that SGLang does not know or of the wrong type (its ``/generate`` schema check);
    ``invalid``, a value that cannot be served."""

    def __init__(self, message: str, kind: ErrorKind = "invalid"):
        super().__init__(message)
        self.kind: ErrorKind = kind


async def json_body(request: web.Request, required: bool = False, limit: int | None = None) -> dict[str, Any]:
    """The JSON object of a request (the query of a GET); a missing body is ``{}`` unless ``required``.
    ``limit``: read up to that many bytes (default: the route's limit, ``guard.read_limited``); a
    longer body is a ``TooLarge`` (413). Bodies over ``PARSE_OFF_LOOP`` bytes are parsed on a thread."""
    if request.method == "GET" or not request.can_read_body:
        if required and request.method != "GET":
            raise BadRequest("the request has no body: send a JSON object", "schema")
        return dict(request.query)
    try:
        raw = await read_limited(request, limit)
    except TooManyValues as exc:
        raise TooManyJSONValues(str(exc)) from None
    except BodyTooLarge as exc:
        raise TooLarge(str(exc)) from None
    if not raw.strip():
        if required:
            raise BadRequest("the request body is empty: send a JSON object", "schema")
        return {}
    try:
        body = orjson.loads(raw) if len(raw) < PARSE_OFF_LOOP else await asyncio.to_thread(orjson.loads, raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}", "schema") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object", "schema")
    return body


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


def error_response(request: web.Request, status: int, message: str, kind: ErrorKind = "invalid") -> web.Response:
    """An error in SGLang's shape for its kind and path: OpenAI's error object under ``/v1`` and for
    ``schema`` errors anywhere (type "Bad Request" for those, as FastAPI's validation has it);
    ``{"error": message}`` for ``contract`` errors; ``{"error": {"message": ...}}`` otherwise."""
    if request.path.startswith("/v1/") or kind == "schema":
        names = {400: "Bad Request" if kind == "schema" else "BadRequestError", 401: "AuthenticationError"}
        return json_response(
            {"object": "error", "message": message, "type": names.get(status, "InternalServerError"),
             "param": None, "code": status}, status,
        )  # fmt: skip
    if kind == "contract":
        return json_response({"error": message}, status)
    return json_response({"error": {"message": message}}, status)


async def sse_response(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    return response


async def send_event(response: web.StreamResponse, event: Any) -> None:
    """One SSE event: ``data: <json>`` (or ``data: [DONE]`` for the text "[DONE]")."""
    data = event.encode() if event == "[DONE]" else orjson.dumps(event)
    await response.write(b"data: " + data + b"\n\n")


def model_config(model_path: str, name: str = "config.json") -> dict[str, Any]:
    """A JSON file of the model directory (``config.json``, ``generation_config.json``); {} when absent."""
    try:
        return orjson.loads((Path(model_path) / name).read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return {}
