"""Named reward functions over a finished rollout request, their weighted sums, and the choice
of one per record by its ``data_source``.

A reward function takes the finished ``AsyncRolloutRequest`` and returns a float, or None when
its reward is *missing* (a failed LLM judgment: the trainer leaves such a request out of its
group's statistics rather than count it as 0). It may also be ``async`` (return an awaitable),
as the LLM judge's is (``rollout/users/judge.py``). Every built-in reward lies in [0, 1]; a spec
weighs them:

    "math"                                          the graded final answer, for every record
    "math+0.1*format"                               a weighted sum, for every record
    "openai/gsm8k=math+0.1*format,default=math"     per data_source, "default" for the rest

or the same as a mapping (YAML)::

    reward:
      openai/gsm8k: {math: 1.0, format: 0.1}
      default: math

``reward_for_records(spec)`` turns a spec into the ``reward_fn`` that ``RolloutRunner`` and
``run_request`` take. The ``judge`` reward needs a configured judge, so it is passed in:
``reward_for_records("math+0.5*judge", rewards={"judge": judge.reward})``.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from data.rewards import extract_answer, score_answer

if TYPE_CHECKING:  # data never imports rollout at run time (dependencies point one way)
    from rollout.request import AsyncRolloutRequest

RewardValue = float | None
"""A reward, or None when it is missing (a failed judgment)."""
RewardFn = Callable[["AsyncRolloutRequest"], RewardValue | Awaitable[RewardValue]]

REWARDS: dict[str, RewardFn] = {}
"""Reward functions by name, as specs name them. Add one with ``@register_reward(name)``."""
DEFAULT_KEY = "default"
"""The spec entry for records whose data_source has none of its own."""
ANSWER_REWARD_KEY = "answer_reward"
"""The ``extra`` key of a record whose answer its own reward grades instead of math-verify (``reasoning_gym``)."""

_NAME = r"[A-Za-z_][\w.\-]*"
_TERM_RE = re.compile(rf"\s*(?:([-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)\s*\*\s*)?({_NAME})\s*")
_ANSWER_TAGS_RE = re.compile(r"<answer>.*?</answer>", re.DOTALL)
"""reasoning-gym's answer format (its ``extract_answer``)."""
_FINAL_NUMBER_RE = re.compile(r"(?<![\w^.])[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?[\s.!*$)\]]*\Z")


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: make a reward function available to specs under ``name`` (a later one replaces it)."""
    if not re.fullmatch(_NAME, name):
        raise ValueError(f"reward name {name!r}: use letters, digits, '_', '.' or '-', starting with a letter")

    def wrap(fn: RewardFn) -> RewardFn:
        REWARDS[name] = fn
        return fn

    return wrap


# ----- what the rewards read from a request ---------------------------------------------------------


def final_answer_text(request: AsyncRolloutRequest) -> str:
    """The content of the last assistant message ("" when the model never answered)."""
    return next((m["content"] for m in reversed(request.messages) if m["role"] == "assistant"), "")


def question_text(request: AsyncRolloutRequest) -> str:
    """The prompt's last user message (the question), before any assistant turn."""
    question = ""
    for message in request.messages:
        if message["role"] == "assistant":
            break
        if message["role"] == "user":
            question = message["content"]
    return question


def has_final_answer(text: str) -> bool:
    """A ``\\boxed{}``, ``####`` or ``<answer>`` answer, or a plain number ending the text, and no tool call in it."""
    if "<tool_call>" in text:
        return False
    if extract_answer(text) is not None or _ANSWER_TAGS_RE.search(text) is not None:
        return True
    return _FINAL_NUMBER_RE.search(text.strip()) is not None


# ----- the built-in rewards --------------------------------------------------------------------------


