"""The gateway's errors, answered as OpenAI's error objects."""

from __future__ import annotations

from aiohttp import web

from rollout.serve.http import json_response


class GatewayError(Exception):
    """An HTTP error of the gateway: status, message and OpenAI's ``type``/``code``."""

    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.status, self.code = status, code


def error_response(status: int, message: str, code: str | None = None) -> web.Response:
    kind = {400: "invalid_request_error", 404: "not_found_error", 409: "conflict_error", 429: "rate_limit_error",
            502: "engine_error", 503: "engine_error"}.get(status, "server_error")  # fmt: skip
    return json_response({"error": {"message": message, "type": kind, "param": None, "code": code}}, status)
