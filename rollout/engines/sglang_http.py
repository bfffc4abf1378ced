"""A client of one SGLang server's native HTTP API (or of ``rallyrl serve``, which speaks it).

One ``aiohttp.ClientSession`` per engine, created and closed by ``async with``, with a
connection pool sized for thousands of requests in flight. ``generate`` posts token ids to
``/generate`` and reads output ids, logprobs, finish reason and weight version.

Failures: connection errors, timeouts and HTTP 408 / 429 / 5xx are retried with exponential
backoff and full jitter (``rollout/retry.py``); anything else (a 400, a malformed response)
fails at once. Each attempt has its own wire rid (``rid#attempt``), so a retry never collides
with a request the server may still be running; a timed-out attempt is aborted on the server
before the next.

Weight updates: a generation aborted by the server that this client did not abort itself
(``/pause_generation`` or ``/update_weights_from_disk`` with ``abort_all_requests``) is
resumed: the tokens so far are kept and generation continues from them with the remaining
budget, and every token records the weight version that produced it.

Adapters (LoRA, ``rollout/engines/server_adapters.py``): ``/load_lora_adapter`` under a new name
per version, named by each request's ``lora_path``, ``/unload_lora_adapter`` once unused, and
``/update_weight_version``, all under one pause.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Self, TypeVar

import aiohttp
import orjson
import yarl

from rollout.deadlines import timeout_after
from rollout.engines.base import EngineError, Generation, SamplingParams
from rollout.engines.config import SGLangHTTPConfig
from rollout.engines.server_adapters import AdapterSupport, ServesAdapters, pause_and_continue, sglang_adapter_support
from rollout.engines.sglang_protocol import (
    generate_payload,
    generate_resuming,
    parse_generation,
    parse_weight_version,
    resumable,
    settled,
)
from rollout.retry import RETRY_STATUSES, Backoff, call_with_retries

JSON_HEADERS = {"Content-Type": "application/json"}
T = TypeVar("T")


class RetryableError(EngineError):
    """An attempt failed in a way that a later attempt (or another server) may not."""


class ServerUnavailableError(EngineError):
    """A server stayed unreachable (or kept answering 408 / 429 / 5xx) through every retry:
    another server may still serve the request."""


class ServerHTTPClient(ServesAdapters):
    """One server's HTTP plumbing, shared by the SGLang and vLLM clients: the session, per-path
    URLs and timeouts, retries of transient failures, control calls and ``/health``; the adapter
    bookkeeping of ``ServesAdapters`` (each client makes the server's calls)."""

    def __init__(self, url: str, config: SGLangHTTPConfig | None = None):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"engine URL {url!r} must start with http:// or https://")
        self.url = url.rstrip("/")
        self.config = config or SGLangHTTPConfig()
        self.weight_version = 0
        self.in_flight = 0
        self._session: aiohttp.ClientSession | None = None
        self._urls: dict[str, yarl.URL] = {}
        self._backoff = Backoff(self.config.backoff_s, self.config.backoff_max_s)
        self._init_adapters()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    async def __aenter__(self) -> Self:
        connector = aiohttp.TCPConnector(limit=self.config.max_connections, limit_per_host=0, force_close=False)
        headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else None
        self._session = aiohttp.ClientSession(
            connector=connector,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=None, connect=self.config.connect_timeout_s),
            cookie_jar=aiohttp.DummyCookieJar(),  # servers set none; skips a cookie filter per request
        )
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._session is not None:
            await self.finish_unloads()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _with_retries(self, attempt: Callable[[], Awaitable[T]]) -> T:
        """``attempt()``, retried on RetryableError with this client's backoff (``rollout/retry.py``)."""
        return await call_with_retries(
            attempt, retries=self.config.max_retries, backoff=self._backoff, retry_on=(RetryableError,)
        )

    # ----- HTTP ----------------------------------------------------------------------------

    def _url(self, path: str) -> yarl.URL:
        """Parsed once per path (parsing a URL string costs more than the rest of a request's setup)."""
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = yarl.URL(self.url + path)
        return url

    def _require_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise EngineError(f"{self!r} is not open: use it inside 'async with engine:'")
        return self._session

    async def _post(self, path: str, payload: dict[str, Any] | None, timeout_s: float) -> Any:
        """POST JSON, return the decoded body (JSON or text). Transient failures raise RetryableError."""
        return await self._request("POST", path, payload, timeout_s)

    async def _request(self, method: str, path: str, payload: dict[str, Any] | None, timeout_s: float) -> Any:
        """Send one request, return the decoded body (JSON or text). Transient failures raise RetryableError.
        ``timeout_s`` bounds the whole exchange through ``rollout.deadlines`` (aiohttp's own per-request
        timer costs more; the connect timeout stays aiohttp's)."""
        session, url = self._require_session(), self._url(path)
        body = None if payload is None else orjson.dumps(payload)
        headers = None if payload is None else JSON_HEADERS
        try:
            with timeout_after(timeout_s):
                async with session.request(method, url, data=body, headers=headers) as response:
                    raw = await response.read()
                    status = response.status
        except aiohttp.ConnectionTimeoutError as exc:
            raise RetryableError(f"{method} {url}: no connection within {self.config.connect_timeout_s:g} s") from exc
        except TimeoutError as exc:
            raise RetryableError(f"{method} {url} timed out after {timeout_s:g} s") from exc
        except aiohttp.ClientError as exc:  # refused, reset, disconnected mid-response
            raise RetryableError(f"{method} {url}: {type(exc).__name__}: {exc}") from exc
        if status in RETRY_STATUSES:
            raise RetryableError(f"{method} {url} answered HTTP {status}: {raw[:200].decode(errors='replace')}")
        if status >= 400:
            raise EngineError(f"{method} {url} answered HTTP {status}: {raw[:500].decode(errors='replace')}")
        try:
            return orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError:
            return raw.decode(errors="replace")

    async def _control(self, method: str, path: str, payload: dict[str, Any] | None = None) -> Any:
        """A control call, retried like generation but named in its error."""
        try:
            return await self._with_retries(lambda: self._request(method, path, payload, self.config.control_timeout_s))
        except RetryableError as exc:
            attempts = self.config.max_retries + 1
            raise ServerUnavailableError(f"{self.url}{path} failed after {attempts} attempts: {exc}") from exc

    async def health(self) -> bool:
        """True when ``/health`` answers 200 within the connect timeout."""
        try:
            await self._request("GET", "/health", None, self.config.connect_timeout_s)
            return True
        except EngineError:
            return False


