"""The calculator behind a slow network: each call waits a seeded lognormal latency, then
answers exactly as ``tools.calculator:CalculatorTool`` does (same name, schema and results).

For training runs (``benchmarks/async_rl.py``), loaded by import path from a tool config:

```yaml
tools:
  - class_name: "benchmarks.slow_tools:SlowCalculator"
    config: {median_s: 0.3, sigma: 1.0, seed: 1}
```

The latency of a call is drawn from ``LogNormal(median_s, sigma)`` (``benchmarks/sim_tools.py``)
with a generator seeded by (``seed``, request, call): the request is the ordinal of the tool
instance (the n-th ``create`` on this tool object gets n), the call is the instance's call
count. Calc records carry no per-request keys for the calculator, so the creation order is
the request's identity here: two runs with the same seed that start their requests in the
same order (a trainer starts each step's requests in prompt order) wait on the same latencies,
whatever the timing of the calls.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from benchmarks.sim_tools import LogNormal
from tools.base import ToolResponse
from tools.calculator import CalculatorTool


class SlowCalculator(CalculatorTool):
    """``calculator(expression)`` after a seeded lognormal wait.

    Config keys: ``median_s`` (default 0.3), ``sigma`` (default 1.0), ``seed`` (default 0), and
    the calculator's own (``max_digits``, ``max_expression_chars``).
    """

    def __init__(self, config: dict[str, Any] | None = None, schema: dict[str, Any] | None = None):
        config = dict(config or {})
        median_s, sigma, seed = config.pop("median_s", 0.3), config.pop("sigma", 1.0), config.pop("seed", 0)
        if not (isinstance(median_s, int | float) and median_s > 0 and isinstance(sigma, int | float) and sigma >= 0):
            raise ValueError(f"slow calculator: median_s must be > 0 and sigma >= 0, got {median_s!r} and {sigma!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"slow calculator: seed must be an integer, got {seed!r}")
        super().__init__(config, schema)
        self.latency = LogNormal(float(median_s), float(sigma))
        """The latency model of every call."""
        self.seed = seed
        """Seed of the latencies; with the request ordinal and call index it fixes each call's wait."""
        self.created = 0
        """Instances created so far: the next instance's request ordinal."""

    def latency_s(self, request: int, call: int) -> float:
        """The wait of call ``call`` (0, 1, ...) of the ``request``-th instance."""
        rng = np.random.default_rng([self.seed, request, call])
        return float(self.latency.sample(rng, ()))

    async def create(self, instance_id: str | None = None, **create_kwargs: Any) -> str:
        request, self.created = self.created, self.created + 1
        instance_id = await super().create(instance_id, **create_kwargs)
        self.instance(instance_id).update(request=request, calls=0)
        return instance_id

    async def execute(self, instance_id: str, parameters: dict[str, Any], **execute_kwargs: Any) -> ToolResponse:
        state = self.instance(instance_id)
        call, state["calls"] = state["calls"], state["calls"] + 1
        await asyncio.sleep(self.latency_s(state["request"], call))
        return await super().execute(instance_id, parameters, **execute_kwargs)
