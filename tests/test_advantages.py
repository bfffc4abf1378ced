"""Group-relative advantages: trajectory, broadcast and per-step modes, scaling, group filtering."""

from __future__ import annotations

import pytest
import torch

from trainer.advantages import (
    GroupFilterStats,
    broadcast_advantages,
    discounted_returns,
    filter_uniform_groups,
    group_normalize,
    per_step_advantages,
    trajectory_advantages,
)

# The worked example: one group, two 3-step trajectories, the first solves the task.
STEP_REWARDS = [[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]
FINAL_REWARDS = torch.tensor([1.0, 0.0])
ONE_GROUP = torch.tensor([0, 0])
# Rewards 1 and 0: mean 0.5, population std 0.5, so a = (1 - 0.5) / 0.5 = 1.
A = 1.0


def approx(values, rel: float = 1e-5):
    return pytest.approx(values, rel=rel, abs=1e-5)


def test_trajectory_mode_gives_plus_and_minus_a_for_the_solved_and_failed_trajectory() -> None:
    adv = trajectory_advantages(FINAL_REWARDS, ONE_GROUP, "group")
    assert adv.tolist() == approx([A, -A])


def test_broadcast_gives_every_step_sample_its_trajectorys_advantage_in_order() -> None:
    adv = broadcast_advantages(torch.tensor([A, -A]), [3, 3])
    assert adv.tolist() == [A, A, A, -A, -A, -A]


def test_broadcast_handles_trajectories_of_different_lengths() -> None:
    adv = broadcast_advantages(torch.tensor([1.0, 2.0, 3.0]), [1, 0, 2])
    assert adv.tolist() == [1.0, 3.0, 3.0]


def test_discounted_returns_are_monte_carlo_with_gamma() -> None:
    assert discounted_returns([0.0, 0.0, 1.0], 0.95) == approx([0.9025, 0.95, 1.0])
    assert discounted_returns([0.0, 0.0, 0.0], 0.95) == [0.0, 0.0, 0.0]


def test_per_step_mode_gives_plus_and_minus_a_at_every_step_index() -> None:
    adv = per_step_advantages(STEP_REWARDS, [0, 0], gamma=0.95, scale="group")
    assert adv[0] == approx([A, A, A])
    assert adv[1] == approx([-A, -A, -A])


def test_per_step_mode_without_scaling_keeps_the_centred_discounted_returns() -> None:
    adv = per_step_advantages(STEP_REWARDS, [0, 0], gamma=0.95, scale="none")
    # Centred on the step mean: (G_t - 0) / 2 on either side.
    assert adv[0] == approx([0.45125, 0.475, 0.5])
    assert adv[1] == approx([-0.45125, -0.475, -0.5])


def test_per_step_mode_gives_zero_at_a_step_reached_by_only_one_trajectory_of_the_group() -> None:
    adv = per_step_advantages([[0.0, 1.0], [0.0, 0.0, 0.0]], [0, 0], gamma=1.0, scale="group")
    assert adv[0] == approx([A, A])
    assert adv[1] == approx([-A, -A, 0.0])


def test_per_step_mode_compares_only_trajectories_of_the_same_group() -> None:
    adv = per_step_advantages([[1.0], [0.0], [5.0]], [0, 0, 1], gamma=1.0, scale="group")
    assert adv == [approx([A]), approx([-A]), [0.0]]


def test_per_step_batch_scale_divides_by_the_std_of_all_centred_returns() -> None:
    # Group 0 centred returns: +-0.5; group 1: +-2. Batch population std: sqrt(2.125).
    adv = per_step_advantages([[1.0], [0.0], [4.0], [0.0]], [0, 0, 1, 1], gamma=1.0, scale="batch")
    std = 2.125**0.5
    assert [a[0] for a in adv] == approx([0.5 / std, -0.5 / std, 2 / std, -2 / std])


# Two groups of two: group 0 rewards (1, 0) centre to +-0.5, group 1 rewards (4, 0) to +-2.
TWO_GROUP_REWARDS = torch.tensor([1.0, 0.0, 4.0, 0.0])
TWO_GROUP_IDS = torch.tensor([0, 0, 1, 1])


def test_group_scale_divides_each_group_by_its_own_std() -> None:
    adv = group_normalize(TWO_GROUP_REWARDS, TWO_GROUP_IDS, "group")
    assert adv.tolist() == approx([1.0, -1.0, 1.0, -1.0])


def test_batch_scale_divides_by_the_std_of_all_centred_values_keeping_group_magnitudes() -> None:
    adv = group_normalize(TWO_GROUP_REWARDS, TWO_GROUP_IDS, "batch")
    std = ((0.5**2 * 2 + 2.0**2 * 2) / 4) ** 0.5  # population std of (0.5, -0.5, 2, -2)
    assert adv.tolist() == approx([0.5 / std, -0.5 / std, 2 / std, -2 / std])


def test_none_scale_only_centres_each_group() -> None:
    adv = group_normalize(TWO_GROUP_REWARDS, TWO_GROUP_IDS, "none")
    assert adv.tolist() == approx([0.5, -0.5, 2.0, -2.0])


def test_group_ids_need_not_be_sorted_or_contiguous() -> None:
    adv = group_normalize(torch.tensor([1.0, 4.0, 0.0, 0.0]), torch.tensor([7, 3, 7, 3]), "none")
    assert adv.tolist() == approx([0.5, 2.0, -0.5, -2.0])


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_a_single_sample_group_gets_advantage_zero(scale: str) -> None:
    adv = group_normalize(torch.tensor([1.0, 0.0, 0.7]), torch.tensor([0, 0, 1]), scale)
    assert adv[2].item() == 0.0
    assert torch.isfinite(adv).all()


def test_a_group_with_equal_rewards_gets_advantage_zero_not_nan() -> None:
    adv = group_normalize(torch.tensor([1.0, 1.0, 1.0]), torch.tensor([0, 0, 0]), "group")
    assert adv.tolist() == [0.0, 0.0, 0.0]


def test_an_unknown_scale_is_an_error_naming_the_choices() -> None:
    with pytest.raises(ValueError, match="group"):
        group_normalize(TWO_GROUP_REWARDS, TWO_GROUP_IDS, "std")  # type: ignore[arg-type]


def test_filter_uniform_groups_drops_equal_reward_groups_and_counts_them() -> None:
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.5, 0.5])
    group_ids = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    keep, stats = filter_uniform_groups(rewards, group_ids, solved_threshold=1.0)
    assert keep.tolist() == [False, False, False, False, True, True, False, False]
    # Group 3 is uniform at 0.5 < threshold: it counts as solve_none.
    assert stats == GroupFilterStats(solve_all=1, solve_none=2, kept=1, total=4)


def test_filter_uniform_groups_uses_the_solved_threshold() -> None:
    _, stats = filter_uniform_groups(torch.tensor([0.5, 0.5]), torch.tensor([0, 0]), solved_threshold=0.5)
    assert stats == GroupFilterStats(solve_all=1, solve_none=0, kept=0, total=1)
