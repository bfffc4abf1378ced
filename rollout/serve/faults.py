"""Fault injection for ``rallyrl serve --fault-*``: a share of ``/generate`` calls fail the way
servers fail in production, so that clients, pools and rollouts can be tested against real
processes.

Each ``/generate`` call draws at most one fault from a generator seeded with ``seed``, so the
n-th call meets the same fault in every run with that seed:

- error: answered HTTP 500 at once, without generating;
- hang: held open without an answer for ``hang_s`` (the client gives up first), then served;
- drop: the status line, the headers and half of the body are sent, then the connection is
  reset (a streamed call, sent whole by its handler, is not cut, nor counted).

Other paths are never faulted. ``GET /fault_stats`` reports the settings and the counts of
calls and faults injected so far.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import asdict
from typing import Any

import orjson
from aiohttp import web

from rollout.config import FaultConfig

FAULTED_PATH = "/generate"


class FaultInjector:
    """The middleware that applies a ``FaultConfig`` to ``/generate``, and its counts."""

    def __init__(self, config: FaultConfig):
        self.config = config
        self.counts = {"generate_calls": 0, "errors": 0, "hangs": 0, "drops": 0}
        self._rng = random.Random(config.seed)

    def draw(self) -> str | None:
        """The fault of the next /generate call: "error", "hang", "drop" or None (served as usual)."""
        draw = self._rng.random()
        for kind, rate in (("error", self.config.error_rate), ("hang", self.config.hang_rate),
                           ("drop", self.config.drop_rate)):  # fmt: skip
            if draw < rate:
                return kind
            draw -= rate
        return None

    @web.middleware
    async def middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path != FAULTED_PATH:
            return await handler(request)
        self.counts["generate_calls"] += 1
        fault = self.draw()
        if fault == "error":
            self.counts["errors"] += 1
            message = "fault injected by rallyrl serve --fault-error-rate: internal server error"
            return web.Response(body=orjson.dumps({"error": {"message": message}}), status=500,
                                content_type="application/json")  # fmt: skip
        if fault == "hang":
            self.counts["hangs"] += 1
            await asyncio.sleep(self.config.hang_s)  # cancelled when the client disconnects
        elif fault == "drop":
            return await self._drop(request, handler)
        return await handler(request)

    async def _drop(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Send the status line, the headers and half of the answer's body, then reset the connection."""
        response = await handler(request)
        body = getattr(response, "body", None)
        if response.prepared or not isinstance(body, bytes):
            return response  # streamed (SSE): already sent whole by its handler, so not cut
        cut = web.StreamResponse(status=response.status, reason=response.reason, headers=response.headers)
        cut.content_length = len(body)
        await cut.prepare(request)
        await cut.write(body[: len(body) // 2])
        if request.transport is not None:
            request.transport.abort()
        self.counts["drops"] += 1
        return cut  # aiohttp's final write_eof fails on the reset connection, quietly

    async def stats(self, request: web.Request) -> web.Response:
        """``GET /fault_stats``: the settings and the counts so far."""
        return web.Response(body=orjson.dumps({"config": asdict(self.config), **self.counts}),
                            content_type="application/json")  # fmt: skip


def install_faults(app: web.Application, config: FaultConfig) -> FaultInjector:
    """Fault ``/generate`` in ``app`` (innermost middleware) and add ``GET /fault_stats``."""
    injector = FaultInjector(config)
    app.middlewares.append(injector.middleware)
    app.router.add_get("/fault_stats", injector.stats)
    return injector
