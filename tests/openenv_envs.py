"""Small OpenEnv environments for tests/test_openenv.py, served by openenv's own ``create_app`` in a
subprocess that rallyrl starts on loopback (``tools/openenv_server.py``).

    CounterEnv     a typed game: each step echoes how long the move was, rewards 0.1, 0.2, 0.3 ... and
                   ends after ``ROUNDS`` steps; ``counter_app`` serves it with a ``/counts`` route (the
                   sessions this server process opened and closed)
    CrashEnv       a typed game whose server process dies on the second step of every episode
    TargetMCPEnv   an MCP environment: tools ``add`` and ``guess`` (a target drawn from the seed); a
                   correct guess rewards 1.0 and ends the episode, any other call rewards 0.1 (or 0);
                   ``target_app`` serves it with ``/counts``
"""

from __future__ import annotations

import os
import random
from typing import Any

from fastmcp import FastMCP
from openenv.core import (
    Action,
    CallToolAction,
    CallToolObservation,
    Environment,
    MCPEnvironment,
    Observation,
    State,
    create_app,
)

ROUNDS = 3


class CounterAction(Action):
    message: str


class CounterObservation(Observation):
    prompt: str


class CounterEnv(Environment[CounterAction, CounterObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True
    opened = 0
    closed = 0

    def __init__(self) -> None:
        super().__init__()
        type(self).opened += 1
        self._state = State(step_count=0)
        self.seed: int | None = None

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> CounterObservation:
        self.seed = seed
        self._state = State(episode_id=episode_id, step_count=0)
        return CounterObservation(prompt=f"Counter game (seed {seed}): make {ROUNDS} moves.")

    def step(self, action: CounterAction, timeout_s: float | None = None, **kwargs: Any) -> CounterObservation:
        self._state.step_count += 1
        n = self._state.step_count
        return CounterObservation(
            prompt=f"Move {n}: {len(action.message)} characters.",
            reward=round(0.1 * n, 3),
            done=n >= ROUNDS,
            metadata={"move": n},
        )

    @property
    def state(self) -> State:
        return self._state

    def close(self) -> None:
        type(self).closed += 1


class CrashEnv(CounterEnv):
    """Its server process exits on the second step (as an environment that segfaults would)."""

    def step(self, action: CounterAction, timeout_s: float | None = None, **kwargs: Any) -> CounterObservation:
        if self._state.step_count >= 1:
            os._exit(3)
        return super().step(action, timeout_s, **kwargs)


class TargetMCPEnv(MCPEnvironment):
    SUPPORTS_CONCURRENT_SESSIONS = True
    opened = 0
    closed = 0

    def __init__(self) -> None:
        mcp = FastMCP("target")
        self.target = 0

        @mcp.tool
        def add(a: int, b: int) -> int:
            """Add two integers."""
            return a + b

        @mcp.tool
        def guess(number: int) -> str:
            """Guess the hidden number (0 to 9)."""
            if number == self.target:
                return "correct"
            return "higher" if number < self.target else "lower"

        super().__init__(mcp)
        type(self).opened += 1
        self._state = State(step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Observation:
        self.target = random.Random(seed).randrange(10)
        self._state = State(episode_id=episode_id, step_count=0)
        return Observation(metadata={"target_range": [0, 9]})

    async def step_async(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        observation = await super().step_async(action, timeout_s, **kwargs)
        if isinstance(action, CallToolAction) and isinstance(observation, CallToolObservation):
            self._state.step_count += 1
            won = action.tool_name == "guess" and action.arguments.get("number") == self.target
            observation.reward = 1.0 if won else (0.1 if observation.error is None else 0.0)
            observation.done = won
        return observation

    def _step_impl(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return Observation(metadata={"error": f"unknown action {type(action).__name__}"})

    @property
    def state(self) -> State:
        return self._state

    def close(self) -> None:
        type(self).closed += 1
        super().close()


def _with_counts(app: Any, env: type) -> Any:
    @app.get("/counts")
    def counts() -> dict[str, int]:
        return {"opened": env.opened, "closed": env.closed}

    return app


def counter_app() -> Any:
    return _with_counts(create_app(CounterEnv, CounterAction, CounterObservation, max_concurrent_envs=64), CounterEnv)


def target_app() -> Any:
    app = create_app(TargetMCPEnv, CallToolAction, CallToolObservation, max_concurrent_envs=64)
    return _with_counts(app, TargetMCPEnv)
