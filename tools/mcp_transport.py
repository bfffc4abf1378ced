"""What tells an MCP client that its connection is lost: the stdio or SSE stream ending, or httpx's
network errors (refused, reset, closed mid-stream), which the MCP SDK drops silently in places and
would leave calls waiting."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import httpx


async def relay_messages(source: Any, sink: Any, lose: Callable[[str], None]) -> None:
    """Pass the transport's messages on to the session; the end of the stream is a lost connection."""
    try:
        async with sink:
            async for item in source:
                await sink.send(item)
    except (anyio.ClosedResourceError, anyio.BrokenResourceError):
        pass
    finally:
        lose("the server closed the connection")


class WatchedTransport(httpx.AsyncBaseTransport):
    """httpx's transport, reporting network errors (refused, reset, closed mid-stream) as a lost
    connection: the SDK drops some of them silently, which would leave calls waiting."""

    def __init__(self, lose: Callable[[str], None]):
        # no connection cap: every call in flight holds a streamed response open
        self._inner = httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=None, max_keepalive_connections=32))
        self._lose = lose

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            response = await self._inner.handle_async_request(request)
        except (httpx.NetworkError, httpx.RemoteProtocolError) as exc:
            self._lose(describe_error(exc))
            raise
        response.stream = _WatchedStream(response.stream, self._lose)  # type: ignore[arg-type]
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


class _WatchedStream(httpx.AsyncByteStream):
    def __init__(self, inner: httpx.AsyncByteStream, lose: Callable[[str], None]):
        self._inner, self._lose = inner, lose

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._inner:
                yield chunk
        except (httpx.NetworkError, httpx.RemoteProtocolError) as exc:
            self._lose(describe_error(exc))
            raise

    async def aclose(self) -> None:
        await self._inner.aclose()


def describe_error(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        return describe_error(exc.exceptions[0])
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
