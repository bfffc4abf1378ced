"""A check that a weight sync arrived whole (``weight_sync.check_logprobs``): every server generates a few
greedy tokens of one fixed prompt, and their logprobs are compared with the trainer's own forward pass
over the same tokens. A sync that loaded stale, partial or mis-named weights shows as a gap far above
the engines' numerical noise (about 1e-5 in float32 on a CPU); ``sync/logprob_gap`` in metrics.jsonl.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import torch

from rollout.engines.base import Engine, SamplingParams
from rollout.engines.pool import EnginePool

PROBE = [{"role": "user", "content": "What is 12+7? Then name a prime above 20."}]
PROBE_TOKENS = 16
"""Greedy tokens each server generates for the check."""


def probe_ids(tokenizer: Any) -> list[int]:
    """The fixed prompt, rendered by the model's chat template."""
    rendered = tokenizer.apply_chat_template(PROBE, add_generation_prompt=True, tokenize=True)
    return list(rendered if isinstance(rendered, list) else rendered["input_ids"])


async def logprob_gap(engine: Engine, lm: torch.nn.Module, tokenizer: Any, rid: str) -> float:
    """The largest |server logprob - trainer logprob| over the probe's greedy tokens, on every healthy
    server of a pool (or the one engine); NaN when the trainer cannot run its model alone (FSDP shards)."""
    if any(getattr(p, "_is_sharded", False) or type(p).__name__ == "DTensor" for p in lm.parameters()):
        return math.nan
    prompt = probe_ids(tokenizer)
    greedy = SamplingParams(max_new_tokens=PROBE_TOKENS, temperature=0.0)
    targets = [s.engine for s in engine.servers if s.healthy] if isinstance(engine, EnginePool) else [engine]
    generations = await asyncio.gather(*(t.generate(prompt, greedy, f"{rid}-{i}") for i, t in enumerate(targets)))
    gap = 0.0
    device = next(lm.parameters()).device
    for generation in generations:
        if not generation.output_ids:
            continue
        ids = torch.tensor([prompt + generation.output_ids], device=device)
        with torch.no_grad():
            logits = lm(ids).logits[0, len(prompt) - 1 : -1].float()
        expected = logits.log_softmax(-1).gather(1, ids[0, len(prompt) :, None]).squeeze(1).double().cpu()
        served = torch.tensor(generation.output_logprobs, dtype=torch.float64)
        gap = max(gap, (expected - served).abs().max().item())
    return gap
