"""A user's own environment class, by import path: ``env: my_pkg.envs:MyEnv``.

The class is imported as a tool's is (also from the folder the command runs in) and made with the
environment's kwargs (``MyEnv(**env_kwargs)``). Its ``reset`` is called with ``seed=`` when it takes
one, and may return the first observation, ``(obs, info)`` or chat messages; its ``step(action)`` may
return any shape ``as_step`` reads (gymnasium's tuple, SkyRL-Gym's mapping, a ``Step``); ``close`` is
called when it has one. Any of them may be ``async`` (and is then awaited on the event loop).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any


class ClassBinding:
    """An environment class with ``reset`` / ``step`` (and optional ``close``), by import path."""

    def __init__(self, env_id: str, **env_kwargs: Any):
        from tools.loading import import_class

        self.spec = env_id
        cls = import_class(env_id, (Path.cwd(),))  # (a package in the folder the command runs in, as for tools)
        if not callable(getattr(cls, "step", None)) or not callable(getattr(cls, "reset", None)):
            raise TypeError(f"environment {env_id}: a class with reset and step methods is needed")
        self.env = cls(**env_kwargs)
        for name in ("reset", "step", "close"):  # the class's async methods stay async (awaited on the loop)
            if inspect.iscoroutinefunction(getattr(self.env, name, None)):
                setattr(self, name, getattr(self, f"_{name}_async"))

    def _reset_kwargs(self, seed: int | None, messages: list[dict[str, Any]]) -> dict[str, Any]:
        parameters = inspect.signature(self.env.reset).parameters
        accepts_any = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
        kwargs: dict[str, Any] = {}
        if "seed" in parameters or accepts_any:
            kwargs["seed"] = seed
        if "messages" in parameters:
            kwargs["messages"] = messages
        return kwargs

    def reset(self, seed: int | None, messages: list[dict[str, Any]]) -> Any:
        return self.env.reset(**self._reset_kwargs(seed, messages))

    def step(self, action: str) -> Any:
        return self.env.step(action)

    def close(self) -> Any:
        close = getattr(self.env, "close", None)
        return close() if callable(close) else None

    async def _reset_async(self, seed: int | None, messages: list[dict[str, Any]]) -> Any:
        return await self.env.reset(**self._reset_kwargs(seed, messages))

    async def _step_async(self, action: str) -> Any:
        return await self.env.step(action)

    async def _close_async(self) -> Any:
        return await self.env.close()
