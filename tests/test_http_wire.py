"""The engine clients' thin HTTP/1.1 client (``rollout/engines/http_wire.py``) against raw servers on
loopback that answer byte for byte as a test says: keep-alive reuse, the connection limit, every way
a response can end (length, chunks, close), and every way it can fail, none leaving a connection that
is reused in an unknown state."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import pytest

from rollout.deadlines import timeout_after
from rollout.engines import http_wire
from rollout.engines.http_wire import WireClient, WireError

Answer = Callable[[bytes], bytes | None]  # the request's head and body -> what to write (None: write nothing)


def ok(body: bytes = b'{"ok": true}', extra: str = "") -> bytes:
    head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
    return head.encode() + body


class RawServer:
    """Reads whole requests (head and Content-Length body) and writes what ``answer`` gives."""

    def __init__(self, answer: Answer, close_after: bool = False):
        self.answer, self.close_after = answer, close_after
        self.requests: list[bytes] = []
        self.connections = 0
        self.url = ""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)  # fmt: skip
                request = head + await reader.readexactly(length)
                self.requests.append(request)
                reply = self.answer(request)
                if reply is not None:
                    writer.write(reply)
                    await writer.drain()
                if self.close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def serving(answer: Answer, close_after: bool = False) -> AsyncIterator[RawServer]:
    server = RawServer(answer, close_after)
    listener = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    server.url = f"http://127.0.0.1:{listener.sockets[0].getsockname()[1]}"
    try:
        yield server
    finally:
        listener.close()


async def test_sequential_requests_reuse_one_connection_and_send_one_well_formed_request_each():
    async with serving(lambda request: ok()) as server:
        client = WireClient(server.url, headers={"Authorization": "Bearer k"})
        for _ in range(3):
            assert await client.request("POST", "/generate", b'{"a": 1}') == (200, b'{"ok": true}')
        client.close()
    assert server.connections == 1 and client.connections_opened == 1
    head, body = server.requests[0].split(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0] == "POST /generate HTTP/1.1" and body == b'{"a": 1}'
    assert {"Authorization: Bearer k", "Content-Type: application/json", "Content-Length: 8"} <= set(lines)
    assert f"Host: {server.url.removeprefix('http://')}" in lines


async def test_a_url_with_a_path_prefixes_every_request():
    async with serving(lambda request: ok()) as server:
        client = WireClient(server.url + "/v1/")
        await client.request("GET", "/models")
        client.close()
    assert server.requests[0].startswith(b"GET /v1/models HTTP/1.1\r\n")


async def test_concurrent_requests_stay_within_the_connection_limit_and_all_finish():
    async with serving(lambda request: ok()) as server:
        client = WireClient(server.url, limit=3)
        results = await asyncio.gather(*(client.request("POST", "/generate", b"{}") for _ in range(20)))
        assert client.open_connections <= 3
        client.close()
    assert all(result[0] == 200 for result in results) and len(server.requests) == 20
    assert server.connections <= 3 and client.connections_opened <= 3


async def test_a_response_that_closes_the_connection_is_not_reused():
    async with serving(lambda request: ok(extra="Connection: close\r\n"), close_after=True) as server:
        client = WireClient(server.url)
        for _ in range(2):
            assert (await client.request("GET", "/health"))[0] == 200
        client.close()
    assert client.connections_opened == 2


async def test_a_chunked_response_is_read_whole():
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
    async with serving(lambda request: chunked) as server:
        client = WireClient(server.url)
        assert await client.request("GET", "/x") == (200, b"hello world")
        assert await client.request("GET", "/x") == (200, b"hello world")  # (and the connection kept)
        client.close()
    assert client.connections_opened == 1


async def test_a_body_without_a_length_ends_where_the_server_closes():
    async with serving(lambda request: b"HTTP/1.1 200 OK\r\n\r\nto the end", close_after=True) as server:
        client = WireClient(server.url)
        assert await client.request("GET", "/x") == (200, b"to the end")
        client.close()


async def test_error_statuses_are_answers_with_their_body():
    async with serving(lambda request: b"HTTP/1.1 503 Busy\r\nContent-Length: 4\r\n\r\nbusy") as server:
        client = WireClient(server.url)
        assert await client.request("POST", "/generate", b"{}") == (503, b"busy")
        client.close()


@pytest.mark.parametrize("reply, message", [
    (b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\nshort", "closed the connection"),
    (b"", "closed the connection"),
    (b"SSH-2.0-OpenSSH_9.2\r\n", "not an HTTP response"),
])  # fmt: skip
async def test_a_response_cut_short_or_not_http_is_a_wire_error_and_its_connection_is_dropped(reply, message):
    async with serving(lambda request: reply, close_after=True) as server:
        client = WireClient(server.url)
        with pytest.raises(WireError, match=message):
            await client.request("POST", "/generate", b"{}")
        assert client.open_connections == 0
        client.close()


async def test_a_request_past_its_deadline_drops_its_connection_and_the_next_opens_a_new_one():
    replies = iter([None, ok()])
    async with serving(lambda request: next(replies)) as server:
        client = WireClient(server.url)
        with pytest.raises(TimeoutError), timeout_after(0.2):
            await client.request("POST", "/generate", b"{}")
        assert client.open_connections == 0  # a late answer could not be read as the next request's
        assert (await client.request("POST", "/generate", b"{}"))[0] == 200
        client.close()
    assert client.connections_opened == 2


async def test_a_connection_idle_past_the_keepalive_is_not_reused():
    async with serving(lambda request: ok()) as server:
        client = WireClient(server.url, keepalive_s=0.1)
        await client.request("GET", "/x")
        await asyncio.sleep(0.2)
        await client.request("GET", "/x")
        client.close()
    assert client.connections_opened == 2


async def test_a_connection_the_server_closed_while_idle_is_not_reused():
    async with serving(lambda request: ok(), close_after=True) as server:  # closes without saying so
        client = WireClient(server.url)
        await client.request("GET", "/x")
        await asyncio.sleep(0.1)
        assert (await client.request("GET", "/x"))[0] == 200
        client.close()
    assert client.connections_opened == 2


async def test_a_body_over_the_limit_is_a_wire_error(monkeypatch):
    monkeypatch.setattr(http_wire, "MAX_BODY_BYTES", 10)
    async with serving(lambda request: ok(b"x" * 11)) as server:
        client = WireClient(server.url)
        with pytest.raises(WireError, match="over 10 bytes"):
            await client.request("GET", "/x")
        client.close()


async def test_a_refused_connection_says_so_and_a_bad_url_is_refused():
    listener = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    listener.close()
    await listener.wait_closed()
    client = WireClient(f"http://127.0.0.1:{port}")
    with pytest.raises(WireError, match=f"cannot connect to 127.0.0.1:{port}: Connection refused"):
        await client.request("GET", "/health")
    assert client.open_connections == 0
    with pytest.raises(ValueError, match="not an http"):
        WireClient("ftp://127.0.0.1:1")


async def test_a_waiter_cancelled_while_waiting_for_a_connection_leaves_the_others_their_turn():
    async with serving(lambda request: ok()) as server:
        client = WireClient(server.url, limit=1)
        first = asyncio.create_task(client.request("GET", "/x"))
        waiting = asyncio.create_task(client.request("GET", "/x"))
        third = asyncio.create_task(client.request("GET", "/x"))
        await asyncio.sleep(0)
        waiting.cancel()
        results = await asyncio.gather(first, third)
        with pytest.raises(asyncio.CancelledError):
            await waiting
        client.close()
    assert [status for status, _ in results] == [200, 200] and client.connections_opened == 1
