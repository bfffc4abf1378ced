"""The engine pool against in-process ``rallyrl serve`` apps on loopback: health ejection, a
restarted server loading the pool's weights before it serves, weight sync with a dead server,
and the error when no server comes back."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import pytest

from data.tiny_model import EMBEDDED_MODEL
from rollout.engines.base import EngineError, SamplingParams
from rollout.engines.local import LocalEngine, LocalEngineConfig
from rollout.engines.pool import EnginePool, PoolConfig
from rollout.engines.sglang_http import SGLangHTTPConfig
from rollout.serve.processes import free_port
from tests.conftest import serving

FAST = PoolConfig(
    health_interval_s=0.05,
    failures_to_eject=1,
    wait_for_server_s=0.5,
    client=SGLangHTTPConfig(max_retries=0, connect_timeout_s=1.0, control_timeout_s=10.0),
)


@contextlib.asynccontextmanager
async def running_server(port: int, model_dir: Path = EMBEDDED_MODEL):
    """A real server on 127.0.0.1:port in this event loop; stopped at exit."""
    engine = LocalEngine.from_pretrained(model_dir, LocalEngineConfig(max_batch_size=8))
    async with engine, serving(engine, model_dir, port) as url:
        yield url


async def wait_until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


def test_a_pool_needs_distinct_urls():
    with pytest.raises(ValueError, match="at least one"):
        EnginePool([])
    with pytest.raises(ValueError, match="duplicate"):
        EnginePool(["http://127.0.0.1:1", "http://127.0.0.1:1"])


async def test_a_restarted_server_loads_the_pools_weights_before_it_is_put_back():
    port_b = free_port()
    async with running_server(free_port()) as url_a, contextlib.AsyncExitStack() as stack:
        url_b = await stack.enter_async_context(running_server(port_b))
        async with EnginePool([url_a, url_b], FAST) as pool:
            await pool.sync_weights_from_disk(str(EMBEDDED_MODEL), 5)
            assert await pool.server_versions() == {url_a: 5, url_b: 5}
            await stack.aclose()  # server b goes down: the pool takes it out and keeps serving on a
            await wait_until(lambda: not pool.servers[1].healthy)
            generation = await pool.generate([5, 6, 7], SamplingParams(max_new_tokens=2), "r1")
            assert generation.meta["server"] == url_a
            async with running_server(port_b):  # a fresh server on b's port, weights "default"
                await wait_until(lambda: pool.servers[1].healthy)
                versions = await pool.server_versions()
    assert versions == {url_a: 5, url_b: 5}


async def test_a_request_fails_over_to_a_live_server_when_its_server_is_down():
    dead = f"http://127.0.0.1:{free_port()}"
    async with running_server(free_port()) as live, EnginePool([dead, live], FAST) as pool:
        pool.servers[0].healthy = True  # not yet noticed by the health check
        results = await asyncio.gather(
            *(pool.generate([5, 6, 7], SamplingParams(max_new_tokens=2), f"r{i}") for i in range(8))
        )
    assert all(result.meta["server"] == live for result in results)
    assert not pool.servers[0].healthy


async def test_with_no_healthy_server_a_request_fails_after_wait_for_server_s():
    urls = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]
    async with EnginePool(urls, FAST) as pool:
        started = time.monotonic()
        with pytest.raises(EngineError, match="no healthy server") as error:
            await pool.generate([5, 6, 7], SamplingParams(max_new_tokens=2), "lonely")
    assert time.monotonic() - started < 5
    assert urls[0] in str(error.value)


async def test_weight_sync_skips_a_dead_server_and_fails_only_when_every_server_fails():
    dead = f"http://127.0.0.1:{free_port()}"
    async with running_server(free_port()) as live, EnginePool([dead, live], FAST) as pool:
        pool.servers[0].healthy = True
        assert await pool.sync_weights_from_disk(str(EMBEDDED_MODEL), 2) == 2
        assert not pool.servers[0].healthy
        assert (await pool.server_versions())[live] == 2
    async with EnginePool([dead], FAST) as pool:
        with pytest.raises(EngineError, match="failed on every server"):
            await pool.sync_weights_from_disk(str(EMBEDDED_MODEL), 3)
