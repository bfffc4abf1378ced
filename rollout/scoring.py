"""COMPLETED: a finished request's scores (each tool's calc_reward, the interaction's score, the graded
answer, the final reward) and its token check (``rollout/history.py``)."""

from __future__ import annotations

import asyncio
import inspect
import math
from dataclasses import dataclass
from typing import Any

from data.reward_fns import ANSWER_REWARD_KEY, RewardFn, grade_answer
from rollout.config import RolloutConfig
from rollout.deadlines import within
from rollout.history import check_history
from rollout.reasoning import get_reasoning_format
from rollout.request import AsyncRolloutRequest
from rollout.tokens import ChatTokenizer
from rollout.transcript import Transcript
from rollout.user_threads import CONTAINED
from tools.base import BaseTool


@dataclass
class UserTurns:
    """The interaction (the user's side) of one request: which one, its instance and its kwargs."""

    interaction: Any  # rollout.users.interactions.BaseInteraction or any class with verl's interface
    kwargs: dict[str, Any]  # the record's interaction_kwargs, given to each of its coroutines
    instance_id: str | None = None  # set once start_interaction returned


def default_reward(request: AsyncRolloutRequest) -> float:
    """The graded final answer when the record has a ground truth or its own answer reward (reasoning-gym's
    records), else the interaction's score when there was one, else the tools' rewards."""
    if request.rewards.answer is not None:
        return request.rewards.answer
    if request.rewards.interaction is not None:
        return request.rewards.interaction
    return sum(request.rewards.tools.values())


async def score_request(
    request: AsyncRolloutRequest,
    created: list[tuple[BaseTool, str]],
    chat: ChatTokenizer,
    config: RolloutConfig,
    reward_fn: RewardFn,
    transcript: Transcript | None = None,
    user: UserTurns | None = None,
) -> None:
    """COMPLETED: each tool's calc_reward, the interaction's score, the graded answer, the final
    reward, the token check (against a full re-render, shown through the transcript where it holds)."""
    for tool, instance_id in created:
        kwargs = request.tools_kwargs.get(tool.name, {}).get("calc_reward_kwargs", {})
        try:
            reward = float(await within(tool.calc_reward(instance_id, **kwargs), config.tool_reward_timeout_s))
            if not math.isfinite(reward):
                raise ValueError(f"returned {reward}, not a finite number")
            request.rewards.tools[tool.name] = reward
        except CONTAINED as exc:
            request.rewards.tools[tool.name] = 0.0
            request.metrics.tool_errors += 1
            note_error(request, f"calc_reward of {tool.name} failed: {type(exc).__name__}: {exc}")
    if user is not None and user.instance_id is not None:
        try:
            score = float(await within(user.interaction.calculate_score(user.instance_id, **user.kwargs),
                                       config.tool_reward_timeout_s))  # fmt: skip
            if not math.isfinite(score):
                raise ValueError(f"returned {score}, not a finite number")
            request.rewards.interaction = score
        except CONTAINED as exc:
            note_error(request, f"calculate_score of {interaction_name(user)} failed: {describe_error(exc)}")
    if request.ground_truth is not None or ANSWER_REWARD_KEY in request.extra:
        try:  # math-verify's symbolic fallback (or a task's own checker) can take a while: off the event loop
            request.rewards.answer = await asyncio.to_thread(grade_answer, request)
        except Exception as exc:  # the record's checker failed: no grade, and no reward to train on
            request.rewards.reward_error = f"grading the answer failed: {describe_error(exc)}"
            note_error(request, request.rewards.reward_error)
    try:
        result = reward_fn(request)
        if inspect.isawaitable(result):
            result = await result
        final = math.nan if result is None else float(result)
        if math.isnan(final) and request.rewards.judge_error is not None:
            request.rewards.final = None  # missing, never 0: the judgment failed (see rollout/users/judge.py)
        elif not math.isfinite(final):
            raise ValueError(f"gave {result!r}, not a finite number")
        else:
            request.rewards.final = final
    except CONTAINED as exc:  # 0.0 for the output's readers; reward_error keeps it out of training
        request.rewards.final = 0.0
        request.rewards.reward_error = f"the reward function failed: {type(exc).__name__}: {exc}"
        note_error(request, request.rewards.reward_error)
    if config.check_consistency and request.prompt_ids:
        try:
            request.consistency_diff, request.history_rewrite = check_history(
                chat, request.messages, request.all_ids, request.assistant_texts,
                get_reasoning_format(config.reasoning_parser), transcript,
            )  # fmt: skip
        except Exception as exc:  # a message the template or tokenizer cannot take
            request.consistency_diff = f"the consistency check failed: {type(exc).__name__}: {exc}"


def interaction_name(user: UserTurns) -> str:
    return f"interaction {getattr(user.interaction, 'name', type(user.interaction).__name__)}"


def describe_error(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    return f"{type(exc).__name__}: {exc}"


def note_error(request: AsyncRolloutRequest, message: str) -> None:
    request.error = message if request.error is None else f"{request.error}; {message}"
