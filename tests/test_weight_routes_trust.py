"""What ``rallyrl serve``'s weight routes (``rollout/serve/weight_routes.py``) take, from whom, and when:
a group join names a trainer the server may trust, as rank 0; a session that loaded part of the weights
never ends as a whole one; a load from disk beside an open session is refused instead of left waiting;
pending joins and tensor bodies cannot take the threads every other route needs; a session is open only
once it holds the update lock. In-process servers of the embedded model on loopback; each wait has a
generous cap (the bugs were answers that never came, not slow ones)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import tempfile
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from typer.testing import CliRunner

from data.tiny_model import EMBEDDED_MODEL
from rollout.engines.local import LocalEngine, LocalEngineConfig
from rollout.engines.tensor_payload import pickle_named_tensors
from rollout.engines.weight_group import address_towards, free_port
from rollout.serve.app import EngineServer, ServeConfig
from rollout.tokens import load_tokenizer

CAP_S = 20.0
"""Longest wait for an answer the server must give (at once, or after a short load)."""
PARTIAL_BODY = 10**9
"""A Content-Length under every route's limit, of which a few bytes are sent: the body never comes."""


@contextlib.asynccontextmanager
async def served(**config: Any) -> AsyncIterator[tuple[TestClient, EngineServer, LocalEngine]]:
    """The embedded model served on loopback; a client that hangs up cancels its handler, as in ``serve``."""
    async with LocalEngine.from_pretrained(EMBEDDED_MODEL, LocalEngineConfig(device="cpu")) as engine:
        config = ServeConfig(model=str(EMBEDDED_MODEL), weights_dirs=[tempfile.gettempdir()], **config)
        server = EngineServer(engine, load_tokenizer(EMBEDDED_MODEL), config)
        async with TestClient(TestServer(server.app(), handler_cancellation=True)) as client:
            yield client, server, engine


@pytest.fixture
async def serving() -> AsyncIterator[tuple[TestClient, EngineServer, LocalEngine]]:
    async with served() as serving:
        yield serving


async def post(client: TestClient, path: str, body: Any = None) -> tuple[int, dict[str, Any]]:
    """POST JSON, answered within ``CAP_S``: the status and the JSON body."""
    async with asyncio.timeout(CAP_S), client.post(path, json=body) as response:
        return response.status, await response.json(content_type=None)


def message(answer: dict[str, Any]) -> str:
    """The message of a refusal in either of the server's shapes (``{success, message}`` or ``{error}``)."""
    error = answer.get("error")
    return str(error.get("message") if isinstance(error, dict) else error or answer.get("message"))


def join_body(**fields: Any) -> dict[str, Any]:
    """An /init_weights_update_group body toward a loopback port where no trainer listens."""
    return {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2,
            "group_name": "g", "backend": "gloo", "timeout_s": 30, **fields}  # fmt: skip


def tensor_body(engine: LocalEngine, weight_version: str | None, scale: float = 1.5) -> dict[str, Any]:
    """An /update_weights_from_tensor body: the model's final norm, scaled (one bucket of one tensor)."""
    named = [("model.norm.weight", engine.model.model.norm.weight.detach().clone() * scale)]
    payload = base64.b64encode(pickle_named_tensors(named)).decode()
    return {"serialized_named_tensors": [payload], "load_format": None, "flush_cache": True,
            "weight_version": weight_version}  # fmt: skip


async def wait_until(condition: Any, what: str) -> None:
    try:
        async with asyncio.timeout(CAP_S):
            while not condition():
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"no {what} within {CAP_S:g} s") from None


