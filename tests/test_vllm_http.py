"""VLLMHTTPEngine against a small vLLM double served on loopback: what it sends to /v1/completions,
what it reads back, how it retries, aborts, resumes and syncs weights, and how ``--engine-url``
tells vLLM from SGLang. The real server is in ``tests/real_engines/test_vllm.py``."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import re
import socket
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
from aiohttp import web
from safetensors import safe_open

from rollout.engines.base import EngineError, FlushesCache, LoadsWeightsFromDisk, SamplingParams
from rollout.engines.config import PoolConfig, SGLangHTTPConfig
from rollout.engines.pool import EnginePool, ServerUnavailableError, detect_server, open_servers
from rollout.engines.sglang_http import SGLangHTTPEngine
from rollout.engines.vllm_http import VLLMHTTPEngine
from rollout.engines.vllm_protocol import logprobs_problem, tied_lm_head_view

MODEL = "/models/qwen"
PROMPT = [11, 12, 13]
FAST = SGLangHTTPConfig(backoff_s=0.01, backoff_max_s=0.02, max_retries=3, timeout_s=5.0, control_timeout_s=5.0)


def sampling(max_new_tokens: int = 10, **changes: Any) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=[2], **changes)


def completion(ids: list[int], finish: str = "stop", stop_reason: int | None = None, rid: str = "r") -> dict:
    """A /v1/completions response in vLLM 0.32's shape (logprob -0.5 - i/100 for token i)."""
    logprobs = [-0.5 - i / 100 for i in range(len(ids))]
    tokens = [f"token_id:{t}" for t in ids]
    return {
        "id": f"cmpl-{rid}", "object": "text_completion", "created": 0, "model": MODEL,
        "choices": [{
            "index": 0, "text": "", "finish_reason": finish, "stop_reason": stop_reason, "token_ids": ids,
            "prompt_token_ids": PROMPT, "prompt_logprobs": None,
            "logprobs": {"text_offset": list(range(len(ids))), "token_logprobs": logprobs, "tokens": tokens,
                         "top_logprobs": [{t: lp} for t, lp in zip(tokens, logprobs, strict=True)]},
        }],
        "usage": {"prompt_tokens": 3, "total_tokens": 3 + len(ids), "completion_tokens": len(ids),
                  "prompt_tokens_details": None},
    }  # fmt: skip


def status(code: int, message: str = "") -> web.Response:
    return web.json_response({"error": {"message": message or f"HTTP {code}", "code": code}}, status=code)


