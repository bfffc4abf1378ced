"""SkyRL-Gym environments as step environments: ``skyrl_gym:gsm8k_multi_turn``.

Made as SkyRL's generator makes them: ``skyrl_gym.make(env_id, env_config=..., extras=...)``, with
``env_kwargs``'s ``env_config`` (a mapping, given to the environment as an OmegaConf DictConfig, as SkyRL
does) and ``extras`` (the record's columns SkyRL passes: ``reward_spec: {ground_truth: ...}``,
``max_turns``, ``extra_info``, ...). For example, a record of the multi-turn GSM8K environment:

```yaml
interaction_kwargs:
  name: env
  env: skyrl_gym:gsm8k_multi_turn
  env_kwargs: {extras: {reward_spec: {ground_truth: "72"}, max_turns: 3}}
```

``reset`` passes the record's prompt (its chat messages) to ``init`` and starts from the conversation
it returns; SkyRL's environments take no seed. Each assistant turn is ``step(text)`` -> ``{observations,
reward, done, metadata}``: the observations' messages (joined) are the next user turn, the reward the
turn's. A ``postprocessed_action`` is kept in the step's info only: the model's tokens are never rewritten.
When the episode ends, the environment's ``get_metrics()`` are in the last step's info.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rollout.envs.bindings import require
from rollout.envs.step import EnvError, Step, as_step

START_CHECK_PROMPT = "(start check)"
"""The question ``init`` gets where a reset has no prompt: SkyRL's environments start from the record's."""


class SkyRLGymBinding:
    """One SkyRL-Gym environment (``skyrl_gym.make(env_id, env_config=, extras=)``)."""

    def __init__(self, env_id: str, *, env_config: Any = None, extras: Mapping[str, Any] | None = None,
                 **make_kwargs: Any):  # fmt: skip
        skyrl_gym = require("skyrl_gym", "skyrl-gym")
        self.env_id = env_id
        if env_config is None or isinstance(env_config, Mapping):
            from omegaconf import OmegaConf  # a dependency of skyrl-gym

            env_config = OmegaConf.create(dict(env_config or {}))
        self.env = skyrl_gym.make(env_id, env_config=env_config, extras=dict(extras or {}), **make_kwargs)
        self._over = self._closed = False

    def reset(self, seed: int | None, messages: list[dict[str, Any]]) -> Any:
        """``init`` with the record's prompt: the conversation to start from (or its first observation).
        Without a prompt (the rollout's start check resets with none) it is given a placeholder question."""
        prompt = [dict(m) for m in messages] or [{"role": "user", "content": START_CHECK_PROMPT}]
        observation, _ = self.env.init(prompt)
        return observation

    def step(self, action: str) -> Step:
        if self._over:
            raise EnvError(f"skyrl_gym {self.env_id}: step on an episode that is over")
        result = self.env.step(action)
        step = as_step(result, f"skyrl_gym:{self.env_id}")
        if isinstance(result, Mapping) and result.get("postprocessed_action") is not None:
            step.info["postprocessed_action"] = result["postprocessed_action"]
        self._over = step.done
        if step.done:
            metrics = getattr(self.env, "get_metrics", None)
            step.info["metrics"] = dict(metrics() or {}) if callable(metrics) else {}
        return step

    def close(self) -> None:
        """Close the environment once."""
        if not self._closed:
            self._closed = True
            self.env.close()
