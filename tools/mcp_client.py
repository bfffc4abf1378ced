"""One MCP client session per server, shared by every request and every tool of that server.

The sessions live on one background thread with its own asyncio loop, so they outlive any one
event loop of the caller (tools are built before the rollout's loop runs, and a trainer runs
several loops over time). A call from the caller's loop is handed over with
``run_coroutine_threadsafe`` and awaited with ``wrap_future``: cancelling the caller cancels the
call.

Every call has a deadline. A lost connection (the stdio process exited, an HTTP connection was
refused or reset, the server forgot the session) fails the calls in flight at once with a
``ToolError`` the model reads; the next call reconnects, and failed connects back off
(0.5 s, 1 s, 2 s ... at most 10 s) so that a dead server is not hammered. ``close_mcp_clients``
(also run at exit) ends every session, so stdio servers do not outlive the process.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import logging
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import anyio
import httpx
from mcp import ClientSession, McpError, StdioServerParameters, types
from mcp.client.sse import sse_client
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client

from tools.base import ToolError
from tools.mcp_transport import WatchedTransport, describe_error, relay_messages

T = TypeVar("T")
log = logging.getLogger(__name__)

BACKOFF_FIRST_S = 0.5
"""Wait before the second connect attempt after a failed one; doubled after each further failure."""
BACKOFF_MAX_S = 10.0
"""The longest wait between connect attempts."""
CLOSE_TIMEOUT_S = 5.0
"""How long closing waits for a session to end (a stdio server to exit) before cancelling it."""
HTTP_READ_TIMEOUT_S = 300.0
"""The SDK's default wait for the next bytes of a streamed HTTP answer; raised to the longest call timeout + 30 s."""
Transport = Literal["stdio", "streamable-http", "sse"]


@dataclass(frozen=True)
class MCPServer:
    """How to reach one MCP server: a command to run (stdio) or a URL (streamable HTTP or SSE)."""

    name: str
    transport: Transport
    command: str | None = None
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] | None = None  # added to the SDK's safe default environment
    cwd: str | None = None
    url: str | None = None
    headers: tuple[tuple[str, str], ...] = ()
    stderr: str | None = None  # a file for a stdio server's stderr (default: this process's stderr)

    def describe(self) -> str:
        where = self.url if self.transport != "stdio" else " ".join([self.command or "", *self.args])
        return f"{self.name!r} ({where})"


@dataclass
class _Connection:
    """One live session: ``lost`` gets the reason when it ends; ``owner`` is the task that holds it."""

    session: ClientSession
    tools: list[types.Tool]
    lost: asyncio.Future[str]
    owner: asyncio.Task[None]


class TokenBucket:
    """At most ``rate`` calls per second on average (verl's ``rate_limit``), bursts up to ``rate``."""

    def __init__(self, rate: float):
        self.rate = rate
        self.tokens = rate
        self.updated = time.monotonic()

    async def acquire(self, deadline: float, what: str) -> None:
        loop = asyncio.get_running_loop()
        while True:
            now = time.monotonic()
            self.tokens = min(self.rate, self.tokens + (now - self.updated) * self.rate)
            self.updated = now
            if self.tokens >= 1:
                self.tokens -= 1
                return
            wait = (1 - self.tokens) / self.rate
            if loop.time() + wait > deadline:
                raise ToolError(f"{what}: rate limit of {self.rate:g} calls/s reached; try again later")
            await asyncio.sleep(wait)