def closed_port() -> int:
    """A loopback port with nothing listening on it."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def wait_until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the test server"
        await asyncio.sleep(0.005)


class FakeVLLM:
    """A vLLM 0.32 server double that records every request. ``/v1/completions`` is answered by
    ``on_complete(body, n)`` (n counts completions from 0; a dict is sent as JSON, a response as is,
    awaitables awaited). ``dev`` serves the development endpoints (VLLM_SERVER_DEV_MODE=1)."""

    def __init__(self, on_complete: Callable[[dict, int], Any] | None = None, *, dev: bool = True,
                 logprobs_mode: str = "processed_logprobs", device: str = "cpu", max_model_len: int = 64,
                 lora_config: dict | None = None, env: dict | None = None):  # fmt: skip
        self.on_complete = on_complete or (lambda body, n: completion([5, 6, 2]))
        self.lora_config, self.env = lora_config, env or {}
        self.dev, self.logprobs_mode, self.device, self.max_model_len = dev, logprobs_mode, device, max_model_len
        self.control: dict[str, Callable[[Any], Any]] = {}
        self.requests: list[tuple[str, str, Any]] = []  # (method, path with query, JSON body or None)
        self.weight_version = "default"

    @property
    def completions(self) -> list[dict[str, Any]]:
        return [body for _, path, body in self.requests if path == "/v1/completions"]

    def control_calls(self) -> list[str]:
        """The paths called besides completions and the one-time reads of the server's settings."""
        reads = ("/v1/models", "/server_info?config_format=json", "/weight_info", "/v1/completions")
        return [path for _, path, _ in self.requests if path not in reads]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = orjson.loads(raw) if raw else None
        path = request.path_qs
        self.requests.append((request.method, path, body))
        dev_only = {"/server_info", "/weight_info", "/pause", "/resume", "/abort_requests", "/collective_rpc",
                    "/reset_prefix_cache", "/update_weight_version"}  # fmt: skip
        if request.path in dev_only and not self.dev:
            return web.json_response({"detail": "Not Found"}, status=404)
        if request.path == "/v1/completions":
            answer = self.on_complete(body, len(self.completions) - 1)
        elif request.path in self.control:
            answer = self.control[request.path](body)
        elif request.path == "/v1/models":
            answer = {"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": self.max_model_len}]}
        elif request.path == "/version":
            answer = {"version": "0.32.0"}
        elif request.path == "/server_info":
            config = {"model_config": {"logprobs_mode": self.logprobs_mode}, "device_config": {"device": self.device},
                      "lora_config": self.lora_config}  # fmt: skip
            answer = {"vllm_config": config, "vllm_env": self.env, "system_env": {}}
        elif request.path == "/weight_info":
            answer = {"weight_version": self.weight_version}
        elif request.path == "/update_weight_version":
            self.weight_version = body["new_version"]
            answer = {"success": True, "new_version": body["new_version"]}
        elif request.path == "/reset_prefix_cache":
            answer = {"success": True}
        elif request.path.endswith("_lora_adapter") and self.env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING"):
            answer = web.Response(text=f"Success: LoRA adapter '{body['lora_name']}' done.")
        elif request.path in ("/health", "/collective_rpc"):
            answer = web.Response()
        elif request.path in ("/pause", "/resume", "/abort_requests"):
            answer = {"status": "ok"}
        else:
            answer = web.json_response({"detail": "Not Found"}, status=404)
        if inspect.isawaitable(answer):
            answer = await answer
        return answer if isinstance(answer, web.StreamResponse) else web.json_response(answer)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[str]:
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self.handle)
        runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            yield f"http://127.0.0.1:{runner.addresses[0][1]}"
        finally:
            await runner.cleanup()


# ----- the request and the response ----------------------------------------------------------------


async def test_generate_posts_token_ids_every_sampling_parameter_and_an_attempt_request_id():
    fake = FakeVLLM()
    async with fake.running() as url, VLLMHTTPEngine(url, FAST) as engine:
        await engine.generate(PROMPT, sampling(7, temperature=0.5, seed=9), "req-1")
    [body] = fake.completions
    assert body == {
        "model": MODEL, "prompt": PROMPT, "max_tokens": 7, "temperature": 0.5, "top_p": 1.0, "top_k": 0,
        "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
        "stop_token_ids": [2], "logprobs": 0, "return_token_ids": True, "return_tokens_as_token_ids": True,
        "skip_special_tokens": False, "add_special_tokens": False, "request_id": "req-1#1", "n": 1,
        "stream": False, "seed": 9,
    }  # fmt: skip


async def test_a_generation_that_stopped_on_eos_ends_with_it_and_carries_each_tokens_logprob():
    fake = FakeVLLM(lambda body, n: completion([5, 6, 2]))
    async with fake.running() as url, VLLMHTTPEngine(url, FAST) as engine:
        generation = await engine.generate(PROMPT, sampling(), "r")
    assert generation.output_ids == [5, 6, 2]
    assert generation.output_logprobs == [-0.5, -0.51, -0.52]
    assert generation.finish_reason == "stop"
    assert generation.output_weight_versions == [0, 0, 0]
    assert generation.meta["completion_tokens"] == 3 and generation.meta["resumes"] == 0


@pytest.mark.parametrize(("finish", "stop_reason", "expected"), [("stop", 2, "stop"), ("length", None, "length")])
async def test_vllms_finish_reasons_map_onto_the_engines(finish, stop_reason, expected):
    fake = FakeVLLM(lambda body, n: completion([5, 6, 2] if finish == "stop" else [5, 6, 7], finish, stop_reason))
    async with fake.running() as url, VLLMHTTPEngine(url, FAST) as engine:
        generation = await engine.generate(PROMPT, sampling(3), "r")
    assert generation.finish_reason == expected


