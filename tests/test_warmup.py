"""The learning-rate warmup: its schedule, the rate each step logs, and the AdamW fact it guards against."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rollout.config import RolloutConfig
from trainer.config import GRPOConfig
from trainer.grpo import GRPOTrainer
from trainer.policy import warmup_schedule


def rates(warmup_steps: int, updates: int, lr: float = 1.0) -> list[float]:
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    schedule = warmup_schedule(optimizer, warmup_steps)
    seen = []
    for _ in range(updates):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    return seen


def test_the_rate_rises_linearly_over_the_warmup_and_the_first_update_moves_the_weights():
    assert rates(5, 8) == pytest.approx([1 / 6, 2 / 6, 3 / 6, 4 / 6, 5 / 6, 1.0, 1.0, 1.0])
    assert rates(0, 3) == [1.0, 1.0, 1.0]
    assert GRPOConfig().warmup_steps == 5


def test_adamw_first_update_moves_every_weight_with_a_gradient_by_the_learning_rate():
    """Why the warmup: the first AdamW update is m / sqrt(v) = g / |g| = sign(g) per weight, so a weight
    whose gradient is 1e-9 moves as far as one whose gradient is 1 (docs/training.md, "Why a run collapses")."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(64, 64))
    before = weight.detach().clone()
    optimizer = torch.optim.AdamW([weight], lr=1e-3, weight_decay=0.0)
    scale = torch.logspace(-5, 0, 64)[:, None]  # rows of gradients a hundred thousand times apart
    gradient = torch.randn(64, 64).sign() * (0.5 + torch.rand(64, 64)) * scale
    gradient[0] = 0.0  # a row with no gradient (a token never seen) does not move
    weight.grad = gradient
    optimizer.step()
    moved = (weight.detach() - before).abs()
    assert torch.all(moved[0] == 0)
    assert torch.allclose(moved[1:], torch.full_like(moved[1:], 1e-3), rtol=1e-2)


def test_each_step_logs_the_rate_it_ran_at(tmp_path, tiny_model_dir):
    config = GRPOConfig(
        model=str(tiny_model_dir), out=str(tmp_path / "run"), steps=3, prompts_per_step=2, samples_per_prompt=4,
        rollout=RolloutConfig(max_turns=1, max_new_tokens=8, max_model_len=768), micro_batch_size=4, lr=3e-4,
        warmup_steps=2, seed=3, checkpoint_every=0, filter_groups=False, progress=False,
    )  # fmt: skip
    trainer = GRPOTrainer(config, reward_fn=lambda request: float(len(request.messages[-1]["content"]) % 2))
    history = asyncio.run(trainer.train())
    assert [m["train/lr"] for m in history] == pytest.approx([1e-4, 2e-4, 3e-4])
