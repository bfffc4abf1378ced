"""What the step-environment tests check of every rollout (tests/test_env_bindings.py, tests/test_openenv.py):
an engine wrapper that records the tokens it returned, and the conversation check."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from rollout.request import AsyncRolloutRequest, FinishReason
from rollout.tokens import ChatTokenizer


class Recorder:
    """An engine that keeps every token the engine it wraps returned, per request."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.emitted: dict[str, list[int]] = defaultdict(list)

    async def generate(self, input_ids: list[int], sampling: Any, rid: str) -> Any:
        generation = await self.engine.generate(input_ids, sampling, rid)
        self.emitted[rid].extend(generation.output_ids)
        return generation

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


def check_conversation(request: AsyncRolloutRequest, emitted: list[int], chat: ChatTokenizer, min_turns: int = 2):
    """Token-exact, trained on exactly the engine's tokens, every observation a masked-0 user turn."""
    assert request.error is None and request.finish_reason is FinishReason.STOP, (request.finish_reason, request.error)
    assert request.consistency_diff is None
    assert len(request.interaction_turns) >= min_turns
    assert sum(request.loss_mask) == len(emitted)
    assert [t for t, m in zip(request.response_ids, request.loss_mask, strict=True) if m] == emitted
    observations = [m["content"] for m in request.messages if m["role"] == "user"][1:]
    assert len(observations) == len(request.interaction_turns) - 1  # the last step ended the episode
    for text in observations:
        ids = chat.encode(text)
        starts = [i for i in range(len(request.response_ids)) if request.response_ids[i : i + len(ids)] == ids]
        assert starts, f"observation {text[:60]!r} is not in the response tokens"
        assert all(request.loss_mask[starts[0] + k] == 0 for k in range(len(ids)))
