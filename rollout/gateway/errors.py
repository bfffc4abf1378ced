"""The gateway's errors, answered as OpenAI's error objects, and the middleware that turns every failure
of a route (a refusal, an engine error, a method or path the gateway does not serve, a bug) into one."""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web

from rollout.serve.http import BadRequest, TooLarge, TooManyJSONValues, json_response

logger = logging.getLogger("rollout.gateway.app")

TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
         409: "conflict_error", 429: "rate_limit_error", 502: "engine_error", 503: "engine_error"}  # fmt: skip
"""OpenAI's error ``type`` by status; any other 4xx is an ``invalid_request_error``, 5xx a ``server_error``."""


class GatewayError(Exception):
    """An HTTP error of the gateway: status, message and OpenAI's ``type``/``code``."""

    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.status, self.code = status, code


def error_response(status: int, message: str, code: str | None = None,
                   headers: dict[str, str] | None = None) -> web.Response:  # fmt: skip
    kind = TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    response = json_response({"error": {"message": message, "type": kind, "param": None, "code": code}}, status)
    response.headers.update(headers or {})
    return response


def guard_reply(request: web.Request, status: int, message: str, code: str) -> web.Response:
    """A refusal of the shared HTTP guard (``rollout/serve/guard.py``), as the gateway's error object."""
    return closing_if_unread(request, error_response(status, message, code))


def closing_if_unread(request: web.Request, response: web.Response) -> web.Response:
    """``response`` with ``Connection: close`` when the request's body was not read to its end: the rest
    of it (which a lying ``Content-Length`` may never send) must not be taken for the next request."""
    if request.body_exists and not request.content.is_eof():
        response.force_close()
    return response


def http_error(request: web.Request, exc: web.HTTPException) -> web.Response:
    """aiohttp's own 404/405 (a path or a method the gateway does not serve), as an error object."""
    if isinstance(exc, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(exc.allowed_methods))
        return error_response(405, f"method {request.method} is not allowed on {request.path} (allowed: {allowed})",
                              "method_not_allowed", {"Allow": allowed})  # fmt: skip
    if isinstance(exc, web.HTTPNotFound):
        return error_response(404, f"no route {request.method} {request.path} (see docs/gateway.md, Endpoints)",
                              "not_found")  # fmt: skip
    return error_response(exc.status, exc.reason or str(exc))


def error_middleware(counters: dict[str, int]) -> Any:
    """The middleware answering every failure of a route as an OpenAI error object (``counters``:
    the gateway's, where refused and failed calls are counted)."""
    from data.disk_space import DiskFull
    from rollout.engines.base import EngineError  # (the engine stack loads torch: imported once serving)
    from rollout.gateway.session import CallRefused

    @web.middleware
    async def errors(request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return closing_if_unread(request, http_error(request, exc))
        except Exception as exc:
            return closing_if_unread(request, answer(request, exc))

    def answer(request: web.Request, exc: Exception) -> web.Response:
        if isinstance(exc, GatewayError):
            return error_response(exc.status, str(exc), exc.code)
        if isinstance(exc, CallRefused):
            counters["calls_refused"] += 1
            return error_response(400, str(exc), exc.code)
        if isinstance(exc, BadRequest):
            return error_response(400, str(exc))
        if isinstance(exc, TooManyJSONValues):
            return error_response(413, str(exc), "too_many_json_values")
        if isinstance(exc, TooLarge):
            return error_response(413, f"{exc} (gateway.max_body_mb)", "body_too_large")
        if isinstance(exc, EngineError):
            counters["calls_failed"] += 1
            return error_response(502, f"engine error: {exc}")
        if isinstance(exc, DiskFull):  # the session is finished, its trajectory not written
            logger.error("%s", exc)
            return error_response(507, str(exc), "disk_full")
        logger.error("%s %s failed", request.method, request.path, exc_info=exc)  # a bug: answer, keep serving
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")

    return errors
