"""The in-process SGLang adapter, against a fake ``sglang`` module (SGLang itself needs a GPU)."""

from __future__ import annotations

import asyncio
import sys
import threading

import fake_sglang
import pytest
import torch
from conftest import CountingTool, call
from fake_sglang import answer, answer_when_aborted, fail, fail_when_aborted

from rollout.engines.base import EngineError, SamplingParams
from rollout.engines.sglang_engine import SGLangEngine, SGLangEngineConfig
from rollout.engines.sglang_protocol import sampling_params_payload
from rollout.loop import RolloutConfig, run_request
from rollout.request import AsyncRolloutRequest, FinishReason
from rollout.tokens import ChatTokenizer

STOP = 2
PROMPT = [1, 5, 9]
CONFIG = SGLangEngineConfig(model_path="/models/qwen", server_args={"mem_fraction_static": 0.5, "tp_size": 2})


@pytest.fixture(autouse=True)
def sglang(monkeypatch):
    fake_sglang.install(monkeypatch)


def sampling(max_new_tokens: int = 10) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.7, top_p=0.9, stop_token_ids=[STOP])


async def started(engine: SGLangEngine, calls: int = 1) -> None:
    """Wait until the fake engine has received ``calls`` generations."""
    while len(engine.engine.generate_calls) < calls:
        await asyncio.sleep(0.001)


def test_from_config_starts_sglang_with_the_model_and_the_server_args():
    engine = SGLangEngine.from_config(CONFIG)
    assert engine.engine.kwargs == {"model_path": "/models/qwen", "mem_fraction_static": 0.5, "tp_size": 2}


def test_from_pretrained_passes_keyword_arguments_as_server_args():
    engine = SGLangEngine.from_pretrained("/models/qwen", tp_size=1)
    assert engine.engine.kwargs == {"model_path": "/models/qwen", "tp_size": 1}


def test_without_sglang_building_the_engine_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)  # import sglang now fails
    with pytest.raises(EngineError, match=r"needs SGLang: pip install 'rallyrl\[sglang\]'"):
        SGLangEngine.from_config(CONFIG)


async def test_generate_sends_input_ids_sglang_sampling_params_and_asks_for_logprobs():
    async with SGLangEngine.from_config(CONFIG) as engine:
        await engine.generate(PROMPT, sampling(5), "r0")
    [sent] = engine.engine.generate_calls
    params = sent["sampling_params"]
    assert sent["input_ids"] == PROMPT
    assert sent["return_logprob"] is True
    assert sent["rid"].startswith("r0#")
    assert params == sampling_params_payload(sampling(5))
    assert params["max_new_tokens"] == 5 and params["stop_token_ids"] == [STOP]
    assert params["skip_special_tokens"] is False and params["no_stop_trim"] is True


async def test_generate_returns_the_output_tokens_logprobs_finish_and_weight_version():
    async with SGLangEngine.from_config(CONFIG) as engine:
        engine.engine.steps = [answer([7, 8, STOP])]
        engine.engine.tokenizer_manager.weight_version = "4"
        generation = await engine.generate(PROMPT, sampling(), "r0")
    assert generation.output_ids == [7, 8, STOP]
    assert generation.output_logprobs == pytest.approx([-0.5, -0.51, -0.52])
    assert generation.finish_reason == "stop"
    assert generation.weight_version == 4
    assert generation.token_weight_versions() == [4, 4, 4]


async def test_a_response_without_weight_version_gets_the_version_of_the_last_update():
    async with SGLangEngine.from_config(CONFIG) as engine:
        await engine.update_weights({}, weight_version=6)
        engine.engine.steps = [lambda fake, sent: fake_sglang.response([7, STOP], weight_version=None)]
        generation = await engine.generate(PROMPT, sampling(), "r0")
    assert generation.weight_version == 6


async def test_per_token_weight_versions_come_from_sglang_weight_version_spans():
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 3}]
    async with SGLangEngine.from_config(CONFIG) as engine:
        engine.engine.steps = [answer([7, 8, STOP], weight_versions=spans)]
        generation = await engine.generate(PROMPT, sampling(), "r0")
    assert generation.output_weight_versions == [3, 3, 4]


