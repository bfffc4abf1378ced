"""From a step's finished requests to training samples, group by group.

A group is the ``samples_per_prompt`` requests of one prompt. Requests that say nothing about the
model leave their group first, trained on nothing and out of its mean and std (``exclusion``):
those that ended in ``error`` or ``abort`` (an engine, server or tool-create failure, a
cancellation), those whose reward function raised (``rewards.reward_error``) and those whose
reward is missing (a failed judgment); each kind is counted. With filtering, groups whose
remaining rewards are all equal carry no signal and are dropped (DAPO's dynamic sampling, counted
as solve_all / solve_none); without it, a group left with one member gets advantage 0. Then the
first groups in draw order are kept, up to this process's share of the step.

A split gateway session (``request.segments``) is one member of its group, with one reward and one
advantage, but every piece of it is trained (``trainer/batch.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from rollout.request import AsyncRolloutRequest, FinishReason
from trainer.advantages import (
    broadcast_advantages,
    filter_uniform_groups,
    per_step_advantages,
    present_mask,
    trajectory_advantages,
)
from trainer.batch import Sample, step_rewards, step_samples, trajectory_samples


def exclusion(request: AsyncRolloutRequest) -> str | None:
    """Why a finished request may not be trained on, as the key of its count in ``select_groups``'
    stats (``excluded_errors``, ``excluded_aborts``, ``excluded_reward_errors``, ``rewards_missing``);
    None when it may be. The first that applies wins, so a request is counted once."""
    if request.finish_reason is FinishReason.ERROR:
        return "excluded_errors"
    if request.finish_reason is FinishReason.ABORT:
        return "excluded_aborts"
    if request.rewards.reward_error is not None:
        return "excluded_reward_errors"
    if not present_mask([request.rewards.final])[0]:
        return "rewards_missing"  # a failed judgment, counted by the rollout metrics already
    return None


def usable(request: AsyncRolloutRequest) -> bool:
    """Whether a finished request may be trained on and counted in its group's statistics."""
    return exclusion(request) is None


def select_groups(requests: list[AsyncRolloutRequest], filter_groups: bool,
                  share: int) -> tuple[list[AsyncRolloutRequest], dict[str, float]]:  # fmt: skip
    """The usable requests of the first ``share`` groups with any left, and the counts of this
    process (excluded_errors, excluded_aborts, excluded_reward_errors, solve_all, solve_none,
    groups_trained) to be summed across processes."""
    stats: dict[str, float] = {"excluded_errors": 0, "excluded_aborts": 0, "excluded_reward_errors": 0}
    kept_requests = []
    for request in requests:
        reason = exclusion(request)
        if reason is None:
            kept_requests.append(request)
        elif reason != "rewards_missing":
            stats[reason] += 1
    requests = kept_requests
    rewards = torch.tensor([r.rewards.final for r in requests], dtype=torch.float32)
    groups = torch.tensor([r.prompt_index for r in requests], dtype=torch.long)
    keep = torch.ones(len(requests), dtype=torch.bool)
    stats |= {"solve_all": 0, "solve_none": 0}
    if filter_groups and requests:
        keep, filtered = filter_uniform_groups(rewards, groups)
        stats |= {"solve_all": filtered.solve_all, "solve_none": filtered.solve_none}
    usable_groups = sorted({int(g) for g, k in zip(groups, keep, strict=True) if k})
    chosen = set(usable_groups[:share])  # in draw order
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
        for request, advantage in zip(kept, advantages.tolist(), strict=True):
            samples += trajectory_samples(request, advantage)
        return samples
    steps = [len(step_rewards(r)) for r in kept]  # broadcast: every step sample carries its trajectory's
    flat = broadcast_advantages(advantages, steps).tolist()
    position = 0
    for request, count in zip(kept, steps, strict=True):
        samples += step_samples(request, flat[position : position + count])
        position += count
    return samples