class SGLangHTTPEngine(ServerHTTPClient):
    """The Engine protocol over one SGLang-compatible server at ``url``."""

    def __init__(self, url: str, config: SGLangHTTPConfig | None = None):
        super().__init__(url, config)
        self._wire_rids: dict[str, str] = {}  # our rid -> the wire rid of its attempt in flight
        self._aborted: set[str] = set()  # rids aborted through this client (not resumed)
        self._active: set[str] = set()  # rids inside generate (in flight or between retries)
        self._attempts = 0

    # ----- generation ----------------------------------------------------------------------

    async def generate(self, input_ids: list[int], sampling: SamplingParams, rid: str) -> Generation:
        """Continue ``input_ids``; resumed across server-side aborts (weight updates)."""
        self._aborted.discard(rid)
        self._active.add(rid)
        self.in_flight += 1
        try:
            part = await self._generate_once(input_ids, sampling, rid)
            if resumable(part, rid, self._aborted):
                generation = await generate_resuming(
                    lambda ids, budget: self._generate_once(ids, budget, rid),
                    input_ids, sampling, self._aborted, rid, self.config.max_resumes, first=part,
                )  # fmt: skip
            else:
                generation = settled(part, sampling)
            self.weight_version = max(self.weight_version, generation.weight_version)
            return generation
        finally:
            self.in_flight -= 1
            self._aborted.discard(rid)
            self._active.discard(rid)

    async def _generate_once(self, input_ids: list[int], sampling: SamplingParams, rid: str) -> Generation:
        """One /generate call, retried on transient failures (the retry loop only after a first failure)."""
        try:
            return await self._attempt(input_ids, sampling, rid)
        except RetryableError as exc:
            return await self._retried(input_ids, sampling, rid, exc)

    async def _retried(
        self, input_ids: list[int], sampling: SamplingParams, rid: str, first: RetryableError
    ) -> Generation:
        """The retries after a first attempt that failed with ``first``, with their backoff."""
        try:
            if self.config.max_retries <= 0:
                raise first
            await asyncio.sleep(self._backoff.delay(0))
            return await call_with_retries(
                lambda: self._attempt(input_ids, sampling, rid),
                retries=self.config.max_retries - 1, backoff=self._backoff, retry_on=(RetryableError,), first_retry=1,
            )  # fmt: skip
        except RetryableError as exc:
            attempts = self.config.max_retries + 1
            raise ServerUnavailableError(f"{self.url}: request {rid} failed after {attempts} attempts: {exc}") from exc

    async def _attempt(self, input_ids: list[int], sampling: SamplingParams, rid: str) -> Generation:
        if rid in self._aborted:  # aborted while waiting to retry
            return Generation([], [], "abort", self.weight_version)
        self._attempts += 1
        wire_rid = f"{rid}#{self._attempts}"
        self._wire_rids[rid] = wire_rid
        try:
            payload = generate_payload(input_ids, sampling, wire_rid)
            with self.adapter_in_use() as adapter:
                if adapter is not None:
                    payload["lora_path"] = adapter
                body = await self._request("POST", "/generate", payload, self.config.timeout_s)
            return parse_generation(body, f"{self.url} request {rid}", self.weight_version)
        except RetryableError as exc:
            if isinstance(exc.__cause__, asyncio.TimeoutError) and not isinstance(
                exc.__cause__, aiohttp.ConnectionTimeoutError
            ):
                await self._abort_quietly(wire_rid)  # the server may still be running it
            raise
        finally:
            if self._wire_rids.get(rid) == wire_rid:
                del self._wire_rids[rid]

    # ----- control endpoints -------------------------------------------------------------------

    async def abort(self, rid: str | None = None) -> None:
        """Abort one request (its generate returns finish "abort" and is not resumed), or all."""
        if rid is None:
            self._aborted.update(self._active)
            await self._control("POST", "/abort_request", {"rid": "", "abort_all": True})
            return
        self._aborted.add(rid)
        wire_rid = self._wire_rids.get(rid)
        if wire_rid is not None:
            await self._control("POST", "/abort_request", {"rid": wire_rid, "abort_all": False})

    async def _abort_quietly(self, wire_rid: str) -> None:
        with contextlib.suppress(EngineError):
            await self._request("POST", "/abort_request", {"rid": wire_rid, "abort_all": False}, 5.0)

    async def health_generate(self) -> bool:
        """True when the server can generate a token (``/health_generate``)."""
        try:
            await self._request("GET", "/health_generate", None, self.config.control_timeout_s)
            return True
        except EngineError:
            return False

    async def get_model_info(self) -> dict[str, Any]:
        return await self._control("GET", "/get_model_info")

    async def get_server_info(self) -> dict[str, Any]:
        return await self._control("GET", "/get_server_info")

    async def get_weight_version(self) -> int | None:
        """The server's weight version as ``/get_model_info`` reports it (None: never updated)."""
        return parse_weight_version((await self.get_model_info()).get("weight_version"))

    async def flush_cache(self) -> None:
        await self._control("POST", "/flush_cache")

    async def pause_generation(self, mode: str = "abort") -> None:
        """Stop generating: in-flight requests are aborted (and resumed by their clients once
        generation continues); new ones wait."""
        await self._control("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self._control("POST", "/continue_generation", {})

    async def update_weights_from_disk(self, model_path: str, weight_version: int) -> int:
        """Load the weights saved at ``model_path`` (a model directory the server can read)."""
        body = await self._control(
            "POST",
            "/update_weights_from_disk",
            {"model_path": str(model_path), "weight_version": str(weight_version), "abort_all_requests": False},
        )
        if isinstance(body, dict) and body.get("success") is False:
            raise EngineError(f"{self.url}/update_weights_from_disk {model_path}: {body.get('message')}")
        self.weight_version = weight_version
        return weight_version

    async def sync_weights_from_disk(self, model_path: str, weight_version: int) -> int:
        """pause -> update_weights_from_disk -> continue; generation continues even if the update fails."""
        async with self._paused():
            return await self.update_weights_from_disk(model_path, weight_version)

    # ----- LoRA adapters (rollout/engines/server_adapters.py) -----------------------------------

    def _paused(self) -> contextlib.AbstractAsyncContextManager[None]:
        return pause_and_continue(self)

    async def adapter_support(self, rank: int, modules: Sequence[str]) -> AdapterSupport:
        return sglang_adapter_support(self.url, await self.get_server_info(), rank, modules)

    async def _load_adapter(self, name: str, path: str) -> None:
        await self._adapter_call("/load_lora_adapter", {"lora_name": name, "lora_path": path})

    async def _unload_adapter(self, name: str) -> None:
        await self._adapter_call("/unload_lora_adapter", {"lora_name": name})

    async def _adapter_call(self, path: str, payload: dict[str, Any]) -> None:
        try:
            body = await self._control("POST", path, payload)
        except ServerUnavailableError:
            raise
        except EngineError as exc:  # SGLang answers a refusal with HTTP 400 and its reason
            raise EngineError(f"{self.url}{path} {payload}: {exc}") from None
        if isinstance(body, dict) and body.get("success") is False:
            raise EngineError(f"{self.url}{path} {payload}: {body.get('error_message')}")

    async def _name_weight_version(self, weight_version: int) -> None:
        await self._control("POST", "/update_weight_version",
                            {"new_version": str(weight_version), "abort_all_requests": False})  # fmt: skip

    async def release_memory_occupation(self) -> None:
        """Free the server's GPU memory (weights and KV cache) while the trainer needs it."""
        await self._control("POST", "/release_memory_occupation", {})

    async def resume_memory_occupation(self) -> None:
        await self._control("POST", "/resume_memory_occupation", {})

    async def update_weights(self, state_dict: dict[str, Any], weight_version: int | None = None) -> int:
        raise EngineError(
            f"{self.url}: a server loads weights from disk; save them (trainer.weight_sync.save_weights) "
            "and call sync_weights_from_disk(path, version)"
        )
