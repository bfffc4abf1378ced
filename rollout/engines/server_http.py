"""The HTTP plumbing every server client shares (``sglang_http.py``, ``vllm_http.py``): per server, the
thin keep-alive client of ``http_wire.py`` for every request (a pool sized for thousands of requests in
flight, each request one pre-encoded write) and an ``aiohttp.ClientSession`` for weight uploads in
pieces, both created and closed by ``async with``; transient failures
(connection errors, timeouts, HTTP 408 / 429 / 5xx) raised as ``RetryableError`` and retried with
exponential backoff and full jitter (``rollout/retry.py``); control calls named in their errors;
``/health``; and the calls of a weight update, which are never retried (a step of an update is not
repeated blindly) and may send a large JSON body in pieces. Every wait has a deadline: a request's
``timeout_s`` (or ``control_timeout_s``) per attempt, ``connect_timeout_s`` per connection, at most
``max_retries`` retries; a read that many requests need first (``SharedRead``) is made once for all of
them, so that none waits behind the others' attempts.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, Generic, Self, TypeVar

import aiohttp
import orjson
import yarl

from rollout.deadlines import timeout_after
from rollout.engines.base import EngineError
from rollout.engines.config import SGLangHTTPConfig
from rollout.engines.http_wire import ConnectTimeout, WireClient, WireError, decode_json_or_text
from rollout.engines.server_adapters import ServesAdapters
from rollout.retry import RETRY_STATUSES, Backoff, call_with_retries

JSON_HEADERS = {"Content-Type": "application/json"}
T = TypeVar("T")


KEEPALIVE_S = 4.0
"""How long an idle connection to a server is kept (SGLang's and vLLM's uvicorn keep theirs 5 s)."""


class RetryableError(EngineError):
    """An attempt failed in a way that a later attempt (or another server) may not; ``status``: the
    HTTP status the server answered (None: no answer)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class ServerUnavailableError(EngineError):
    """A server stayed unreachable (or kept answering 408 / 429 / 5xx) through every retry:
    another server may still serve the request."""


