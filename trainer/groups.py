"""From a step's finished requests to training samples, group by group.

A group is the ``samples_per_prompt`` requests of one prompt. Requests whose reward is missing (a
failed judgment) leave their group first; with filtering, groups whose rewards are all equal carry
no signal and are dropped (DAPO's dynamic sampling, counted as solve_all / solve_none); then the
first groups in draw order are kept, up to this process's share of the step.
"""

from __future__ import annotations

from typing import Any

import torch

from rollout.request import AsyncRolloutRequest
from trainer.advantages import (
    broadcast_advantages,
    filter_uniform_groups,
    per_step_advantages,
    present_mask,
    trajectory_advantages,
)
from trainer.batch import Sample, step_rewards, step_samples, trajectory_sample


def select_groups(requests: list[AsyncRolloutRequest], filter_groups: bool,
                  share: int) -> tuple[list[AsyncRolloutRequest], dict[str, float]]:  # fmt: skip
    """The requests of the first ``share`` usable groups, and the counts of this process
    (solve_all, solve_none, groups_trained) to be summed across processes."""
    present = present_mask([r.rewards.final for r in requests])
    requests = [r for r, p in zip(requests, present.tolist(), strict=True) if p]
    rewards = torch.tensor([r.rewards.final for r in requests], dtype=torch.float32)
    groups = torch.tensor([r.prompt_index for r in requests], dtype=torch.long)
    keep = torch.ones(len(requests), dtype=torch.bool)
    stats: dict[str, float] = {"solve_all": 0, "solve_none": 0}
    if filter_groups and requests:
        keep, filtered = filter_uniform_groups(rewards, groups)
        stats = {"solve_all": filtered.solve_all, "solve_none": filtered.solve_none}
    usable = sorted({int(g) for g, k in zip(groups, keep, strict=True) if k})
    chosen = set(usable[:share])  # in draw order
    stats["groups_trained"] = len(chosen)
    return [r for r in requests if r.prompt_index in chosen], stats


def group_samples(kept: list[AsyncRolloutRequest], mode: str, scale: Any, gamma: float) -> list[Sample]:
    """Training samples with advantages (``GRPOConfig.advantage_mode``, ``advantage_scale``, ``gamma``)."""
    if not kept:
        return []
    rewards = torch.tensor([r.rewards.final for r in kept], dtype=torch.float32)
    groups = torch.tensor([r.prompt_index for r in kept], dtype=torch.long)
    samples: list[Sample] = []
    if mode == "per_step":
        per_step = per_step_advantages([step_rewards(r) for r in kept], groups.tolist(), gamma, scale)
        for request, advantages in zip(kept, per_step, strict=True):
            samples += step_samples(request, advantages)
        return samples
    advantages = trajectory_advantages(rewards, groups, scale)
    if mode == "trajectory":
        return [trajectory_sample(r, advantage) for r, advantage in zip(kept, advantages.tolist(), strict=True)]
    steps = [len(step_rewards(r)) for r in kept]  # broadcast: every step sample carries its trajectory's
    flat = broadcast_advantages(advantages, steps).tolist()
    position = 0
    for request, count in zip(kept, steps, strict=True):
        samples += step_samples(request, flat[position : position + count])
        position += count
    return samples
