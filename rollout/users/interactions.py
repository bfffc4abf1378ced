"""Interactions: the user's turn of a conversation, verl's ``BaseInteraction`` interface.

When the model stops without a tool call and its record carries ``interaction_kwargs`` (with
``name``), the rollout loop moves the request to INTERACTING and asks that interaction for the
user's reply: ``generate_response(instance_id, messages, **interaction_kwargs)`` returns
``(should_terminate, user_text, turn_score, metadata)``. The user text is appended as a user
message (context, loss mask 0) and the model answers again, until the interaction ends the
conversation or a budget runs out. Each request gets its own instance (``start_interaction``),
scored at the end (``calculate_score``) and finalized exactly once (``finalize_interaction``).

Interactions load from verl's ``interaction_config`` YAML by import path:

```yaml
interaction:
  - name: checker                                   # the name records use in interaction_kwargs.name
    class_name: rollout.users.interactions:AnswerChecker  # or "pkg.module.Class"; a verl class works as it is
    config: {max_attempts: 3}
```

Built in: ``AnswerChecker`` (tells the model its answer is wrong and asks it to try again, up to
a limit; verl's ``Gsm8kInteraction`` resolves to it) and ``rollout.users.simulated_user:SimulatedUser``
(a user played by a model, with a persona and a goal).
"""

from __future__ import annotations

import asyncio
import uuid
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from data.rewards import score_answer

VERL_ALIASES = {
    "verl.interactions.gsm8k_interaction.Gsm8kInteraction": "rollout.users.interactions:AnswerChecker",
    "verl.interactions.gsm8k_interaction:Gsm8kInteraction": "rollout.users.interactions:AnswerChecker",
}
"""verl's built-in interactions, used where verl itself is not installed (verl 0.9 no longer ships them)."""


class BaseInteraction(ABC):
    """The user's side of a conversation (verl's ``BaseInteraction``). Subclasses override
    ``generate_response`` and, for per-request state, the other coroutines; the defaults keep an
    empty state dict per instance. An interaction that opens connections (a simulated user over
    HTTP) may also be an async context manager: the rollout enters it before the first request."""

    def __init__(self, config: dict[str, Any] | None = None):
        self.config: dict[str, Any] = dict(config or {})
        self.name: str = str(self.config.get("name", type(self).__name__))
        self._instances: dict[str, dict[str, Any]] = {}

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        """Start a per-request instance (``kwargs`` are the record's ``interaction_kwargs``); its id."""
        instance_id = instance_id or uuid.uuid4().hex
        self._instances[instance_id] = dict(kwargs)
        return instance_id

    @abstractmethod
    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        """The user's reply to the conversation so far: (should_terminate, text, turn score, metadata)."""

    async def calculate_score(self, instance_id: str, **kwargs: Any) -> float:
        """The instance's score at the end of the request (0 unless the interaction scores)."""
        return 0.0

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        """Free the instance. Called exactly once for every successful ``start_interaction``."""
        self._instances.pop(instance_id, None)

    @property
    def live_instances(self) -> int:
        """Instances started and not yet finalized."""
        return len(self._instances)


def last_assistant_text(messages: list[dict[str, Any]]) -> str:
    """The content of the last assistant message ("" when there is none)."""
    return next((str(m.get("content") or "") for m in reversed(messages) if m.get("role") == "assistant"), "")


