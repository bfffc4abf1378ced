"""A tool the model calls to submit its final answer, in verl's gsm8k-tool pattern.

Each request's instance holds the ground truth (from ``create_kwargs.ground_truth``) and the
best score submitted so far. A submission that raises the best score earns a step reward of
0; any other one earns ``non_improving_reward`` (verl's -0.05), so resubmitting is not free.
``calc_reward`` is the best score: 1.0 once a correct answer was submitted.
"""

from __future__ import annotations

import asyncio
from typing import Any

from data.rewards import answers_equal, extract_answer, reference_answer
from tools.base import BaseTool, ToolError, ToolResponse, function_schema

DEFAULT_NON_IMPROVING_REWARD = -0.05


class AnswerCheckTool(BaseTool):
    """``answer_check(answer)``: grade a submitted final answer against the request's ground truth.

    Config key: ``non_improving_reward`` (default -0.05), the step reward of a submission that
    does not improve on the best score so far.
    """

    def __init__(self, config: dict[str, Any] | None = None, schema: dict[str, Any] | None = None):
        super().__init__(config, schema)
        value = self.config.get("non_improving_reward", DEFAULT_NON_IMPROVING_REWARD)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"answer_check config 'non_improving_reward' must be a number, got {value!r}")
        self.non_improving_reward = float(value)
        """Step reward of a submission that does not raise the best score (verl uses -0.05)."""

    @classmethod
    def default_schema(cls) -> dict[str, Any]:
        return function_schema(
            "answer_check",
            "Submit your final answer to be checked. Returns the parsed answer and its reward "
            "(1.0 when correct). Resubmitting an answer that is not better costs a small penalty.",
            {
                "type": "object",
                "properties": {"answer": {"type": "string", "description": "the final answer, a number"}},
                "required": ["answer"],
            },
        )

    async def create(self, instance_id: str | None = None, ground_truth: Any = None, **create_kwargs: Any) -> str:
        """Start an instance for one request; ``ground_truth`` is its reference answer (``"72"``, ``"#### 72"``)."""
        if ground_truth is None or (isinstance(ground_truth, str) and not ground_truth.strip()):
            raise ToolError(
                "answer_check needs create_kwargs.ground_truth (the reference answer, e.g. '72'); "
                "set tools_kwargs.answer_check.create_kwargs.ground_truth in the data record"
            )
        return await super().create(
            instance_id, ground_truth=reference_answer(str(ground_truth)), best_score=0.0, **create_kwargs
        )

    async def execute(self, instance_id: str, parameters: dict[str, Any], **execute_kwargs: Any) -> ToolResponse:
        """Grade ``parameters["answer"]`` (a bare value; ``\\boxed{}`` or ``####`` are unwrapped)."""
        state = self.instance(instance_id)
        answer = parameters.get("answer", "")
        answer = answer if isinstance(answer, str) else str(answer)
        submitted = extract_answer(answer) or answer
        # math-verify may take a while and must not block the event loop; its timeouts are off
        # in answers_equal, so running it in a worker thread is safe.
        correct = await asyncio.to_thread(answers_equal, submitted, state["ground_truth"])
        reward = 1.0 if correct else 0.0
        improved = reward > state["best_score"]
        state["best_score"] = max(state["best_score"], reward)
        return ToolResponse(
            text=f"Current parsed {answer=} {reward=}",
            reward=0.0 if improved else self.non_improving_reward,
            metrics={"score": reward, "improved": improved},
        )

    async def calc_reward(self, instance_id: str, **calc_reward_kwargs: Any) -> float:
        """The best score submitted in this instance (0.0 when nothing was submitted)."""
        return float(self.instance(instance_id)["best_score"])