async def raw_request(client: TestClient, path: str, content_length: int, sent: bytes) -> asyncio.StreamReader:
    """A POST on a connection of its own that announces ``content_length`` bytes and sends ``sent``."""
    reader, writer = await asyncio.open_connection(client.host, client.port)
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{client.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {content_length}\r\n\r\n")  # fmt: skip
    writer.write(head.encode() + sent)
    await writer.drain()
    reader.writer = writer  # type: ignore[attr-defined]  (closed by the test)
    return reader


async def raw_answer(reader: asyncio.StreamReader) -> tuple[int, str]:
    """The status and the body of the answer on a raw connection (read until the server closes it or the
    announced length has come)."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    lines = head.lower().split(b"\r\n")
    length = next((int(line.split(b":")[1]) for line in lines if line.startswith(b"content-length:")), None)
    body = await (reader.readexactly(length) if length is not None else reader.read())
    return status, body.decode()


# ----- 1. a join names a trainer the server may trust, as rank 0 ---------------------------------------------


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"rank_offset": 0, "world_size": 2}, "rank_offset"),
        ({"rank_offset": 1, "world_size": 1}, "world_size"),
        ({"rank_offset": 1, "world_size": 1 + 4096 + 1}, "world_size"),
        ({"master_port": 0}, "master_port"),
        ({"master_port": 70000}, "master_port"),
        ({"master_address": "trainer.example"}, "master_address"),
        ({"master_address": "192.0.2.7"}, "master_address"),  # not loopback, and the server is bound to loopback
        ({"timeout_s": 0}, "timeout_s"),
        ({"timeout_s": 301}, "timeout_s"),
    ],
)
async def test_a_group_join_is_refused_at_once_naming_the_field_that_would_let_another_trainer_in(
    serving, fields, named
):
    client, _, _ = serving
    status, answer = await post(client, "/init_weights_update_group", join_body(**fields))
    assert status == 400
    assert message(answer).startswith(f"{named}:")
    if fields.get("master_address") == "192.0.2.7":
        assert "--weight-peer 192.0.2.7" in message(answer)


async def test_a_server_bound_outside_loopback_takes_broadcasts_from_its_weight_peers_only():
    try:
        own = address_towards("192.0.2.1")  # this machine's address on its default route (nothing is sent)
    except OSError:
        pytest.skip("this machine has no address outside loopback")
    if own.startswith("127.") or own == "::1":
        pytest.skip("this machine has no address outside loopback")
    async with served(host="0.0.0.0", weight_peers=[own]) as (client, _, _):
        status, answer = await post(client, "/init_weights_update_group", join_body(master_address="192.0.2.7"))
        assert status == 400
        assert message(answer) == (f"master_address: 192.0.2.7 is not one of this server's weight peers ({own}): to "
                                   "take weights from it, start the server with --weight-peer 192.0.2.7")  # fmt: skip
        # a peer is taken: its join fails only because no trainer listens there
        status, answer = await post(client, "/init_weights_update_group", join_body(master_address=own, timeout_s=1))
        assert status == 400 and answer["success"] is False
        assert answer["message"].startswith("Failed to initialize custom process group")


def test_a_weight_peer_that_is_not_an_address_is_refused_when_the_server_starts():
    from cli import app

    with pytest.raises(ValueError, match=r"weight_peers: '10\.0\.0\.300' is not an IP address or a CIDR network"):
        ServeConfig(weight_peers=["10.0.0.0/24", "10.0.0.300"])
    done = CliRunner().invoke(app, ["serve", "--weight-peer", "trainer.example"])
    assert done.exit_code != 0
    assert "trainer.example" in done.output


# ----- 2. a partial session does not end as a whole one --------------------------------------------------------


async def test_ending_a_session_that_loaded_part_of_the_weights_fails_and_they_never_serve(serving):
    client, _, engine = serving
    assert (await post(client, "/begin_weight_update", {}))[0] == 200
    status, answer = await post(client, "/update_weights_from_tensor", tensor_body(engine, None))
    assert status == 200, answer
    status, answer = await post(client, "/end_weight_update", {})
    assert status == 400 and answer["success"] is False
    assert "the weights are partial" in answer["message"]
    assert "will not generate until whole weights load" in answer["message"]
    status, answer = await post(client, "/continue_generation", {})
    assert status == 400 and "part of the new weights" in message(answer)
    # a whole session (its last bucket names the version) ends well, and generation goes on
    assert (await post(client, "/begin_weight_update", {}))[0] == 200
    assert (await post(client, "/update_weights_from_tensor", tensor_body(engine, "1")))[0] == 200
    assert await post(client, "/end_weight_update", {}) == (200, {"success": True, "message": "Success"})
    assert (await post(client, "/continue_generation", {}))[0] == 200
    status, answer = await post(client, "/generate", {"text": "1+1=", "sampling_params": {"max_new_tokens": 2}})
    assert status == 200 and answer["meta_info"]["weight_version"] == "1"


# ----- 3. a load from disk beside an open session --------------------------------------------------------------


async def test_a_load_from_disk_while_a_session_is_open_is_refused_at_once(serving):
    client, _, _ = serving
    assert (await post(client, "/begin_weight_update", {}))[0] == 200
    status, answer = await post(client, "/update_weights_from_disk", {"model_path": str(EMBEDDED_MODEL)})
    assert status == 400 and answer["success"] is False and answer["num_paused_requests"] == 0
    assert "a weight-update session is open" in answer["message"]
    assert "call /end_weight_update first" in answer["message"]
    assert await post(client, "/end_weight_update", {}) == (200, {"success": True, "message": "Success"})
    status, answer = await post(client, "/update_weights_from_disk", {"model_path": str(EMBEDDED_MODEL)})
    assert status == 200 and answer["success"] is True


# ----- 4. pending joins and tensor bodies cannot starve the server ---------------------------------------------


async def test_joins_past_two_pending_are_refused_at_once_and_the_other_routes_keep_their_threads(serving):
    client, _, _ = serving
    default_threads = min(32, (os.cpu_count() or 1) + 4)  # asyncio's default executor
    port = free_port()  # no trainer ever comes: each join pends until its deadline
    joins = [asyncio.create_task(post(client, "/init_weights_update_group", join_body(master_port=port,
                                                                                      group_name=f"g{i}")))
             for i in range(default_threads + 2)]  # fmt: skip
    try:
        await wait_until(lambda: sum(join.done() for join in joins) >= len(joins) - 2, "the joins past two refused")
        refused = [join.result() for join in joins if join.done()]
        assert len(refused) == len(joins) - 2
        for status, answer in refused:
            assert status == 503 and answer["success"] is False
            assert answer["message"].startswith("2 weight-group joins are pending, the most this server waits for")
        async with client.post("/init_weights_update_group", json=join_body(group_name="late")) as response:
            assert response.status == 503 and response.headers["Retry-After"]
        # the default executor still has its threads: a load from disk (its files are read there) is answered
        status, answer = await post(client, "/update_weights_from_disk", {"model_path": str(EMBEDDED_MODEL)})
        assert status == 200 and answer["success"] is True
    finally:
        for join in joins:
            join.cancel()  # (the client hangs up: the server stops waiting; the rendezvous ends at its deadline)
        await asyncio.gather(*joins, return_exceptions=True)


@pytest.mark.parametrize("path", ["/update_weights_from_tensor", "/update_weights_from_distributed"])
async def test_a_weight_bucket_outside_a_session_is_refused_before_its_body_is_read(serving, path):
    client, _, _ = serving
    length = PARTIAL_BODY if path.endswith("tensor") else 10 * 2**20  # within each route's limit
    reader = await raw_request(client, path, length, b'{"serialized_named_tensors": ["')
    try:
        async with asyncio.timeout(CAP_S):
            status, body = await raw_answer(reader)
    finally:
        reader.writer.close()  # type: ignore[attr-defined]
    assert status == 400
    assert "must run between begin_weight_update() and end_weight_update()" in json.loads(body)["error"]["message"]


async def test_a_third_tensor_body_at_once_is_refused_before_it_is_read(serving):
    client, _, _ = serving
    assert (await post(client, "/begin_weight_update", {}))[0] == 200
    readers = [await raw_request(client, "/update_weights_from_tensor", PARTIAL_BODY, b'{"serialized_named_tensors"')
               for _ in range(3)]  # fmt: skip
    answers = [asyncio.create_task(raw_answer(reader)) for reader in readers]
    try:
        done, _ = await asyncio.wait(answers, timeout=CAP_S, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1, "one of the three must be refused at once"
        status, body = done.pop().result()
        assert status == 503
        assert json.loads(body)["error"]["message"] == (
            "2 update_weights_from_tensor bodies are being read, the most this server takes at once: send the "
            "buckets one after another")  # fmt: skip
    finally:
        for answer in answers:
            answer.cancel()
        for reader in readers:
            reader.writer.close()  # type: ignore[attr-defined]
    assert await post(client, "/end_weight_update", {}) == (200, {"success": True, "message": "Success"})


# ----- 5. a session is open once it holds the update lock ------------------------------------------------------


async def test_begin_waits_for_a_load_under_way_and_takes_no_bucket_before_it_has_begun(serving):
    client, server, engine = serving
    await server._update_lock.acquire()  # as a load from disk holds it
    begin = asyncio.create_task(post(client, "/begin_weight_update", {}))
    try:
        await wait_until(lambda: server.weight_session_beginning, "begin waiting for the update lock")
        status, answer = await post(client, "/update_weights_from_tensor", tensor_body(engine, "1"))
        assert status == 400
        assert "must run between begin_weight_update() and end_weight_update()" in message(answer)
        assert not begin.done()
    finally:
        server.release_after_weights()
    assert await begin == (200, {"success": True, "message": "Success"})
    assert (await post(client, "/update_weights_from_tensor", tensor_body(engine, "1")))[0] == 200
    assert await post(client, "/end_weight_update", {}) == (200, {"success": True, "message": "Success"})
    async with client.get("/get_model_info") as response:
        assert (await response.json())["weight_version"] == "1"


# ----- what a trainer can plan with ----------------------------------------------------------------------------


async def test_server_info_gives_the_largest_bucket_and_tensor_body_the_server_takes(serving):
    client, _, _ = serving
    async with client.get("/get_server_info") as response:
        info = await response.json()
    assert info["weight_limits"] == {"max_bucket_bytes": 8 * 2**30, "max_tensor_body_bytes": 2 * 2**30}