def grade_answer(request: AsyncRolloutRequest) -> float | None:
    """The final answer's grade (``rewards.answer``): by the reward the record names in
    ``extra["answer_reward"]`` (its task's own checker, e.g. reasoning-gym's), else against
    ``ground_truth`` with math-verify; None when the record has neither. May be slow: call it off the loop."""
    name = request.extra.get(ANSWER_REWARD_KEY)
    if name is not None:
        grade = resolve_reward(str(name))(request)
        if inspect.isawaitable(grade):
            grade.close()  # type: ignore[union-attr]
            raise TypeError(f"the answer reward {name!r} (extra.{ANSWER_REWARD_KEY}) is async; it must answer at once")
        return None if grade is None else float(grade)
    if request.ground_truth is None:
        return None
    return score_answer(final_answer_text(request), request.ground_truth)


@register_reward("math")
def math_reward(request: AsyncRolloutRequest) -> float:
    """1.0 when the final answer equals ``ground_truth`` (math-verify, see data/rewards.py), else 0.0;
    for a record that names its own answer reward (``extra["answer_reward"]``), that reward's grade."""
    if request.rewards.answer is not None:  # graded by the loop already, off the event loop
        return request.rewards.answer
    if request.ground_truth is None:
        raise ValueError(
            f"the math reward needs a ground_truth, and request {request.request_id} "
            f"(data_source {request.data_source!r}) has none: give its records one or choose another reward"
        )
    return score_answer(final_answer_text(request), request.ground_truth)


@register_reward("reasoning_gym")
def reasoning_gym_reward(request: AsyncRolloutRequest) -> float:
    """reasoning-gym's own ``score_answer`` of the answer in ``<answer>`` tags (else ``\\boxed{}``), in
    [0, 1], for the item the record's ``extra["reasoning_gym"]`` re-creates (data/reasoning_gym.py)."""
    if request.rewards.answer is not None and request.extra.get(ANSWER_REWARD_KEY) == "reasoning_gym":
        return request.rewards.answer  # graded by the loop already, off the event loop
    from data.reasoning_gym import score_completion

    return score_completion(request.extra.get("reasoning_gym"), final_answer_text(request))


@register_reward("format")
def format_reward(request: AsyncRolloutRequest) -> float:
    """1.0 when every tool call parsed (valid JSON with a name and an arguments object) and the
    last assistant message gives a final answer (``\\boxed{}``, ``####``, ``<answer>`` or a plain final number)."""
    parsed = all(call.arguments is not None for call in request.tool_calls)  # None only when unreadable
    return 1.0 if parsed and has_final_answer(final_answer_text(request)) else 0.0


@register_reward("tool_use")
def tool_use_reward(request: AsyncRolloutRequest) -> float:
    """1.0 when at least one tool call succeeded, else 0.0; meant as a small bonus (``0.1*tool_use``)."""
    return 1.0 if any(call.error is None for call in request.tool_calls) else 0.0


@register_reward("tools")
def tools_reward(request: AsyncRolloutRequest) -> float:
    """The sum of the tools' own rewards (each tool's calc_reward)."""
    return float(sum(request.rewards.tools.values()))


@register_reward("interaction")
def interaction_reward(request: AsyncRolloutRequest) -> float:
    """The interaction's score of the request (``calculate_score``: for the answer checker, the last
    answer's correctness less its retry penalty); 0.0 for a request without an interaction."""
    score = request.rewards.interaction
    return 0.0 if score is None else float(score)


# ----- weighted sums and the choice by data_source ----------------------------------------------------


def resolve_reward(name: str, rewards: Mapping[str, RewardFn] | None = None) -> RewardFn:
    """The reward function called ``name``: from ``rewards`` first, then the registry."""
    if rewards and name in rewards:
        return rewards[name]
    if name in REWARDS:
        return REWARDS[name]
    known = ", ".join(sorted({*REWARDS, *(rewards or {})}))
    hint = " (the judge reward needs a Judge: pass rewards={'judge': judge.reward})" if name == "judge" else ""
    raise ValueError(f"unknown reward {name!r}{hint}; known: {known}")