class MCPClient:
    """The shared session of one server. ``list_tools`` is for building tools (blocking);
    ``call_tool`` is awaited from any event loop."""

    def __init__(self, server: MCPServer, runner: _LoopThread, connect_timeout_s: float, read_timeout_s: float):
        self.server = server
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.connections = 0
        """Sessions opened so far (1 + the reconnects)."""
        self._runner = runner
        self._conn: _Connection | None = None
        self._connecting: asyncio.Task[_Connection] | None = None
        self._failures = 0
        self._retry_at = 0.0
        self._last_error = ""
        self._closed = False

    # ----- from the caller's side --------------------------------------------------------------

    def list_tools(self) -> list[types.Tool]:
        """Connect (if needed) and return the server's tools; blocks for at most the connect timeout."""
        future = self._runner.submit(self._list_tools())
        try:
            return future.result(self.connect_timeout_s + CLOSE_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise ToolError(
                f"MCP server {self.server.describe()}: no answer within {self.connect_timeout_s:g} s"
            ) from None

    async def call_tool(
        self, name: str, arguments: dict[str, Any], timeout_s: float, limiter: TokenBucket | None = None
    ) -> types.CallToolResult:
        """Call tool ``name`` within ``timeout_s``; a ``ToolError`` for a timeout or a lost connection."""
        return await asyncio.wrap_future(self._runner.submit(self._call_tool(name, arguments, timeout_s, limiter)))

    # ----- on the background loop --------------------------------------------------------------

    async def _list_tools(self) -> list[types.Tool]:
        conn = await self._connected(asyncio.get_running_loop().time() + self.connect_timeout_s)
        return conn.tools

    async def _call_tool(
        self, name: str, arguments: dict[str, Any], timeout_s: float, limiter: TokenBucket | None
    ) -> types.CallToolResult:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        what = f"MCP tool {name} on server {self.server.name!r}"
        conn = await self._connected(deadline)
        if limiter is not None:
            await limiter.acquire(deadline, what)
        call = asyncio.ensure_future(conn.session.call_tool(name, arguments))
        try:
            await asyncio.wait((call, conn.lost), timeout=deadline - loop.time(), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not call.done():  # timed out, connection lost, or the caller gave up
                call.cancel()
                call.add_done_callback(_retrieve)
        if call.done():
            try:
                return call.result()
            except McpError as exc:
                if exc.error.code == types.CONNECTION_CLOSED or exc.error.message == "Session terminated":
                    self._lose(conn, exc.error.message)
                    raise ToolError(f"{what}: connection lost ({exc.error.message})") from None
                raise ToolError(f"{what}: {exc.error.message}") from None
            except (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream):
                self._lose(conn, "the session's streams are closed")
                raise ToolError(f"{what}: connection lost (the session's streams are closed)") from None
        if conn.lost.done():
            raise ToolError(f"{what}: connection lost during the call ({conn.lost.result()})")
        raise ToolError(f"{what} timed out after {timeout_s:g} s")

    async def _connected(self, deadline: float) -> _Connection:
        """The live connection, opening one if needed (one attempt at a time, shared by all callers)."""
        if self._closed:
            raise ToolError(f"MCP server {self.server.describe()}: the client is closed")
        conn = self._conn
        if conn is not None and not conn.lost.done():
            return conn
        loop = asyncio.get_running_loop()
        if self._connecting is None:
            if self._retry_at > deadline:
                raise ToolError(
                    f"MCP server {self.server.describe()} is unreachable ({self._last_error}); "
                    f"next attempt in {self._retry_at - loop.time():.1f} s"
                )
            self._connecting = loop.create_task(self._connect())
            self._connecting.add_done_callback(_retrieve)
        try:
            return await asyncio.wait_for(asyncio.shield(self._connecting), max(deadline - loop.time(), 0))
        except TimeoutError:
            raise ToolError(f"MCP server {self.server.describe()}: not connected in time") from None

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            await asyncio.sleep(max(self._retry_at - loop.time(), 0))
            ready: asyncio.Future[_Connection] = loop.create_future()
            owner = loop.create_task(self._own(ready))
            try:
                async with asyncio.timeout(self.connect_timeout_s):
                    conn = await asyncio.shield(ready)
            except BaseException:
                owner.cancel()
                raise
        except Exception as exc:
            self._failures += 1
            self._retry_at = loop.time() + min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (self._failures - 1))
            self._last_error = "timed out" if isinstance(exc, TimeoutError) else describe_error(exc)
            raise ToolError(f"cannot connect to MCP server {self.server.describe()}: {self._last_error}") from None
        finally:
            self._connecting = None
        self._failures, self._retry_at = 0, 0.0
        self.connections += 1
        if self._closed:  # closed while connecting
            self._lose(conn, "closed")
            raise ToolError(f"MCP server {self.server.describe()}: the client is closed")
        self._conn = conn
        return conn

    async def _own(self, ready: asyncio.Future[_Connection]) -> None:
        """Open the transport and the session, hand them over through ``ready``, and hold them
        until the connection is lost or closed (anyio's scopes must be left by the task that entered them)."""
        loop = asyncio.get_running_loop()
        lost: asyncio.Future[str] = loop.create_future()

        def lose(reason: str) -> None:
            if not lost.done():
                lost.set_result(reason)

        try:
            async with contextlib.AsyncExitStack() as stack:
                read, write = await stack.enter_async_context(self._transport(lose))
                relay_in, session_read = anyio.create_memory_object_stream[Any](0)
                relays = await stack.enter_async_context(anyio.create_task_group())
                stack.callback(relays.cancel_scope.cancel)  # on the way out, before the task group waits
                relays.start_soon(relay_messages, read, relay_in, lose)
                session = await stack.enter_async_context(ClientSession(session_read, write))
                await session.initialize()
                tools = await _all_tools(session)
                ready.set_result(_Connection(session, tools, lost, asyncio.current_task()))  # type: ignore[arg-type]
                reason = await lost
                log.info("MCP server %s: connection ended (%s)", self.server.describe(), reason)
        except Exception as exc:  # a transport that failed (its task group re-raises what broke it)
            lose(describe_error(exc))
            if not ready.done():
                ready.set_exception(exc)
        finally:
            lose("closed")
            if not ready.done():
                ready.set_exception(ConnectionError("the connection was cancelled"))

    @contextlib.asynccontextmanager
    async def _transport(self, lose: Callable[[str], None]) -> AsyncIterator[tuple[Any, Any]]:
        server = self.server
        if server.transport == "stdio":
            assert server.command is not None
            params = StdioServerParameters(
                command=server.command,
                args=list(server.args),
                env=dict(server.env) if server.env is not None else None,
                cwd=server.cwd,
            )
            with contextlib.ExitStack() as files:
                errlog = files.enter_context(open(server.stderr, "a")) if server.stderr else sys.stderr
                async with stdio_client(params, errlog=errlog) as (read, write):
                    yield read, write
            return
        assert server.url is not None

        def http_client(
            headers: dict[str, str] | None = None, timeout: httpx.Timeout | None = None, auth: httpx.Auth | None = None
        ) -> httpx.AsyncClient:
            """The SDK's client factory, with our read timeout (a call may outlast the SDK's 5 minutes)
            and network errors reported as a lost connection."""
            return httpx.AsyncClient(
                headers={**dict(server.headers), **(headers or {})},
                timeout=httpx.Timeout(30.0, read=self.read_timeout_s),
                auth=auth,
                transport=WatchedTransport(lose),
            )

        if server.transport == "sse":
            async with sse_client(server.url, httpx_client_factory=http_client) as (read, write):
                yield read, write
        else:
            async with http_client() as client, streamable_http_client(server.url, http_client=client) as streams:
                yield streams[0], streams[1]

    def _lose(self, conn: _Connection, reason: str) -> None:
        if not conn.lost.done():
            conn.lost.set_result(reason)

    async def _close(self) -> None:
        self._closed = True
        if self._connecting is not None:
            self._connecting.cancel()
        conn = self._conn
        if conn is None:
            return
        self._lose(conn, "closed")
        try:
            await asyncio.wait_for(asyncio.shield(conn.owner), CLOSE_TIMEOUT_S)
        except TimeoutError:
            conn.owner.cancel()
            await asyncio.wait({conn.owner}, timeout=1.0)


async def _all_tools(session: ClientSession) -> list[types.Tool]:
    tools: list[types.Tool] = []
    page = await session.list_tools()
    tools += page.tools
    while page.nextCursor:
        page = await session.list_tools(params=types.PaginatedRequestParams(cursor=page.nextCursor))
        tools += page.tools
    return tools


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Mark a background future's exception as seen (its callers got it, or have gone)."""
    if not future.cancelled():
        future.exception()


# ----- the background loop and the clients of this process ------------------------------------


class _LoopThread:
    """A daemon thread running an asyncio loop forever."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="rallyrl-mcp", daemon=True)
        self.thread.start()

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)


_lock = threading.Lock()
_runner: _LoopThread | None = None
_clients: dict[MCPServer, MCPClient] = {}


def mcp_client(server: MCPServer, connect_timeout_s: float = 60.0, call_timeout_s: float = 30.0) -> MCPClient:
    """The process's client of ``server`` (one per distinct server config), created on first use;
    its timeouts cover the longest asked for."""
    global _runner
    with _lock:
        if _runner is None:
            _runner = _LoopThread()
        client = _clients.get(server)
        if client is None:
            client = _clients[server] = MCPClient(server, _runner, connect_timeout_s, HTTP_READ_TIMEOUT_S)
        client.connect_timeout_s = max(client.connect_timeout_s, connect_timeout_s)
        client.read_timeout_s = max(client.read_timeout_s, call_timeout_s + 30.0)
        return client


def close_mcp_clients() -> None:
    """Close every MCP session of this process (stdio servers exit); tools built on them stop working."""
    with _lock:
        clients = list(_clients.values())
        _clients.clear()
        runner = _runner
    if runner is None or not clients:
        return

    async def close_all() -> None:
        await asyncio.gather(*(client._close() for client in clients), return_exceptions=True)

    with contextlib.suppress(concurrent.futures.TimeoutError, RuntimeError):
        runner.submit(close_all()).result(CLOSE_TIMEOUT_S + 2)


atexit.register(close_mcp_clients)
