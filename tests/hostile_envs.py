"""Step environments that hang, exit or lie, as users write them or hit them (issue 50): each a small class
run by import path (``tests.hostile_envs:Name``), sync unless its name says async. Every instance writes
what happens to it to ``log`` (a file, one line per event: ``made``, ``reset``, ``step``, ``close``), so a
test in a subprocess counts closes where they actually ran."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from typing import Any

_LOCK = threading.Lock()


class Healthy:
    """Three steps of "go"; reward 1 at the end. ``reset_s`` / ``step_s``: how long reset and step take."""

    def __init__(self, log: str | None = None, reset_s: float = 0.0, step_s: float = 0.0, turns: int = 3):
        self.log, self.reset_s, self.step_s, self.turns, self.n = log, reset_s, step_s, turns, 0
        self._write("made")

    def _write(self, event: str) -> None:
        if self.log is not None:
            with _LOCK, open(self.log, "a") as file:
                file.write(f"{event} {type(self).__name__} {os.getpid()}\n")

    def reset(self, seed: int | None = None) -> Any:
        self._write("reset")
        time.sleep(self.reset_s)
        return f"Game {seed}: say go {self.turns} times."

    def step(self, action: str) -> Any:
        self._write("step")
        time.sleep(self.step_s)
        self.n += 1
        done = self.n >= self.turns
        return f"Move {self.n} taken.", float(done), done, False, {"move": self.n}

    def close(self) -> None:
        self._write("close")


class HangingReset(Healthy):
    """A reset that never returns (``reset_s`` long)."""

    def __init__(self, log: str | None = None, reset_s: float = 3600.0, **kwargs: Any):
        super().__init__(log, reset_s=reset_s, **kwargs)


class HangingStep(Healthy):
    def __init__(self, log: str | None = None, step_s: float = 3600.0, **kwargs: Any):
        super().__init__(log, step_s=step_s, **kwargs)


class HangingClose(Healthy):
    def __init__(self, log: str | None = None, close_s: float = 3600.0, **kwargs: Any):
        super().__init__(log, **kwargs)
        self.close_s = close_s

    def close(self) -> None:
        self._write("close-start")
        time.sleep(self.close_s)


class RaisingClose(Healthy):
    def close(self) -> None:
        self._write("close")
        raise OSError(5, "the board would not fold")


class ExitingStep(Healthy):
    """``sys.exit(3)`` in its step (or another BaseException: ``raises``)."""

    def __init__(self, log: str | None = None, raises: str = "SystemExit", **kwargs: Any):
        super().__init__(log, **kwargs)
        self.raises = raises

    def step(self, action: str) -> Any:
        self._write("step")
        if self.raises == "SystemExit":
            sys.exit(3)
        raise {"KeyboardInterrupt": KeyboardInterrupt, "GeneratorExit": GeneratorExit}[self.raises]()


class AsyncExitingStep(ExitingStep):
    async def step(self, action: str) -> Any:  # type: ignore[override]
        await asyncio.sleep(0)
        return super().step(action)


class AsyncEnv(Healthy):
    """A well-behaved class whose reset, step and close are all ``async``."""

    async def reset(self, seed: int | None = None) -> Any:  # type: ignore[override]
        await asyncio.sleep(self.reset_s)
        self._write("reset")
        return f"Game {seed}: say go {self.turns} times."

    async def step(self, action: str) -> Any:  # type: ignore[override]
        await asyncio.sleep(self.step_s)
        return Healthy.step(self, action)

    async def close(self) -> None:  # type: ignore[override]
        await asyncio.sleep(0)
        self._write("close")


class BlockingAsyncStep(Healthy):
    """``async def step`` that calls ``time.sleep`` inside: it blocks the event loop (asyncio's contract broken)."""

    async def step(self, action: str) -> Any:  # type: ignore[override]
        return Healthy.step(self, action)


class AsyncHealthy(AsyncEnv):
    """Async, with steps that wait (never block) ``step_s``."""


class HugeReset(Healthy):
    def reset(self, seed: int | None = None) -> Any:
        self._write("reset")
        return "x" * 5_000_000


class HugeInfo(Healthy):
    def step(self, action: str) -> Any:
        obs, reward, done, truncated, _ = super().step(action)
        return obs, reward, done, truncated, {"blob": "y" * 5_000_000}


class CircularInfo(Healthy):
    def step(self, action: str) -> Any:
        obs, reward, done, truncated, info = super().step(action)
        info["self"] = info
        return obs, reward, done, truncated, info


class StepShapedReset(Healthy):
    """A reset that returns what a step returns."""

    def reset(self, seed: int | None = None) -> Any:
        return (f"Game {seed}: ...", 0.0, True, False, {})


class BytesObservation(Healthy):
    def reset(self, seed: int | None = None) -> Any:
        return f"Game {seed}: say go.".encode()

    def step(self, action: str) -> Any:
        return b"\xff\xfe not text", 0.0, True, False, {}


class ObjectObservation(Healthy):
    def step(self, action: str) -> Any:
        return object(), 0.0, True, False, {}


class StringReward(Healthy):
    def step(self, action: str) -> Any:
        return "Move taken.", "abc", True, False, {}


class SlowTools:
    """A TRL environment class (``environment_factory``): its method ``wait`` is a tool that takes ``seconds``."""

    closed = 0

    def reset(self, **kwargs: Any) -> None:
        return None

    def wait(self, seconds: float) -> str:
        """Wait a while.

        Args:
            seconds: How long to wait.
        """
        time.sleep(seconds)
        return "waited"

    def close(self) -> None:
        with _LOCK:
            SlowTools.closed += 1
