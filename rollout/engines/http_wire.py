"""A thin HTTP/1.1 client for the calls a rollout makes thousands of times a second: one request, a
whole JSON body in, a whole body out, on keep-alive connections to one server.

aiohttp's client builds a request object, a header multidict, a payload object, a response object and
a timer for every call; at thousands of turns a second that was the largest part of rallyrl's client
CPU (``benchmarks/client_overhead.py``). Here a request is one ``bytes`` (the request line and
headers of a path are encoded once, then the length and the body) written to a pooled connection,
and the response is read by ``httptools`` (llhttp, the C parser uvicorn uses) into a status and a
body. What it does not do (streamed bodies, redirects, cookies, proxies) the callers never need: a
weight upload in pieces still goes through aiohttp (``server_http.py``).

Connections: at most ``limit`` open at once (0: no limit; a caller over it waits for one, first come
first served), reused most-recent first, closed after ``keepalive_s`` idle (before the server's own
keep-alive closes them under a request), and closed, never reused, after anything other than a whole
response the server lets us keep the connection after: an error, a timeout, a cancellation.
"""

from __future__ import annotations

import asyncio
import collections
import os
import ssl
import time
from typing import Any

import httptools
import yarl

MAX_BODY_BYTES = 1 << 30
"""The largest response body read (a 32k-token generation with logprobs is a few MB)."""


class WireError(ConnectionError):
    """The connection failed before a whole response came: refused, reset, closed mid-response, or
    an answer that is not HTTP."""


