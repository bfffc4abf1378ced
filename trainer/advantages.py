"""Group-relative advantages for GRPO, as plain functions over tensors and lists.

Three ways to turn rewards into per-sample advantages:

- **trajectory**: one advantage per trajectory, from its final reward, normalised within
  its group (``trajectory_advantages``); a multi-step trajectory hands it to every step
  sample (``broadcast_advantages``).
- **per-step**: Monte Carlo returns ``G_t = r_t + gamma * G_{t+1}`` per trajectory,
  normalised across the trajectories of the same group at the same step index
  (``per_step_advantages``).

Scaling (``Scale``) after subtracting the group mean:

- ``"group"``: divide by the group's std (GRPO);
- ``"batch"``: divide by the std of all centred values of the batch (REINFORCE++ /
  Dr. GRPO-style variants, keeps the relative size of advantages across groups);
- ``"none"``: centring only.

Every std here is the *population* std (``unbiased=False``): a group of two with rewards
1 and 0 gets advantages +1 and -1 (up to ``eps``). A division is by ``std + eps``.

Groups whose rewards are all equal carry no learning signal under group centring;
``filter_uniform_groups`` drops them and counts them.

A missing reward (a failed LLM judgment) is NaN here: it is left out of its group's mean and
std (and of the batch std) and its advantage comes back NaN; the trainer gives such a request no
sample at all (``present_mask`` picks the others).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

import torch
from torch import Tensor

from trainer.config import AdvantageScale as Scale

_SCALES = get_args(Scale)


def _check_scale(scale: str) -> None:
    if scale not in _SCALES:
        raise ValueError(f"advantage scale must be one of {_SCALES}, got {scale!r}")


def _check_same_length(values: Tensor, group_ids: Tensor, values_name: str) -> None:
    if values.dim() != 1 or group_ids.shape != values.shape:
        raise ValueError(
            f"{values_name} and group_ids must be 1-D tensors of the same length, "
            f"got shapes {tuple(values.shape)} and {tuple(group_ids.shape)}"
        )


def group_normalize(values: Tensor, group_ids: Tensor, scale: Scale, eps: float = 1e-6) -> Tensor:
    """Subtract each group's mean from ``values``, then scale (see the module docstring).

    ``group_ids`` are arbitrary integers (neither contiguous nor sorted). Stds are
    population stds; a group of one sample gets advantage 0 under every scale. NaN values
    (missing rewards) are left out of every mean and std and stay NaN.
    Returns a new tensor shaped like ``values`` (float), detached from any graph.
    """
    _check_scale(scale)
    _check_same_length(values, group_ids, "values")
    values = values.detach()
    if not values.is_floating_point():
        values = values.float()
    if values.numel() == 0:
        return values.clone()
    _, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inverse.max()) + 1
    present = ~values.isnan()
    filled = values.nan_to_num(0.0)
    counts = values.new_zeros(num_groups).index_add_(0, inverse, present.to(values.dtype)).clamp_min(1.0)
    sums = values.new_zeros(num_groups).index_add_(0, inverse, filled)
    centred = values - (sums / counts)[inverse]  # NaN where missing
    if scale == "none":
        return centred
    squares = centred.nan_to_num(0.0).square()
    if scale == "group":
        sq_sums = values.new_zeros(num_groups).index_add_(0, inverse, squares)
        group_std = (sq_sums / counts).sqrt()
        return centred / (group_std[inverse] + eps)
    batch_std = (squares.sum() / present.sum().clamp_min(1)).sqrt()
    return centred / (batch_std + eps)


def present_mask(rewards: list[float | None]) -> Tensor:
    """True where a reward is present (not None, not NaN): the requests that get a training sample."""
    return torch.tensor([r is not None and r == r for r in rewards], dtype=torch.bool)


def trajectory_advantages(rewards: Tensor, group_ids: Tensor, scale: Scale) -> Tensor:
    """One advantage per trajectory: its final reward normalised within its group."""
    return group_normalize(rewards, group_ids, scale)


def broadcast_advantages(trajectory_adv: Tensor, steps_per_trajectory: list[int]) -> Tensor:
    """Repeat each trajectory's advantage for each of its step samples.

    Step samples of one trajectory are contiguous, trajectories in order:
    ``[a0] * steps[0] + [a1] * steps[1] + ...``.
    """
    if trajectory_adv.dim() != 1 or len(steps_per_trajectory) != trajectory_adv.numel():
        raise ValueError(
            f"steps_per_trajectory has {len(steps_per_trajectory)} entries but there are "
            f"{trajectory_adv.numel()} trajectory advantages; give one step count per trajectory"
        )
    if any(steps < 0 for steps in steps_per_trajectory):
        raise ValueError(f"step counts must be >= 0, got {steps_per_trajectory}")
    repeats = torch.tensor(steps_per_trajectory, dtype=torch.long, device=trajectory_adv.device)
    return torch.repeat_interleave(trajectory_adv, repeats)


def discounted_returns(step_rewards: list[float], gamma: float) -> list[float]:
    """Monte Carlo returns ``G_t = r_t + gamma * G_{t+1}`` (``G_T = 0`` past the last step)."""
    returns = [0.0] * len(step_rewards)
    running = 0.0
    for t in reversed(range(len(step_rewards))):
        running = step_rewards[t] + gamma * running
        returns[t] = running
    return returns


def per_step_advantages(
    step_rewards: list[list[float]],
    group_ids: list[int],
    gamma: float,
    scale: Scale,
    eps: float = 1e-6,
) -> list[list[float]]:
    """Per-step advantages: discounted returns normalised per (group, step index).

    Each trajectory's returns come from ``discounted_returns``. The return at step ``t`` is
    centred on the mean return at step ``t`` of the trajectories with the same group id, then
    divided by that cell's std (``"group"``), by the std of all centred returns of the batch
    (``"batch"``), or not at all (``"none"``). Trajectories may differ in length; a step index
    reached by only one trajectory of its group has nothing to compare with and gets
    advantage 0 (under every scale). Returns one list per trajectory, shaped like
    ``step_rewards``.
    """
    _check_scale(scale)
    if len(group_ids) != len(step_rewards):
        raise ValueError(
            f"step_rewards has {len(step_rewards)} trajectories but group_ids has {len(group_ids)} entries; "
            "give one group id per trajectory"
        )
    returns: list[float] = []
    cells: dict[tuple[int, int], int] = {}
    cell_ids: list[int] = []
    for rewards, group_id in zip(step_rewards, group_ids, strict=True):
        for step, value in enumerate(discounted_returns(rewards, gamma)):
            returns.append(value)
            cell_ids.append(cells.setdefault((group_id, step), len(cells)))
    flat = group_normalize(
        torch.tensor(returns, dtype=torch.float64), torch.tensor(cell_ids, dtype=torch.long), scale, eps
    ).tolist()
    out: list[list[float]] = []
    start = 0
    for rewards in step_rewards:
        out.append(flat[start : start + len(rewards)])
        start += len(rewards)
    return out


@dataclass
class GroupFilterStats:
    """What ``filter_uniform_groups`` did, counted in groups (not samples).

    ``solve_all + solve_none + kept == total``.
    """

    solve_all: int
    """Groups dropped because every sample had the same reward >= the solved threshold."""
    solve_none: int
    """Groups dropped because every sample had the same reward < the solved threshold."""
    kept: int
    """Groups kept (their rewards differ)."""
    total: int
    """All groups in the batch."""


def filter_uniform_groups(
    rewards: Tensor, group_ids: Tensor, solved_threshold: float = 1.0
) -> tuple[Tensor, GroupFilterStats]:
    """Keep-mask dropping the groups whose rewards are all (exactly) equal.

    A dropped group counts as ``solve_all`` when its common reward is ``>= solved_threshold``,
    else as ``solve_none``. A group of one sample is uniform, so it is dropped too.
    Returns a bool keep-mask over the samples and the counts in groups.
    """
    _check_same_length(rewards, group_ids, "rewards")
    if rewards.numel() == 0:
        return torch.zeros(0, dtype=torch.bool, device=rewards.device), GroupFilterStats(0, 0, 0, 0)
    rewards = rewards.detach()
    _, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inverse.max()) + 1
    group_min = rewards.new_full((num_groups,), float("inf")).scatter_reduce(0, inverse, rewards, reduce="amin")
    group_max = rewards.new_full((num_groups,), float("-inf")).scatter_reduce(0, inverse, rewards, reduce="amax")
    uniform = group_min == group_max
    solved = uniform & (group_min >= solved_threshold)
    stats = GroupFilterStats(
        solve_all=int(solved.sum()),
        solve_none=int((uniform & ~solved).sum()),
        kept=int((~uniform).sum()),
        total=num_groups,
    )
    return ~uniform[inverse], stats
