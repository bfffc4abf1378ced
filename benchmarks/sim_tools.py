"""Tools with latency models for the concurrency benchmark: fixed, uniform, lognormal (heavy
tail), and a rate limit (at most M executions at once) around any of them. All async.

Latencies are sampled up front from a seeded generator, one per (request, call), and handed
to each request's tool instance through ``create_kwargs``, so every system the benchmark
compares waits on exactly the same tool latencies.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from tools.base import BaseTool, ToolResponse, function_schema


@dataclass(frozen=True)
class Fixed:
    """Every call takes ``seconds``."""

    seconds: float

    def sample(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        return np.full(shape, self.seconds)

    def describe(self) -> str:
        return f"fixed {self.seconds:g} s"


@dataclass(frozen=True)
class Uniform:
    """Uniform in [low, high] seconds."""

    low: float
    high: float

    def sample(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        return rng.uniform(self.low, self.high, shape)

    def describe(self) -> str:
        return f"uniform {self.low:g}-{self.high:g} s"


@dataclass(frozen=True)
class LogNormal:
    """exp(N(log median, sigma)) seconds: a heavy right tail (sigma 1: p99 is about 10x the median)."""

    median: float
    sigma: float

    def sample(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        return rng.lognormal(math.log(self.median), self.sigma, shape)

    def describe(self) -> str:
        return f"lognormal median {self.median:g} s, sigma {self.sigma:g}"


LatencyModel = Fixed | Uniform | LogNormal


class SimTool(BaseTool):
    """``wait()``: sleeps for this request's next sampled latency and answers "done".

    ``create_kwargs.latencies`` holds the request's latencies in call order. With config
    ``max_concurrent`` M, at most M executions run at once; the others queue in arrival order,
    and their latency starts when they get a slot.
    """

    def __init__(self, config: dict[str, Any] | None = None, schema: dict[str, Any] | None = None):
        super().__init__(config, schema)
        limit = self.config.get("max_concurrent")
        self.limit = asyncio.Semaphore(int(limit)) if limit else None
        self.running = 0
        self.peak_running = 0

    @classmethod
    def default_schema(cls) -> dict[str, Any]:
        return function_schema("wait", "Wait for an external system.", {"type": "object", "properties": {}})

    async def create(self, instance_id: str | None = None, latencies: list[float] | None = None, **kwargs: Any) -> str:
        return await super().create(instance_id, latencies=list(latencies or []), calls=0)

    async def execute(self, instance_id: str, parameters: dict[str, Any], **execute_kwargs: Any) -> ToolResponse:
        state = self.instance(instance_id)
        latencies = state["latencies"]
        latency = latencies[state["calls"]] if state["calls"] < len(latencies) else 0.0
        state["calls"] += 1
        if self.limit is None:
            return await self._wait(latency)
        async with self.limit:
            return await self._wait(latency)

    async def _wait(self, latency: float) -> ToolResponse:
        self.running += 1
        self.peak_running = max(self.peak_running, self.running)
        try:
            await asyncio.sleep(latency)
        finally:
            self.running -= 1
        return ToolResponse("done")
