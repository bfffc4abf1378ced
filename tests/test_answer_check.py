"""The ``answer_check`` tool: submit, grade, keep the best score, penalise non-improving resubmissions."""

from __future__ import annotations

import pytest

from tools.answer_check import AnswerCheckTool
from tools.base import ToolError


async def test_a_correct_answer_scores_one_with_no_step_penalty() -> None:
    tool = AnswerCheckTool()
    instance_id = await tool.create(ground_truth="72")
    try:
        response = await tool.execute(instance_id, {"answer": "72"})
        assert response.text == "Current parsed answer='72' reward=1.0"
        assert response.reward == 0.0
        assert await tool.calc_reward(instance_id) == 1.0
    finally:
        await tool.release(instance_id)


async def test_a_wrong_first_answer_scores_zero_and_is_penalised() -> None:
    tool = AnswerCheckTool()
    instance_id = await tool.create(ground_truth="72")
    try:
        response = await tool.execute(instance_id, {"answer": "71"})
        assert response.text == "Current parsed answer='71' reward=0.0"
        assert response.reward == -0.05
        assert await tool.calc_reward(instance_id) == 0.0
    finally:
        await tool.release(instance_id)


async def test_the_best_score_is_kept_and_resubmitting_is_penalised() -> None:
    tool = AnswerCheckTool()
    instance_id = await tool.create(ground_truth="72")
    try:
        step_rewards = [(await tool.execute(instance_id, {"answer": a})).reward for a in ["71", "72", "72", "70"]]
        assert step_rewards == [-0.05, 0.0, -0.05, -0.05]
        assert await tool.calc_reward(instance_id) == 1.0
    finally:
        await tool.release(instance_id)


async def test_calc_reward_is_zero_when_nothing_was_submitted() -> None:
    tool = AnswerCheckTool()
    instance_id = await tool.create(ground_truth="72")
    try:
        assert await tool.calc_reward(instance_id) == 0.0
    finally:
        await tool.release(instance_id)


@pytest.mark.parametrize(
    ("answer", "ground_truth"),
    [
        ("1,234", "1234"),
        ("0.75", "\\frac{3}{4}"),
        ("\\boxed{72}", "72"),
        ("#### 72", "72"),
        ("72", "Natalia sold 48/2 = 24 clips.\n#### 72"),
        ("72", 72),
    ],
)
async def test_answers_and_ground_truths_are_unwrapped_before_grading(answer: str, ground_truth: object) -> None:
    tool = AnswerCheckTool()
    instance_id = await tool.create(ground_truth=ground_truth)
    try:
        assert (await tool.execute(instance_id, {"answer": answer})).metrics["score"] == 1.0
    finally:
        await tool.release(instance_id)


async def test_instances_keep_their_own_ground_truth_and_score() -> None:
    tool = AnswerCheckTool()
    first, second = await tool.create(ground_truth="1"), await tool.create(ground_truth="2")
    try:
        await tool.execute(first, {"answer": "1"})
        await tool.execute(second, {"answer": "1"})
        assert [await tool.calc_reward(first), await tool.calc_reward(second)] == [1.0, 0.0]
    finally:
        await tool.release(first)
        await tool.release(second)


async def test_the_penalty_is_configurable() -> None:
    tool = AnswerCheckTool(config={"non_improving_reward": -0.5})
    instance_id = await tool.create(ground_truth="72")
    try:
        assert (await tool.execute(instance_id, {"answer": "0"})).reward == -0.5
    finally:
        await tool.release(instance_id)


@pytest.mark.parametrize("create_kwargs", [{}, {"ground_truth": None}, {"ground_truth": "  "}])
async def test_create_without_a_ground_truth_raises_a_clear_tool_error(create_kwargs: dict[str, object]) -> None:
    with pytest.raises(ToolError, match=r"create_kwargs\.ground_truth"):
        await AnswerCheckTool().create(**create_kwargs)


async def test_release_drops_the_instance() -> None:
    tool = AnswerCheckTool()
    instance_id = await tool.create(ground_truth="72")
    await tool.release(instance_id)
    with pytest.raises(ToolError, match="no live instance"):
        await tool.calc_reward(instance_id)


def test_schema_names_the_tool_and_requires_an_answer() -> None:
    schema = AnswerCheckTool().schema["function"]
    assert schema["name"] == "answer_check"
    assert schema["parameters"]["required"] == ["answer"]
    assert schema["parameters"]["properties"]["answer"]["type"] == "string"
