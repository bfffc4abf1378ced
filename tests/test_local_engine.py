"""The embedded engine on a real tiny Qwen2: continuous batching must not change the math."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rollout.engines.base import Engine, EngineError, SamplingParams
from rollout.engines.local import LocalEngine, LocalEngineConfig, sample_tokens, shared_prefix_length


def prompts(tokenizer, count: int) -> list[list[int]]:
    return [
        tokenizer.encode(f"Prompt {i}: " + "ab" * (3 + 7 * (i % 4)), add_special_tokens=False) for i in range(count)
    ]


def recomputed_logprobs(model, prompt: list[int], output: list[int]) -> list[float]:
    with torch.no_grad():
        logprobs = model(torch.tensor([prompt + output])).logits[0].float().log_softmax(-1)
    return [logprobs[len(prompt) - 1 + i, token].item() for i, token in enumerate(output)]


def test_local_engine_satisfies_the_engine_protocol(tiny_model):
    assert isinstance(LocalEngine(tiny_model), Engine)


async def test_greedy_output_equals_model_generate(tiny_model, tokenizer):
    prompt = prompts(tokenizer, 1)[0]
    async with LocalEngine(tiny_model) as engine:
        generation = await engine.generate(prompt, SamplingParams(max_new_tokens=30, temperature=0), "r")
    reference = tiny_model.generate(
        torch.tensor([prompt]), max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, len(prompt) :].tolist()
    assert generation.output_ids == reference
    assert generation.finish_reason == "length"


async def test_logprobs_match_a_full_recompute_while_requests_join_and_leave(tiny_model, tokenizer):
    batch = prompts(tokenizer, 12)

    async def one(engine, i):
        await asyncio.sleep(0.003 * i)  # staggered arrivals join a running batch
        sampling = SamplingParams(max_new_tokens=10 + 3 * i, temperature=1.0, top_k=8 if i % 2 else -1)
        return await engine.generate(batch[i], sampling, f"r{i}")

    async with LocalEngine(tiny_model, LocalEngineConfig(max_batch_size=5)) as engine:
        generations = await asyncio.gather(*(one(engine, i) for i in range(12)))
    for i, generation in enumerate(generations):
        assert len(generation.output_ids) == 10 + 3 * i
        expected = recomputed_logprobs(tiny_model, batch[i], generation.output_ids)
        assert generation.output_logprobs == pytest.approx(expected, abs=1e-4)


async def test_greedy_output_does_not_depend_on_the_batch(tiny_model, tokenizer):
    batch = prompts(tokenizer, 8)
    greedy = SamplingParams(max_new_tokens=20, temperature=0)
    async with LocalEngine(tiny_model) as engine:
        together = await asyncio.gather(*(engine.generate(p, greedy, f"b{i}") for i, p in enumerate(batch)))
        alone = [await engine.generate(p, greedy, f"s{i}") for i, p in enumerate(batch)]
    assert [g.output_ids for g in together] == [g.output_ids for g in alone]


async def test_stop_token_ends_the_output_and_is_included(tiny_model, tokenizer):
    prompt = prompts(tokenizer, 1)[0]
    async with LocalEngine(tiny_model) as engine:
        free = await engine.generate(prompt, SamplingParams(max_new_tokens=8, temperature=0), "a")
        stop_at = free.output_ids[3]
        stopped = await engine.generate(
            prompt, SamplingParams(max_new_tokens=8, temperature=0, stop_token_ids=[stop_at]), "b"
        )
    assert stopped.finish_reason == "stop"
    assert stopped.output_ids == free.output_ids[: free.output_ids.index(stop_at) + 1]


async def test_context_limit_ends_in_length(tiny_model, tokenizer):
    prompt = prompts(tokenizer, 1)[0]
    config = LocalEngineConfig(max_model_len=len(prompt) + 5)
    async with LocalEngine(tiny_model, config) as engine:
        generation = await engine.generate(prompt, SamplingParams(max_new_tokens=50), "a")
        too_long = await engine.generate(prompt * 2, SamplingParams(max_new_tokens=50), "b")
    assert generation.finish_reason == "length" and len(prompt) + len(generation.output_ids) == len(prompt) + 5
    assert too_long.finish_reason == "length" and too_long.output_ids == []


async def test_abort_returns_the_tokens_so_far(tiny_model, tokenizer):
    prompt = prompts(tokenizer, 1)[0]
    async with LocalEngine(tiny_model) as engine:
        task = asyncio.create_task(engine.generate(prompt, SamplingParams(max_new_tokens=100_000), "long"))
        await asyncio.sleep(0.2)
        await engine.abort("long")
        generation = await task
    assert generation.finish_reason == "abort"
    assert 0 < len(generation.output_ids) < 100_000


async def test_update_weights_changes_outputs_and_the_weight_version(tiny_model, tokenizer):
    prompt = prompts(tokenizer, 1)[0]
    greedy = SamplingParams(max_new_tokens=12, temperature=0)
    model = type(tiny_model)(tiny_model.config)
    model.load_state_dict(tiny_model.state_dict())
    async with LocalEngine(model) as engine:
        before = await engine.generate(prompt, greedy, "a")
        shifted = {k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()}
        version = await engine.update_weights(shifted)
        after = await engine.generate(prompt, greedy, "b")
    assert (before.weight_version, version, after.weight_version) == (0, 1, 1)
    assert before.output_ids != after.output_ids


async def test_bad_weight_update_is_refused_without_hurting_requests_in_flight(tiny_model, tokenizer):
    prompt = prompts(tokenizer, 1)[0]
    async with LocalEngine(tiny_model) as engine:
        running = asyncio.create_task(engine.generate(prompt, SamplingParams(max_new_tokens=200), "r"))
        await asyncio.sleep(0.05)
        with pytest.raises(EngineError, match="unknown parameters"):
            await engine.update_weights({"not.a.weight": torch.zeros(1)})
        with pytest.raises(EngineError, match=r"lm_head.weight has shape \(3,\)"):
            await engine.update_weights({"lm_head.weight": torch.zeros(3)})
        generation = await running
        assert await engine.health()
    assert len(generation.output_ids) == 200 and engine.weight_version == 0


async def test_generate_outside_async_with_is_a_clear_error(tiny_model):
    with pytest.raises(EngineError, match="async with"):
        await LocalEngine(tiny_model).generate([1, 2], SamplingParams(), "r")


def test_top_k_one_is_greedy_and_logprobs_use_the_temperature():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    params = [SamplingParams(temperature=0.5, top_k=1), SamplingParams(temperature=0)]
    tokens, logprobs = sample_tokens(logits, params, torch.Generator().manual_seed(0))
    assert tokens.tolist() == [1, 0]
    assert logprobs[0].item() == pytest.approx(torch.log_softmax(logits[0] / 0.5, -1)[1].item())
    assert logprobs[1].item() == pytest.approx(torch.log_softmax(logits[1], -1)[0].item())


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    generator = torch.Generator().manual_seed(0)
    seen = {sample_tokens(logits, [SamplingParams(top_p=0.7)], generator)[0].item() for _ in range(200)}
    assert seen == {0, 1}


async def test_next_turn_reuses_the_cached_conversation_and_keeps_logprobs_exact(tiny_model, tokenizer):
    prompt = prompts(tokenizer, 3)[2]  # long enough for a few cache blocks
    sampling = SamplingParams(max_new_tokens=40, temperature=1.0)
    async with LocalEngine(tiny_model) as engine:
        first = await engine.generate(prompt, sampling, "turn1")
        follow_up = prompt + first.output_ids + tokenizer.encode("\ntool says 42\n", add_special_tokens=False)
        second = await engine.generate(follow_up, sampling, "turn2")
        cached = engine.stats.cached_tokens
    assert cached >= len(prompt) + len(first.output_ids) - 32 - 1  # all but the last partial block
    expected = recomputed_logprobs(tiny_model, follow_up, second.output_ids)
    assert second.output_logprobs == pytest.approx(expected, abs=1e-4)


async def test_prompts_sharing_a_system_prompt_share_its_cache(tiny_model, tokenizer):
    system = tokenizer.encode("You are a careful calculator user. " * 4, add_special_tokens=False)
    first, second = system + [40, 41, 42], system + [50, 51]
    greedy = SamplingParams(max_new_tokens=10, temperature=0)
    async with LocalEngine(tiny_model) as engine:
        await engine.generate(first, greedy, "a")
        with_cache = await engine.generate(second, greedy, "b")
        assert engine.stats.cached_tokens == len(system) // 32 * 32
    async with LocalEngine(tiny_model, LocalEngineConfig(prefix_cache_mb=0)) as engine:
        await engine.generate(first, greedy, "a")
        without_cache = await engine.generate(second, greedy, "b")
        assert engine.stats.cached_tokens == 0
    assert with_cache.output_ids == without_cache.output_ids


async def test_prompts_arriving_together_with_an_uncached_shared_prefix_compute_it_once(tiny_model, tokenizer):
    system = tokenizer.encode("You are a careful calculator user. " * 4, add_special_tokens=False)
    batch = [system + [40 + i, 41, 42] for i in range(6)]
    greedy = SamplingParams(max_new_tokens=5, temperature=0)
    async with LocalEngine(tiny_model) as engine:
        together = await asyncio.gather(*(engine.generate(p, greedy, f"r{i}") for i, p in enumerate(batch)))
        assert engine.stats.cached_tokens == 5 * (len(system) // 32 * 32)  # all but the first
        assert engine.stats.prefills == 2
    async with LocalEngine(tiny_model, LocalEngineConfig(prefix_cache_mb=0)) as engine:
        alone = [await engine.generate(p, greedy, f"r{i}") for i, p in enumerate(batch)]
    assert [g.output_ids for g in together] == [g.output_ids for g in alone]


async def test_weight_update_empties_the_prefix_cache(tiny_model, tokenizer):
    prompt = prompts(tokenizer, 3)[2]
    greedy = SamplingParams(max_new_tokens=5, temperature=0)
    async with LocalEngine(tiny_model) as engine:
        await engine.generate(prompt, greedy, "a")
        await engine.update_weights(tiny_model.state_dict())
        await engine.generate(prompt, greedy, "b")
        assert engine.stats.cached_tokens == 0


async def test_one_prefill_mixes_different_cache_hits_and_misses(tiny_model, tokenizer):
    short, long = prompts(tokenizer, 3)[1], prompts(tokenizer, 4)[3]
    sampling = SamplingParams(max_new_tokens=20, temperature=1.0)
    async with LocalEngine(tiny_model) as engine:
        done = await asyncio.gather(engine.generate(short, sampling, "a"), engine.generate(long, sampling, "b"))
        batch = [
            short + done[0].output_ids + [40, 41],
            long + done[1].output_ids + [42],
            tokenizer.encode("a fresh prompt that nothing has cached yet", add_special_tokens=False),
        ]
        generations = await asyncio.gather(*(engine.generate(p, sampling, f"n{i}") for i, p in enumerate(batch)))
        assert engine.stats.prefills == 2  # the three were admitted together
        assert engine.stats.cached_tokens > 0
    for prompt, generation in zip(batch, generations, strict=True):
        expected = recomputed_logprobs(tiny_model, prompt, generation.output_ids)
        assert generation.output_logprobs == pytest.approx(expected, abs=1e-4)


async def test_a_failing_step_fails_its_requests_and_the_engine_keeps_serving(tiny_model, tokenizer, monkeypatch):
    prompt = prompts(tokenizer, 1)[0]
    sampling = SamplingParams(max_new_tokens=5, temperature=0)
    async with LocalEngine(tiny_model) as engine:
        real_decode = engine._batch.decode

        def broken_decode() -> None:
            monkeypatch.setattr(engine._batch, "decode", real_decode)  # fail once
            raise RuntimeError("out of memory")

        monkeypatch.setattr(engine._batch, "decode", broken_decode)
        with pytest.raises(EngineError, match="local engine step failed: RuntimeError\\('out of memory'\\)"):
            await engine.generate(prompt, sampling, "a")
        after = await engine.generate(prompt, sampling, "b")
    assert after.finish_reason == "length" and len(after.output_ids) == 5


async def test_a_sampling_failure_ends_only_its_own_request_and_its_neighbours_decode_on(
    tiny_model, tokenizer, monkeypatch
):
    """A request whose sampling raises inside the shared step (a case validation missed) ends with an
    error naming it; the requests batched with it keep their greedy tokens (issue 42, class 2)."""
    import rollout.engines.batch as batch_module

    batch = prompts(tokenizer, 4)
    greedy = SamplingParams(max_new_tokens=12, temperature=0)
    poisoned = SamplingParams(max_new_tokens=12, temperature=0, seed=666)
    real = batch_module.sample_tokens

    def sample(logits, params, generator, row_generators=None):
        if any(p.seed == 666 for p in params):
            raise RuntimeError("this row's sampling is broken")
        return real(logits, params, generator, row_generators)

    async with LocalEngine(tiny_model) as engine:
        alone = [await engine.generate(p, greedy, f"alone{i}") for i, p in enumerate(batch)]
        monkeypatch.setattr(batch_module, "sample_tokens", sample)
        together = await asyncio.gather(
            *(engine.generate(p, greedy, f"n{i}") for i, p in enumerate(batch)),
            engine.generate(batch[0], poisoned, "poisoned"),
            return_exceptions=True,
        )
    assert isinstance(together[-1], EngineError) and "request poisoned" in str(together[-1])
    assert [g.output_ids for g in together[:-1]] == [g.output_ids for g in alone]


async def test_a_seeded_request_samples_the_same_tokens_whatever_the_batch(tiny_model, tokenizer):
    batch = prompts(tokenizer, 6)
    seeded = SamplingParams(max_new_tokens=15, temperature=1.0, seed=1234)
    async with LocalEngine(tiny_model) as engine:
        alone = await engine.generate(batch[0], seeded, "alone")
        crowd = await asyncio.gather(
            engine.generate(batch[0], seeded, "crowded"),
            *(engine.generate(p, SamplingParams(max_new_tokens=15), f"o{i}") for i, p in enumerate(batch[1:])),
        )
        other_seed = await engine.generate(batch[0], SamplingParams(max_new_tokens=15, seed=99), "other")
    assert crowd[0].output_ids == alone.output_ids
    assert other_seed.output_ids != alone.output_ids


async def test_logprobs_stay_exact_when_decode_reads_a_shared_prompt_prefix_once(tiny_model, tokenizer):
    header = tokenizer.encode("System: " + "use the tools well. " * 6, add_special_tokens=False)
    batch = [header + prompt for prompt in prompts(tokenizer, 10)]

    async def one(engine, i):
        await asyncio.sleep(0.003 * i)
        return await engine.generate(batch[i], SamplingParams(max_new_tokens=8 + 2 * i, temperature=1.0), f"r{i}")

    async with LocalEngine(tiny_model, LocalEngineConfig(max_batch_size=4)) as engine:
        generations = await asyncio.gather(*(one(engine, i) for i in range(10)))
    assert engine.stats.shared_prefix_steps > 0
    for i, generation in enumerate(generations):
        expected = recomputed_logprobs(tiny_model, batch[i], generation.output_ids)
        assert generation.output_logprobs == pytest.approx(expected, abs=1e-4)


def test_the_shared_prefix_is_the_longest_common_one_when_long_enough():
    header = list(range(10, 90))
    assert shared_prefix_length([header + [5, 6, 7], header + [5, 6, 9, 9], header + [5, 8]]) == len(header) + 1
    assert shared_prefix_length([header, header + [1]]) == len(header)
    assert shared_prefix_length([header[:40] + [1], header[:40] + [2]]) == 0  # too short to be worth it
    assert shared_prefix_length([header]) == 0