async def test_a_weight_update_aborts_a_generation_which_resumes_on_the_new_weights():
    async with SGLangEngine.from_config(CONFIG) as engine:
        fake = engine.engine
        fake.steps = [answer_when_aborted([7, 8]), answer([9, STOP])]
        generating = asyncio.create_task(engine.generate(PROMPT, sampling(10), "r0"))
        await started(engine)
        version = await engine.update_weights({"lm_head.weight": torch.ones(2)})
        generation = await generating
    first, resumed = fake.generate_calls
    assert version == 1
    assert resumed["input_ids"] == PROMPT + [7, 8]  # the tokens so far are kept
    assert resumed["sampling_params"]["max_new_tokens"] == 8  # and the budget reduced by them
    assert resumed["rid"] != first["rid"] and resumed["rid"].startswith("r0#")
    assert generation.output_ids == [7, 8, 9, STOP]
    assert generation.output_weight_versions == [0, 0, 1, 1]
    assert generation.finish_reason == "stop" and generation.weight_version == 1
    assert generation.meta["resumes"] == 1


async def test_a_resumed_generation_that_used_its_whole_budget_finishes_with_length():
    async with SGLangEngine.from_config(CONFIG) as engine:
        engine.engine.steps = [answer_when_aborted([7, 8, 9])]
        generating = asyncio.create_task(engine.generate(PROMPT, sampling(3), "r0"))
        await started(engine)
        await engine.update_weights({})
        generation = await generating
    assert generation.finish_reason == "length"
    assert len(engine.engine.generate_calls) == 1


async def test_an_abort_we_asked_for_returns_abort_and_is_not_resumed():
    async with SGLangEngine.from_config(CONFIG) as engine:
        fake = engine.engine
        fake.steps = [answer_when_aborted([7, 8]), answer([9, STOP])]
        generating = asyncio.create_task(engine.generate(PROMPT, sampling(), "r0"))
        await started(engine)
        await engine.abort("r0")
        generation = await generating
    assert generation.finish_reason == "abort"
    assert generation.output_ids == [7, 8]
    assert len(fake.generate_calls) == 1
    assert fake.tokenizer_manager.aborts == [(fake.generate_calls[0]["rid"], False)]


async def test_abort_of_all_requests_ends_every_generation_in_flight():
    async with SGLangEngine.from_config(CONFIG) as engine:
        engine.engine.steps = [answer_when_aborted([7])]
        generating = [asyncio.create_task(engine.generate(PROMPT, sampling(), f"r{i}")) for i in range(3)]
        await started(engine, 3)
        await engine.abort()
        generations = await asyncio.gather(*generating)
    assert [g.finish_reason for g in generations] == ["abort"] * 3
    assert engine.engine.tokenizer_manager.aborts == [("", True)]


async def test_an_abort_that_older_sglang_raises_as_an_error_still_returns_abort():
    async with SGLangEngine.from_config(CONFIG) as engine:
        engine.engine.steps = [fail_when_aborted(ValueError("Request aborted by scheduler."))]
        generating = asyncio.create_task(engine.generate(PROMPT, sampling(), "r0"))
        await started(engine)
        await engine.abort("r0")
        generation = await generating
    assert generation.finish_reason == "abort" and generation.output_ids == []


async def test_cancelling_a_generation_aborts_it_in_sglang():
    async with SGLangEngine.from_config(CONFIG) as engine:
        engine.engine.steps = [answer_when_aborted([7])]
        generating = asyncio.create_task(engine.generate(PROMPT, sampling(), "r0"))
        await started(engine)
        generating.cancel()
        with pytest.raises(asyncio.CancelledError):
            await generating
    assert engine.engine.tokenizer_manager.aborts[0] == (engine.engine.generate_calls[0]["rid"], False)


async def test_an_sglang_error_is_an_engine_error_naming_the_request():
    async with SGLangEngine.from_config(CONFIG) as engine:
        engine.engine.steps = [fail(ValueError("The input (9000 tokens) is longer than the model's context length"))]
        with pytest.raises(EngineError, match=r"request r0: ValueError: The input \(9000 tokens\)"):
            await engine.generate(PROMPT, sampling(), "r0")


