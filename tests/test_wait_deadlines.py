"""Every wait in the clients, the benchmarks and the test helpers has a deadline: past it, an error
naming what was waited for and for how long, in about that time (issue 42, the clients' side)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from benchmarks.waits import WaitTimeout, finish_within, read_line, stop_process
from rollout.engines.launch import wait_ready
from rollout.engines.vllm_http import VLLMHTTPEngine
from rollout.serve.processes import ServeProcess, wait_healthy
from tests.test_vllm_http import FAST, FakeVLLM, sampling, status


@contextlib.contextmanager
def silent_server() -> Iterator[str]:
    """A loopback URL whose server accepts connections and never answers."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


def test_waiting_for_a_server_that_accepts_and_never_answers_ends_at_its_deadline():
    with silent_server() as url:
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=rf"{url} did not become healthy in 1 s"):
            wait_healthy(url, None, None, timeout_s=1.0)
        assert time.monotonic() - started < 1.5  # (each try's own timeout is cut to what is left)


def test_an_engine_that_never_becomes_ready_is_stopped_at_the_deadline_with_its_log(tmp_path):
    log = tmp_path / "engine.log"
    log.write_text("loading the model ...\n")
    with silent_server() as url:
        process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
        server = ServeProcess(url, process, log)
        try:
            with pytest.raises(RuntimeError, match=r"did not become healthy in 0.5 s:\nloading the model"):
                wait_ready(server, timeout_s=0.5)
            assert not server.running()
        finally:
            server.kill()


async def test_a_wait_past_its_deadline_names_what_it_waited_for_and_the_flag_that_sets_it():
    started = time.monotonic()
    with pytest.raises(WaitTimeout, match=r"^the raw run did not finish within 0.2 s \(--run-timeout-s\)$"):
        await finish_within(asyncio.sleep(60), 0.2, "the raw run", "--run-timeout-s")
    assert time.monotonic() - started < 1


async def test_a_timeout_of_the_awaited_work_itself_is_not_taken_for_the_deadline():
    async def times_out() -> None:
        raise TimeoutError("the server's own")

    with pytest.raises(TimeoutError, match="the server's own") as raised:
        await finish_within(times_out(), 60, "a run", "--run-timeout-s")
    assert not isinstance(raised.value, WaitTimeout)


def test_a_child_process_that_never_says_it_is_ready_is_a_wait_timeout():
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], stdout=subprocess.PIPE,
                               text=True)  # fmt: skip
    try:
        started = time.monotonic()
        with pytest.raises(WaitTimeout, match=r"the simulated server's start: nothing written within 0.5 s"):
            read_line(process, 0.5, "the simulated server's start")
        assert time.monotonic() - started < 1.5
    finally:
        stop_process(process, grace_s=1)
    assert process.returncode is not None


def test_a_child_process_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path):
    code = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint(1, flush=True)\ntime.sleep(300)"
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert read_line(process, 10, "the child") == "1\n"
    started = time.monotonic()
    stop_process(process, grace_s=0.5)
    assert process.returncode == -9 and time.monotonic() - started < 3


async def test_requests_that_need_the_vllm_servers_settings_share_one_read_and_its_failure():
    """Before, each request waited on a lock for the one before it to fail its own attempts: 8 requests
    took 8 reads of ``max_retries + 1`` attempts each, one after another (the 17-minute wait of issue 42)."""
    fake = FakeVLLM()
    fake.control["/v1/models"] = lambda body: status(503, "loading")
    async with fake.running() as url, VLLMHTTPEngine(url, FAST) as engine:
        results = await asyncio.gather(*(engine.generate([1, 2], sampling(), f"r{i}") for i in range(8)),
                                       return_exceptions=True)  # fmt: skip
        assert all(type(r).__name__ == "ServerUnavailableError" and "/v1/models" in str(r) for r in results)
        assert [path for _, path, _ in fake.requests].count("/v1/models") == FAST.max_retries + 1
        del fake.control["/v1/models"]  # (the server is up now: the next request reads again, and goes through)
        assert (await engine.generate([1, 2], sampling(), "later")).output_ids == [5, 6, 2]
