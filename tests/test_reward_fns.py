"""Named reward functions, their weighted sums, and the choice of one per record by data_source."""

from __future__ import annotations

import asyncio
import math

import pytest
from conftest import ScriptedEngine, call

from data.reward_fns import (
    REWARDS,
    combine,
    format_reward,
    math_reward,
    parse_reward_spec,
    register_reward,
    reward_for_records,
    tool_use_reward,
)
from data.schema import Record
from rollout.loop import RolloutConfig, run_request
from rollout.request import AsyncRolloutRequest, ToolCallRecord
from rollout.runner import RolloutRunner


def finished(answer: str, ground_truth: str | None = "72", data_source: str = "openai/gsm8k", calls=()):
    """A request as the loop leaves it: the prompt, the final assistant message and its tool calls."""
    request = AsyncRolloutRequest(
        "r0", 0, 0, [{"role": "user", "content": "How many?"}], data_source=data_source, ground_truth=ground_truth
    )
    request.messages.append({"role": "assistant", "content": answer})
    request.tool_calls = list(calls)
    return request


OK_CALL = ToolCallRecord(1, "calculator", {"expression": "8*9"}, "72")
FAILED_CALL = ToolCallRecord(1, "calculator", {"expression": "1/0"}, "Error: ...", error="division by zero")
UNREADABLE_CALL = ToolCallRecord(1, "", None, "Error: ...", error="invalid JSON in tool call")


# ----- each reward ------------------------------------------------------------------------------------


def test_math_reward_grades_the_final_answer_against_the_ground_truth():
    assert math_reward(finished("So the answer is \\boxed{72}.")) == 1.0
    assert math_reward(finished("#### 72.0")) == 1.0
    assert math_reward(finished("\\boxed{71}")) == 0.0
    assert math_reward(finished("no answer at all")) == 0.0


def test_math_reward_uses_the_grade_the_loop_already_computed():
    request = finished("\\boxed{71}")
    request.rewards.answer = 1.0
    assert math_reward(request) == 1.0


def test_math_reward_without_a_ground_truth_is_an_error_naming_the_request():
    with pytest.raises(ValueError, match=r"needs a ground_truth.*r0.*openai/gsm8k"):
        math_reward(finished("\\boxed{72}", ground_truth=None))


@pytest.mark.parametrize(
    "answer",
    ["\\boxed{72}", "The total is 72.", "#### 72", "It costs $1,234.50", "**72**"],
)
def test_format_reward_accepts_a_boxed_or_plain_final_answer(answer):
    assert format_reward(finished(answer, calls=[OK_CALL])) == 1.0


@pytest.mark.parametrize("answer", ["I do not know.", "x2", "", call("calculator", expression="8*9") + " 72"])
def test_format_reward_needs_a_final_answer_without_a_tool_call(answer):
    assert format_reward(finished(answer)) == 0.0


def test_format_reward_is_zero_when_a_tool_call_could_not_be_parsed():
    assert format_reward(finished("\\boxed{72}", calls=[OK_CALL, UNREADABLE_CALL])) == 0.0


def test_format_reward_does_not_blame_the_model_for_a_tool_that_failed_to_run():
    assert format_reward(finished("\\boxed{72}", calls=[FAILED_CALL])) == 1.0


def test_tool_use_reward_needs_at_least_one_successful_call():
    assert tool_use_reward(finished("72", calls=[FAILED_CALL, OK_CALL])) == 1.0
    assert tool_use_reward(finished("72", calls=[FAILED_CALL, UNREADABLE_CALL])) == 0.0
    assert tool_use_reward(finished("72")) == 0.0


def test_tools_reward_sums_the_tools_own_rewards():
    request = finished("72")
    request.rewards.tools = {"a": 0.25, "b": 0.5}
    assert REWARDS["tools"](request) == 0.75


# ----- combinations -------------------------------------------------------------------------------------


def test_a_combination_is_the_weighted_sum_of_its_parts():
    reward = combine({"math": 1.0, "format": 0.1, "tool_use": 0.05})
    assert reward(finished("\\boxed{72}", calls=[OK_CALL])) == pytest.approx(1.15)
    assert reward(finished("\\boxed{71}", calls=[OK_CALL])) == pytest.approx(0.15)
    assert reward(finished("I do not know.")) == 0.0


def test_a_combination_with_a_missing_part_is_missing():
    reward = combine({"math": 1.0, "nothing": 0.5}, rewards={"nothing": lambda request: None})
    assert reward(finished("\\boxed{72}")) is None
    reward = combine({"math": 1.0, "nan": 0.5}, rewards={"nan": lambda request: math.nan})
    assert reward(finished("\\boxed{72}")) is None


async def test_a_combination_with_an_async_part_is_awaited():
    async def half(request):
        await asyncio.sleep(0)
        return 0.5

    result = combine({"math": 1.0, "half": 2.0}, rewards={"half": half})(finished("\\boxed{72}"))
    assert asyncio.iscoroutine(result)
    assert await result == 2.0


def test_a_single_unweighted_reward_is_used_as_it_is():
    assert combine({"math": 1.0}) is math_reward