def combine(weights: Mapping[str, float], rewards: Mapping[str, RewardFn] | None = None) -> RewardFn:
    """The weighted sum of named rewards, e.g. ``combine({"math": 1.0, "format": 0.1})``.

    Missing when any part is missing (None or NaN). Async when any part answers with an
    awaitable; the awaitable parts then run concurrently.
    """
    if not weights:
        raise ValueError("a reward combination needs at least one reward")
    parts: list[tuple[str, float, RewardFn]] = []
    for name, weight in weights.items():
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise ValueError(f"weight of reward {name!r}: expected a finite number, got {weight!r}")
        parts.append((name, float(weight), resolve_reward(name, rewards)))
    if len(parts) == 1 and parts[0][1] == 1.0:
        return parts[0][2]

    def total(values: list[Any]) -> RewardValue:
        out = 0.0
        for (_, weight, _), value in zip(parts, values, strict=True):
            if value is None or math.isnan(float(value)):
                return None
            out += weight * float(value)
        return out

    async def total_async(values: list[Any]) -> RewardValue:
        pending = [i for i, value in enumerate(values) if inspect.isawaitable(value)]
        for i, value in zip(pending, await asyncio.gather(*(values[i] for i in pending)), strict=True):
            values[i] = value
        return total(values)

    def combined(request: AsyncRolloutRequest) -> RewardValue | Awaitable[RewardValue]:
        values = [fn(request) for _, _, fn in parts]
        if any(inspect.isawaitable(value) for value in values):
            return total_async(values)
        return total(values)

    combined.__name__ = "+".join(f"{weight:g}*{name}" for name, weight, _ in parts)
    return combined


def parse_combination(text: str) -> dict[str, float]:
    """``"math+0.1*format"`` -> ``{"math": 1.0, "format": 0.1}`` (a bare name weighs 1)."""
    weights: dict[str, float] = {}
    for term in text.split("+"):
        match = _TERM_RE.fullmatch(term)
        if match is None:
            raise ValueError(
                f"reward spec {text!r}: cannot read {term.strip()!r}; write terms like 'math' or '0.1*format'"
            )
        name = match[2]
        weights[name] = weights.get(name, 0.0) + (float(match[1]) if match[1] else 1.0)
    return weights


def parse_reward_spec(spec: str | Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """A spec (see the module docstring) as {data_source or "default": {reward name: weight}}."""
    if isinstance(spec, str):
        if "=" not in spec:
            return {DEFAULT_KEY: parse_combination(spec)}
        mapping: dict[str, Any] = {}
        for entry in spec.split(","):
            source, sep, combination = entry.partition("=")
            if not sep or not source.strip():
                raise ValueError(f"reward spec {spec!r}: entry {entry.strip()!r} is not 'data_source=rewards'")
            mapping[source.strip()] = combination
        spec = mapping
    if not isinstance(spec, Mapping) or not spec:
        raise ValueError(f"reward spec: expected a non-empty string or mapping, got {spec!r}")
    if all(isinstance(value, (int, float)) and not isinstance(value, bool) for value in spec.values()):
        return {DEFAULT_KEY: {str(name): float(weight) for name, weight in spec.items()}}  # {math: 1, format: 0.1}
    parsed: dict[str, dict[str, float]] = {}
    for source, value in spec.items():
        if isinstance(value, str):
            parsed[str(source)] = parse_combination(value)
        elif isinstance(value, Mapping) and value:
            parsed[str(source)] = dict(value)
        else:
            raise ValueError(
                f"reward spec for {source!r}: expected 'math+0.1*format' or {{name: weight}}, got {value!r}"
            )
    return parsed


def reward_for_records(spec: str | Mapping[str, Any], rewards: Mapping[str, RewardFn] | None = None) -> RewardFn:
    """A ``reward_fn`` that scores each request with the reward its ``data_source`` has in
    ``spec`` (the ``"default"`` entry for the others). Every name is checked here, not per request;
    ``rewards`` adds named functions for this spec only (``{"judge": judge.reward}``)."""
    by_source = {source: combine(weights, rewards) for source, weights in parse_reward_spec(spec).items()}
    default = by_source.get(DEFAULT_KEY)

    def reward(request: AsyncRolloutRequest) -> RewardValue | Awaitable[RewardValue]:
        fn = by_source.get(request.data_source, default)
        if fn is None:
            raise ValueError(
                f"no reward for data_source {request.data_source!r} in the reward spec "
                f"(it has {', '.join(sorted(by_source))}); add a 'default' entry"
            )
        return fn(request)

    return reward