async def test_update_weights_passes_named_tensors_per_tensor_parallel_rank_and_bumps_the_version():
    weights = {"model.embed_tokens.weight": torch.zeros(4, 2), "lm_head.weight": torch.ones(4, 2)}
    async with SGLangEngine.from_config(CONFIG) as engine:
        first = await engine.update_weights(weights)
        second = await engine.update_weights(weights, weight_version=7)
    update = engine.engine.tokenizer_manager.weight_updates[0]
    assert (first, second, engine.weight_version) == (1, 7, 7)
    assert update.serialized_named_tensors == [("serialized", list(weights.items()))] * 2  # tp_size 2
    assert update.weight_version == "1" and update.flush_cache is True


async def test_a_failed_weight_update_is_an_engine_error_and_keeps_the_version():
    async with SGLangEngine.from_config(CONFIG) as engine:
        engine.engine.tokenizer_manager.update_result = (False, "shape mismatch for lm_head.weight")
        with pytest.raises(EngineError, match=r"shape mismatch for lm_head\.weight"):
            await engine.update_weights({"lm_head.weight": torch.ones(1)})
    assert engine.weight_version == 0


async def test_release_and_resume_memory_occupation_reach_sglang_with_their_tags():
    async with SGLangEngine.from_config(CONFIG) as engine:
        await engine.release_memory_occupation()
        await engine.resume_memory_occupation(tags=["weights"])
    assert engine.engine.tokenizer_manager.memory_requests == [("release", None), ("resume", ["weights"])]


async def test_flush_cache_raises_when_sglang_refused_to_flush():
    async with SGLangEngine.from_config(CONFIG) as engine:
        await engine.flush_cache()
        engine.engine.tokenizer_manager.flush_success = False  # requests were running
        with pytest.raises(EngineError, match="did not flush its cache"):
            await engine.flush_cache()
    assert engine.engine.tokenizer_manager.flushes == 2


async def test_context_exit_shuts_sglang_down_off_the_event_loop():
    engine = SGLangEngine.from_config(CONFIG)
    async with engine:
        assert await engine.health()
    assert engine.engine.shutdown_threads and engine.engine.shutdown_threads[0] is not threading.current_thread()
    assert not await engine.health()
    with pytest.raises(EngineError, match="not open"):
        await engine.generate(PROMPT, sampling(), "r0")


async def test_an_async_generate_without_rid_is_bypassed_through_the_tokenizer_manager():
    async with SGLangEngine(fake_sglang.EngineWithoutRid(), CONFIG) as engine:
        engine.engine.steps = [answer([7, STOP])]
        generation = await engine.generate(PROMPT, sampling(), "r0")
    [sent] = engine.engine.generate_calls
    assert sent["rid"].startswith("r0#") and sent["input_ids"] == PROMPT
    assert generation.output_ids == [7, STOP]


async def test_a_multi_turn_rollout_with_a_tool_call_runs_through_the_engine(tokenizer):
    tool = CountingTool()
    chat = ChatTokenizer(tokenizer, [tool.schema])
    turns = [call("echo", text="pong"), "done"]

    def assistant_turn(fake, sent):
        text = turns[len(fake.generate_calls) - 1]
        return fake_sglang.response([*chat.encode(text), chat.turn_close_ids[0]], rid=sent["rid"])

    request = AsyncRolloutRequest("r0", 0, 0, [{"role": "user", "content": "Say pong."}])
    async with SGLangEngine.from_config(CONFIG) as engine:
        engine.engine.steps = [assistant_turn]
        await run_request(request, engine, chat, {tool.name: tool}, RolloutConfig(max_new_tokens=64))
    first, second = engine.engine.generate_calls
    assert request.finish_reason is FinishReason.STOP, request.error
    assert [m["content"] for m in request.messages if m["role"] == "tool"] == ["pong"]
    assert request.messages[-1] == {"role": "assistant", "content": "done"}
    assert second["input_ids"][: len(first["input_ids"])] == first["input_ids"]  # token-in: the turn extends the prompt
    assert sum(request.loss_mask) == len(chat.encode(turns[0])) + len(chat.encode(turns[1])) + 2
