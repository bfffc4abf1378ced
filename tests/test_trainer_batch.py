"""Trajectories -> training samples -> padded tensors."""

from __future__ import annotations

import torch

from rollout.request import AsyncRolloutRequest, ToolCallRecord
from trainer.batch import collate, micro_batches, step_rewards, step_samples, step_spans, trajectory_sample


def three_step_request(final_reward: float) -> AsyncRolloutRequest:
    """prompt [1,2]; turns [10,11] glue [0] tool [5] turn [12] glue [0,6] turn [13,14]."""
    request = AsyncRolloutRequest("r", 0, 0, [{"role": "user", "content": "q"}])
    request.prompt_ids = [1, 2]
    request.append_generated([10, 11], [-0.1, -0.2], 0)
    request.append_context([0, 5])
    request.append_generated([12], [-0.3], 0)
    request.append_context([0, 6])
    request.append_generated([13, 14], [-0.4, -0.5], 0)
    request.tool_calls = [ToolCallRecord(1, "t", {}, "x", reward=0.5), ToolCallRecord(2, "t", {}, "y", reward=-0.1)]
    request.rewards.final = final_reward
    return request


def test_steps_are_the_runs_of_engine_tokens():
    assert step_spans([1, 1, 0, 0, 1, 0, 0, 1, 1]) == [(0, 2), (4, 5), (7, 9)]
    assert step_spans([0, 0]) == [] and step_spans([1]) == [(0, 1)]


def test_step_rewards_add_tool_rewards_per_turn_and_the_final_reward_last():
    assert step_rewards(three_step_request(1.0)) == [0.5, -0.1, 1.0]


def test_trajectory_sample_masks_exactly_the_engine_tokens():
    sample = trajectory_sample(three_step_request(1.0), 0.7)
    assert sample.input_ids == [1, 2, 10, 11, 0, 5, 12, 0, 6, 13, 14]
    assert sample.loss_mask == [0, 0, 1, 1, 0, 0, 1, 0, 0, 1, 1]
    assert sample.engine_logprobs[2:4] == [-0.1, -0.2] and sample.engine_logprobs[4] == 0.0
    assert sample.advantage == 0.7


def test_each_step_sample_is_the_conversation_up_to_that_turn_with_only_its_tokens_masked():
    samples = step_samples(three_step_request(1.0), [0.1, 0.2, 0.3])
    assert [s.input_ids for s in samples] == [
        [1, 2, 10, 11],
        [1, 2, 10, 11, 0, 5, 12],
        [1, 2, 10, 11, 0, 5, 12, 0, 6, 13, 14],
    ]
    assert [s.loss_mask for s in samples] == [
        [0, 0, 1, 1],
        [0, 0, 0, 0, 0, 0, 1],
        [0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1],
    ]
    assert [s.advantage for s in samples] == [0.1, 0.2, 0.3]


def test_collate_pads_on_the_right_with_zero_mask():
    samples = step_samples(three_step_request(1.0), [0.1, 0.2, 0.3])
    batch = collate(samples, pad_id=99)
    assert batch.input_ids.shape == (3, 11)
    assert batch.input_ids[0, 4:].tolist() == [99] * 7
    assert batch.attention_mask.sum(1).tolist() == [4, 7, 11]
    assert batch.loss_mask[0, 4:].sum() == 0
    assert batch.position_ids[1].tolist() == list(range(7)) + [6] * 4
    assert torch.allclose(batch.advantages, torch.tensor([0.1, 0.2, 0.3]))
    assert batch.loss_mask.sum() == 5


def test_micro_batches_cover_every_sample_once_grouped_by_length():
    samples = step_samples(three_step_request(1.0), [0.1, 0.2, 0.3]) * 3
    chunks = micro_batches(samples, 4)
    assert [len(c) for c in chunks] == [4, 4, 1]
    assert sorted(id(s) for c in chunks for s in c) == sorted(id(s) for s in samples)


def test_micro_batches_keep_to_a_padded_token_budget_and_a_long_sample_goes_alone():
    samples = step_samples(three_step_request(1.0), [0.1, 0.2, 0.3]) * 3
    lengths = sorted(len(s.input_ids) for s in samples)
    budget = 2 * lengths[-1]  # two of the longest fit, three do not
    chunks = micro_batches(samples, 16, max_tokens=budget)
    assert all(len(c) * max(len(s.input_ids) for s in c) <= budget for c in chunks)
    assert len(chunks) > 1 and sorted(id(s) for c in chunks for s in c) == sorted(id(s) for s in samples)
    alone = micro_batches(samples, 16, max_tokens=1)
    assert [len(c) for c in alone] == [1] * len(samples)
