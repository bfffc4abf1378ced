"""One rollout request: its state, tokens, tool calls, rewards, metrics and trace.

States: PENDING -> RUNNING -> ((TOOL_CALLING | INTERACTING) -> RUNNING)* -> COMPLETED, where
INTERACTING is the user's turn (an interaction, ``rollout/users/interactions.py``). Every transition is
appended to ``trace`` with a ``time.monotonic()`` timestamp; ``metrics.state_seconds`` adds up
the time spent in each state.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class RequestState(str, Enum):
    PENDING = "pending"
    RUNNING = "running"
    TOOL_CALLING = "tool_calling"
    INTERACTING = "interacting"
    COMPLETED = "completed"


_STATE_NAMES = {state: state.value for state in RequestState}  # (an enum's .value is slow on a hot path)


class FinishReason(str, Enum):
    STOP = "stop"  # the model answered without calling a tool (and the user, if any, ended the conversation)
    LENGTH = "length"  # max_new_tokens of a turn or max_model_len reached
    MAX_TURNS = "max_turns"  # still calling tools, or the user still talking, when the turn budget ran out
    ABORT = "abort"  # cancelled or aborted by the engine
    ERROR = "error"  # an engine or tool failure that ended this request (see ``error``)


@dataclass
class ToolCallRecord:
    """One tool call as it happened. ``error`` is set when the call failed (its text says why)."""

    turn: int
    name: str
    arguments: dict[str, Any] | None
    text: str
    latency_s: float = 0.0
    error: str | None = None
    reward: float = 0.0
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass
class InteractionTurn:
    """One user turn played by an interaction, answering assistant turn ``turn``."""

    turn: int
    text: str  # appended as a user message, unless ``terminated``
    score: float  # the interaction's score of that assistant turn
    terminated: bool  # the interaction ended the conversation here
    latency_s: float = 0.0
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class Segment:
    """An earlier sample of a gateway session (``rollout/gateway/session.py``): the agent rewrote the
    conversation after it (truncated, summarised, edited), so the session went on in a new sample.
    It is trained like the request's own tokens, with the session's reward; the request's own
    ``prompt_ids``/``response_ids`` are the session's last sample."""

    messages: list[dict[str, Any]]
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float | None]
    weight_versions: list[int | None]
    turns: int  # assistant turns generated in this sample
    split_reason: str  # why the session went on in a new sample after this one
    consistency_diff: str | None = None


@dataclass(slots=True)
class TraceEvent:
    state: RequestState
    t: float  # time.monotonic()


@dataclass
class RequestMetrics:
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    parsed_calls: int = 0  # every call the tool-call parser returned, malformed ones and the last turn's included
    malformed_calls: int = 0  # of those, the calls it could not read (``ToolCall.error``)
    failed_calls: int = 0  # calls run that were read but came back as an error (unknown tool, bad arguments, ...)
    user_turns: int = 0  # replies of the interaction (INTERACTING), the one that ended it included
    generated_tokens: int = 0
    reasoning_tokens: int = 0  # generated tokens inside reasoning (``RolloutConfig.reasoning_parser``)
    truncated_in_reasoning: bool = False  # a budget ran out before the reasoning closed
    state_seconds: dict[str, float] = field(default_factory=dict)


@dataclass
class Rewards:
    step: list[float] = field(default_factory=list)  # ToolResponse.reward, in call order
    tools: dict[str, float] = field(default_factory=dict)  # each tool's calc_reward
    answer: float | None = None  # the final answer graded against ground_truth (None without one)
    final: float | None = 0.0  # what the trainer optimises; None: missing (a failed judgment), not trained on
    judge: float | None = None  # the LLM judge's score in [0, 1] (None: not judged, or the judgment failed)
    judge_error: str | None = None  # why the judgment failed (rollout/users/judge.py); the only reason final is None
    reward_error: str | None = None  # why the reward function raised (final stays 0.0); not trained on
    interaction: float | None = None  # the interaction's calculate_score (None: no interaction)
    turn_scores: list[float] = field(default_factory=list)  # the interaction's score of each user turn
    posted: float | None = None  # the reward posted to the agent gateway for this session (it is the final)