async def test_a_stop_token_in_the_last_allowed_slot_is_stop_not_length():
    fake = FakeVLLM(lambda body, n: completion([5, 2], "length"))
    async with fake.running() as url, VLLMHTTPEngine(url, FAST) as engine:
        generation = await engine.generate(PROMPT, sampling(2), "r")
    assert generation.finish_reason == "stop"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c["choices"][0].update(finish_reason="repetition"), "'repetition' is not stop, length or abort"),
        (lambda c: c["choices"][0]["logprobs"]["tokens"].reverse(), r"tokens\[0\] 'token_id:2' does not match"),
        (lambda c: c["choices"][0].pop("token_ids"), "token_ids must be a list of token ids"),
        (lambda c: c["choices"][0].update(stop_reason=9), "stopped on token 9, which does not end token_ids"),
    ],
)
async def test_a_malformed_completion_fails_at_once_naming_the_server_and_the_fault(change, message):
    def answer(body: dict, n: int) -> dict:
        broken = completion([5, 6, 2])
        change(broken)
        return broken

    fake = FakeVLLM(answer)
    async with fake.running() as url, VLLMHTTPEngine(url, FAST) as engine:
        with pytest.raises(EngineError, match=message) as error:
            await engine.generate(PROMPT, sampling(), "r")
    assert url in str(error.value) and not isinstance(error.value, ServerUnavailableError)
    assert len(fake.completions) == 1


async def test_max_tokens_is_capped_to_the_servers_context():
    fake = FakeVLLM(max_model_len=10)
    async with fake.running() as url, VLLMHTTPEngine(url, FAST) as engine:
        await engine.generate(PROMPT, sampling(100), "r")
    assert fake.completions[0]["max_tokens"] == 7


async def test_a_prompt_that_fills_the_context_is_length_with_no_tokens_and_no_request():
    fake = FakeVLLM(max_model_len=3)
    async with fake.running() as url, VLLMHTTPEngine(url, FAST) as engine:
        generation = await engine.generate(PROMPT, sampling(), "r")
    assert (generation.output_ids, generation.finish_reason) == ([], "length")
    assert fake.completions == []


# ----- failures and retries --------------------------------------------------------------------------


async def test_503_429_408_and_500_are_retried_each_attempt_its_own_request_id():
    answers = [status(503), status(429), status(408), status(500)]
    fake = FakeVLLM(lambda body, n: answers[n] if n < len(answers) else completion([5, 2]))
    async with fake.running() as url, VLLMHTTPEngine(url, config(max_retries=4)) as engine:
        generation = await engine.generate(PROMPT, sampling(), "r")
    assert generation.output_ids == [5, 2]
    assert [body["request_id"] for body in fake.completions] == ["r#1", "r#2", "r#3", "r#4", "r#5"]


async def test_a_400_fails_at_once_with_vllms_message():
    message = "max_tokens=3000 cannot be greater than max_model_len=2048."
    fake = FakeVLLM(lambda body, n: status(400, message))
    async with fake.running() as url, VLLMHTTPEngine(url, FAST) as engine:
        with pytest.raises(EngineError, match=r"HTTP 400.*cannot be greater than max_model_len") as error:
            await engine.generate(PROMPT, sampling(), "r")
    assert not isinstance(error.value, ServerUnavailableError)
    assert len(fake.completions) == 1


async def test_connection_refused_raises_server_unavailable_after_max_retries_plus_one_attempts():
    url = f"http://127.0.0.1:{closed_port()}"
    async with VLLMHTTPEngine(url, config(max_retries=2)) as engine:
        with pytest.raises(ServerUnavailableError, match="failed after 3 attempts") as error:
            await engine.generate(PROMPT, sampling(), "r")
    assert url in str(error.value) and engine.in_flight == 0


async def test_a_response_past_timeout_s_is_retried_and_the_timed_out_request_is_aborted_on_the_server():
    aborted = asyncio.Event()

    async def hang_first(body: dict, n: int) -> dict:
        if n == 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(aborted.wait(), 5)
        return completion([5, 2])

    fake = FakeVLLM(hang_first)
    fake.control["/abort_requests"] = lambda body: aborted.set() or {"status": "aborted"}
    async with fake.running() as url, VLLMHTTPEngine(url, config(timeout_s=0.3)) as engine:
        generation = await engine.generate(PROMPT, sampling(), "r")
    assert generation.output_ids == [5, 2]
    assert fake.control_calls() == ["/abort_requests"]
    assert [body for _, path, body in fake.requests if path == "/abort_requests"] == [{"request_ids": ["cmpl-r#1-0"]}]


