"""Honest samples: a request that ended in error or abort, or whose reward function raised, is left
out of its group's statistics, trained on nothing, and counted."""

from __future__ import annotations

import math

import orjson
import pytest
from conftest import ScriptedEngine

from rollout.loop import RolloutConfig, run_request
from rollout.request import AsyncRolloutRequest, FinishReason, validate_trajectory
from trainer.groups import exclusion, group_samples, select_groups, usable


def finished(prompt_index: int, sample_index: int, reward: float | None, how: str = "ok") -> AsyncRolloutRequest:
    """A finished request with a reward and two trained tokens; ``how`` is "ok", "error", "abort",
    "reward_error" (the reward function raised: final 0.0) or "missing" (a failed judgment)."""
    request = AsyncRolloutRequest(f"r{prompt_index}-{sample_index}", prompt_index, sample_index, [])
    request.prompt_ids, request.response_ids = [1, 2, 3], [4, 5]
    request.loss_mask, request.logprobs = [1, 1], [-0.5, -0.5]
    request.finish(FinishReason.STOP)
    request.rewards.final = reward
    if how == "error":
        request.finish_reason, request.error = FinishReason.ERROR, "EngineError: server down"
    elif how == "abort":
        request.finish_reason, request.error = FinishReason.ABORT, "aborted by the engine"
    elif how == "reward_error":
        request.rewards.reward_error = "the reward function failed: KeyError: 'answer'"
    elif how == "missing":
        request.rewards.judge_error = "the judge failed"
    return request


def advantages(kept: list[AsyncRolloutRequest], scale: str = "group") -> dict[str, float]:
    samples = group_samples(kept, "trajectory", scale, 1.0)
    return {r.request_id: s.advantage for r, s in zip(kept, samples, strict=True)}


# ----- which requests may be trained on -----------------------------------------------------------


@pytest.mark.parametrize(
    ("how", "reason"),
    [
        ("ok", None),
        ("error", "excluded_errors"),
        ("abort", "excluded_aborts"),
        ("reward_error", "excluded_reward_errors"),
        ("missing", "rewards_missing"),
    ],
)
def test_usable_says_whether_a_finished_request_may_be_trained_on(how, reason):
    request = finished(0, 0, None if how == "missing" else 0.0, how)
    assert exclusion(request) == reason
    assert usable(request) is (reason is None)


def test_the_model_running_out_of_turns_or_length_is_its_own_doing_and_usable():
    for reason in (FinishReason.LENGTH, FinishReason.MAX_TURNS):
        request = finished(0, 0, 0.0)
        request.finish_reason = reason
        assert usable(request)


def test_an_error_with_a_failed_reward_too_is_counted_once_as_an_error():
    request = finished(0, 0, 0.0, "error")
    request.rewards.reward_error = "the reward function failed: ValueError: gave nan"
    _, stats = select_groups([request, finished(0, 1, 1.0)], filter_groups=False, share=1)
    assert (stats["excluded_errors"], stats["excluded_reward_errors"]) == (1, 0)


# ----- select_groups: left out, counted, the group computed over the rest -----------------------------


def test_errors_aborts_and_raised_rewards_are_left_out_and_counted():
    requests = [
        finished(0, 0, 1.0), finished(0, 1, 0.0), finished(0, 2, 0.0, "error"), finished(0, 3, 0.0, "abort"),
        finished(1, 0, 1.0), finished(1, 1, 0.0), finished(1, 2, 0.0, "reward_error"), finished(1, 3, None, "missing"),
    ]  # fmt: skip
    kept, stats = select_groups(requests, filter_groups=False, share=2)
    assert [r.request_id for r in kept] == ["r0-0", "r0-1", "r1-0", "r1-1"]
    assert stats == {"excluded_errors": 1, "excluded_aborts": 1, "excluded_reward_errors": 1,
                     "solve_all": 0, "solve_none": 0, "groups_trained": 2}  # fmt: skip


def test_every_count_is_there_when_nothing_is_excluded_so_processes_sum_the_same_keys():
    _, stats = select_groups([finished(0, 0, 1.0), finished(0, 1, 0.0)], filter_groups=True, share=1)
    assert stats == {"excluded_errors": 0, "excluded_aborts": 0, "excluded_reward_errors": 0,
                     "solve_all": 0, "solve_none": 0, "groups_trained": 1}  # fmt: skip
    _, empty = select_groups([], filter_groups=True, share=1)
    assert set(empty) == set(stats)


def test_the_group_advantages_are_computed_over_the_usable_members_only():
    # with the failed request's 0 counted in, the mean would be 1/3 and the advantages +1.41 / -0.71
    requests = [finished(0, 0, 1.0), finished(0, 1, 0.0), finished(0, 2, 0.0, "error")]
    kept, _ = select_groups(requests, filter_groups=False, share=1)
    assert advantages(kept) == {"r0-0": pytest.approx(1.0, abs=1e-4), "r0-1": pytest.approx(-1.0, abs=1e-4)}