class ConnectTimeout(WireError):
    """No connection could be opened within the connect timeout."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection: a request at a time, its response parsed as it arrives."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.body: list[bytes] = []
        self.size = 0
        self.closed = False
        self.idle_since = 0.0
        self.until_close = False  # a response with neither a length nor chunks: its body ends at close
        self.headers_done = False

    # ----- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.waiter is None:  # bytes nobody asked for: the connection is not in a known state
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(WireError("the server switched protocols"))
        except httptools.HttpParserError as exc:
            self._fail(WireError(f"not an HTTP response: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            if self.until_close and self.headers_done:
                self._complete()
            else:
                self._fail(WireError(f"the server closed the connection{f': {exc}' if exc else ''}"))

    # ----- httptools callbacks --------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-length" or (name == b"transfer-encoding" and b"chunked" in value.lower()):
            self.until_close = False

    def on_headers_complete(self) -> None:
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.size += len(body)
        if self.size > MAX_BODY_BYTES:
            self._fail(WireError(f"the response body is over {MAX_BODY_BYTES} bytes"))
            return
        self.body.append(body)

    def on_message_complete(self) -> None:
        if not self.parser.should_keep_alive():
            self.closed = True  # (closed once the response is handed over)
        self._complete()

    # ----- requests -----------------------------------------------------------------------------

    def send(self, data: bytes, loop: asyncio.AbstractEventLoop) -> asyncio.Future[tuple[int, bytes]]:
        self.body, self.size, self.until_close, self.headers_done = [], 0, True, False
        self.waiter = loop.create_future()
        self.transport.write(data)  # type: ignore[union-attr]
        return self.waiter

    def _complete(self) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            body = self.body[0] if len(self.body) == 1 else b"".join(self.body)
            waiter.set_result((self.parser.get_status_code(), body))
        self.body = []

    def _fail(self, error: WireError) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)
        self.close()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class WireClient:
    """Keep-alive connections to the server at ``url`` (``http://`` or ``https://``), and its requests."""

    def __init__(self, url: str, limit: int = 0, connect_timeout_s: float = 10.0, keepalive_s: float = 4.0,
                 headers: dict[str, str] | None = None):  # fmt: skip
        parsed = yarl.URL(url)
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise ValueError(f"{url!r} is not an http:// or https:// URL")
        self.host, self.port = parsed.host, parsed.port or (443 if parsed.scheme == "https" else 80)
        self.ssl: ssl.SSLContext | None = ssl.create_default_context() if parsed.scheme == "https" else None
        self.base_path = parsed.path.rstrip("/")
        self.limit, self.connect_timeout_s, self.keepalive_s = limit, connect_timeout_s, keepalive_s
        host = f"[{parsed.host}]" if ":" in parsed.host else parsed.host  # (an IPv6 address)
        host = host if parsed.is_default_port() else f"{host}:{self.port}"
        lines = [f"Host: {host}", "Accept: */*", "Connection: keep-alive",
                 *(f"{name}: {value}" for name, value in (headers or {}).items())]  # fmt: skip
        self._common = "".join(f"{line}\r\n" for line in lines)
        self._heads: dict[tuple[str, str], bytes] = {}
        self._idle: collections.deque[_Connection] = collections.deque()
        self._open = 0  # connections open or being opened
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()
        self.connections_opened = 0
        self._closed = False

    @property
    def open_connections(self) -> int:
        return self._open

    def _head(self, method: str, path: str) -> bytes:
        """The request line and headers of ``method path`` up to the body's length, encoded once."""
        key = (method, path)
        head = self._heads.get(key)
        if head is None:
            text = f"{method} {self.base_path}{path} HTTP/1.1\r\n{self._common}Content-Type: application/json\r\n"
            head = self._heads[key] = (text + "Content-Length: ").encode("latin-1")
        return head

    async def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        """Send ``method path`` with ``body`` (JSON, or none); the response's status and body. Raises
        WireError (ConnectTimeout) when no whole response comes; the caller bounds the wait."""
        data = b"%s%d\r\n\r\n%s" % (self._head(method, path), len(body or b""), body or b"")
        connection = await self._acquire()
        ok = False
        try:
            status, raw = await connection.send(data, asyncio.get_running_loop())
            ok = True
            return status, raw
        finally:
            self._release(connection, reuse=ok)

    async def _acquire(self) -> _Connection:
        now = time.monotonic()
        while self._idle:
            connection = self._idle.pop()
            if not connection.closed and now - connection.idle_since < self.keepalive_s:
                return connection
            self._drop(connection)
        if self._closed:
            raise WireError("the client is closed")
        if self.limit and self._open >= self.limit:
            waiter = asyncio.get_running_loop().create_future()
            self._waiting.append(waiter)
            try:
                await waiter  # a slot: a connection handed back idle, or room to open one
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    self._wake()  # the slot given to us goes to the next in line
                raise
            return await self._acquire()
        self._open += 1
        try:
            connection = await self._connect()
        except BaseException:
            self._open -= 1
            self._wake()
            raise
        self.connections_opened += 1
        return connection

    async def _connect(self) -> _Connection:
        loop, where = asyncio.get_running_loop(), f"{self.host}:{self.port}"
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, connection = await loop.create_connection(_Connection, self.host, self.port, ssl=self.ssl,
                                                             server_hostname=self.host if self.ssl else None)
        except TimeoutError:
            raise ConnectTimeout(f"no connection to {where} within {self.connect_timeout_s:g} s") from None
        except OSError as exc:
            reason = os.strerror(exc.errno) if exc.errno else str(exc)  # (asyncio's own text names no reason)
            raise WireError(f"cannot connect to {where}: {reason}") from exc
        return connection

    def _release(self, connection: _Connection, reuse: bool) -> None:
        if reuse and not connection.closed and not self._closed:
            connection.idle_since = time.monotonic()
            self._idle.append(connection)
        else:
            self._drop(connection)
        self._wake()

    def _drop(self, connection: _Connection) -> None:
        connection.close()
        self._open -= 1

    def _wake(self) -> None:
        """Let the first caller waiting for a connection go on (an idle one, or room to open one)."""
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def close(self) -> None:
        """Close every idle connection; those in use close when their request ends."""
        self._closed = True
        while self._idle:
            self._drop(self._idle.pop())
        for waiter in self._waiting:
            if not waiter.done():
                waiter.set_exception(WireError("the client is closed"))
        self._waiting.clear()

    def __repr__(self) -> str:
        return f"WireClient({self.host}:{self.port}, open={self._open}, idle={len(self._idle)})"


def decode_json_or_text(raw: bytes, loads: Any) -> Any:
    """A body as JSON, else as text (None when empty)."""
    if not raw:
        return None
    try:
        return loads(raw)
    except ValueError:
        return raw.decode(errors="replace")