# ----- aborts, resumes and weight syncs ----------------------------------------------------------------


async def test_abort_by_rid_posts_vllms_own_request_id_and_the_generation_is_not_resumed():
    release = asyncio.Event()

    async def until_aborted(body: dict, n: int) -> dict:
        await release.wait()
        return completion([5, 6], "abort", rid=body["request_id"])

    fake = FakeVLLM(until_aborted)
    fake.control["/abort_requests"] = lambda body: release.set() or {"status": "aborted", "aborted": 1}
    async with fake.running() as url, VLLMHTTPEngine(url, FAST) as engine:
        task = asyncio.create_task(engine.generate(PROMPT, sampling(), "r"))
        await wait_until(lambda: len(fake.completions) == 1)
        await engine.abort("r")
        generation = await task
    assert (generation.output_ids, generation.finish_reason) == ([5, 6], "abort")
    assert [body for _, path, body in fake.requests if path == "/abort_requests"] == [{"request_ids": ["cmpl-r#1-0"]}]
    assert len(fake.completions) == 1


async def test_without_development_endpoints_abort_closes_the_requests_connection():
    disconnected = asyncio.Event()

    async def until_disconnected(body: dict, n: int) -> dict:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:  # aiohttp cancels the handler when its client goes away
            disconnected.set()
            raise
        return completion([5, 2])

    fake = FakeVLLM(until_disconnected, dev=False)
    async with fake.running() as url, VLLMHTTPEngine(url, FAST) as engine:
        task = asyncio.create_task(engine.generate(PROMPT, sampling(), "r"))
        await wait_until(lambda: len(fake.completions) == 1)
        await engine.abort("r")
        generation = await asyncio.wait_for(task, 2)
        await asyncio.wait_for(disconnected.wait(), 2)
    assert (generation.output_ids, generation.finish_reason) == ([], "abort")


async def test_abort_of_every_request_asks_vllm_for_all_and_none_is_resumed():
    release = asyncio.Event()

    async def until_aborted(body: dict, n: int) -> dict:
        await release.wait()
        return completion([5], "abort")

    fake = FakeVLLM(until_aborted)
    fake.control["/abort_requests"] = lambda body: release.set() or {"status": "aborted"}
    async with fake.running() as url, VLLMHTTPEngine(url, FAST) as engine:
        tasks = [asyncio.create_task(engine.generate(PROMPT, sampling(), f"r{i}")) for i in range(3)]
        await wait_until(lambda: len(fake.completions) == 3)
        await engine.abort()
        generations = await asyncio.gather(*tasks)
    assert [g.finish_reason for g in generations] == ["abort"] * 3
    assert [body for _, path, body in fake.requests if path == "/abort_requests"] == [{}]
    assert len(fake.completions) == 3


async def test_a_request_aborted_by_a_weight_sync_resumes_after_it_and_each_token_keeps_its_version(tmp_path):
    weights = save_tied_checkpoint(tmp_path)
    paused = asyncio.Event()

    async def answer(body: dict, n: int) -> dict:
        if n == 0:  # in flight when the sync pauses the server
            await paused.wait()
            return completion([5, 6], "abort")
        return completion([7, 2])

    fake = FakeVLLM(answer)
    fake.control["/pause"] = lambda body: paused.set() or {"status": "paused"}
    async with fake.running() as url, VLLMHTTPEngine(url, FAST) as engine:
        task = asyncio.create_task(engine.generate(PROMPT, sampling(10), "r"))
        await wait_until(lambda: len(fake.completions) == 1)
        assert await engine.sync_weights_from_disk(str(weights), 3) == 3
        generation = await task
    assert generation.output_ids == [5, 6, 7, 2]
    assert generation.output_weight_versions == [0, 0, 3, 3]
    assert (generation.finish_reason, generation.weight_version, generation.meta["resumes"]) == ("stop", 3, 1)
    resumed = fake.completions[1]
    assert resumed["prompt"] == [*PROMPT, 5, 6] and resumed["max_tokens"] == 8