class AnswerChecker(BaseInteraction):
    """A GSM8K-style checker: grades the model's answer against ``ground_truth`` (math-verify, as
    the ``math`` reward does); a wrong answer is answered with ``retry_message`` and the model
    tries again, up to ``max_attempts`` answers in all.

    Config: ``max_attempts`` (3), ``retry_penalty`` (0.0: each attempt after the first takes this
    much off the final score of a correct answer), ``correct_message``,
    ``retry_message``. ``interaction_kwargs``: ``ground_truth`` (else the request's).
    Turn score: 1.0 for a correct answer, 0.0 for a wrong one; ``calculate_score``: the last
    attempt's score less the retry penalty, never below 0.
    """

    def __init__(self, config: dict[str, Any] | None = None):
        super().__init__(config)
        self.max_attempts = int(self.config.get("max_attempts", 3))
        if self.max_attempts < 1:
            raise ValueError(f"AnswerChecker: max_attempts must be >= 1, got {self.max_attempts}")
        self.retry_penalty = float(self.config.get("retry_penalty", 0.0))
        self.correct_message = str(self.config.get("correct_message", "Your answer is correct."))
        self.retry_message = str(
            self.config.get(
                "retry_message", "Your answer is incorrect. Check your work and try again; give only the final answer."
            )
        )

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        ground_truth = kwargs.get("ground_truth")
        if ground_truth is None:
            raise ValueError("AnswerChecker needs interaction_kwargs.ground_truth (the reference answer)")
        instance_id = instance_id or uuid.uuid4().hex
        self._instances[instance_id] = {"ground_truth": str(ground_truth), "attempts": 0, "score": 0.0}
        return instance_id

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        state = self._instances[instance_id]
        state["attempts"] += 1
        # math-verify's symbolic fallback can take a while: keep it off the event loop
        state["score"] = await asyncio.to_thread(score_answer, last_assistant_text(messages), state["ground_truth"])
        metadata = {"attempt": state["attempts"], "correct": state["score"] == 1.0}
        if state["score"] == 1.0:
            return True, self.correct_message, 1.0, metadata
        if state["attempts"] >= self.max_attempts:
            return True, "", 0.0, metadata
        return False, self.retry_message, 0.0, metadata

    async def calculate_score(self, instance_id: str, **kwargs: Any) -> float:
        state = self._instances[instance_id]
        return max(0.0, state["score"] - self.retry_penalty * max(0, state["attempts"] - 1))


class InteractionConfigError(ValueError):
    """An interaction config that cannot be loaded; the message names the file, the entry and the field."""


def build_interactions(entries: list[Any], source: str = "<interactions>") -> dict[str, Any]:
    """Instantiate every entry (``name``, ``class_name``, ``config``) as verl does:
    ``cls(config={**config, "name": name})``. The result maps each name to its interaction."""
    interactions: dict[str, Any] = {}
    for i, entry in enumerate(entries):
        where = f"{source}: interaction[{i}]"
        if not isinstance(entry, dict):
            raise InteractionConfigError(f"{where}: expected a mapping with 'class_name', got {type(entry).__name__}")
        unknown = set(entry) - {"name", "class_name", "config"}
        if unknown:
            raise InteractionConfigError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
        class_name = entry.get("class_name")
        if not isinstance(class_name, str) or not class_name:
            raise InteractionConfigError(f"{where}.class_name: expected an import path like 'pkg.module:Class'")
        config = entry.get("config") or {}
        if not isinstance(config, dict):
            raise InteractionConfigError(f"{where}.config: expected a mapping, got {type(config).__name__}")
        cls = _interaction_class(class_name, where)
        name = entry.get("name") or _default_name(cls)
        if not isinstance(name, str):
            raise InteractionConfigError(f"{where}.name: expected a string, got {type(name).__name__}")
        missing = [m for m in ("start_interaction", "generate_response", "calculate_score", "finalize_interaction")
                   if not callable(getattr(cls, m, None))]  # fmt: skip
        if missing:
            raise InteractionConfigError(f"{where}.class_name: {class_name} has no {', '.join(missing)}")
        try:
            interaction = cls(config={**config, "name": name})
        except Exception as exc:
            raise InteractionConfigError(f"{where}: {class_name} could not be created: {exc}") from None
        if name in interactions:
            raise InteractionConfigError(f"{where}.name: a second interaction named {name!r}")
        interactions[name] = interaction
    return interactions


def _interaction_class(class_name: str, where: str) -> type:
    from tools.registry import import_class

    try:
        return import_class(class_name)
    except Exception as exc:
        alias = VERL_ALIASES.get(class_name)
        if alias is not None:
            return import_class(alias)
        detail = str(exc) if isinstance(exc, ImportError) else f"{type(exc).__name__}: {exc}"
        raise InteractionConfigError(f"{where}.class_name: cannot import {class_name!r}: {detail}") from None


def _default_name(cls: type) -> str:
    """verl's default: the class name without "Interaction", lower case (Gsm8kInteraction -> gsm8k)."""
    name = cls.__name__
    return (name[: -len("Interaction")] if name.endswith("Interaction") and name != "Interaction" else name).lower()


def load_interactions(path: str | Path) -> dict[str, Any]:
    """Read verl's interaction config (YAML or JSON, a top-level ``interaction:`` list) and build it."""
    from tools.registry import read_config_file

    path = Path(path)
    data = read_config_file(path, "interaction config", InteractionConfigError)
    entries = data.get("interaction", data.get("interactions")) if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise InteractionConfigError(f"{path}: expected a top-level 'interaction:' list")
    return build_interactions(entries, str(path))
