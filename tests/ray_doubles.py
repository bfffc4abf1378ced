"""What tests/test_ray_tools.py runs in Ray actors; importable on the workers (Ray puts the driver's
folder, the repository root, on their path) as ``tests.ray_doubles``."""

from __future__ import annotations

from typing import Any

from tools.base import ToolResponse
from tools.calculator import CalculatorTool
from tools.python_sandbox import PythonTool

MARK = "rallyrl-ray-test-sandbox"
"""In the command line of every program the doubles start in a sandbox, so tests can find what is left."""


def marked_program(seconds: float, print_this: str) -> str:
    """A python-tool program that re-executes itself with ``MARK`` in its command line, sleeps, prints."""
    return (
        "import os, sys\n"
        f"if {MARK!r} not in sys.argv:\n"
        f"    os.execv(sys.executable, [sys.executable, '-c', open('main.py').read(), {MARK!r}])\n"
        "import time\n"
        f"time.sleep({seconds!r})\n"
        f"print({print_this!r})\n"
    )


class SlowSandboxCalculator(PythonTool):
    """The calculator's name and arguments (the embedded model calls it), each call a sandboxed program
    that sleeps ``sleep_s`` (config) with ``MARK`` in its command line, then prints the expression."""

    def __init__(self, config: dict[str, Any] | None = None, schema: dict[str, Any] | None = None):
        config = dict(config or {})
        self.sleep_s = float(config.pop("sleep_s", 5.0))
        super().__init__(config, schema)

    @classmethod
    def default_schema(cls) -> dict[str, Any]:
        return CalculatorTool.default_schema()  # the schema the embedded model was trained with

    async def execute(self, instance_id: str, parameters: dict[str, Any], **execute_kwargs: Any) -> ToolResponse:
        code = marked_program(self.sleep_s, str(parameters.get("expression")))
        return await super().execute(instance_id, {"code": code}, **execute_kwargs)


class GoGame:
    """A step environment: say "go" ``turns`` times; reward 1 per "go"."""

    def __init__(self, turns: int = 2):
        self.turns, self.n = turns, 0

    def reset(self, seed: int | None = None):
        self.n = 0
        return f"Game {seed}: say go {self.turns} times.", {"seed": seed}

    def step(self, action: str):
        self.n += 1
        reward = 1.0 if action.strip() == "go" else 0.0
        return f"{self.turns - self.n} to go", reward, self.n >= self.turns, False, {"n": self.n}
