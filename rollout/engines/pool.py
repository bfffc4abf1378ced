"""Several SGLang-compatible servers behind one Engine.

Routing: a request's later turns go to the server that served its earlier ones (its KV cache
holds their prefix); a new request goes to the healthy server with the fewest requests in
flight. A server whose connection fails is taken out at once and its requests are retried on
another; a background health check (``/health``) puts it back when it answers again, after
loading the pool's current weights, so a restarted server never serves stale ones.

Weight sync: ``sync_weights_from_disk`` pauses every server, has each load the same saved
weights, then lets them continue (requests aborted by the pause are resumed by the clients).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from rollout.engines.base import EngineError, Generation, SamplingParams
from rollout.engines.config import PoolConfig
from rollout.engines.sglang_http import ServerUnavailableError, SGLangHTTPEngine

logger = logging.getLogger(__name__)


@dataclass
class ServerStats:
    requests: int = 0
    failures: int = 0
    ejections: int = 0


@dataclass
class _Server:
    index: int
    engine: SGLangHTTPEngine
    healthy: bool = True
    failed_checks: int = 0
    weight_version: int | None = 0  # None: unknown (it was out, and may have restarted since)
    stats: ServerStats = field(default_factory=ServerStats)

    @property
    def url(self) -> str:
        return self.engine.url


class EnginePool:
    """The Engine protocol over several servers: sticky, least-in-flight, health-checked."""

    def __init__(self, urls: list[str], config: PoolConfig | None = None):
        if not urls:
            raise ValueError("an engine pool needs at least one server URL")
        if len(set(urls)) != len(urls):
            raise ValueError(f"duplicate server URLs in {urls}")
        self.config = config or PoolConfig()
        self.servers = [_Server(i, SGLangHTTPEngine(url, self.config.client)) for i, url in enumerate(urls)]
        self.weight_version = 0
        self.weights_path: str | None = None  # the weights every server must have loaded
        self.failovers = 0
        self._sticky: OrderedDict[str, int] = OrderedDict()
        self._back = asyncio.Event()  # set when a server is put back
        self._health_task: asyncio.Task[None] | None = None
        self._sync_lock = asyncio.Lock()

    def __repr__(self) -> str:
        return f"EnginePool({[s.url for s in self.servers]})"

    async def __aenter__(self) -> EnginePool:
        for server in self.servers:
            await server.engine.__aenter__()
        self._health_task = asyncio.create_task(self._health_loop(), name="engine-pool-health")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
            self._health_task = None
        for server in self.servers:
            await server.engine.__aexit__(*exc_info)

    # ----- generation ------------------------------------------------------------------------

    async def generate(self, input_ids: list[int], sampling: SamplingParams, rid: str) -> Generation:
        """Serve on the request's server, or the least busy; fail over while servers fail."""
        tried: set[int] = set()
        while True:
            server = self._pick(rid, tried)
            if server is None:
                await self._wait_for_server(rid)
                tried.clear()
                continue
            try:
                generation = await server.engine.generate(input_ids, sampling, rid)
            except ServerUnavailableError as exc:
                server.stats.failures += 1
                self._eject(server, str(exc))
                tried.add(server.index)
                self._sticky.pop(rid, None)
                self.failovers += 1
                continue
            server.stats.requests += 1
            self._remember(rid, server.index)
            generation.meta["server"] = server.url
            return generation

    def _pick(self, rid: str, tried: set[int]) -> _Server | None:
        healthy = [s for s in self.servers if s.healthy and s.index not in tried]
        if not healthy:
            return None
        index = self._sticky.get(rid)
        if index is not None and any(s.index == index for s in healthy):
            return self.servers[index]
        least = min(s.engine.in_flight for s in healthy)
        return random.choice([s for s in healthy if s.engine.in_flight == least])

    def _remember(self, rid: str, index: int) -> None:
        self._sticky[rid] = index
        self._sticky.move_to_end(rid)
        while len(self._sticky) > self.config.sticky_entries:
            self._sticky.popitem(last=False)

    async def _wait_for_server(self, rid: str) -> None:
        self._back.clear()
        if any(s.healthy for s in self.servers):
            return
        try:
            await asyncio.wait_for(self._back.wait(), self.config.wait_for_server_s)
        except TimeoutError:
            urls = ", ".join(s.url for s in self.servers)
            raise EngineError(
                f"request {rid}: no healthy server among {urls} for {self.config.wait_for_server_s:g} s"
            ) from None

    def _eject(self, server: _Server, reason: str) -> None:
        if server.healthy:
            server.healthy = False
            server.weight_version = None  # whatever comes back at this URL may have restarted
            server.stats.ejections += 1
            logger.warning("engine pool: taking %s out: %s", server.url, reason)

    # ----- health ----------------------------------------------------------------------------

    async def _health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self._check(server) for server in self.servers))
            await asyncio.sleep(self.config.health_interval_s)

    async def _check(self, server: _Server) -> None:
        ok = await server.engine.health()
        if server.healthy:
            server.failed_checks = 0 if ok else server.failed_checks + 1
            if server.failed_checks >= self.config.failures_to_eject:
                self._eject(server, "health check failed")
            return
        if not ok:
            return
        async with self._sync_lock:  # a server coming back loads the pool's weights first
            if self.weights_path is not None and server.weight_version != self.weight_version:
                try:
                    await server.engine.update_weights_from_disk(self.weights_path, self.weight_version)
                except EngineError:
                    return
                server.weight_version = self.weight_version
            server.healthy, server.failed_checks = True, 0
            self._back.set()
            logger.warning("engine pool: %s is back (weight version %s)", server.url, server.weight_version)

    async def health(self) -> bool:
        return any(s.healthy for s in self.servers)

    # ----- control ---------------------------------------------------------------------------

    async def abort(self, rid: str | None = None) -> None:
        """Abort one request on its server, or every request on every healthy server."""
        if rid is None:
            targets = [s for s in self.servers if s.healthy]
        else:
            index = self._sticky.get(rid)
            targets = [self.servers[index]] if index is not None else [s for s in self.servers if s.healthy]
        await asyncio.gather(*(self._quietly(s.engine.abort(rid)) for s in targets))

    async def flush_cache(self) -> None:
        await asyncio.gather(*(self._quietly(s.engine.flush_cache()) for s in self.servers if s.healthy))

    async def sync_weights_from_disk(self, model_path: str, weight_version: int) -> int:
        """Every healthy server: pause -> load ``model_path`` -> continue. A server that fails is
        taken out (it loads these weights when it comes back); no healthy server left is an error."""
        async with self._sync_lock:
            self.weights_path, self.weight_version = str(model_path), weight_version
            targets = [s for s in self.servers if s.healthy]
            results = await asyncio.gather(
                *(s.engine.sync_weights_from_disk(model_path, weight_version) for s in targets), return_exceptions=True
            )
            errors = []
            for server, result in zip(targets, results, strict=True):
                if isinstance(result, BaseException):
                    errors.append(f"{server.url}: {result}")
                    self._eject(server, str(result))
                else:
                    server.weight_version = weight_version
            if len(errors) == len(targets):
                raise EngineError(f"weight update {weight_version} failed on every server: {'; '.join(errors)}")
        return weight_version

    async def update_weights(self, state_dict: dict[str, Any], weight_version: int | None = None) -> int:
        raise EngineError("servers load weights from disk: save them and call sync_weights_from_disk(path, version)")

    async def server_versions(self) -> dict[str, int | None]:
        """Each server's weight version as its /get_model_info reports it (None: unreachable)."""

        async def one(server: _Server) -> int | None:
            try:
                return await server.engine.get_weight_version()
            except EngineError:
                return None

        versions = await asyncio.gather(*(one(s) for s in self.servers))
        return {s.url: v for s, v in zip(self.servers, versions, strict=True)}

    def stats(self) -> dict[str, Any]:
        return {
            "failovers": self.failovers,
            "servers": {s.url: {"healthy": s.healthy, **s.stats.__dict__} for s in self.servers},
        }

    @staticmethod
    async def _quietly(call: Any) -> None:
        with contextlib.suppress(EngineError):
            await call


def connect(urls: list[str], config: PoolConfig | None = None) -> SGLangHTTPEngine | EnginePool:
    """The engine for ``--engine-url``: one server's client, or a pool of several."""
    if len(urls) == 1:
        return SGLangHTTPEngine(urls[0])
    return EnginePool(urls, config)
