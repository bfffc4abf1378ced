"""Sampling parameters that pass the schema but would break the shared batch step: a real
``rallyrl serve`` process must answer them (greedy, or a 400 naming the field) and go on serving the
requests batched with them (issue 42, class 2: one request must not fail the others)."""

from __future__ import annotations

import asyncio
import math

import aiohttp
import pytest
import torch

from data.tiny_model import EMBEDDED_MODEL
from rollout.engines.base import SamplingParams
from rollout.engines.sampling import sample_tokens
from rollout.serve.processes import serve_processes

VOCAB = 105
HOSTILE = {
    "a temperature that overflows the division": {"temperature": 1e-40},
    "a top_k past int64": {"top_k": 18446744073709551615},
    "a top_k past the vocabulary": {"top_k": 10**9, "temperature": 1.0},
}


@pytest.mark.parametrize("params", HOSTILE.values(), ids=HOSTILE.keys())
def test_the_sampler_keeps_every_row_finite_and_the_neighbours_draws_unchanged(params):
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0)).repeat(3, 1)
    normal = SamplingParams(temperature=1.0, top_k=20, seed=7)

    def own() -> torch.Generator:
        return torch.Generator().manual_seed(7)

    alone, alone_lp = sample_tokens(logits[:1], [normal], torch.Generator(), [own()])
    hostile = SamplingParams(**{"temperature": 1.0, **params})
    tokens, logprobs = sample_tokens(logits, [normal, hostile, normal], torch.Generator(), [own(), None, own()])
    assert torch.isfinite(logprobs).all()
    assert tokens[0] == alone[0] and tokens[2] == alone[0] and logprobs[0] == alone_lp[0]


def test_a_temperature_below_sglangs_epsilon_is_greedy_with_logprobs_at_temperature_one():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(1))
    tokens, logprobs = sample_tokens(logits, [SamplingParams(temperature=1e-40)], torch.Generator())
    assert tokens[0] == logits.argmax()
    assert logprobs[0] == torch.log_softmax(logits, dim=-1)[0, tokens[0]]


@pytest.mark.parametrize("temperature", [math.nan, math.inf, -1.0])
def test_a_temperature_that_is_not_a_finite_non_negative_number_is_refused(temperature):
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        SamplingParams(temperature=temperature)


async def test_a_hostile_sampling_request_does_not_fail_the_generations_batched_with_it(tmp_path):
    with serve_processes(EMBEDDED_MODEL, tmp_path, 1) as (server,):
        async with aiohttp.ClientSession() as session:

            async def generate(sampling: dict) -> tuple[int, dict]:
                body = {"input_ids": [1, 93, 99], "return_logprob": True,
                        "sampling_params": {"max_new_tokens": 200, **sampling}}  # fmt: skip
                async with session.post(f"{server.url}/generate", json=body) as response:
                    return response.status, await response.json()

            normal = {"temperature": 1.0, "ignore_eos": True, "sampling_seed": 3}
            for name, params in HOSTILE.items():
                results = await asyncio.gather(generate(normal), generate({"max_new_tokens": 8, **params}),
                                               generate(normal))  # fmt: skip
                (s1, first), (s2, hostile), (s3, third) = results
                assert (s1, s2, s3) == (200, 200, 200), (name, results)
                assert first["meta_info"]["completion_tokens"] == 200 and first["output_ids"] == third["output_ids"]
                assert all(math.isfinite(lp) for lp, *_ in hostile["meta_info"]["output_token_logprobs"])
            status, answer = await generate({"temperature": -1.0})
            assert status == 400 and "temperature" in str(answer)
            async with session.post(f"{server.url}/generate", json={"text": []}) as response:  # was an IndexError
                assert response.status == 400 and "text: an empty list" in await response.text()
