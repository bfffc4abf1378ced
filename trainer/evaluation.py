"""Evaluation: greedy accuracy and unbiased pass@k of a model on a task or dataset."""

from __future__ import annotations

from collections import defaultdict
from math import comb
from typing import Any

from data.schema import Record
from rollout.engines.base import Engine
from rollout.loop import RolloutConfig
from rollout.request import AsyncRolloutRequest
from rollout.runner import RolloutRunner
from rollout.tokens import ChatTokenizer
from tools.base import BaseTool


def pass_at_k(n: int, correct: int, k: int) -> float:
    """Unbiased pass@k from n samples of which ``correct`` are right (Chen et al., 2021)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - correct < k:
        return 1.0
    return 1.0 - comb(n - correct, k) / comb(n, k)


def _correct_by_prompt(requests: list[AsyncRolloutRequest]) -> dict[int, list[bool]]:
    by_prompt: dict[int, list[bool]] = defaultdict(list)
    for request in requests:
        by_prompt[request.prompt_index].append(request.rewards.answer == 1.0)
    return by_prompt


async def evaluate(
    engine: Engine,
    chat: ChatTokenizer,
    tools: dict[str, BaseTool],
    records: list[Record],
    config: RolloutConfig,
    *,
    samples: int = 1,
    max_concurrency: int = 256,
    progress: bool = True,
) -> dict[str, Any]:
    """Greedy accuracy over ``records``, and unbiased pass@k for k = 1, 2, 4, ..., ``samples``
    from that many samples per prompt at ``config.temperature``."""
    greedy = RolloutConfig(**{**config.__dict__, "temperature": 0.0})
    runner = RolloutRunner(engine, chat, tools, greedy, max_concurrency=max_concurrency, progress=progress)
    result = await runner.run(records, 1)
    graded = [r for r in result.requests if r.rewards.answer is not None]
    report: dict[str, Any] = {
        "prompts": len(records),
        "accuracy": sum(r.rewards.answer == 1.0 for r in graded) / len(graded) if graded else None,
        "greedy": result.summary.to_dict(),
        "pass_at_k": {},
    }
    if samples >= 1:
        runner = RolloutRunner(engine, chat, tools, config, max_concurrency=max_concurrency, progress=progress)
        sampled = await runner.run(records, samples)
        by_prompt = _correct_by_prompt([r for r in sampled.requests if r.rewards.answer is not None])
        ks = sorted({k for k in (1, 2, 4, 8, 16, 32, 64, 128) if k <= samples} | {samples})
        report["pass_at_k"] = {
            str(k): sum(pass_at_k(len(c), sum(c), k) for c in by_prompt.values()) / max(len(by_prompt), 1) for k in ks
        }
        report["sampled"] = sampled.summary.to_dict()
    return report