async def test_weight_sync_pauses_reloads_from_the_directory_resets_the_cache_names_the_version_and_resumes(tmp_path):
    weights = save_tied_checkpoint(tmp_path)
    fake = FakeVLLM(device="cuda")
    async with fake.running() as url, VLLMHTTPEngine(url, FAST) as engine:
        await engine.sync_weights_from_disk(str(weights), 4)
        assert await engine.get_weight_version() == 4
        generation = await engine.generate(PROMPT, sampling(), "r")
    assert fake.control_calls() == [
        "/pause?mode=abort", "/collective_rpc", "/reset_prefix_cache", "/update_weight_version", "/resume"
    ]  # fmt: skip
    rpc = next(body for _, path, body in fake.requests if path == "/collective_rpc")
    assert rpc == {"method": "reload_weights", "kwargs": {"weights_path": str(weights)}}  # GPU: the tied weight
    assert generation.output_weight_versions == [4, 4, 4]


async def test_generation_waits_while_a_weight_sync_runs(tmp_path):
    weights = save_tied_checkpoint(tmp_path)
    reloading, finish_reload = asyncio.Event(), asyncio.Event()

    async def slow_reload(body: Any) -> web.Response:
        reloading.set()
        await finish_reload.wait()
        return web.Response()

    fake = FakeVLLM(device="cuda")
    fake.control["/collective_rpc"] = slow_reload
    async with fake.running() as url, VLLMHTTPEngine(url, FAST) as engine:
        await engine.server_info()
        sync = asyncio.create_task(engine.sync_weights_from_disk(str(weights), 1))
        await reloading.wait()
        generate = asyncio.create_task(engine.generate(PROMPT, sampling(), "r"))
        await asyncio.sleep(0.1)
        assert fake.completions == []
        finish_reload.set()
        await sync
        generation = await generate
    assert generation.output_weight_versions == [1, 1, 1]
    assert [path for _, path, _ in fake.requests][-2:] == ["/resume", "/v1/completions"]


async def test_a_cpu_server_reloads_a_tied_checkpoint_with_an_explicit_lm_head_from_a_temporary_view(tmp_path):
    weights = save_tied_checkpoint(tmp_path)
    before = sorted(p.name for p in weights.iterdir())
    seen: dict[str, Any] = {}

    def reload(body: dict) -> web.Response:  # what the server reads, while it reads it
        view = Path(body["kwargs"]["weights_path"])
        seen["view"], seen["files"] = view, sorted(p.name for p in view.iterdir())
        with safe_open(str(view / "lm_head.safetensors"), "pt") as head:
            seen["lm_head"] = head.get_tensor("lm_head.weight")
        return web.Response()

    fake = FakeVLLM(device="cpu")
    fake.control["/collective_rpc"] = reload
    async with fake.running() as url, VLLMHTTPEngine(url, FAST) as engine:
        await engine.sync_weights_from_disk(str(weights), 1)
    with safe_open(str(weights / "model.safetensors"), "pt") as model:
        assert seen["lm_head"].equal(model.get_tensor("model.embed_tokens.weight"))
    assert seen["view"] != weights and seen["files"] == sorted([*before, "lm_head.safetensors"])
    assert not seen["view"].exists()  # removed after the reload
    assert sorted(p.name for p in weights.iterdir()) == before  # the checkpoint itself is unchanged


def test_a_sharded_tied_checkpoints_view_has_the_lm_head_in_its_index(tmp_path):
    weights = save_tied_checkpoint(tmp_path)
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model.safetensors",
                                            "model.norm.weight": "model.safetensors"}}  # fmt: skip
    (weights / "model.safetensors.index.json").write_bytes(orjson.dumps(index))
    view = tied_lm_head_view(weights)
    assert view is not None
    written = orjson.loads((view / "model.safetensors.index.json").read_bytes())
    assert written["weight_map"] == {**index["weight_map"], "lm_head.weight": "lm_head.safetensors"}
    assert orjson.loads((weights / "model.safetensors.index.json").read_bytes()) == index


def test_a_checkpoint_with_its_own_lm_head_needs_no_view(tmp_path):
    from safetensors.torch import save_file

    weights = save_tied_checkpoint(tmp_path)
    save_file({"lm_head.weight": torch.zeros(8, 4)}, str(weights / "head.safetensors"))
    assert tied_lm_head_view(weights) is None