@dataclass
class AsyncRolloutRequest:
    """The unit the rollout loop moves through its states. Token lists stay aligned:
    ``len(response_ids) == len(loss_mask) == len(logprobs)``; ``logprobs[i]`` is None where
    ``loss_mask[i] == 0``."""

    request_id: str
    prompt_index: int
    sample_index: int
    messages: list[dict[str, Any]]
    data_source: str = "unknown"
    ground_truth: str | None = None
    tools_kwargs: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    state: RequestState = RequestState.PENDING
    finish_reason: FinishReason | None = None
    error: str | None = None
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    weight_versions: list[int | None] = field(default_factory=list)
    tool_instance_ids: dict[str, str] = field(default_factory=dict)
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    interaction_turns: list[InteractionTurn] = field(default_factory=list)
    rewards: Rewards = field(default_factory=Rewards)
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    trace: list[TraceEvent] = field(default_factory=list)
    consistency_diff: str | None = None
    history_rewrite: str | None = None
    """The chat template renders earlier turns otherwise than they were sampled, as the reasoning
    format declares (e.g. Qwen3 drops earlier reasoning); the tokens stay as sampled (``rollout/history.py``)."""
    segments: list[Segment] = field(default_factory=list)
    """Earlier samples of a gateway session whose history the agent rewrote; empty otherwise."""
    assistant_texts: list[str] = field(default_factory=list, repr=False)
    """Each assistant turn's text as generated (reasoning included), in order; not written out."""

    def __post_init__(self) -> None:
        if not self.trace:
            self.trace.append(TraceEvent(self.state, time.monotonic()))

    def transition(self, state: RequestState) -> None:
        """Move to ``state`` and record it; time in the old state goes to ``metrics``."""
        now = time.monotonic()
        last = self.trace[-1]
        spent, name = self.metrics.state_seconds, _STATE_NAMES[last.state]
        spent[name] = spent.get(name, 0.0) + now - last.t
        self.state = state
        self.trace.append(TraceEvent(state, now))

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        """Set the finish reason once (the first reason wins)."""
        if self.finish_reason is None:
            self.finish_reason = reason
            self.error = error

    def append_generated(self, ids: list[int], logprobs: list[float], weight_versions: list[int] | int | None) -> None:
        """Engine tokens: trained on (mask 1), logprobs and the weight version of each kept."""
        if not isinstance(weight_versions, list):
            weight_versions = [weight_versions] * len(ids)  # type: ignore[list-item]
        self.response_ids += ids
        self.loss_mask += [1] * len(ids)
        self.logprobs += logprobs
        self.weight_versions += weight_versions
        self.metrics.generated_tokens += len(ids)

    def append_context(self, ids: list[int]) -> None:
        """Template glue and tool output: context only (mask 0, no logprob)."""
        self.response_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [None] * len(ids)
        self.weight_versions += [None] * len(ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def to_record(self) -> dict[str, Any]:
        """The JSONL form of a finished request (field names as in the README)."""
        start = self.trace[0].t
        return {
            "request_id": self.request_id,
            "prompt_index": self.prompt_index,
            "sample_index": self.sample_index,
            "state": self.state.value,
            "finish_reason": self.finish_reason.value if self.finish_reason else None,
            "error": self.error,
            "data_source": self.data_source,
            "ground_truth": self.ground_truth,
            "messages": self.messages,
            "prompt_ids": self.prompt_ids,
            "response_ids": self.response_ids,
            "loss_mask": self.loss_mask,
            "logprobs": self.logprobs,
            "weight_versions": self.weight_versions,
            "reward": self.rewards.final,  # the top-level key readers (sft, show, export) use
            "rewards": _fields(self.rewards),
            "turns": self.metrics.turns,
            "tool_calls": [_fields(call) for call in self.tool_calls],
            "interaction_turns": [_fields(turn) for turn in self.interaction_turns],
            "metrics": _fields(self.metrics),
            "consistency_diff": self.consistency_diff,
            **({"history_rewrite": self.history_rewrite} if self.history_rewrite else {}),  # (only when declared)
            "segments": [_fields(segment) for segment in self.segments],
            "trace": [{"state": e.state.value, "t": round(e.t - start, 6)} for e in self.trace],
            "trace_start": start,
        }


def _fields(record: Any) -> dict[str, Any]:
    """A flat dataclass's fields as a dict, its containers shared (``dataclasses.asdict`` deep-copies
    every list and dict: 0.4 ms of a request's record, written once per request)."""
    return dict(vars(record))


TRAJECTORY_FIELDS = (
    "request_id", "prompt_index", "sample_index", "state", "finish_reason", "messages", "prompt_ids",
    "response_ids", "loss_mask", "logprobs", "reward", "turns", "tool_calls", "trace",
)  # fmt: skip


def validate_trajectory(obj: Any) -> None:
    """Check one JSONL trajectory (``to_record`` output); a ValueError names the broken field."""
    if not isinstance(obj, dict):
        raise ValueError(f"a trajectory must be a JSON object, got {type(obj).__name__}")
    missing = [name for name in TRAJECTORY_FIELDS if name not in obj]
    if missing:
        raise ValueError(f"missing field(s): {', '.join(missing)}")
    if obj["state"] != RequestState.COMPLETED.value:
        raise ValueError(f"state: expected 'completed', got {obj['state']!r}")
    if obj["finish_reason"] not in {reason.value for reason in FinishReason}:
        raise ValueError(f"finish_reason: unknown value {obj['finish_reason']!r}")
    for name in ("tool_calls", "trace"):
        if not isinstance(obj[name], list):
            raise ValueError(f"{name}: expected a list")
    _validate_sample(obj, "")
    if "segments" in obj:  # a split gateway session's earlier samples (absent in older files)
        _validate_segments(obj["segments"])
    if obj["reward"] is None:  # missing: allowed only where the judgment failed (rewards.judge_error)
        rewards = obj.get("rewards")
        if not isinstance(rewards, dict) or not isinstance(rewards.get("judge_error"), str):
            raise ValueError("reward: null is allowed only for a failed judgment (rewards.judge_error); none is set")
    elif not isinstance(obj["reward"], (int, float)):
        raise ValueError(f"reward: expected a number, got {obj['reward']!r}")


def _validate_sample(obj: dict[str, Any], where: str) -> None:
    """The tokens and messages of one sample: the trajectory's own (``where`` empty) or a segment's
    (``where`` = ``"segments[i]."``, which prefixes every field named in an error)."""
    for name in ("prompt_ids", "response_ids", "loss_mask", "logprobs", "messages"):
        if not isinstance(obj[name], list):
            raise ValueError(f"{where}{name}: expected a list")
    response, mask, logprobs = obj["response_ids"], obj["loss_mask"], obj["logprobs"]
    if not (len(response) == len(mask) == len(logprobs)):
        raise ValueError(
            f"{where}response_ids, {where}loss_mask and {where}logprobs differ in length "
            f"({len(response)}, {len(mask)}, {len(logprobs)})"
        )
    if not all(isinstance(t, int) for t in obj["prompt_ids"] + response):
        raise ValueError(f"{where}prompt_ids/{where}response_ids: expected token ids (integers)")
    for i, (m, lp) in enumerate(zip(mask, logprobs, strict=True)):
        if m not in (0, 1):
            raise ValueError(f"{where}loss_mask[{i}]: expected 0 or 1, got {m!r}")
        if (m == 1) != isinstance(lp, (int, float)) or (m == 0 and lp is not None):
            raise ValueError(f"{where}logprobs[{i}]: must be a number where loss_mask is 1 and null where it is 0")
    for i, message in enumerate(obj["messages"]):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise ValueError(f"{where}messages[{i}]: expected an object with a string 'content'")
        if message.get("role") not in ("system", "user", "assistant", "tool"):
            raise ValueError(f"{where}messages[{i}].role: unknown role {message.get('role')!r}")


SEGMENT_FIELDS = ("messages", "prompt_ids", "response_ids", "loss_mask", "logprobs", "turns", "split_reason")


def _validate_segments(segments: Any) -> None:
    """``segments``: a list of ``Segment`` objects, each checked as a sample of its own."""
    if not isinstance(segments, list):
        raise ValueError("segments: expected a list")
    for i, segment in enumerate(segments):
        where = f"segments[{i}]."
        if not isinstance(segment, dict):
            raise ValueError(f"segments[{i}]: expected an object")
        missing = [name for name in SEGMENT_FIELDS if name not in segment]
        if missing:
            raise ValueError(f"segments[{i}]: missing field(s): {', '.join(missing)}")
        _validate_sample(segment, where)
        turns = segment["turns"]
        if not isinstance(turns, int) or isinstance(turns, bool) or turns < 0:
            raise ValueError(f"{where}turns: expected a count (an integer >= 0), got {turns!r}")
        if not isinstance(segment["split_reason"], str):
            raise ValueError(f"{where}split_reason: expected a string, got {segment['split_reason']!r}")
