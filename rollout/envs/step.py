"""The one shape every step environment is bound to, and the readers that bring the hubs' results to it.

A *binding* wraps one episode of one hub's environment (``rollout/envs/bindings.py`` names them):

```python
class MyBinding:
    def __init__(self, env_id: str, **env_kwargs): ...           # make the environment (no reset yet)
    def reset(self, seed: int | None, messages: list[dict]) -> str | list[dict]  # the first observation
    def step(self, action: str) -> Step | tuple | dict           # the assistant's turn is the action
    def close(self) -> None                                      # optional
```

Each method may be sync (run in a worker thread) or ``async``. ``reset`` gets the record's
prompt (its system message, say) and returns the first user message's text, or the whole
conversation to start from (SkyRL-Gym's ``init`` does). ``step`` may return a ``Step``, a
gymnasium tuple ``(obs, reward, terminated, truncated, info)``, the older ``(obs, reward, done,
info)``, or SkyRL-Gym's mapping ``{observations, reward, done, metadata}``: ``as_step`` reads them all.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Step:
    """One environment step, normalized: the next user message, the step's reward, whether the episode ended."""

    observation: str = ""
    reward: float = 0.0
    done: bool = False
    """The episode is over (won, lost, solved): the request ends with ``stop``."""
    truncated: bool = False
    """The environment's own step limit ended the episode (also ends the request, counted apart)."""
    info: dict[str, Any] = field(default_factory=dict)


class EnvError(RuntimeError):
    """An environment that cannot be made, reset or stepped; the message names the environment."""


def as_step(result: Any, env: str) -> Step:
    """Read whatever a ``step`` returned as a ``Step``; a TypeError naming ``env`` when it is none of the shapes."""
    if isinstance(result, Step):
        step = result
    elif isinstance(result, Mapping):  # SkyRL-Gym's BaseTextEnvStepOutput
        step = Step(observation_text(result.get("observations", result.get("observation", "")), env),
                    _reward(result.get("reward"), env), bool(result.get("done")), bool(result.get("truncated")),
                    dict(result.get("metadata") or result.get("info") or {}))  # fmt: skip
    elif isinstance(result, tuple) and len(result) == 5:  # gymnasium: obs, reward, terminated, truncated, info
        obs, reward, terminated, truncated, info = result
        step = Step(observation_text(obs, env), _reward(reward, env), bool(terminated), bool(truncated), _info(info))
    elif isinstance(result, tuple) and len(result) == 4:  # gym: obs, reward, done, info
        obs, reward, done, info = result
        step = Step(observation_text(obs, env), _reward(reward, env), bool(done), False, _info(info))
    else:
        raise TypeError(
            f"environment {env}: step returned {type(result).__name__}; expected a Step, "
            "(obs, reward, terminated, truncated, info), (obs, reward, done, info) or {observations, reward, done}"
        )
    if step.truncated:
        step.done = True
    return step


def observation_text(observation: Any, env: str = "") -> str:
    """An observation as the text of a user message: a string as it is, UTF-8 bytes decoded, a number
    written out, chat messages joined by their contents, a mapping's ``content`` / ``text`` /
    ``observation`` / ``prompt``; anything else is a TypeError naming ``env``."""
    if observation is None:
        return ""
    if isinstance(observation, str):
        return observation
    if isinstance(observation, bytes | bytearray):
        try:
            return bytes(observation).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise TypeError(f"environment {env}: an observation of bytes that are not UTF-8 text ({exc})") from None
    if isinstance(observation, int | float) and not isinstance(observation, bool):
        return str(observation)
    if isinstance(observation, list):
        return "\n".join(observation_text(item, env) for item in observation)
    if isinstance(observation, Mapping):
        for key in ("content", "text", "observation", "prompt"):
            if key in observation:
                return observation_text(observation[key], env)
        raise TypeError(f"environment {env}: an observation mapping without content, text, observation or prompt "
                        f"(keys: {', '.join(map(str, list(observation)[:8]))})")  # fmt: skip
    raise TypeError(f"environment {env}: an observation of type {type(observation).__name__} is not text; "
                    "return a str (or chat messages)")  # fmt: skip


def first_messages(result: Any, prompt: list[dict[str, Any]], env: str) -> list[dict[str, Any]]:
    """The conversation a request starts from, given what ``reset`` returned: the record's prompt
    and the observation as a user message; a list of chat messages replaces the prompt."""
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], Mapping | type(None)):
        result = result[0]  # (obs, info) as gymnasium's reset returns it
    elif isinstance(result, tuple):
        hint = " (what a step returns)" if len(result) in (4, 5) else ""
        raise TypeError(f"environment {env}: reset returned a tuple of {len(result)}{hint}; expected the first "
                        "observation, (observation, info) or chat messages")  # fmt: skip
    if isinstance(result, list) and result and all(isinstance(m, Mapping) and "role" in m for m in result):
        messages = [{"role": str(m["role"]), "content": observation_text(m.get("content"), env)} for m in result]
        if not any(m["role"] == "user" for m in messages):
            raise TypeError(f"environment {env}: reset gave messages without a user message")
        return messages
    text = observation_text(result, env)
    if not text:
        raise TypeError(f"environment {env}: reset gave no first observation (an empty text)")
    return [*prompt, {"role": "user", "content": text}]


def _reward(value: Any, env: str) -> float:
    if value is None:
        return 0.0
    if isinstance(value, Mapping | list | tuple | str | bytes):  # textarena's {player: reward}: read by its binding
        raise TypeError(f"environment {env}: step reward {_short(value)} is not a number")
    try:
        reward = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"environment {env}: step reward {_short(value)} is not a number") from None
    if not math.isfinite(reward):
        raise ValueError(f"environment {env}: step reward {reward} is not a finite number")
    return reward


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


def _info(info: Any) -> dict[str, Any]:
    return dict(info) if isinstance(info, Mapping) else {}