async def test_a_missing_weights_directory_is_refused_before_vllm_is_asked_to_reload(tmp_path):
    fake = FakeVLLM()
    async with fake.running() as url, VLLMHTTPEngine(url, FAST) as engine:
        with pytest.raises(EngineError, match="not a model directory"):
            await engine.sync_weights_from_disk(str(tmp_path / "nope"), 1)
    assert fake.control_calls() == []


async def test_a_failed_reload_is_not_retried_and_generation_is_resumed(tmp_path):
    weights = save_tied_checkpoint(tmp_path)
    fake = FakeVLLM(device="cuda")
    fake.control["/collective_rpc"] = lambda body: status(500, "Call to collective_rpc method failed")
    async with fake.running() as url, VLLMHTTPEngine(url, FAST) as engine:
        with pytest.raises(ServerUnavailableError, match=r"reloading weights from .* failed.*collective_rpc"):
            await engine.sync_weights_from_disk(str(weights), 1)
    assert fake.control_calls() == ["/pause?mode=abort", "/collective_rpc", "/resume"]


async def test_a_refused_prefix_cache_reset_is_an_engine_error():
    fake = FakeVLLM()
    fake.control["/reset_prefix_cache"] = lambda body: {"success": False}
    async with fake.running() as url, VLLMHTTPEngine(url, FAST) as engine:
        with pytest.raises(EngineError, match="reset_prefix_cache: vLLM refused"):
            await engine.flush_cache()


async def test_update_weights_with_tensors_names_the_ways_a_vllm_server_takes_weights():
    async with VLLMHTTPEngine("http://127.0.0.1:1", FAST) as engine:
        with pytest.raises(EngineError, match=r"push_weights \(a broadcast, or disk\).*sync_weights_from_disk"):
            await engine.update_weights({}, 1)


def test_the_client_declares_its_abilities_with_the_protocols_signatures():
    engine = VLLMHTTPEngine("http://127.0.0.1:1")
    for ability, method in ((FlushesCache, "flush_cache"), (LoadsWeightsFromDisk, "sync_weights_from_disk")):
        assert isinstance(engine, ability)
        assert inspect.signature(getattr(VLLMHTTPEngine, method)) == inspect.signature(getattr(ability, method))


# ----- logprobs modes ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "changes", "refused"),
    [
        ("processed_logprobs", {"temperature": 0.7}, None),
        ("processed_logprobs", {"temperature": 0.7, "top_p": 0.9}, "renormalises its processed_logprobs"),
        ("processed_logprobs", {"temperature": 0.0, "top_k": 5}, None),
        ("raw_logprobs", {"temperature": 1.0, "top_p": 0.9}, None),
        ("raw_logprobs", {"temperature": 0.7}, "ignore the temperature.*--logprobs-mode processed_logprobs"),
        ("raw_logits", {}, "returns logits"),
        (None, {"temperature": 0.7, "top_k": 5}, None),
    ],
)
def test_a_request_is_refused_when_the_servers_logprobs_mode_would_misreport_its_logprobs(mode, changes, refused):
    problem = logprobs_problem(mode, sampling(**changes))
    assert problem is None if refused is None else re.search(refused, problem or "")


async def test_a_raw_logprobs_server_refuses_tempered_sampling_with_how_to_fix_it():
    fake = FakeVLLM(logprobs_mode="raw_logprobs")
    async with fake.running() as url, VLLMHTTPEngine(url, FAST) as engine:
        with pytest.raises(EngineError, match="--logprobs-mode processed_logprobs"):
            await engine.generate(PROMPT, sampling(temperature=0.6), "r")
    assert fake.completions == []


async def test_without_development_endpoints_generation_works_and_warns_that_the_logprobs_mode_is_unknown(caplog):
    fake = FakeVLLM(dev=False)
    async with fake.running() as url, VLLMHTTPEngine(url, FAST) as engine:
        first = await engine.generate(PROMPT, sampling(temperature=0.6), "r1")
        await engine.generate(PROMPT, sampling(temperature=0.6), "r2")
    assert first.output_ids == [5, 6, 2]
    warnings = [r.getMessage() for r in caplog.records if "logprobs-mode" in r.getMessage()]
    assert len(warnings) == 1 and "VLLM_SERVER_DEV_MODE=1" in warnings[0]


