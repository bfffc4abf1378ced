"""LoRA adapters loaded by servers at run time (``rollout/engines/server_adapters.py``), against the
vLLM and SGLang doubles of ``test_vllm_http.py`` and ``test_sglang_http.py``: what a sync sends,
which adapter each request names, when the old one is unloaded, what each server's settings allow,
and how the trainer chooses between the adapter and merged weights (``adapter_sync_plan``). The
real vLLM server is in ``tests/real_engines/test_vllm_lora.py``."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest
from aiohttp import web

from data.config_tree import ConfigError
from rollout.engines.base import EngineError, LoadsAdapters
from rollout.engines.config import PoolConfig
from rollout.engines.pool import EnginePool
from rollout.engines.server_adapters import AdapterSupport, sglang_adapter_support, vllm_adapter_support
from rollout.engines.sglang_http import SGLangHTTPEngine
from rollout.engines.vllm_http import VLLMHTTPEngine
from tests.test_sglang_http import FakeSGLang
from tests.test_sglang_http import config as sglang_config
from tests.test_vllm_http import FAST, PROMPT, FakeVLLM, completion, sampling, wait_until
from trainer.config import LoRAConfig
from trainer.weight_sync import adapter_sync_plan

LORA_ON = {"max_lora_rank": 16, "max_loras": 2}
RUNTIME = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


def lora_vllm(**kwargs: Any) -> FakeVLLM:
    return FakeVLLM(lora_config=LORA_ON, env=RUNTIME, **kwargs)


def sync_calls(server: FakeVLLM | FakeSGLang) -> list[tuple[str, Any]]:
    paths = ("load_lora_adapter", "unload_lora_adapter", "pause", "resume", "continue_generation", "weight_version")
    return [(path, body) for _, path, body in server.requests if any(p in path for p in paths)]


async def test_a_vllm_adapter_sync_loads_a_new_name_per_version_requests_name_it_and_the_old_one_goes():
    server = lora_vllm()
    async with server.running() as url, VLLMHTTPEngine(url, FAST) as engine:
        assert isinstance(engine, LoadsAdapters)
        engine.adapter_tag = "t"
        await engine.generate(PROMPT, sampling(), "base")
        assert await engine.sync_adapter_from_disk("/runs/w/v000001", 1) == 1
        first = await engine.generate(PROMPT, sampling(), "after-1")
        await engine.sync_adapter_from_disk("/runs/w/v000002", 2)
        second = await engine.generate(PROMPT, sampling(), "after-2")
        await engine.finish_unloads()
    assert [body["model"] for body in server.completions] == ["/models/qwen", "rallyrl-v1-t", "rallyrl-v2-t"]
    assert (first.weight_version, second.weight_version, server.weight_version) == (1, 2, "2")
    assert sync_calls(server) == [
        ("/pause?mode=abort", None),
        ("/v1/load_lora_adapter", {"lora_name": "rallyrl-v1-t", "lora_path": "/runs/w/v000001"}),
        ("/update_weight_version", {"new_version": "1"}),
        ("/resume", None),
        ("/pause?mode=abort", None),
        ("/v1/load_lora_adapter", {"lora_name": "rallyrl-v2-t", "lora_path": "/runs/w/v000002"}),
        ("/update_weight_version", {"new_version": "2"}),
        ("/resume", None),
        ("/v1/unload_lora_adapter", {"lora_name": "rallyrl-v1-t"}),
    ]


async def test_the_old_adapter_is_unloaded_only_once_no_request_names_it():
    release = asyncio.Event()

    async def slow_then_fast(body: dict, n: int) -> dict:
        if n == 0:
            await release.wait()
        return completion([5, 2])

    server = lora_vllm(on_complete=slow_then_fast)
    async with server.running() as url, VLLMHTTPEngine(url, FAST) as engine:
        engine.adapter_tag = "t"
        await engine.sync_adapter_from_disk("/w/v1", 1)
        slow = asyncio.create_task(engine.generate(PROMPT, sampling(), "slow"))
        await wait_until(lambda: len(server.completions) == 1)
        await engine.sync_adapter_from_disk("/w/v2", 2)  # (the double's pause aborts nothing)
        await asyncio.sleep(0.05)
        unloads = [body for _, path, body in server.requests if path == "/v1/unload_lora_adapter"]
        assert unloads == []  # "slow" still runs on rallyrl-v1-t
        release.set()
        generation = await slow
        await engine.finish_unloads()
    assert generation.weight_version == 1 and server.completions[0]["model"] == "rallyrl-v1-t"
    assert [body for _, path, body in server.requests if path == "/v1/unload_lora_adapter"] == [
        {"lora_name": "rallyrl-v1-t"}
    ]


async def test_a_refused_vllm_adapter_is_one_attempt_with_the_servers_reason_and_generation_continues():
    message = "Call to add_lora method failed: Worker failed with error 'LoRA rank 32 is greater than max_lora_rank 16'"
    server = lora_vllm()
    refusal = web.json_response({"error": {"message": message}}, status=500)
    server.control["/v1/load_lora_adapter"] = lambda body: refusal
    async with server.running() as url, VLLMHTTPEngine(url, FAST) as engine:
        with pytest.raises(EngineError, match="rank 32 is greater than max_lora_rank 16"):
            await engine.sync_adapter_from_disk("/w/v1", 1)
        assert engine.adapter is None and engine.weight_version == 0
        await engine.generate(PROMPT, sampling(), "still-base")
    assert [path for _, path, _ in server.requests].count("/v1/load_lora_adapter") == 1
    assert server.control_calls()[-1] == "/resume" and server.completions[-1]["model"] == "/models/qwen"


async def test_a_vllm_without_the_runtime_lora_routes_is_told_which_variable_adds_them():
    server = FakeVLLM(lora_config=LORA_ON, env={})  # (no route: the double answers 404 Not Found)
    async with server.running() as url, VLLMHTTPEngine(url, FAST) as engine:
        with pytest.raises(EngineError, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"):
            await engine.update_adapter_from_disk("/w/v1", 1)


@pytest.mark.parametrize(
    ("lora_config", "env", "rank", "problem", "fix"),
    [
        (None, RUNTIME, 8, "without --enable-lora", "--enable-lora --max-lora-rank 8 --max-loras 2"),
        (LORA_ON, RUNTIME, 32, "lora.rank 32 is above .*--max-lora-rank 16", "set lora.rank to 16 or less"),
        (LORA_ON, {}, 8, "without VLLM_ALLOW_RUNTIME_LORA_UPDATING=True", "restart it with that variable"),
        (LORA_ON, RUNTIME, 16, None, None),
    ],
    ids=["lora-off", "rank-too-high", "no-runtime-updates", "ready"],
)
async def test_what_a_vllm_server_can_load_is_read_from_its_settings(lora_config, env, rank, problem, fix):
    server = FakeVLLM(lora_config=lora_config, env=env)
    async with server.running() as url, VLLMHTTPEngine(url, FAST) as engine:
        support = await engine.adapter_support(rank, ["q_proj", "v_proj"])
    assert support.ready is (problem is None)
    if problem is not None:
        assert re.search(problem, support.problem) and fix in support.fix


def test_a_vllm_without_development_endpoints_cannot_say_and_is_told_to_enable_them():
    support = vllm_adapter_support("http://h", None, None, 8)
    assert not support.ready and "VLLM_SERVER_DEV_MODE=1" in support.fix


@pytest.mark.parametrize(
    ("info", "ready", "impossible", "words"),
    [
        ({"model_path": "m"}, False, True, "serves no LoRA endpoints"),
        ({"enable_lora": False, "device": "cpu"}, False, True, "Found no NVIDIA driver"),
        ({"enable_lora": False, "device": "cuda"}, False, False, "without --enable-lora"),
        ({"enable_lora": True, "max_lora_rank": 8, "device": "cuda"}, False, False, "above"),
        ({"enable_lora": True, "max_lora_rank": 64, "lora_target_modules": ["q_proj"]}, False, False, "leave out"),
        ({"enable_lora": True, "max_lora_rank": 64, "lora_target_modules": ["all"]}, True, False, ""),
    ],
    ids=["rallyrl-serve", "sglang-cpu", "lora-off", "rank", "modules", "ready"],
)
def test_what_an_sglang_server_can_load_follows_its_server_info(info, ready, impossible, words):
    support = sglang_adapter_support("http://h", info, 16, ["q_proj", "v_proj"])
    assert (support.ready, support.impossible) == (ready, impossible)
    assert words in support.problem


async def test_an_sglang_adapter_sync_pauses_loads_names_it_in_lora_path_and_unloads_the_old_one():
    server = FakeSGLang()
    async with server.running() as url, SGLangHTTPEngine(url, sglang_config()) as engine:
        engine.adapter_tag = "t"
        await engine.sync_adapter_from_disk("/w/v1", 1)
        await engine.generate(PROMPT, sampling(), "a")
        await engine.sync_adapter_from_disk("/w/v2", 2)
        await engine.generate(PROMPT, sampling(), "b")
        await engine.finish_unloads()
    assert [body.get("lora_path") for body in server.generates] == ["rallyrl-v1-t", "rallyrl-v2-t"]
    assert sync_calls(server) == [
        ("/pause_generation", {"mode": "abort"}),
        ("/load_lora_adapter", {"lora_name": "rallyrl-v1-t", "lora_path": "/w/v1"}),
        ("/update_weight_version", {"new_version": "1", "abort_all_requests": False}),
        ("/continue_generation", {}),
        ("/pause_generation", {"mode": "abort"}),
        ("/load_lora_adapter", {"lora_name": "rallyrl-v2-t", "lora_path": "/w/v2"}),
        ("/update_weight_version", {"new_version": "2", "abort_all_requests": False}),
        ("/continue_generation", {}),
        ("/unload_lora_adapter", {"lora_name": "rallyrl-v1-t"}),
    ]


async def test_an_sglang_refusal_carries_its_error_message():
    refusal = {"success": False, "error_message": "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."}
    server = FakeSGLang(control={"/load_lora_adapter": lambda body: web.json_response(refusal, status=400)})
    async with server.running() as url, SGLangHTTPEngine(url, sglang_config()) as engine:
        with pytest.raises(EngineError, match="LoRA is not enabled"):
            await engine.sync_adapter_from_disk("/w/v1", 1)
    assert server.paths()[-1] == "/continue_generation"


async def test_a_pool_syncs_the_adapter_on_every_server_and_a_server_that_comes_back_loads_it():
    first, second = lora_vllm(), lora_vllm()
    async with first.running() as url_a, second.running() as url_b:
        pool = EnginePool([url_a, url_b], PoolConfig(health_interval_s=0.02, client=FAST), server="vllm")
        async with pool:
            for server in pool.servers:
                server.engine.adapter_tag = "t"
            assert (await pool.adapter_support(8, ["q_proj"])).ready
            await pool.sync_adapter_from_disk("/w/v1", 1)
            pool._eject(pool.servers[1], "test: it restarted")
            await wait_until(lambda: pool.servers[1].healthy)
    loads = [[body for _, path, body in s.requests if path == "/v1/load_lora_adapter"] for s in (first, second)]
    assert loads[0] == [{"lora_name": "rallyrl-v1-t", "lora_path": "/w/v1"}]
    assert loads[1] == [{"lora_name": "rallyrl-v1-t", "lora_path": "/w/v1"},
                        {"lora_name": "rallyrl-v1-t.2", "lora_path": "/w/v1"}]  # fmt: skip


class Servers:
    """An engine double that loads adapters (or not) as told."""

    def __init__(self, support: AdapterSupport):
        self.support = support

    async def adapter_support(self, rank: int, modules: Any) -> AdapterSupport:
        return self.support

    async def sync_adapter_from_disk(self, adapter_path: str, weight_version: int) -> int:
        return weight_version


@pytest.mark.parametrize(
    ("sync", "support", "adapter", "said"),
    [
        ("auto", AdapterSupport(True), True, "adapter alone"),
        ("adapter", AdapterSupport(True), True, "adapter alone"),
        ("merged", AdapterSupport(True), False, "full weights at each sync (lora.sync: merged)"),
        ("auto", AdapterSupport(False, "http://h: SGLang on CPU cannot"), False, "at each sync: http://h"),
    ],
)
async def test_the_trainer_sends_the_adapter_where_the_servers_can_load_it(sync, support, adapter, said):
    chosen, line = await adapter_sync_plan(Servers(support), LoRAConfig(rank=8, sync=sync), ["q_proj"])
    assert chosen is adapter and said in line


@pytest.mark.parametrize("sync", ["auto", "adapter"])
async def test_a_server_that_lacks_a_flag_is_an_error_naming_the_fix_before_any_rollout(sync):
    lacking = AdapterSupport(False, "http://h was started without --enable-lora", "restart it with --enable-lora")
    with pytest.raises(ConfigError, match=f"lora.sync {sync}: .*without --enable-lora: restart it with --enable-lora"):
        await adapter_sync_plan(Servers(lacking), LoRAConfig(sync=sync), ["q_proj"])


async def test_lora_sync_adapter_refuses_an_engine_that_cannot_load_adapters():
    impossible = AdapterSupport(False, "http://h: SGLang on CPU cannot")
    with pytest.raises(ConfigError, match=r"SGLang on CPU cannot: set lora\.sync: merged"):
        await adapter_sync_plan(Servers(impossible), LoRAConfig(sync="adapter"), ["q_proj"])


def test_lora_sync_is_checked():
    with pytest.raises(ConfigError, match=r"lora\.sync must be one of"):
        LoRAConfig(sync="adapters")
