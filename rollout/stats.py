"""One definition of every rollout statistic, for every summary: ``rallyrl rollout``'s table,
training metrics, ``rallyrl eval`` and SFT's held-out evaluation.

``RolloutCounts`` holds sums only, so the counts of several processes add up (the trainer sums
them across ranks) before the means are taken. Definitions:

- **accuracy**: right answers / graded requests (a request is graded when its record has a ground
  truth); None when nothing is graded.
- **reward_mean / reward_std**: over the requests whose reward is not missing (a failed judgment).
- **pass_at_n**: graded prompts with at least one right sample / graded prompts.
- **user_turns**: the interaction's replies per request that had an interaction (for the answer
  checker, the attempts); only reported when some request had one.
- **malformed_call_share**: the calls the tool-call parser could not read (``ToolCall.error``: invalid
  JSON, no name, an unclosed ``<tool_call>``) / every call it returned, in every parsed assistant turn
  (the last turn's, which no turn is left to run, included). A broken call counts even where the text
  before it reads as an answer: the loop answers it with its error, so it is a call to the model. A
  turn cut by its token budget is not parsed (``truncated_rate``), and text with no opening tag is an
  answer, not a call. 0.0 when no call was written. Gateway sessions: the gateway answers the agent
  with the calls it can read, so theirs are not counted.
- **tool_error_share**: the calls run that were read but came back as an error (unknown tool, bad
  arguments, a timeout, a tool that raised, beyond ``max_parallel_calls``) / the calls run; malformed
  calls are not in it (``tool_errors`` counts both, and failed ``calc_reward`` calls). 0.0 with none run.
- **staleness**: the policy version minus the weight version that produced each generated token
  (a split gateway session's segments included).
- **consistency_failures**: requests whose re-rendered conversation differed from their tokens, in
  their own tokens or in any segment (counted once).
- **history_rewrites**: requests whose template renders earlier turns otherwise than sampled, as
  their reasoning format declares (not failures; only reported when some request had one).
- **reasoning_tokens**: generated tokens inside reasoning per request; **truncated_in_reasoning**:
  the share of requests whose budget ran out while reasoning (only reported with reasoning).
- **split_sessions**: gateway sessions split into segments because the agent rewrote its history;
  only reported when some request was split.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field, fields

from rollout.request import AsyncRolloutRequest


def is_correct(request: AsyncRolloutRequest) -> bool:
    return request.rewards.answer == 1.0


def has_reward(request: AsyncRolloutRequest) -> bool:
    final = request.rewards.final
    return final is not None and not math.isnan(final)


def accuracy(requests: list[AsyncRolloutRequest]) -> float | None:
    """Right answers / graded requests; None when none is graded."""
    graded = [r for r in requests if r.rewards.answer is not None]
    return sum(is_correct(r) for r in graded) / len(graded) if graded else None


def pass_at_n(requests: list[AsyncRolloutRequest]) -> float | None:
    """Graded prompts with at least one right sample / graded prompts; None when none is graded."""
    by_prompt: dict[int, bool] = {}
    for r in requests:
        if r.rewards.answer is not None:
            by_prompt[r.prompt_index] = by_prompt.get(r.prompt_index, False) or is_correct(r)
    return sum(by_prompt.values()) / len(by_prompt) if by_prompt else None


def _inconsistent(request: AsyncRolloutRequest) -> bool:
    """Whether the request or any of its segments has a consistency diff."""
    return any(piece.consistency_diff is not None for piece in (*request.segments, request))


@dataclass
class RolloutCounts:
    """Sums over a batch of finished requests (add several with ``+``)."""

    requests: int = 0
    rewarded: int = 0
    reward_sum: float = 0.0
    reward_sq_sum: float = 0.0
    graded: int = 0
    correct: int = 0
    generated_tokens: int = 0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    parsed_calls: int = 0
    malformed_calls: int = 0
    failed_calls: int = 0
    interactive: int = 0
    user_turns: int = 0
    errors: int = 0
    truncated: int = 0
    consistency_failures: int = 0
    history_rewrites: int = 0
    reasoning_tokens: int = 0
    truncated_in_reasoning: int = 0
    split_sessions: int = 0
    stale_sum: int = 0
    stale_tokens: int = 0
    stale_max: int = 0
    finish_reasons: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, requests: list[AsyncRolloutRequest], policy_version: int | None = None) -> RolloutCounts:
        """The counts of ``requests``; staleness only when ``policy_version`` is given."""
        rewards = [r.rewards.final for r in requests if has_reward(r)]
        gaps = []
        if policy_version is not None:
            versions = [v for r in requests for piece in (*r.segments, r) for v in piece.weight_versions]
            gaps = [policy_version - v for v in versions if v is not None]
        reasons = Counter(r.finish_reason.value for r in requests if r.finish_reason is not None)
        return cls(
            requests=len(requests),
            rewarded=len(rewards),
            reward_sum=float(sum(rewards)),
            reward_sq_sum=float(sum(x * x for x in rewards)),
            graded=sum(r.rewards.answer is not None for r in requests),
            correct=sum(is_correct(r) for r in requests),
            generated_tokens=sum(r.metrics.generated_tokens for r in requests),
            turns=sum(r.metrics.turns for r in requests),
            tool_calls=sum(r.metrics.tool_calls for r in requests),
            tool_errors=sum(r.metrics.tool_errors for r in requests),
            parsed_calls=sum(r.metrics.parsed_calls for r in requests),
            malformed_calls=sum(r.metrics.malformed_calls for r in requests),
            failed_calls=sum(r.metrics.failed_calls for r in requests),
            interactive=sum(r.rewards.interaction is not None or r.metrics.user_turns > 0 for r in requests),
            user_turns=sum(r.metrics.user_turns for r in requests),
            errors=reasons.get("error", 0),
            truncated=reasons.get("length", 0),
            consistency_failures=sum(_inconsistent(r) for r in requests),
            history_rewrites=sum(r.history_rewrite is not None for r in requests),
            reasoning_tokens=sum(r.metrics.reasoning_tokens for r in requests),
            truncated_in_reasoning=sum(r.metrics.truncated_in_reasoning for r in requests),
            split_sessions=sum(bool(r.segments) for r in requests),
            stale_sum=sum(gaps),
            stale_tokens=len(gaps),
            stale_max=max(gaps, default=0),
            finish_reasons=dict(reasons),
        )

    def sums(self) -> dict[str, float]:
        """The additive fields (for a sum across processes); ``stale_max`` and ``finish_reasons`` are not."""
        skip = ("stale_max", "finish_reasons")
        return {f.name: float(getattr(self, f.name)) for f in fields(self) if f.name not in skip}

    def with_sums(self, sums: dict[str, float], stale_max: int | None = None) -> RolloutCounts:
        """These counts with the additive fields replaced by ``sums`` (summed across processes)."""
        values = asdict(self)
        for name, value in sums.items():
            values[name] = int(value) if isinstance(values[name], int) else float(value)
        if stale_max is not None:
            values["stale_max"] = stale_max
        return RolloutCounts(**values)

    def metrics(self) -> dict[str, float | int | None]:
        """The means, under the names every summary uses (training prefixes them with ``rollout/``)."""
        n = max(self.requests, 1)
        mean = std = 0.0 if not self.requests else math.nan
        if self.rewarded:
            mean = self.reward_sum / self.rewarded
            std = math.sqrt(max(self.reward_sq_sum / self.rewarded - mean**2, 0.0))
        interaction = {"user_turns": self.user_turns / self.interactive} if self.interactive else {}
        split = {"split_sessions": self.split_sessions} if self.split_sessions else {}
        rewrites = {"history_rewrites": self.history_rewrites} if self.history_rewrites else {}
        reasoning = {}
        if self.reasoning_tokens:
            reasoning = {"reasoning_tokens": self.reasoning_tokens / n,
                         "truncated_in_reasoning_rate": self.truncated_in_reasoning / n}  # fmt: skip
        return {
            "trajectories": self.requests,
            "reward_mean": mean,
            "reward_std": std,
            "rewards_missing": self.requests - self.rewarded,
            "accuracy": self.correct / self.graded if self.graded else None,
            "response_length": self.generated_tokens / n,
            "turns": self.turns / n,
            "tool_calls": self.tool_calls / n,
            "tool_errors": self.tool_errors / n,
            "malformed_call_share": self.malformed_calls / self.parsed_calls if self.parsed_calls else 0.0,
            "tool_error_share": self.failed_calls / self.tool_calls if self.tool_calls else 0.0,
            "error_rate": self.errors / n,
            "truncated_rate": self.truncated / n,
            "generated_tokens": self.generated_tokens,
            "consistency_failures": self.consistency_failures,
            "staleness_mean": self.stale_sum / self.stale_tokens if self.stale_tokens else 0.0,
            "staleness_max": self.stale_max,
            **interaction,
            **split,
            **rewrites,
            **reasoning,
        }


SOURCE_SUMS = ("requests", "graded", "correct", "reward")


def source_sums(requests: list[AsyncRolloutRequest], sources: list[str]) -> dict[str, float]:
    """Per data source: requests, graded requests, right answers and the reward's sum, under keys that
    depend only on ``sources`` (so they sum across processes whatever each one rolled out)."""
    sums = {f"{source}|{key}": 0.0 for source in sources for key in SOURCE_SUMS}
    for request in requests:
        if f"{request.data_source}|requests" not in sums:
            continue
        prefix = f"{request.data_source}|"
        sums[prefix + "requests"] += 1
        sums[prefix + "graded"] += request.rewards.answer is not None
        sums[prefix + "correct"] += is_correct(request)
        sums[prefix + "reward"] += request.rewards.final or 0.0
    return sums


def source_metrics(sums: dict[str, float], sources: list[str]) -> dict[str, float]:
    """``accuracy/<source>`` and ``reward_mean/<source>`` from ``source_sums`` (NaN where there was none)."""
    metrics: dict[str, float] = {}
    for source in sources:
        count, graded = sums[f"{source}|requests"], sums[f"{source}|graded"]
        metrics[f"accuracy/{source}"] = sums[f"{source}|correct"] / graded if graded else math.nan
        metrics[f"reward_mean/{source}"] = sums[f"{source}|reward"] / count if count else math.nan
    return metrics
