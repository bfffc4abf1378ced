"""The embedded engine across a weight update: a request in flight goes on from its tokens so far
on the new weights, as a request SGLang aborts and resumes does (``recompute_on_update``)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rollout.engines.base import Generation, SamplingParams
from rollout.engines.local import LocalEngine, LocalEngineConfig
from rollout.loop import RolloutConfig, run_request
from rollout.request import AsyncRolloutRequest
from rollout.tokens import ChatTokenizer

LONG = 60  # tokens a generation asks for; no stop token, so it runs across the update
UPDATE_AFTER = 8  # tokens a generation has when the update is asked for
EXACT = 1e-4  # float32: decoding vs one full forward differs by up to ~3e-5; old keys and values by ~1e-2 and more


def prompt_ids(tokenizer, i: int = 0) -> list[int]:
    return tokenizer.encode(f"Prompt {i}: " + "ab" * (5 + 3 * i), add_special_tokens=False)


def copy_of(model, state_dict=None):
    """A model of the same kind holding ``state_dict`` (default: ``model``'s own weights)."""
    copy = type(model)(model.config)
    copy.load_state_dict(state_dict if state_dict is not None else model.state_dict())
    return copy.eval()


def perturbed(model, scale: float = 0.05, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=generator) for k, v in model.state_dict().items()}


def teacher_forced_logprobs(model, prompt: list[int], output: list[int]) -> list[float]:
    with torch.no_grad():
        logprobs = model(torch.tensor([prompt + output])).logits[0].float().log_softmax(-1)
    return [logprobs[len(prompt) - 1 + i, token].item() for i, token in enumerate(output)]


async def generate_across_update(engine, prompt, sampling, new_weights, rid="r") -> Generation:
    """Stream one generation; once it has ``UPDATE_AFTER`` tokens, update the weights."""
    updated = False
    async for part in engine.generate_stream(prompt, sampling, rid):
        if isinstance(part, Generation):
            return part
        if not updated and len(part.output_ids) >= UPDATE_AFTER:
            updated = True
            await engine.update_weights(new_weights)
    raise AssertionError("the stream ended without a Generation")


def split_at_update(generation: Generation) -> int:
    """How many tokens the old weights produced; checks that both versions are there, old first."""
    versions = generation.output_weight_versions
    old = versions.count(0)
    assert versions == [0] * old + [1] * (len(versions) - old)
    assert UPDATE_AFTER <= old < len(versions), "the update did not land mid-generation"
    return old


async def test_a_generation_spanning_an_update_records_both_versions_old_first(tiny_model, tokenizer):
    sampling = SamplingParams(max_new_tokens=LONG)
    async with LocalEngine(copy_of(tiny_model)) as engine:
        generation = await generate_across_update(engine, prompt_ids(tokenizer), sampling, perturbed(tiny_model))
    assert len(generation.output_ids) == LONG and generation.finish_reason == "length"
    split_at_update(generation)
    assert generation.weight_version == 1
    assert engine.stats.resumed_sequences == 1


async def test_tokens_after_an_update_have_the_new_models_logprobs_over_all_the_context(tiny_model, tokenizer):
    prompt, new_weights = prompt_ids(tokenizer), perturbed(tiny_model)
    async with LocalEngine(copy_of(tiny_model)) as engine:
        generation = await generate_across_update(engine, prompt, SamplingParams(max_new_tokens=LONG), new_weights)
    old = split_at_update(generation)
    before = teacher_forced_logprobs(tiny_model, prompt, generation.output_ids[:old])
    after = teacher_forced_logprobs(copy_of(tiny_model, new_weights), prompt, generation.output_ids)[old:]
    assert generation.output_logprobs[:old] == pytest.approx(before, abs=EXACT)
    assert generation.output_logprobs[old:] == pytest.approx(after, abs=EXACT)
    assert engine.stats.recomputed_tokens == len(prompt) + old


async def test_without_recompute_the_tokens_after_an_update_see_old_keys_and_values(tiny_model, tokenizer):
    prompt, new_weights = prompt_ids(tokenizer), perturbed(tiny_model)
    config = LocalEngineConfig(recompute_on_update=False)
    async with LocalEngine(copy_of(tiny_model), config) as engine:
        generation = await generate_across_update(engine, prompt, SamplingParams(max_new_tokens=LONG), new_weights)
    old = split_at_update(generation)
    after = teacher_forced_logprobs(copy_of(tiny_model, new_weights), prompt, generation.output_ids)[old:]
    assert max(abs(a - b) for a, b in zip(generation.output_logprobs[old:], after, strict=True)) > 100 * EXACT
    assert engine.stats.resumed_sequences == 0


