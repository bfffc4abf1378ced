"""One GRPO step, run by tests/test_grpo_ddp.py under `accelerate launch` (1 or 2 processes).

Seeded sampling (per prompt, sample and turn) and a reward that depends only on the indices make
the global batch the same however the prompts are split, so the updates must match.
"""

from __future__ import annotations

import asyncio
import sys

import torch

from rollout.config import RolloutConfig
from trainer.config import GRPOConfig, LoRAConfig
from trainer.grpo import GRPOTrainer


def by_sample(request) -> float:
    return float(request.sample_index % 2) + 0.25 * (request.prompt_index % 3)


def main(model_dir: str, out_dir: str, result: str, mode: str = "sync") -> None:
    # async with max_staleness 0: each process trains on its share of the first groups, all
    # sampled by the initial weights, so the update is the synchronous one; lora: the synchronous
    # step with an adapter (its gradients are the adapter's alone); auto: micro_batch_tokens probed by
    # every process under a limit, the smallest budget taken by all
    budget: dict = {"micro_batch_size": 3}
    if mode == "auto":
        budget = {"micro_batch_tokens": "auto", "memory_limit_gib": 16.0, "micro_batch_size": None}
    config = GRPOConfig(
        async_rl=mode == "async", max_staleness=0,
        model=model_dir, out=out_dir, steps=1, prompts_per_step=4, samples_per_prompt=2,
        rollout=RolloutConfig(max_turns=1, max_new_tokens=8, max_model_len=768, temperature=1.0),
        lr=1e-2, seed=5, filter_groups=False, checkpoint_every=0, tis_cap=None,
        lora=LoRAConfig(rank=4, alpha=8.0) if mode == "lora" else None, **budget,
    )  # fmt: skip
    trainer = GRPOTrainer(config, reward_fn=by_sample)
    grads: dict[str, torch.Tensor] = {}
    step = trainer.optimizer.step

    def capture_then_step(*args, **kwargs):  # the (all-reduced) gradient the update is made from
        model = trainer.policy.language_model()
        grads.update({name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None})
        return step(*args, **kwargs)

    trainer.optimizer.step = capture_then_step
    history = asyncio.run(trainer.train())
    if trainer.is_main:
        processes = trainer.accelerator.num_processes
        torch.save({"grads": grads, "metrics": history[-1], "processes": processes}, result)


if __name__ == "__main__":
    main(*sys.argv[1:5])
