"""GEM (gem-llm) environments as step environments: ``gem:game:GuessTheNumber-v0-easy``.

``gem.make(env_id, **env_kwargs)`` makes the environment (env_kwargs override its registered ones, e.g.
``max_turns``); ``reset(seed)`` gives the first observation, each assistant turn is ``step(text)`` ->
``(obs, reward, terminated, truncated, info)``. The step's reward is GEM's own (a game's internal steps
give 0, a win 1, a format error -0.1); the request's return is their sum.

Actions: GEM's games read the move from the LAST ``\\boxed{...}`` in the reply (``\\boxed{7}`` for
GuessTheNumber, ``\\boxed{3 4}`` for Minesweeper, ...); a reply with none is a format error, which ENDS
the episode in every game (reward -0.1). Tell the model so in the record's system message.

Observations: GEM's ``info`` may carry a ``prefix`` and a ``suffix`` ("Enter your next guess."); they are
put around the observation as GEM's own observation wrapper does for the newest turn. The chat holds the
history, so none of GEM's history-concatenating wrappers is applied.

GEM seeds Python's and NumPy's global generators at reset; each episode runs with its own copy of them
(``rollout/envs/episode.py``), so a seed gives the same game however many run at once.
Offline: the word games (Hangman, Wordle, WordSearch) need NLTK's ``words``: ``nltk.download`` only looks on
disk here, and missing data is an EnvError naming it, at the rollout's start check. The ``math:``, ``qa:``
and ``code:`` environments load a Hugging Face dataset when made: where it is not cached, the start check
fails at startup too.
"""

from __future__ import annotations

from typing import Any

from rollout.envs.bindings import require
from rollout.envs.episode import EpisodeRandom, inside
from rollout.envs.step import EnvError, Step, as_step


class GEMBinding:
    """One GEM environment (``gem.make(env_id, **env_kwargs)``), reset with the record's seed."""

    def __init__(self, env_id: str, **env_kwargs: Any):
        gem = require("gem", "gem")
        self.env_id, self.spec = env_id, f"gem:{env_id}"
        self.random = EpisodeRandom()
        with inside(self.random, self.spec):  # GEM games reset once when made
            self.env = gem.make(env_id, **env_kwargs)
        self._over = self._closed = False

    def reset(self, seed: int | None, messages: list[dict[str, Any]]) -> str:
        """The first observation (GEM's instructions, with its suffix)."""
        with inside(self.random, self.spec):
            observation, info = self.env.reset(seed=seed)
        return _framed(observation, info)

    def step(self, action: str) -> Step:
        if self._over:
            raise EnvError(f"gem {self.env_id}: step on an episode that is over")
        with inside(self.random, self.spec):
            result = self.env.step(action)
        step = as_step(result, self.spec)
        if not step.done:
            step.observation = _framed(step.observation, step.info)
        self._over = step.done
        return step

    def close(self) -> None:
        """Close the environment once (most GEM environments have nothing to close)."""
        if self._closed:
            return
        self._closed = True
        close = getattr(self.env, "close", None)
        if callable(close):
            with inside(self.random, self.spec):
                close()


def _framed(observation: Any, info: Any) -> str:
    """GEM's observation with ``info``'s prefix and suffix, as its ObservationWrapper writes the newest turn."""
    text = str(observation if observation is not None else "")
    if isinstance(info, dict):
        if info.get("suffix"):
            text = (text if not text or text.endswith("\n") else text + "\n") + str(info["suffix"])
        if info.get("prefix"):
            text = str(info["prefix"]) + text
    return text
