"""The tool interface: a create / execute / calc_reward / release lifecycle per rollout request.

A tool object is shared by every request of a rollout; each request gets its own *instance*
(an id returned by ``create``) so that tools with per-request state (a sandbox, a ground truth,
a search session) keep it apart. Subclasses override the coroutines they need; the defaults
keep an empty state dict per instance.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from tools.schema_check import ArgumentsCheck


@dataclass
class ToolResponse:
    """What one tool call gives back: the text the model reads, a step reward and metrics."""

    text: str
    reward: float = 0.0
    metrics: dict[str, Any] = field(default_factory=dict)


class ToolError(Exception):
    """Raised by a tool for a problem the model should read about (bad arguments, bad state).

    The rollout loop turns it into a tool message; any other exception is reported the same way
    but also logged as a tool crash in the request's tool-call record.
    """


def function_schema(name: str, description: str, parameters: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI function-calling schema: ``{"type": "function", "function": {...}}``."""
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


class BaseTool(ABC):
    """A tool the model can call. ``name`` and ``schema`` (OpenAI function schema) describe it.

    ``config`` comes from the tool config file; ``schema`` there, when given, replaces the
    class default (``default_schema``), so a deployment can rename or re-describe a tool.
    """

    def __init__(self, config: dict[str, Any] | None = None, schema: dict[str, Any] | None = None):
        self.config: dict[str, Any] = dict(config or {})
        self.schema: dict[str, Any] = schema or self.default_schema()
        self.name: str = self.schema["function"]["name"]
        self._instances: dict[str, dict[str, Any]] = {}

    @classmethod
    def default_schema(cls) -> dict[str, Any]:
        """The OpenAI function schema used when the config gives none. Tools whose schema always comes
        from elsewhere (a function, a verl class, an MCP server) keep this refusal."""
        raise ValueError(f"{cls.__name__} has no default schema: give one under 'schema' in the tool config")

    async def create(self, instance_id: str | None = None, **create_kwargs: Any) -> str:
        """Start a per-request instance and return its id."""
        instance_id = instance_id or uuid.uuid4().hex
        self._instances[instance_id] = dict(create_kwargs)
        return instance_id

    @abstractmethod
    async def execute(self, instance_id: str, parameters: dict[str, Any], **execute_kwargs: Any) -> ToolResponse:
        """Run one call with the model's arguments (already checked against the schema)."""

    async def calc_reward(self, instance_id: str, **calc_reward_kwargs: Any) -> float:
        """The instance's reward at the end of the request (0 unless the tool scores)."""
        return 0.0

    async def release(self, instance_id: str, **release_kwargs: Any) -> None:
        """Free the instance. Called exactly once for every successful ``create``."""
        self._instances.pop(instance_id, None)

    @cached_property
    def _arguments_check(self) -> ArgumentsCheck:
        parameters = self.schema["function"].get("parameters") or {"type": "object"}
        return ArgumentsCheck(parameters, f"tool {self.name!r}")

    def check_arguments(self, arguments: dict[str, Any]) -> str | None:
        """A readable message when ``arguments`` break the schema's parameters, else None (the schema
        compiled once per tool: ``tools/schema_check.py``)."""
        if not arguments:  # {}: the same verdict every time
            return self._empty_arguments_problem
        return self._arguments_check(arguments)

    @cached_property
    def _empty_arguments_problem(self) -> str | None:
        return self._arguments_check({})

    def instance(self, instance_id: str) -> dict[str, Any]:
        """The state dict of a live instance; a clear ToolError for an unknown id."""
        try:
            return self._instances[instance_id]
        except KeyError:
            raise ToolError(f"tool {self.name!r} has no live instance {instance_id!r}") from None