class SharedRead(Generic[T]):
    """A value read once from a server and kept. Callers that arrive while it is being read wait on that
    read (not on a lock, each making its own attempts after the one before failed, which made a
    failing read take as many times longer as there were callers) and get its value, or its error;
    a caller after a failed read starts a new one."""

    def __init__(self, read: Callable[[], Awaitable[T]]) -> None:
        self._read = read
        self._value: T | None = None
        self._pending: asyncio.Future[T] | None = None

    async def get(self) -> T:
        if self._value is None:
            if self._pending is None or self._pending.done():
                self._pending = asyncio.ensure_future(self._read())
                self._pending.add_done_callback(lambda done: done.cancelled() or done.exception())  # (retrieved)
            self._value = await asyncio.shield(self._pending)  # (a caller cancelled leaves it to the others)
        return self._value


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
        self._session: aiohttp.ClientSession | None = None  # weight uploads in pieces
        self._wire: WireClient | None = None  # every other request
        self._urls: dict[str, yarl.URL] = {}
        self._backoff = Backoff(self.config.backoff_s, self.config.backoff_max_s)
        self._init_adapters()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def sockets_for(self, in_flight: int) -> int:
        """Sockets ``in_flight`` requests hold: one each, at most ``max_connections``."""
        limit = self.config.max_connections
        return min(in_flight, limit) if limit else in_flight

    async def __aenter__(self) -> Self:
        # idle connections closed before the server's own keep-alive (uvicorn: 5 s) can close them under a
        # request: a weight call, not retried, written onto a connection the server just closed fails
        connector = aiohttp.TCPConnector(limit=self.config.max_connections, limit_per_host=0, force_close=False,
                                         keepalive_timeout=KEEPALIVE_S)  # fmt: skip
        headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else None
        self._wire = WireClient(self.url, self.config.max_connections, self.config.connect_timeout_s, KEEPALIVE_S,
                                headers)  # fmt: skip
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
        if self._wire is not None:
            self._wire.close()
            self._wire = None

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

    def _require_wire(self) -> WireClient:
        if self._wire is None:
            raise EngineError(f"{self!r} is not open: use it inside 'async with engine:'")
        return self._wire

    def _require_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise EngineError(f"{self!r} is not open: use it inside 'async with engine:'")
        return self._session

    async def _post(self, path: str, payload: dict[str, Any] | None, timeout_s: float) -> Any:
        """POST JSON, return the decoded body (JSON or text). Transient failures raise RetryableError."""
        return await self._request("POST", path, payload, timeout_s)

    async def _request(self, method: str, path: str, payload: dict[str, Any] | None, timeout_s: float) -> Any:
        """Send one request, return the decoded body (JSON or text). Transient failures raise RetryableError.
        ``timeout_s`` bounds the whole exchange through ``rollout.deadlines``; the connect timeout is the
        wire client's. On the thin client of ``http_wire.py``: one pre-encoded request, no per-call
        header or URL building."""
        wire = self._require_wire()
        body = None if payload is None else orjson.dumps(payload)
        try:
            with timeout_after(timeout_s):
                status, raw = await wire.request(method, path, body)
        except ConnectTimeout as exc:
            raise RetryableError(f"{method} {self.url}{path}: {exc}") from exc
        except TimeoutError as exc:
            raise RetryableError(f"{method} {self.url}{path} timed out after {timeout_s:g} s") from exc
        except WireError as exc:  # refused, reset, disconnected mid-response
            raise RetryableError(f"{method} {self.url}{path}: {exc}") from exc
        if status in RETRY_STATUSES:
            raise RetryableError(f"{method} {self.url}{path} answered HTTP {status}: "
                                 f"{raw[:200].decode(errors='replace')}", status)  # fmt: skip
        if status >= 400:
            raise EngineError(f"{method} {self.url}{path} answered HTTP {status}: {raw[:500].decode(errors='replace')}")
        return decode_json_or_text(raw, orjson.loads)

    async def _control(self, method: str, path: str, payload: dict[str, Any] | None = None) -> Any:
        """A control call, retried like generation but named in its error."""
        try:
            return await self._with_retries(lambda: self._request(method, path, payload, self.config.control_timeout_s))
        except RetryableError as exc:
            attempts = self.config.max_retries + 1
            raise ServerUnavailableError(f"{self.url}{path} failed after {attempts} attempts: {exc}") from exc

    async def get(self, path: str) -> Any:
        """``GET path`` as a control call (retried; the decoded answer)."""
        return await self._control("GET", path)

    async def health(self) -> bool:
        """True when ``/health`` answers 200 within the connect timeout."""
        try:
            await self._request("GET", "/health", None, self.config.connect_timeout_s)
            return True
        except EngineError:
            return False

    async def weight_call(self, path: str, payload: dict[str, Any] | Iterable[bytes], timeout_s: float) -> Any:
        """One call of a weight update (``payload``: JSON, or a JSON body in pieces), not retried: a step
        of an update is not repeated blindly. A refusal (an HTTP error, ``"success": false``) is an
        EngineError with the server's message."""
        if isinstance(payload, dict):
            try:
                body = await self._request("POST", path, payload, timeout_s)
            except RetryableError as exc:
                raise EngineError(str(exc)) from None
        else:
            body = await self._post_pieces(path, payload, timeout_s)
        if isinstance(body, dict) and body.get("success") is False:
            raise EngineError(f"{path}: {body.get('message')}")
        return body

    async def _post_pieces(self, path: str, pieces: Iterable[bytes], timeout_s: float) -> Any:
        """POST a JSON body given in pieces (sent as they come, never joined)."""

        async def body() -> AsyncIterator[bytes]:
            for piece in pieces:
                yield piece

        url = self._url(path)
        try:
            with timeout_after(timeout_s):
                async with self._require_session().post(url, data=body(), headers=JSON_HEADERS) as response:
                    raw, status = await response.read(), response.status
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise EngineError(f"POST {url}: {type(exc).__name__}: {exc}") from None
        if status >= 400:
            raise EngineError(f"POST {url} answered HTTP {status}: {raw[:500].decode(errors='replace')}")
        return decode_json_or_text(raw, orjson.loads)

    async def pause_for_update(self) -> None:
        """Stop generating for a weight update (in-flight requests are aborted and resumed by their
        clients once generation continues)."""
        await self.pause_generation()  # type: ignore[attr-defined]

    async def continue_after_update(self, complete: bool) -> None:
        """Continue generating after a weight update: only when it ``complete``d; a server left with
        part of its new weights stays paused until a full update succeeds."""
        if complete:
            await self.continue_generation()  # type: ignore[attr-defined]
