"""``rallyrl serve``: any rallyrl engine behind SGLang's HTTP API, so SGLang clients work unchanged.

Native API (as ``sglang.launch_server`` serves it), here: ``/generate`` (one request, a batch or
``n`` samples; JSON or SSE-streamed), ``/health``, ``/health_generate``, ``/get_model_info``,
``/get_server_info``, ``/flush_cache``, ``/abort_request``, ``/update_weights_from_disk``,
``/pause_generation``, ``/continue_generation``. OpenAI-compatible (``rollout/serve/openai_routes.py``):
``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``. ``sampling_params`` are read with
SGLang's defaults and generations end where SGLang ends them (``rollout/serve/generate.py``).
Answers, errors included, have SGLang 0.5.23's shapes: ``tests/real_engines/test_sglang_conformance.py``
compares them with a real SGLang and lists where rallyrl serve differs on purpose.

Weight updates follow SGLang: ``/update_weights_from_disk`` waits for the requests in flight
(or aborts them with ``abort_all_requests``) while new ones wait, so every ``/generate``
response comes from one weight version; weights in memory (a broadcast, tensors) come through
SGLang's session routes (``weight_routes.py``). ``/pause_generation`` aborts what is in flight (the
clients resume it) and holds new requests until ``/continue_generation``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web

from rollout.config import ServeConfig
from rollout.engines.base import Engine, EngineError
from rollout.serve.admission import Busy
from rollout.serve.faults import install_faults
from rollout.serve.guard import HttpGuard
from rollout.serve.http import BadRequest, TooLarge, error_response
from rollout.serve.native_routes import NativeRoutes
from rollout.serve.openai_routes import OpenAIRoutes
from rollout.serve.state import ServerState
from rollout.serve.weight_routes import MAX_WEIGHT_BODY, WeightRoutes

__all__ = ["EngineServer", "ServeConfig", "serve"]

OPEN_PATHS = frozenset({"/health", "/health_generate"})
"""Paths answered without the API key (as in SGLang), so that health probes need no secret."""
logger = logging.getLogger(__name__)


def _guard_reply(request: web.Request, status: int, message: str, code: str) -> web.Response:
    """The guard's refusal in SGLang's shape: a body that is not JSON as FastAPI's validation answers it."""
    return error_response(request, status, message, "schema" if code == "not_json" else "invalid")


class EngineServer(ServerState):
    """The aiohttp application around one engine: the state its routes share (``state.py``), SGLang's
    native routes (``native_routes.py``) and the OpenAI-compatible ones (``openai_routes.py``)."""

    def app(self) -> web.Application:
        limits = {"/update_weights_from_tensor": MAX_WEIGHT_BODY}
        app = web.Application(client_max_size=max(self.config.limits.max_body_bytes, *limits.values()),
                              middlewares=[self._errors])  # fmt: skip
        bounds = self.config.limits
        HttpGuard(self.config.host, _guard_reply, self.config.api_key, OPEN_PATHS, bounds.max_body_bytes, limits,
                  not_json_status=400, max_json_items=bounds.max_json_items).install(app)  # fmt: skip
        routes = [*NativeRoutes(self).routes(), *WeightRoutes(self).routes(), *OpenAIRoutes(self).routes()]
        for method, path, handler in routes:
            app.router.add_route(method, path, handler)
        if self.config.faults is not None:
            install_faults(app, self.config.faults)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Bad requests and engine failures as JSON errors in SGLang's shapes (the guard, ``guard.py``,
        has checked the host, the origin, the key and the body's type and length already)."""
        try:
            return await handler(request)
        except BadRequest as exc:
            response = error_response(request, 400, str(exc), exc.kind)
        except TooLarge as exc:
            response = error_response(request, 413, str(exc))
        except Busy as exc:
            response = error_response(request, 503, str(exc))
            response.headers["Retry-After"] = "1"
        except EngineError as exc:
            response = error_response(request, 500, f"engine error: {exc}")
        except web.HTTPException:
            raise
        except Exception as exc:  # a bug: answer, log the trace, keep serving
            logger.exception("%s %s failed", request.method, request.path)
            response = error_response(request, 500, f"internal error: {type(exc).__name__}: {exc}")
        if request.body_exists and not request.content.is_eof():  # refused unread (a weight route outside a
            response.force_close()  # session): the rest of the body is not waited for
        return response


async def serve(engine: Engine, tokenizer: Any, config: ServeConfig, ready: asyncio.Event | None = None) -> None:
    """Serve until cancelled. Client disconnects cancel their handlers (and so abort their requests)."""
    server = EngineServer(engine, tokenizer, config)
    runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port, backlog=4096, reuse_address=True)
    await site.start()
    config.port = runner.addresses[0][1]  # the port bound when config.port was 0
    server.config.port = config.port
    if ready is not None:
        ready.set()
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