async def test_greedy_tokens_after_an_update_are_a_fresh_generation_from_the_tokens_so_far(tiny_model, tokenizer):
    prompt, new_weights = prompt_ids(tokenizer), perturbed(tiny_model)
    greedy = SamplingParams(max_new_tokens=LONG, temperature=0)
    async with LocalEngine(copy_of(tiny_model)) as engine:
        generation = await generate_across_update(engine, prompt, greedy, new_weights)
    old = split_at_update(generation)
    context = prompt + generation.output_ids[:old]
    fresh = (
        copy_of(tiny_model, new_weights)
        .generate(
            torch.tensor([context]), max_new_tokens=LONG - old, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(context) :]
        .tolist()
    )
    assert generation.output_ids[old:] == fresh


async def test_a_batch_recomputed_in_chunks_of_max_prefill_tokens_stays_exact(tiny_model, tokenizer):
    short = [tokenizer.encode(f"Q{i}: abab", add_special_tokens=False) for i in range(4)]
    batch = [*short, prompt_ids(tokenizer, 8)]  # 8 tokens each, and 68
    new_weights = perturbed(tiny_model)
    config = LocalEngineConfig(max_prefill_tokens=48)  # the short ones two by two, the long one in two chunks
    sampling = SamplingParams(max_new_tokens=LONG)
    async with LocalEngine(copy_of(tiny_model), config) as engine:
        tasks = [asyncio.create_task(engine.generate(p, sampling, f"r{i}")) for i, p in enumerate(batch)]
        prompt_tokens = sum(map(len, batch))
        while engine.stats.prefill_tokens < prompt_tokens or engine.stats.steps < UPDATE_AFTER:  # all admitted
            await asyncio.sleep(0.001)
        await engine.update_weights(new_weights)
        generations = await asyncio.gather(*tasks)
    new_model = copy_of(tiny_model, new_weights)
    for prompt, generation in zip(batch, generations, strict=True):
        old = generation.output_weight_versions.count(0)
        assert 0 < old < LONG
        after = teacher_forced_logprobs(new_model, prompt, generation.output_ids)[old:]
        assert generation.output_logprobs[old:] == pytest.approx(after, abs=EXACT)
    assert engine.stats.resumed_sequences == len(batch)


async def test_without_recompute_the_next_turn_finds_no_old_keys_in_the_prefix_cache(tiny_model, tokenizer):
    prompt, new_weights = prompt_ids(tokenizer, 4), perturbed(tiny_model)
    config = LocalEngineConfig(recompute_on_update=False)
    async with LocalEngine(copy_of(tiny_model), config) as engine:
        first = await generate_across_update(engine, prompt, SamplingParams(max_new_tokens=LONG), new_weights)
        follow_up = prompt + first.output_ids + tokenizer.encode("\nok\n", add_special_tokens=False)
        second = await engine.generate(follow_up, SamplingParams(max_new_tokens=10), "turn2")
    assert engine.stats.cached_tokens == 0
    expected = teacher_forced_logprobs(copy_of(tiny_model, new_weights), follow_up, second.output_ids)
    assert second.output_logprobs == pytest.approx(expected, abs=EXACT)


async def test_a_rollout_request_spanning_an_update_records_each_tokens_version(tiny_model, tokenizer):
    chat = ChatTokenizer(tokenizer)
    config = RolloutConfig(max_new_tokens=LONG, max_turns=1, temperature=0)
    request = AsyncRolloutRequest("r0", 0, 0, [{"role": "user", "content": "Say something long."}])
    async with LocalEngine(copy_of(tiny_model)) as engine:
        running = asyncio.create_task(run_request(request, engine, chat, {}, config))
        while engine.stats.generated_tokens < UPDATE_AFTER:
            await asyncio.sleep(0.001)
        await engine.update_weights(perturbed(tiny_model))
        await running
    assert request.error is None
    assert len(request.weight_versions) == len(request.response_ids) == len(request.loss_mask)
    generated = [v for v, mask in zip(request.weight_versions, request.loss_mask, strict=True) if mask]
    old = generated.count(0)
    assert UPDATE_AFTER <= old < len(generated) and generated == [0] * old + [1] * (len(generated) - old)
    assert all(v is None for v, mask in zip(request.weight_versions, request.loss_mask, strict=True) if not mask)
