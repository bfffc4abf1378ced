"""Fault injection (``rallyrl serve --fault-*``, rollout/serve/faults.py): each fault at its rate and in
the order its seed says, a drop that really cuts the body, a hang that really holds; then
rollouts through real faulted ``rallyrl serve`` processes that lose and duplicate no request,
one of them through a pool whose other server is killed mid-rollout."""

from __future__ import annotations

import asyncio
import contextlib
import time
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer
from conftest import ScriptedEngine, run_cli

from data.synthetic import make_task
from data.tiny_model import EMBEDDED_MODEL
from rollout.engines.base import SamplingParams
from rollout.engines.pool import EnginePool, PoolConfig
from rollout.engines.sglang_http import SGLangHTTPConfig, SGLangHTTPEngine
from rollout.serve.app import EngineServer, ServeConfig
from rollout.serve.faults import FaultConfig, FaultInjector
from rollout.serve.processes import serve_processes
from rollout.tokens import ChatTokenizer, load_tokenizer
from tests.test_serve_processes import assert_all_accounted, calc_runner

ANSWER = "The answer is 4, as 2 + 2 = 4. " * 8  # a body long enough to be cut in the middle
BODY = {"text": "What is 2+2?", "sampling_params": {"max_new_tokens": 512, "temperature": 0.0}}
FAULTS = ("--fault-error-rate", "0.1", "--fault-hang-rate", "0.05", "--fault-drop-rate", "0.05")
FAST_RETRIES = SGLangHTTPConfig(timeout_s=2.0, max_retries=6, backoff_s=0.05, backoff_max_s=0.5)
"""A hung attempt is given up after 2 s and retried within half a second."""
ROLLOUT_RETRIES = replace(FAST_RETRIES, timeout_s=6.0)
"""For a rollout 32 requests at a time on one CPU server, whose answers take 2 s on a loaded machine."""


@pytest.fixture(scope="module")
def model_tokenizer():
    return load_tokenizer(EMBEDDED_MODEL)


@contextlib.asynccontextmanager
async def faulted(tokenizer: Any, faults: FaultConfig) -> AsyncIterator[tuple[TestClient, ScriptedEngine]]:
    """An in-process server with ``faults`` over a scripted engine that always gives ``ANSWER``."""
    engine = ScriptedEngine(ChatTokenizer(tokenizer), lambda turn, prompt, rid: ANSWER)
    server = EngineServer(engine, tokenizer, ServeConfig(model=str(EMBEDDED_MODEL), faults=faults))
    async with TestClient(TestServer(server.app()), connector=aiohttp.TCPConnector(limit=0)) as client:
        yield client, engine


