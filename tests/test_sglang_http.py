"""SGLangHTTPEngine against small SGLang doubles served on loopback: what it sends, what it reads
back, how it retries, aborts and resumes, and the control endpoints it calls."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import random
import socket
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from rollout.engines.base import EngineError, SamplingParams
from rollout.engines.sglang_http import ServerUnavailableError, SGLangHTTPConfig, SGLangHTTPEngine

FIXTURES = Path(__file__).parent / "fixtures" / "sglang"
PROMPT = [11, 12, 13]
FAST = SGLangHTTPConfig(backoff_s=0.01, backoff_max_s=0.02, max_retries=3, timeout_s=5.0, control_timeout_s=5.0)


def config(**changes: Any) -> SGLangHTTPConfig:
    return SGLangHTTPConfig(**{**FAST.__dict__, **changes})


def sampling(max_new_tokens: int = 10) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.7, top_p=0.9, top_k=0, stop_token_ids=[2])


def output(ids: list[int], finish: str = "stop", version: str = "default", rid: str = "rid") -> dict[str, Any]:
    """A /generate response object in SGLang's shape (logprob -0.5 - i/100 for token i)."""
    finish_reason = {
        "stop": {"type": "stop", "matched": ids[-1] if ids else None},
        "length": {"type": "length", "length": len(ids)},
        "abort": {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None},
    }[finish]
    triples = [[-0.5 - i / 100, token, None] for i, token in enumerate(ids)]
    meta = {"id": rid, "finish_reason": finish_reason, "weight_version": version, "output_token_logprobs": triples}
    return {"text": "", "output_ids": ids, "meta_info": meta}


def status(code: int, message: str = "") -> web.Response:
    return web.json_response({"error": {"message": message or f"HTTP {code}"}}, status=code)


@contextlib.asynccontextmanager
async def loopback(app: web.Application) -> AsyncIterator[str]:
    """Serve ``app`` on 127.0.0.1 (a free port, a deep accept backlog); yields its URL."""
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=4096)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


class FakeSGLang:
    """An SGLang server double that records every request. ``/generate`` is answered by
    ``on_generate(body, n)`` (n counts /generate calls from 0): a dict is sent as JSON, a
    response as is. Control endpoints answer as SGLang does, or by ``control[path](body)``."""

    def __init__(
        self,
        on_generate: Callable[[dict[str, Any], int], Any] | None = None,
        control: dict[str, Callable[[Any], Any]] | None = None,
    ):
        self.on_generate = on_generate or (lambda body, n: output([5, 6, 2], rid=body["rid"]))
        self.control = control or {}
        self.requests: list[tuple[str, str, Any]] = []  # (method, path, JSON body or None)
        self.headers: list[dict[str, str]] = []
        self.weight_version = "default"
        self.current: web.Request | None = None  # the request being answered (until its first await)

    @property
    def generates(self) -> list[dict[str, Any]]:
        return [body for _, path, body in self.requests if path == "/generate"]

    def paths(self) -> list[str]:
        return [path for _, path, _ in self.requests]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = orjson.loads(raw) if raw else None
        self.requests.append((request.method, request.path, body))
        self.headers.append(dict(request.headers))
        self.current = request
        if request.path == "/generate":
            answer = self.on_generate(body, len(self.generates) - 1)
        elif request.path in self.control:
            answer = self.control[request.path](body)
        elif request.path == "/get_model_info":
            answer = {"model_path": "/models/qwen", "is_generation": True, "weight_version": self.weight_version}
        elif request.path == "/update_weights_from_disk":
            answer = {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
        elif request.path in ("/abort_request", "/health"):
            answer = web.Response()
        elif request.path == "/flush_cache":
            answer = web.Response(text="Cache flushed.\n")
        else:
            answer = {"message": "ok", "status": "ok"}
        if inspect.isawaitable(answer):
            answer = await answer
        return answer if isinstance(answer, web.StreamResponse) else web.json_response(answer)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[str]:
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self.handle)
        async with loopback(app) as url:
            yield url


async def wait_until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the test server"
        await asyncio.sleep(0.005)


