"""The embedded engine gives its memory back for the update and takes it back with the next weights
(colocation): the KV cache, the prefix cache and the weights' storage, accounted in bytes on the CPU
as on CUDA; what it generates afterwards is what it generated before."""

from __future__ import annotations

import copy

import pytest

from rollout.engines.base import EngineError, SamplingParams
from rollout.engines.local import LocalEngine, LocalEngineConfig

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0)
PROMPTS = [[5, 9, 17, 3, 22, 8], [7, 7, 30, 2]]


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


async def generations(engine: LocalEngine, tag: str) -> list:
    return [await engine.generate(prompt, GREEDY, f"{tag}-{i}") for i, prompt in enumerate(PROMPTS)]


async def test_release_gives_back_the_cache_and_weights_and_resume_restores_the_same_logprobs(tiny_model):
    model = copy.deepcopy(tiny_model)
    weights = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    async with LocalEngine(model, LocalEngineConfig(device="cpu", max_model_len=64, prefix_cache_mb=8)) as engine:
        before = await generations(engine, "before")
        resident = weight_bytes(engine.model)
        kv = engine._batch.kv.nbytes
        assert kv > 0 and resident > 0

        freed = await engine.release_memory()

        assert freed >= resident + kv
        assert weight_bytes(engine.model) == 0 and engine._batch.kv.nbytes == 0
        assert engine._batch.prefix_cache.nbytes == 0
        with pytest.raises(EngineError, match="memory is released"):
            await engine.generate(PROMPTS[0], GREEDY, "while-released")

        taken = await engine.resume_memory(weights, weight_version=3)

        assert taken >= resident and weight_bytes(engine.model) == resident
        assert engine.weight_version == 3
        after = await generations(engine, "after")
    for old, new in zip(before, after, strict=True):
        assert new.output_ids == old.output_ids
        assert new.output_logprobs == pytest.approx(old.output_logprobs, abs=1e-6)
        assert new.weight_version == 3


async def test_an_update_while_released_is_the_resume_and_a_partial_one_is_refused(tiny_model):
    model = copy.deepcopy(tiny_model)
    weights = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    async with LocalEngine(model, LocalEngineConfig(device="cpu", max_model_len=64)) as engine:
        await engine.release_memory()
        assert await engine.release_memory() == 0  # (released already)
        partial = {name: tensor for name, tensor in weights.items() if "layers.0." not in name}
        with pytest.raises(EngineError, match="are not in the update"):
            await engine.resume_memory(partial, 1)
        assert engine.released
        wrong = {**weights, "lm_head.weight": weights["lm_head.weight"][:-1]}
        with pytest.raises(EngineError, match=r"lm_head\.weight has shape"):
            await engine.resume_memory(wrong, 1)
        assert engine.released
        assert await engine.update_weights(weights, weight_version=2) == 2
        assert not engine.released
        assert (await engine.generate(PROMPTS[0], GREEDY, "back")).output_ids


async def test_release_is_refused_while_requests_are_in_flight(tiny_model):
    import asyncio

    async with LocalEngine(copy.deepcopy(tiny_model), LocalEngineConfig(device="cpu", max_model_len=64)) as engine:
        running = asyncio.create_task(engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=40), "busy"))
        await asyncio.sleep(0)
        with pytest.raises(EngineError, match="in flight"):
            await engine.release_memory()
        await running
        assert await engine.release_memory() > 0


async def test_resume_without_a_release_is_a_plain_update(tiny_model):
    model = copy.deepcopy(tiny_model)
    weights = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    async with LocalEngine(model, LocalEngineConfig(device="cpu", max_model_len=64)) as engine:
        assert await engine.resume_memory(weights, 4) == 0
        assert engine.weight_version == 4 and not engine.released