async def outcome(client: TestClient, timeout_s: float = 0.5) -> str | None:
    """What one /generate call met: None (answered 200), "error", "hang" or "drop"."""
    try:
        async with client.post("/generate", json=BODY, timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            await response.read()
            return {200: None, 500: "error"}[response.status]
    except TimeoutError:
        return "hang"
    except aiohttp.ClientPayloadError:
        return "drop"


async def fault_stats(client: TestClient) -> dict[str, Any]:
    async with client.get("/fault_stats") as response:
        return await response.json()


async def raw_generate(client: TestClient) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A /generate request written on a bare socket, to see exactly which bytes come back."""
    reader, writer = await asyncio.open_connection(client.host, client.port)
    body = orjson.dumps(BODY)
    head = f"POST /generate HTTP/1.1\r\nHost: {client.host}\r\nContent-Type: application/json\r\n"
    writer.write(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
    await writer.drain()
    return reader, writer


# ----- the middleware, in process ----------------------------------------------------------------


async def test_each_fault_happens_at_about_its_rate_and_is_counted(model_tokenizer):
    faults = FaultConfig(error_rate=0.2, hang_rate=0.1, drop_rate=0.1, hang_s=60, seed=3)
    async with faulted(model_tokenizer, faults) as (client, _):
        slots = asyncio.Semaphore(64)  # a thousand connections at once overflow the listen backlog

        async def one() -> str | None:
            async with slots:  # a hang is 60 s; 3 s is room for an answer on a loaded machine
                return await outcome(client, timeout_s=3.0)

        seen = Counter(await asyncio.gather(*(one() for _ in range(1000))))
        stats = await fault_stats(client)
    assert stats["generate_calls"] == 1000
    assert (seen["error"], seen["hang"], seen["drop"]) == (stats["errors"], stats["hangs"], stats["drops"])
    for kind, rate in (("error", 0.2), ("hang", 0.1), ("drop", 0.1), (None, 0.6)):
        assert abs(seen[kind] / 1000 - rate) < 0.04, seen


async def test_the_seed_decides_which_calls_fail_in_which_order(model_tokenizer):
    faults = FaultConfig(error_rate=0.2, hang_rate=0.1, drop_rate=0.2, hang_s=60, seed=7)
    async with faulted(model_tokenizer, faults) as (client, _):
        seen = [await outcome(client, timeout_s=1.0) for _ in range(40)]  # a hang is 60 s
    expected = FaultInjector(faults)
    assert seen == [expected.draw() for _ in range(40)]
    assert {"error", "hang", "drop", None} <= set(seen)
    other = FaultInjector(FaultConfig(error_rate=0.2, hang_rate=0.1, drop_rate=0.2, seed=8))
    assert [other.draw() for _ in range(40)] != seen


async def test_an_injected_error_is_a_500_in_sglangs_error_shape_and_generates_nothing(model_tokenizer):
    async with (
        faulted(model_tokenizer, FaultConfig(error_rate=1.0)) as (client, engine),
        client.post("/generate", json=BODY) as response,
    ):
        status, body = response.status, await response.json()
    assert status == 500
    assert "fault injected" in body["error"]["message"]
    assert engine.turns == {}


async def test_a_dropped_response_sends_headers_and_part_of_the_body_then_resets(model_tokenizer):
    async with faulted(model_tokenizer, FaultConfig(drop_rate=1.0)) as (client, engine):
        reader, writer = await raw_generate(client)
        received = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := await reader.read(65536):
                received += chunk
        writer.close()
        stats = await fault_stats(client)
    head, _, body = received.partition(b"\r\n\r\n")
    length = int(next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))[15:])
    assert head.startswith(b"HTTP/1.1 200")
    assert 0 < len(body) < length  # cut in the middle of the body
    assert len(engine.emitted) == 1  # the generation ran; only its answer was lost
    assert stats["drops"] == 1


async def test_a_client_reading_a_dropped_response_gets_a_payload_error(model_tokenizer):
    async with (
        faulted(model_tokenizer, FaultConfig(drop_rate=1.0)) as (client, _),
        client.post("/generate", json=BODY) as response,
    ):
        assert response.status == 200
        with pytest.raises(aiohttp.ClientPayloadError, match="content length"):
            await response.read()


async def test_a_hung_request_gets_no_byte_until_the_client_gives_up(model_tokenizer):
    async with faulted(model_tokenizer, FaultConfig(hang_rate=1.0)) as (client, engine):
        reader, writer = await raw_generate(client)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(reader.read(1), 1.0)
        writer.close()
        started = time.monotonic()
        assert await outcome(client, timeout_s=0.5) == "hang"
        waited = time.monotonic() - started
        stats = await fault_stats(client)
    assert waited >= 0.5
    assert stats["hangs"] == 2
    assert engine.turns == {}


async def test_a_hang_shorter_than_the_client_timeout_is_answered_late(model_tokenizer):
    async with faulted(model_tokenizer, FaultConfig(hang_rate=1.0, hang_s=0.3)) as (client, _):
        started = time.monotonic()
        assert await outcome(client, timeout_s=5.0) is None
    assert time.monotonic() - started >= 0.3


async def test_only_generate_is_faulted(model_tokenizer):
    async with faulted(model_tokenizer, FaultConfig(error_rate=1.0)) as (client, _):
        statuses = {}
        for path in ("/health", "/get_model_info", "/get_server_info", "/v1/models"):
            async with client.get(path) as response:
                statuses[path] = response.status
        assert await outcome(client) == "error"
    assert set(statuses.values()) == {200}, statuses


async def test_the_http_client_retries_through_every_fault_kind(model_tokenizer):
    faults = FaultConfig(error_rate=0.2, hang_rate=0.1, drop_rate=0.2, hang_s=60, seed=1)
    config = SGLangHTTPConfig(timeout_s=3.0, max_retries=8, backoff_s=0.01, backoff_max_s=0.05)  # hang: 60 s
    async with faulted(model_tokenizer, faults) as (client, _):
        async with SGLangHTTPEngine(str(client.make_url("")), config) as http:
            sampling = SamplingParams(max_new_tokens=512, temperature=0.0)
            prompt = model_tokenizer.encode("What is 2+2?", add_special_tokens=False)
            generations = await asyncio.gather(*(http.generate(prompt, sampling, f"r{i}") for i in range(50)))
        stats = await fault_stats(client)
    assert all(
        g.finish_reason == "stop" and model_tokenizer.decode(g.output_ids).startswith(ANSWER) for g in generations
    )
    assert stats["errors"] and stats["hangs"] and stats["drops"]
    assert stats["generate_calls"] == 50 + stats["errors"] + stats["hangs"] + stats["drops"]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--fault-error-rate", "1.5"], "error_rate must be a share in [0, 1], got 1.5"),
        (["--fault-hang-rate", "0.6", "--fault-drop-rate", "0.5"], "error_rate + hang_rate + drop_rate must be <= 1"),
    ],
)
def test_serve_rejects_bad_fault_rates_with_exit_code_2(flags, message):
    made = run_cli("serve", "--port", "0", *flags, timeout=120)
    assert made.returncode == 2
    assert message in " ".join(made.stderr.split())


# ----- rollouts through real faulted servers ---------------------------------------------------


def server_fault_stats(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/fault_stats", timeout=10) as response:
        return orjson.loads(response.read())


def assert_faults_injected(stats: dict[str, Any]) -> None:
    calls = stats["generate_calls"]
    assert 0.06 < stats["errors"] / calls < 0.14, stats
    assert 0.02 < stats["hangs"] / calls < 0.08, stats
    assert stats["drops"] > 0, stats  # fewer than drawn: a drawn drop whose client timed out first is not cut


@pytest.mark.slow
async def test_a_1024_request_rollout_through_a_faulty_server_loses_and_duplicates_nothing(tmp_path):
    out = tmp_path / "out.jsonl"
    with serve_processes(EMBEDDED_MODEL, tmp_path, 1, *FAULTS, "--fault-seed", "1") as (server,):
        async with SGLangHTTPEngine(server.url, ROLLOUT_RETRIES) as engine:
            result = await calc_runner(engine, max_concurrency=32).run(make_task("calc", 256, seed=11), 4, out)
        stats = server_fault_stats(server.url)
    assert_all_accounted(result, out, 1024)  # count in = count out, ids unique, lines valid, errors recorded
    assert_faults_injected(stats)
    errors = [r.error for r in result.requests if r.finish_reason.value == "error"]
    # retries absorb the faults (7 faulted attempts in a row are rare); on a loaded machine a few
    # ordinary generations, 32 at a time on one CPU server, also outlast the per-attempt timeout
    assert len(errors) <= 50, errors[:3]


@pytest.mark.slow
async def test_killing_one_of_two_faulty_servers_mid_rollout_loses_and_duplicates_nothing(tmp_path):
    out = tmp_path / "out.jsonl"
    with serve_processes(EMBEDDED_MODEL, tmp_path, 2, *FAULTS, "--fault-seed", "2") as servers:
        config = PoolConfig(health_interval_s=0.2, client=replace(FAST_RETRIES, max_retries=1))
        async with EnginePool([s.url for s in servers], config) as pool:
            victim = pool.servers[0]
            rollout = asyncio.create_task(
                calc_runner(pool, max_concurrency=32).run(make_task("calc", 64, seed=12), 4, out)
            )
            deadline = time.monotonic() + 60
            while not (victim.stats.requests >= 20 and victim.engine.in_flight >= 3):
                assert time.monotonic() < deadline and not rollout.done(), "the rollout never loaded the victim"
                await asyncio.sleep(0.01)
            await asyncio.to_thread(servers[0].kill)
            result = await rollout
            stats = pool.stats()
        survivor_stats = server_fault_stats(servers[1].url)
    assert_all_accounted(result, out, 256)
    assert stats["failovers"] >= 1
    assert not stats["servers"][servers[0].url]["healthy"]
    assert_faults_injected(survivor_stats)
    errors = [r.error for r in result.requests if r.finish_reason.value == "error"]
    assert not errors, errors[:3]  # a request waits for a server to come back rather than fail