def closed_port() -> int:
    """A loopback port with nothing listening on it."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# ----- the request and the response ----------------------------------------------------------------


async def test_generate_posts_input_ids_sglang_sampling_params_logprobs_and_an_attempt_rid():
    fake = FakeSGLang()
    async with fake.running() as url, SGLangHTTPEngine(url, FAST) as engine:
        await engine.generate(PROMPT, SamplingParams(max_new_tokens=7, temperature=0.5, seed=9), "req-1")
    [body] = fake.generates
    assert body["input_ids"] == PROMPT
    assert body["sampling_params"] == {
        "max_new_tokens": 7,
        "temperature": 0.5,
        "top_p": 1.0,
        "top_k": -1,
        "stop_token_ids": [],
        "skip_special_tokens": False,
        "no_stop_trim": True,
        "sampling_seed": 9,
    }
    assert body["return_logprob"] is True
    assert body["stream"] is False
    assert body["rid"] == "req-1#1"


async def test_generate_sends_stop_token_ids_and_no_top_k_cut_as_minus_one():
    fake = FakeSGLang()
    async with fake.running() as url, SGLangHTTPEngine(url, FAST) as engine:
        await engine.generate(PROMPT, sampling(), "r")
    params = fake.generates[0]["sampling_params"]
    assert params["stop_token_ids"] == [2]
    assert params["top_k"] == -1
    assert "sampling_seed" not in params


def recorded(name: str) -> Any:
    """The body of a response recorded from a real SGLang (``tests/fixtures/record_sglang.py``)."""
    return json.loads((FIXTURES / f"{name}.json").read_text())["body"]


async def test_recorded_sglang_response_parses_into_a_generation_with_the_clients_version():
    sglangs = recorded("generate_logprob")
    fake = FakeSGLang(lambda body, n: sglangs)
    async with fake.running() as url, SGLangHTTPEngine(url, FAST) as engine:
        engine.weight_version = 4  # the fixture says "default": the client's own version stands
        generation = await engine.generate(PROMPT, sampling(8), "r")
    triples = sglangs["meta_info"]["output_token_logprobs"]
    assert generation.output_ids == sglangs["output_ids"] == [token for _, token, _ in triples]
    assert generation.output_logprobs == [logprob for logprob, _, _ in triples]
    assert generation.finish_reason == "length"
    assert generation.weight_version == 4
    assert generation.output_weight_versions == [4] * 8
    assert generation.meta["id"] == sglangs["meta_info"]["id"]
    assert "output_token_logprobs" not in generation.meta


async def test_a_recorded_generation_that_stops_at_the_eos_keeps_it_in_the_output():
    sglangs = recorded("generate_stop_eos")
    fake = FakeSGLang(lambda body, n: sglangs)
    async with fake.running() as url, SGLangHTTPEngine(url, FAST) as engine:
        generation = await engine.generate(PROMPT, sampling(200), "r")
    assert sglangs["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}
    assert generation.finish_reason == "stop"
    assert generation.output_ids[-1] == 2


async def test_a_numbered_weight_version_in_the_response_is_read_and_raises_the_clients_version():
    fake = FakeSGLang(lambda body, n: output([5, 2], version="step_7"))
    async with fake.running() as url, SGLangHTTPEngine(url, FAST) as engine:
        generation = await engine.generate(PROMPT, sampling(), "r")
        assert engine.weight_version == 7
    assert generation.weight_version == 7
    assert generation.output_weight_versions == [7, 7]


async def test_a_malformed_response_raises_an_engine_error_naming_the_server_without_retrying():
    def mismatched(body: dict[str, Any], n: int) -> dict[str, Any]:
        answer = output([5, 6])
        answer["meta_info"]["output_token_logprobs"] = answer["meta_info"]["output_token_logprobs"][:1]
        return answer

    fake = FakeSGLang(mismatched)
    async with fake.running() as url, SGLangHTTPEngine(url, FAST) as engine:
        with pytest.raises(EngineError, match=r"1 output_token_logprobs for 2 output_ids") as error:
            await engine.generate(PROMPT, sampling(), "r")
    assert url in str(error.value)
    assert not isinstance(error.value, ServerUnavailableError)
    assert len(fake.generates) == 1


# ----- failures and retries --------------------------------------------------------------------------


async def test_503_429_and_408_are_retried_each_with_its_own_wire_rid_until_one_succeeds():
    answers = [status(503), status(429), status(408)]
    fake = FakeSGLang(lambda body, n: answers[n] if n < len(answers) else output([5, 2]))
    async with fake.running() as url, SGLangHTTPEngine(url, FAST) as engine:
        generation = await engine.generate(PROMPT, sampling(), "r")
    assert generation.output_ids == [5, 2]
    assert [body["rid"] for body in fake.generates] == ["r#1", "r#2", "r#3", "r#4"]
    assert all(body["input_ids"] == PROMPT for body in fake.generates)


@pytest.mark.parametrize("code", [500, 502, 504])
async def test_5xx_is_retried(code: int):
    fake = FakeSGLang(lambda body, n: status(code) if n == 0 else output([5, 2]))
    async with fake.running() as url, SGLangHTTPEngine(url, FAST) as engine:
        generation = await engine.generate(PROMPT, sampling(), "r")
    assert generation.finish_reason == "stop"
    assert len(fake.generates) == 2


async def test_a_400_fails_at_once_with_the_servers_message():
    fake = FakeSGLang(lambda body, n: status(400, "The input_ids [99999] contains values greater than the vocab size"))
    async with fake.running() as url, SGLangHTTPEngine(url, FAST) as engine:
        with pytest.raises(EngineError, match=r"HTTP 400.*contains values greater than the vocab size") as error:
            await engine.generate(PROMPT, sampling(), "r")
    assert not isinstance(error.value, ServerUnavailableError)
    assert len(fake.generates) == 1


async def test_a_server_that_keeps_answering_503_is_given_up_after_max_retries_plus_one_attempts():
    fake = FakeSGLang(lambda body, n: status(503, "overloaded"))
    async with fake.running() as url, SGLangHTTPEngine(url, config(max_retries=2)) as engine:
        with pytest.raises(ServerUnavailableError, match=r"request r failed after 3 attempts.*503"):
            await engine.generate(PROMPT, sampling(), "r")
    assert len(fake.generates) == 3


async def test_connection_refused_raises_server_unavailable_after_max_retries_plus_one_attempts():
    url = f"http://127.0.0.1:{closed_port()}"
    async with SGLangHTTPEngine(url, config(max_retries=2)) as engine:
        with pytest.raises(ServerUnavailableError, match=r"failed after 3 attempts.*Connection refused") as error:
            await engine.generate(PROMPT, sampling(), "r")
    assert url in str(error.value)
    assert engine.in_flight == 0


async def test_a_response_past_timeout_s_is_retried_and_the_timed_out_wire_rid_is_aborted():
    aborted = asyncio.Event()

    async def hang_first(body: dict[str, Any], n: int) -> Any:
        if n == 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(aborted.wait(), 5)
        return output([5, 2])

    fake = FakeSGLang(hang_first, control={"/abort_request": lambda body: aborted.set() or web.Response()})
    async with fake.running() as url, SGLangHTTPEngine(url, config(timeout_s=0.3)) as engine:
        generation = await engine.generate(PROMPT, sampling(), "r")
    assert generation.output_ids == [5, 2]
    assert fake.paths() == ["/generate", "/abort_request", "/generate"]
    assert fake.requests[1][2] == {"rid": "r#1", "abort_all": False}
    assert fake.generates[1]["rid"] == "r#2"


async def test_a_connection_dropped_in_the_middle_of_the_response_body_is_retried():
    fake = FakeSGLang()

    async def drop_first(body: dict[str, Any], n: int) -> web.StreamResponse:
        if n > 0:
            return web.json_response(output([5, 2]))
        request = fake.current  # read before the first await
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.content_length = 4096
        await response.prepare(request)
        await response.write(b'{"text": "par')
        request.transport.close()
        return response

    fake.on_generate = drop_first
    async with fake.running() as url, SGLangHTTPEngine(url, FAST) as engine:
        generation = await engine.generate(PROMPT, sampling(), "r")
    assert generation.output_ids == [5, 2]
    assert len(fake.generates) == 2


async def test_a_server_that_never_accepts_the_connection_fails_after_connect_timeout_s():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []  # fill the accept queue: further SYNs are dropped and connect() hangs
    for _ in range(3):
        filler = socket.socket()
        filler.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            filler.connect(("127.0.0.1", port))
        fillers.append(filler)
    try:
        slow = config(timeout_s=30.0, connect_timeout_s=0.2, max_retries=0)
        async with SGLangHTTPEngine(f"http://127.0.0.1:{port}", slow) as engine:
            with pytest.raises(ServerUnavailableError):
                await asyncio.wait_for(engine.generate(PROMPT, sampling(), "r"), 2.0)
    finally:
        for sock in [*fillers, listener]:
            sock.close()


# ----- aborts and resumes ------------------------------------------------------------------------------


async def test_a_server_side_abort_is_resumed_from_the_partial_tokens_with_the_remaining_budget():
    answers = [output([5, 6], "abort", version="1"), output([7, 2], "stop", version="2")]
    fake = FakeSGLang(lambda body, n: answers[n])
    async with fake.running() as url, SGLangHTTPEngine(url, FAST) as engine:
        generation = await engine.generate(PROMPT, sampling(10), "r")
        assert engine.weight_version == 2
    first, second = fake.generates
    assert second["input_ids"] == [*PROMPT, 5, 6]
    assert second["sampling_params"]["max_new_tokens"] == 8
    assert first["rid"] != second["rid"]
    assert generation.output_ids == [5, 6, 7, 2]
    assert generation.output_logprobs == [-0.5, -0.51, -0.5, -0.51]
    assert generation.output_weight_versions == [1, 1, 2, 2]
    assert generation.finish_reason == "stop"
    assert generation.weight_version == 2
    assert generation.meta["resumes"] == 1


async def test_an_abort_requested_through_the_engine_is_sent_with_the_wire_rid_and_not_resumed():
    aborted = asyncio.Event()

    async def until_aborted(body: dict[str, Any], n: int) -> dict[str, Any]:
        await asyncio.wait_for(aborted.wait(), 5)
        return output([5, 6], "abort")

    fake = FakeSGLang(until_aborted, control={"/abort_request": lambda body: aborted.set() or web.Response()})
    async with fake.running() as url, SGLangHTTPEngine(url, FAST) as engine:
        task = asyncio.create_task(engine.generate(PROMPT, sampling(), "r"))
        await wait_until(lambda: len(fake.generates) == 1)
        await engine.abort("r")
        generation = await task
    assert generation.finish_reason == "abort"
    assert generation.output_ids == [5, 6]
    assert len(fake.generates) == 1
    assert ("POST", "/abort_request", {"rid": "r#1", "abort_all": False}) in fake.requests


async def test_max_resumes_is_honoured_and_the_generation_returned_as_aborted():
    fake = FakeSGLang(lambda body, n: output([7], "abort"))
    async with fake.running() as url, SGLangHTTPEngine(url, config(max_resumes=2)) as engine:
        generation = await engine.generate(PROMPT, sampling(10), "r")
    assert len(fake.generates) == 3
    assert [body["sampling_params"]["max_new_tokens"] for body in fake.generates] == [10, 9, 8]
    assert generation.output_ids == [7, 7, 7]
    assert generation.finish_reason == "abort"
    assert generation.meta["resumes"] == 2


async def test_an_abort_that_used_the_whole_budget_is_not_resumed():
    fake = FakeSGLang(lambda body, n: output([7, 8, 9], "abort"))
    async with fake.running() as url, SGLangHTTPEngine(url, FAST) as engine:
        generation = await engine.generate(PROMPT, sampling(3), "r")
    assert len(fake.generates) == 1
    assert generation.output_ids == [7, 8, 9]


async def test_an_abort_during_a_retry_backoff_ends_the_generation_as_aborted(monkeypatch):
    monkeypatch.setattr(random, "uniform", lambda low, high: high)  # no jitter: back off the full 0.3 s
    fake = FakeSGLang(lambda body, n: status(503) if n == 0 else output([5, 6, 2]))
    async with fake.running() as url, SGLangHTTPEngine(url, config(backoff_s=0.3, backoff_max_s=0.3)) as engine:
        task = asyncio.create_task(engine.generate(PROMPT, sampling(), "r"))
        await wait_until(lambda: len(fake.generates) == 1)
        await asyncio.sleep(0.05)
        await engine.abort("r")
        generation = await task
    assert generation.finish_reason == "abort"
    assert len(fake.generates) == 1


# ----- control endpoints -----------------------------------------------------------------------------

CONTROL_CALLS = [
    (
        lambda engine: engine.update_weights_from_disk("/ckpt/step_3", 3),
        "POST",
        "/update_weights_from_disk",
        {"model_path": "/ckpt/step_3", "weight_version": "3", "abort_all_requests": False},
    ),
    (lambda engine: engine.pause_generation(), "POST", "/pause_generation", {"mode": "abort"}),
    (lambda engine: engine.continue_generation(), "POST", "/continue_generation", {}),
    (lambda engine: engine.flush_cache(), "POST", "/flush_cache", None),
    (lambda engine: engine.release_memory_occupation(), "POST", "/release_memory_occupation", {}),
    (lambda engine: engine.resume_memory_occupation(), "POST", "/resume_memory_occupation", {}),
    (lambda engine: engine.abort(), "POST", "/abort_request", {"rid": "", "abort_all": True}),
    (lambda engine: engine.get_model_info(), "GET", "/get_model_info", None),
    (lambda engine: engine.get_server_info(), "GET", "/get_server_info", None),
    (lambda engine: engine.health(), "GET", "/health", None),
]
CONTROL_IDS = [
    path.strip("/") + ("_all" if body and body.get("abort_all") else "") for _, _, path, body in CONTROL_CALLS
]


@pytest.mark.parametrize(("call", "method", "path", "body"), CONTROL_CALLS, ids=CONTROL_IDS)
async def test_control_call_hits_its_sglang_endpoint_with_sglangs_body(call, method, path, body):
    fake = FakeSGLang()
    async with fake.running() as url, SGLangHTTPEngine(url, FAST) as engine:
        await call(engine)
    assert fake.requests == [(method, path, body)]


async def test_update_weights_from_disk_sets_the_clients_weight_version():
    fake = FakeSGLang()
    async with fake.running() as url, SGLangHTTPEngine(url, FAST) as engine:
        assert await engine.update_weights_from_disk("/ckpt/step_3", 3) == 3
        assert engine.weight_version == 3


@pytest.mark.parametrize("code", [400, 200])
async def test_a_failed_weight_update_raises_with_the_servers_message_and_keeps_the_version(code: int):
    failed = {"success": False, "message": "no safetensors at /ckpt/x", "num_paused_requests": 0}
    fake = FakeSGLang(control={"/update_weights_from_disk": lambda body: web.json_response(failed, status=code)})
    async with fake.running() as url, SGLangHTTPEngine(url, FAST) as engine:
        with pytest.raises(EngineError, match=r"no safetensors at /ckpt/x"):
            await engine.update_weights_from_disk("/ckpt/x", 5)
        assert engine.weight_version == 0


@pytest.mark.parametrize(("reported", "version"), [("3", 3), ("step_3", 3), ("default", None)])
async def test_get_weight_version_reads_get_model_info(reported: str, version: int | None):
    fake = FakeSGLang()
    fake.weight_version = reported
    async with fake.running() as url, SGLangHTTPEngine(url, FAST) as engine:
        assert await engine.get_weight_version() == version


async def test_sync_weights_from_disk_pauses_updates_then_continues():
    fake = FakeSGLang()
    async with fake.running() as url, SGLangHTTPEngine(url, FAST) as engine:
        assert await engine.sync_weights_from_disk("/ckpt/step_4", 4) == 4
    assert fake.paths() == ["/pause_generation", "/update_weights_from_disk", "/continue_generation"]


async def test_sync_weights_from_disk_continues_generation_even_when_the_update_fails():
    failed = {"success": False, "message": "shape mismatch", "num_paused_requests": 0}
    fake = FakeSGLang(control={"/update_weights_from_disk": lambda body: web.json_response(failed, status=400)})
    async with fake.running() as url, SGLangHTTPEngine(url, FAST) as engine:
        with pytest.raises(EngineError, match="shape mismatch"):
            await engine.sync_weights_from_disk("/ckpt/step_4", 4)
    assert fake.paths() == ["/pause_generation", "/update_weights_from_disk", "/continue_generation"]


async def test_control_calls_are_retried_on_503():
    answers = iter([status(503), {"message": "ok", "status": "ok"}])
    fake = FakeSGLang(control={"/pause_generation": lambda body: next(answers)})
    async with fake.running() as url, SGLangHTTPEngine(url, FAST) as engine:
        await engine.pause_generation()
    assert fake.paths() == ["/pause_generation", "/pause_generation"]


async def test_health_is_false_when_the_server_is_unreachable():
    async with SGLangHTTPEngine(f"http://127.0.0.1:{closed_port()}", FAST) as engine:
        assert await engine.health() is False


async def test_the_api_key_is_sent_as_a_bearer_token():
    fake = FakeSGLang()
    async with fake.running() as url, SGLangHTTPEngine(url, config(api_key="sekret")) as engine:
        await engine.generate(PROMPT, sampling(), "r")
        await engine.flush_cache()
    assert [headers["Authorization"] for headers in fake.headers] == ["Bearer sekret", "Bearer sekret"]


# ----- concurrency and lifetime ------------------------------------------------------------------------


async def test_2000_requests_are_all_in_flight_at_once_and_all_complete():
    counts = {"now": 0, "max": 0}

    async def slow(body: dict[str, Any], n: int) -> dict[str, Any]:
        counts["now"] += 1
        counts["max"] = max(counts["max"], counts["now"])
        try:
            await asyncio.sleep(0.2)
        finally:
            counts["now"] -= 1
        return output([body["input_ids"][0], 2])

    fake = FakeSGLang(slow)
    async with fake.running() as url, SGLangHTTPEngine(url, config(timeout_s=30.0)) as engine:
        generations = await asyncio.gather(*(engine.generate([i + 3], sampling(), f"r{i}") for i in range(2000)))
        assert engine.in_flight == 0
    assert [g.output_ids[0] for g in generations] == [i + 3 for i in range(2000)]
    assert counts["max"] == 2000
    assert len(fake.generates) == 2000


async def test_using_the_engine_outside_async_with_raises_a_clear_engine_error():
    engine = SGLangHTTPEngine("http://127.0.0.1:30000", FAST)
    with pytest.raises(EngineError, match=r"is not open: use it inside 'async with engine:'"):
        await engine.generate(PROMPT, sampling(), "r")
    with pytest.raises(EngineError, match=r"async with"):
        await engine.flush_cache()


@pytest.mark.parametrize("url", ["127.0.0.1:30000", "localhost", "ftp://host:1", ""])
def test_an_engine_url_without_http_scheme_is_rejected(url: str):
    with pytest.raises(ValueError, match=r"must start with http:// or https://"):
        SGLangHTTPEngine(url)


def test_a_trailing_slash_in_the_url_is_dropped():
    assert SGLangHTTPEngine("http://127.0.0.1:30000/").url == "http://127.0.0.1:30000"


async def test_update_weights_with_a_state_dict_says_to_save_and_sync_from_disk():
    async with SGLangHTTPEngine("http://127.0.0.1:30000", FAST) as engine:
        with pytest.raises(EngineError, match=r"sync_weights_from_disk"):
            await engine.update_weights({})


async def test_a_stop_token_in_the_last_allowed_slot_is_a_stop_as_in_process(tokenizer):
    """SGLang (and rallyrl serve) check the length before the stop token, so a turn whose stop
    token is its last allowed token comes back as "length"; the client reports it as the stop
    it is, as the embedded engine in-process does."""
    from rollout.tokens import ChatTokenizer
    from tests.conftest import ScriptedEngine, serving

    chat = ChatTokenizer(tokenizer)
    model = ScriptedEngine(chat, lambda turn, prompt, rid: "hi")
    budget = len(chat.encode("hi")) + 1
    async with serving(model) as url, SGLangHTTPEngine(url) as client:
        exact = SamplingParams(max_new_tokens=budget, stop_token_ids=chat.stop_token_ids)
        generation = await client.generate(chat.encode("q"), exact, "r1")
        assert generation.finish_reason == "stop" and generation.output_ids[-1] in chat.stop_token_ids
        cut = await client.generate(chat.encode("q"), SamplingParams(max_new_tokens=budget - 1), "r2")
        assert cut.finish_reason == "length"