def test_a_raised_reward_does_not_push_its_partial_tokens_down():
    requests = [finished(0, 0, 1.0), finished(0, 1, 1.0), finished(0, 2, 0.0, "reward_error")]
    kept, _ = select_groups(requests, filter_groups=False, share=1)
    samples = group_samples(kept, "trajectory", "group", 1.0)
    assert len(samples) == 2 and all(s.advantage == 0.0 for s in samples)


def test_with_filtering_a_group_whose_remaining_rewards_are_equal_is_dropped_as_uniform():
    requests = [finished(0, 0, 1.0), finished(0, 1, 1.0), finished(0, 2, 0.0, "abort"),
                finished(1, 0, 0.0), finished(1, 1, 0.0, "error")]  # fmt: skip
    kept, stats = select_groups(requests, filter_groups=True, share=2)
    assert kept == []
    assert (stats["solve_all"], stats["solve_none"], stats["groups_trained"]) == (1, 1, 0)
    assert (stats["excluded_errors"], stats["excluded_aborts"]) == (1, 1)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_without_filtering_a_group_left_with_one_member_gets_advantage_zero(scale):
    requests = [finished(0, 0, 1.0), finished(0, 1, 0.0, "error"), finished(0, 2, 0.0, "abort")]
    kept, stats = select_groups(requests, filter_groups=False, share=1)
    assert [r.request_id for r in kept] == ["r0-0"] and stats["groups_trained"] == 1
    assert advantages(kept, scale) == {"r0-0": 0.0}


def test_a_group_with_no_usable_member_is_neither_trained_nor_counted_as_filtered():
    requests = [finished(0, 0, 0.0, "error"), finished(0, 1, 0.0, "error"), finished(1, 0, 1.0), finished(1, 1, 0.0)]
    kept, stats = select_groups(requests, filter_groups=True, share=1)
    assert {r.prompt_index for r in kept} == {1}  # the failed group takes no share slot
    assert (stats["solve_all"], stats["solve_none"], stats["excluded_errors"]) == (0, 0, 2)


# ----- the rollout loop: a raised reward is recorded --------------------------------------------------


async def run(chat, tool, reward_fn, turns=("hello",)) -> AsyncRolloutRequest:
    request = AsyncRolloutRequest("r0", 0, 0, [{"role": "user", "content": "hi"}])
    engine = ScriptedEngine(chat, lambda turn, prompt, rid: turns[min(turn, len(turns) - 1)])
    return await run_request(request, engine, chat, {"echo": tool}, RolloutConfig(), reward_fn)


async def test_a_reward_function_that_raises_sets_reward_error_and_keeps_final_for_the_output(chat, tool):
    def broken(request):
        raise KeyError("answer")

    request = await run(chat, tool, broken)
    assert request.finish_reason is FinishReason.STOP  # the model finished; the reward did not
    assert request.rewards.final == 0.0
    assert request.rewards.reward_error == "the reward function failed: KeyError: 'answer'"
    assert request.rewards.reward_error in request.error
    assert not usable(request)


async def test_a_non_finite_reward_is_a_reward_error(chat, tool):
    request = await run(chat, tool, lambda r: math.inf)
    assert request.rewards.reward_error == "the reward function failed: ValueError: gave inf, not a finite number"


async def test_a_working_reward_function_sets_no_reward_error(chat, tool):
    request = await run(chat, tool, lambda r: 0.25)
    assert request.rewards.final == 0.25 and request.rewards.reward_error is None
    assert usable(request)


async def test_reward_error_round_trips_through_the_record(chat, tool):
    def broken(request):
        raise RuntimeError("grader offline")

    request = await run(chat, tool, broken)
    record = orjson.loads(orjson.dumps(request.to_record()))
    validate_trajectory(record)
    assert record["reward"] == 0.0
    assert record["rewards"]["reward_error"] == "the reward function failed: RuntimeError: grader offline"
    fine = await run(chat, tool, lambda r: 1.0)
    assert orjson.loads(orjson.dumps(fine.to_record()))["rewards"]["reward_error"] is None


async def test_an_engine_failure_from_the_loop_is_left_out_of_its_group(chat, tool):
    ok = await run(chat, tool, lambda r: 1.0)
    failed = await run(chat, tool, lambda r: 0.0, [RuntimeError("server down")])
    other = await run(chat, tool, lambda r: 0.0)
    failed.request_id, failed.sample_index, other.request_id, other.sample_index = "r1", 1, "r2", 2
    assert failed.finish_reason is FinishReason.ERROR
    kept, stats = select_groups([ok, failed, other], filter_groups=True, share=1)
    assert [r.request_id for r in kept] == ["r0", "r2"] and stats["excluded_errors"] == 1