def test_unknown_rewards_and_bad_weights_are_refused_when_the_spec_is_built():
    with pytest.raises(ValueError, match=r"unknown reward 'maths'; known: .*math"):
        combine({"maths": 1.0})
    with pytest.raises(ValueError, match="judge reward needs a Judge"):
        reward_for_records("math+judge")
    with pytest.raises(ValueError, match="weight of reward 'math'"):
        combine({"math": "heavy"})


# ----- specs and dispatch by data_source -----------------------------------------------------------------


def test_spec_strings_and_mappings_parse_to_weights_per_data_source():
    assert parse_reward_spec("math") == {"default": {"math": 1.0}}
    assert parse_reward_spec("math + 0.1*format + -0.5*tool_use") == {
        "default": {"math": 1.0, "format": 0.1, "tool_use": -0.5}
    }
    assert parse_reward_spec("openai/gsm8k=math+0.1*format, default=math") == {
        "openai/gsm8k": {"math": 1.0, "format": 0.1},
        "default": {"math": 1.0},
    }
    assert parse_reward_spec({"openai/gsm8k": {"math": 1.0, "format": 0.1}, "default": "tools"}) == {
        "openai/gsm8k": {"math": 1.0, "format": 0.1},
        "default": {"tools": 1.0},
    }
    assert parse_reward_spec({"math": 1, "format": 0.1}) == {"default": {"math": 1.0, "format": 0.1}}


@pytest.mark.parametrize(
    "spec", ["", "math+", "0.1*", "math*0.1", "=math", {}, {"calc": 3, "default": "math"}, {"calc": []}]
)
def test_malformed_specs_are_refused(spec):
    with pytest.raises(ValueError, match="reward spec"):
        parse_reward_spec(spec)


def test_each_record_gets_the_reward_of_its_data_source():
    reward = reward_for_records({"openai/gsm8k": "math+0.1*format", "calc": "tool_use", "default": "format"})
    assert reward(finished("\\boxed{72}", data_source="openai/gsm8k")) == pytest.approx(1.1)
    assert reward(finished("\\boxed{72}", data_source="calc", calls=[OK_CALL])) == 1.0
    assert reward(finished("\\boxed{72}", data_source="other")) == 1.0


def test_a_data_source_without_a_reward_and_no_default_is_an_error():
    reward = reward_for_records("openai/gsm8k=math")
    with pytest.raises(ValueError, match=r"no reward for data_source 'calc'.*add a 'default' entry"):
        reward(finished("\\boxed{72}", data_source="calc"))


def test_a_registered_reward_can_be_named_in_a_spec():
    @register_reward("answer_length_test")
    def answer_length(request):
        return len(request.messages[-1]["content"]) / 100

    try:
        assert reward_for_records("0.5*answer_length_test")(finished("x" * 10)) == pytest.approx(0.05)
    finally:
        del REWARDS["answer_length_test"]


# ----- through the rollout loop ----------------------------------------------------------------------------


async def test_a_rollout_scores_each_record_with_its_data_sources_reward(chat, tool):
    records = [
        Record(prompt=[{"role": "user", "content": "question 0"}], data_source="openai/gsm8k", ground_truth="7"),
        Record(prompt=[{"role": "user", "content": "question 1"}], data_source="calc", ground_truth="8"),
        Record(prompt=[{"role": "user", "content": "question 2"}], data_source="other", ground_truth="9"),
    ]

    def script(turn, prompt, rid):
        return call("echo", text="ok") if turn == 0 else "\\boxed{7}"

    engine = ScriptedEngine(chat, script)
    reward_fn = reward_for_records("openai/gsm8k=math+0.1*format, calc=math+0.2*tool_use, default=format")
    runner = RolloutRunner(engine, chat, {"echo": tool}, reward_fn=reward_fn, progress=False)
    result = await runner.run(records)
    assert [r.rewards.final for r in result.requests] == pytest.approx([1.1, 0.2, 1.0])
    assert all(r.error is None for r in result.requests)


async def test_the_loop_awaits_an_async_reward(chat, tool):
    async def slow_reward(request):
        await asyncio.sleep(0.01)
        return 0.75

    request = AsyncRolloutRequest("r0", 0, 0, [{"role": "user", "content": "hi"}])
    engine = ScriptedEngine(chat, lambda turn, prompt, rid: "hello")
    await run_request(request, engine, chat, {"echo": tool}, RolloutConfig(), slow_reward)
    assert request.rewards.final == 0.75 and request.error is None


async def test_a_missing_reward_without_a_failed_judgment_is_an_error_not_a_silent_gap(chat, tool):
    request = AsyncRolloutRequest("r0", 0, 0, [{"role": "user", "content": "hi"}])
    engine = ScriptedEngine(chat, lambda turn, prompt, rid: "hello")
    await run_request(request, engine, chat, {"echo": tool}, RolloutConfig(), lambda r: None)
    assert request.rewards.final == 0.0
    assert "the reward function failed: ValueError: gave None, not a finite number" in request.error
