"""Several SGLang-compatible or vLLM servers behind one Engine, and what opens ``--engine-url``.

Routing: a request's later turns go to the server that served its earlier ones (its KV cache
holds their prefix); a new request goes to the healthy server with the fewest requests in
flight. A server whose connection fails is taken out at once and its requests are retried on
another; a background health check (``/health``) puts it back when it answers again, after
loading the pool's current weights, so a restarted server never serves stale ones.

Weight sync (``pool_sync.py``): ``push_weights`` gives every server the trainer's weights in
memory (a broadcast or tensors) or through disk, each by the transport ``plan_weight_sync`` chose
for it before the first rollout; ``sync_weights_from_disk`` has each load the same saved weights,
``sync_adapter_from_disk`` the same LoRA adapter. Each pauses every server first (requests aborted by
the pause are resumed by the clients) and reads its version back after. A server that fails is taken
out; one that comes back takes the current weights before it gets requests.

Server kinds: each server gets the client of its kind (``sglang_http.py``, ``vllm_http.py``). With
"auto", each URL is asked once when the pool opens (``detect_server``); a server that does not
answer then takes the kind of those that do, since a pool serves one model.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import aiohttp

from rollout.engines.base import EngineError, Generation, SamplingParams
from rollout.engines.config import PoolConfig, SGLangHTTPConfig, WeightSyncConfig
from rollout.engines.pool_sync import PoolWeights, ServerSync
from rollout.engines.server_adapters import AdapterSupport
from rollout.engines.sglang_http import RetryableError, ServerUnavailableError, SGLangHTTPEngine
from rollout.engines.vllm_http import VLLMHTTPEngine
from rollout.retry import RETRY_STATUSES, Backoff, call_with_retries

if TYPE_CHECKING:
    import torch

    from rollout.engines.base import WeightSource

logger = logging.getLogger(__name__)

ServerKind = Literal["sglang", "vllm"]
ServerClient = SGLangHTTPEngine | VLLMHTTPEngine


def server_client(url: str, kind: ServerKind, config: SGLangHTTPConfig | None = None) -> ServerClient:
    """The client of one server of ``kind`` at ``url`` (not yet entered)."""
    return VLLMHTTPEngine(url, config) if kind == "vllm" else SGLangHTTPEngine(url, config)


async def detect_server(url: str, config: SGLangHTTPConfig | None = None) -> ServerKind:
    """What serves ``url``: "sglang" when ``GET /get_model_info`` answers (SGLang, ``rallyrl serve``),
    "vllm" when ``GET /version`` and ``GET /v1/models`` do. Connection failures and 5xx are retried
    like the client's requests. Raises ServerUnavailableError when nothing answers, EngineError when
    something else does; both name the URL."""
    config = config or SGLangHTTPConfig()
    url = url.rstrip("/")
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else None
    timeout = aiohttp.ClientTimeout(total=config.control_timeout_s, connect=config.connect_timeout_s)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout) as session:

        async def status(path: str) -> int:
            try:
                async with session.get(url + path) as response:
                    await response.read()
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise RetryableError(f"GET {url}{path}: {type(exc).__name__}: {exc}") from exc
            if response.status in RETRY_STATUSES:
                raise RetryableError(f"GET {url}{path} answered HTTP {response.status}")
            return response.status

        async def attempt() -> ServerKind | None:
            if (answer := await status("/get_model_info")) == 200:
                return "sglang"
            if answer in (401, 403):
                fix = "the key given (engine.http.api_key) was refused" if config.api_key else (
                    "give it with --set engine.http.api_key=KEY")
                raise EngineError(f"{url} answered HTTP {answer} to GET /get_model_info: it wants an API key; {fix}")
            if await status("/version") == 200 and await status("/v1/models") == 200:
                return "vllm"
            return None

        backoff = Backoff(config.backoff_s, config.backoff_max_s)
        try:
            kind = await call_with_retries(
                attempt, retries=config.max_retries, backoff=backoff, retry_on=(RetryableError,)
            )
        except RetryableError as exc:
            raise ServerUnavailableError(
                f"{url}: could not ask whether SGLang or vLLM serves it ({exc}); is the server up? "
                "(engine.server / --engine-server names the kind without asking)"
            ) from None
    if kind is None:
        raise EngineError(
            f"{url} answers neither GET /get_model_info (SGLang, rallyrl serve) nor GET /version and /v1/models "
            "(vLLM): is it an inference server's URL?"
        )
    return kind


@contextlib.asynccontextmanager
async def detected_client(url: str, config: SGLangHTTPConfig | None = None) -> AsyncIterator[ServerClient]:
    """The client of whatever serves ``url`` (``detect_server``), entered."""
    kind = await detect_server(url, config)
    async with server_client(url, kind, config) as client:
        yield client


def open_servers(urls: list[str], server: ServerKind | Literal["auto"], http: SGLangHTTPConfig, pool: PoolConfig,
                 pooled: bool = False) -> Any:  # fmt: skip
    """The engine for ``--engine-url``, not yet entered (``async with`` it): one server's client, or
    a pool of several (``pooled``: a pool even of one, whose client has ``http``'s settings: training,
    where the pool syncs weights and brings a restarted server back). With ``server`` "auto" the kind
    is asked on entry, so use what entering returns."""
    if len(urls) > 1:
        return EnginePool(urls, pool, server)
    if pooled:
        return EnginePool(urls, dataclasses.replace(pool, client=http), server)
    if server == "auto":
        return detected_client(urls[0], http)
    return server_client(urls[0], server, http)


@dataclass
class ServerStats:
    requests: int = 0
    failures: int = 0
    ejections: int = 0


@dataclass(eq=False)  # hashed by identity (the sync keeps per-server results)
class _Server:
    index: int
    engine: ServerClient
    healthy: bool = True
    failed_checks: int = 0
    sync: ServerSync = field(default_factory=ServerSync)
    """How it takes weights, and the version it holds (None: unknown; it was out and may have restarted)."""
    stats: ServerStats = field(default_factory=ServerStats)

    @property
    def weight_version(self) -> int | None:
        return self.sync.version

    @property
    def url(self) -> str:
        return self.engine.url


class EnginePool:
    """The Engine protocol over several servers: sticky, least-in-flight, health-checked. ``server``
    is their kind; "auto" asks each when the pool is entered (``servers`` is empty until then)."""

    def __init__(self, urls: list[str], config: PoolConfig | None = None,
                 server: ServerKind | Literal["auto"] = "sglang"):  # fmt: skip
        if not urls:
            raise ValueError("an engine pool needs at least one server URL")
        if len(set(urls)) != len(urls):
            raise ValueError(f"duplicate server URLs in {urls}")
        self.config = config or PoolConfig()
        self.urls = list(urls)
        self.server = server
        self.servers: list[_Server] = [] if server == "auto" else self._make_servers([server] * len(urls))
        self.weights = PoolWeights()  # what every server must hold (pool_sync.py)
        self.failovers = 0
        self._sticky: OrderedDict[str, int] = OrderedDict()
        self._back = asyncio.Event()  # set when a server is put back
        self._health_task: asyncio.Task[None] | None = None

    def __repr__(self) -> str:
        return f"EnginePool({self.urls})"

    def _make_servers(self, kinds: list[ServerKind]) -> list[_Server]:
        return [
            _Server(i, server_client(url, kind, self.config.client))
            for i, (url, kind) in enumerate(zip(self.urls, kinds, strict=True))
        ]

    async def _detect_kinds(self) -> list[ServerKind]:
        """Each URL's kind; one that does not answer takes the kind of those that do."""
        found = await asyncio.gather(*(detect_server(url, self.config.client) for url in self.urls),
                                     return_exceptions=True)  # fmt: skip
        for error in found:
            if isinstance(error, BaseException) and not isinstance(error, ServerUnavailableError):
                raise error
        kinds = {kind for kind in found if isinstance(kind, str)}
        errors = [str(error) for error in found if isinstance(error, BaseException)]
        if not kinds:
            raise EngineError("; ".join(errors))
        if len(kinds) > 1 and errors:
            raise EngineError(
                f"the pool mixes SGLang and vLLM, so the kind of the others is unknown: {'; '.join(errors)}"
            )
        for url, kind in zip(self.urls, found, strict=True):
            if isinstance(kind, BaseException):
                logger.warning("engine pool: %s did not answer; taking it for %s like the others", url, *kinds)
        return [kind if isinstance(kind, str) else next(iter(kinds)) for kind in found]

    async def __aenter__(self) -> EnginePool:
        if not self.servers:
            self.servers = self._make_servers(await self._detect_kinds())
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
        await self.weights.close(self.servers)
        for server in self.servers:
            await server.engine.__aexit__(*exc_info)

    def sockets_for(self, in_flight: int) -> int:
        """Sockets ``in_flight`` requests may hold: one each, at most every server's connection limit
        (each server gets them all when the others are out)."""
        limits = [server.engine.config.max_connections for server in self.servers] or [0]
        return in_flight if 0 in limits else min(in_flight, sum(limits))

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
            server.sync.version = None  # whatever comes back at this URL may have restarted
            server.stats.ejections += 1
            logger.warning("engine pool: taking %s out: %s", server.url, reason)

    # ----- health ----------------------------------------------------------------------------

    async def _health_loop(self) -> None:
        while True:
            results = await asyncio.gather(*(self._check(server) for server in self.servers), return_exceptions=True)
            for server, error in zip(self.servers, results, strict=True):  # (a bug of ours must not end the checks)
                if isinstance(error, Exception):
                    logger.error("engine pool: checking %s: %s: %s", server.url, type(error).__name__, error)
            await asyncio.sleep(self.config.health_interval_s)

    async def _check(self, server: _Server) -> None:
        ok = await server.engine.health()
        if server.healthy:
            if not ok and self.weights.lock.locked():
                return  # busy taking weights (a push has deadlines of its own)
            server.failed_checks = 0 if ok else server.failed_checks + 1
            if server.failed_checks >= self.config.failures_to_eject:
                self._eject(server, "health check failed")
            elif ok and (drift := await self.weights.drift(server)) is not None:
                self._eject(server, drift)  # restarted between two checks: it serves its checkpoint
            return
        if not ok:
            return
        if not await self.weights.bring_back(server):  # the pool's current weights first
            return
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

    @property
    def weight_version(self) -> int:
        """The version every server must hold."""
        return self.weights.version

    async def plan_weight_sync(self, config: WeightSyncConfig, source: WeightSource, device: torch.device) -> list[str]:
        """Choose each server's transport for ``push_weights`` and check that its model takes the
        trainer's weights (WeightSyncError otherwise); one line per server saying how it syncs."""
        return await self.weights.plan(self.servers, config, source, device)

    async def push_weights(self, source: WeightSource, weight_version: int) -> dict[str, int | None]:
        """Every healthy server: pause -> the trainer's weights, by its transport -> version read back ->
        continue. A server that fails is taken out (and synced when it answers again); every server
        failing is an EngineError. Returns each server's version (None: failed)."""
        return await self.weights.push(self.servers, source, weight_version, self._eject)

    async def sync_weights_from_disk(self, model_path: str, weight_version: int) -> int:
        """Every healthy server: pause -> load ``model_path`` -> continue. A server that fails is
        taken out (it loads these weights when it comes back); no healthy server left is an error."""
        return await self.weights.load_from_disk(self.servers, model_path, weight_version, False, self._eject)

    async def sync_adapter_from_disk(self, adapter_path: str, weight_version: int) -> int:
        """``sync_weights_from_disk`` for a LoRA adapter (``rollout/engines/server_adapters.py``)."""
        return await self.weights.load_from_disk(self.servers, adapter_path, weight_version, True, self._eject)

    async def adapter_support(self, rank: int, modules: Sequence[str]) -> AdapterSupport:
        """Ready when every healthy server is; else the first server's reason."""
        found = await asyncio.gather(*(s.engine.adapter_support(rank, modules) for s in self.servers if s.healthy))
        return next((support for support in found if not support.ready), AdapterSupport(True))

    async def update_weights(self, state_dict: dict[str, Any], weight_version: int | None = None) -> int:
        raise EngineError("servers take weights through push_weights (broadcast, tensor or disk) or "
                          "sync_weights_from_disk(path, version)")  # fmt: skip

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
    """The engine for ``--engine-url`` on SGLang servers: one server's client, or a pool of several
    (``open_servers`` for vLLM or detection)."""
    if len(urls) == 1:
        return SGLangHTTPEngine(urls[0])
    return EnginePool(urls, config)