async def test_a_server_info_that_answers_500_is_read_as_absent_once_with_the_reason_in_the_warning(caplog):
    """vLLM's own environment report fails (500) when ``uv`` is not on its PATH: generation goes on."""
    fake = FakeVLLM()
    fake.control["/server_info"] = lambda body: web.Response(status=500, text="Internal Server Error")
    async with fake.running() as url, VLLMHTTPEngine(url, FAST) as engine:
        first = await engine.generate(PROMPT, sampling(temperature=0.6), "r1")
        await engine.generate(PROMPT, sampling(temperature=0.6), "r2")
    assert first.output_ids == [5, 6, 2]
    assert [path for _, path, _ in fake.requests].count("/server_info?config_format=json") == 1  # not retried
    warnings = [r.getMessage() for r in caplog.records if "logprobs-mode" in r.getMessage()]
    assert len(warnings) == 1 and "answered HTTP 500" in warnings[0], warnings


async def test_the_weight_version_a_server_already_has_is_read_when_the_client_starts():
    fake = FakeVLLM()
    fake.weight_version = "5"
    async with fake.running() as url, VLLMHTTPEngine(url, FAST) as engine:
        generation = await engine.generate(PROMPT, sampling(), "r")
    assert generation.weight_version == 5


# ----- which server --------------------------------------------------------------------------------------


async def test_detection_tells_vllm_from_sglang():
    async def model_info(request: web.Request) -> web.Response:
        return web.json_response({"model_path": MODEL})

    sglang = web.Application()
    sglang.router.add_get("/get_model_info", model_info)
    runner = web.AppRunner(sglang)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        async with FakeVLLM().running() as vllm:
            assert await detect_server(vllm, FAST) == "vllm"
            assert await detect_server(f"http://127.0.0.1:{runner.addresses[0][1]}/", FAST) == "sglang"
    finally:
        await runner.cleanup()


async def test_detection_names_a_url_that_answers_neither_and_one_that_does_not_answer():
    fake = FakeVLLM()
    fake.control["/version"] = lambda body: status(404)
    async with fake.running() as url:
        with pytest.raises(EngineError, match=f"{url} answers neither GET /get_model_info") as error:
            await detect_server(url, FAST)
        assert not isinstance(error.value, ServerUnavailableError)
    dead = f"http://127.0.0.1:{closed_port()}"
    with pytest.raises(ServerUnavailableError, match=f"{dead}: could not ask.*--engine-server"):
        await detect_server(dead, config(max_retries=1))


async def test_engine_url_with_server_auto_opens_a_vllm_client():
    fake = FakeVLLM()
    async with fake.running() as url:
        async with open_servers([url], "auto", FAST, PoolConfig()) as engine:
            assert isinstance(engine, VLLMHTTPEngine)
            assert (await engine.generate(PROMPT, sampling(), "r")).output_ids == [5, 6, 2]
        assert isinstance(open_servers([url], "sglang", FAST, PoolConfig()), SGLangHTTPEngine)


async def test_an_auto_pool_detects_its_servers_and_a_dead_one_takes_the_others_kind():
    dead = f"http://127.0.0.1:{closed_port()}"
    pool_config = PoolConfig(health_interval_s=60, client=config(max_retries=0))
    async with FakeVLLM().running() as url, open_servers([url, dead], "auto", FAST, pool_config) as pool:
        assert isinstance(pool, EnginePool)
        assert [type(s.engine) for s in pool.servers] == [VLLMHTTPEngine, VLLMHTTPEngine]


# ----- helpers -----------------------------------------------------------------------------------------


def config(**changes: Any) -> SGLangHTTPConfig:
    return SGLangHTTPConfig(**{**FAST.__dict__, **changes})


def save_tied_checkpoint(tmp_path: Path) -> Path:
    """A checkpoint directory whose safetensors hold embeddings but no LM head, as ``save_pretrained``
    writes a model with tied embeddings."""
    from safetensors.torch import save_file

    weights = tmp_path / "v000001"
    weights.mkdir()
    tensors = {"model.embed_tokens.weight": torch.randn(8, 4), "model.norm.weight": torch.ones(4)}
    save_file(tensors, str(weights / "model.safetensors"), metadata={"format": "pt"})
    return weights
