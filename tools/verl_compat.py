"""verl's tool classes, as their users wrote them, behind our BaseTool.

A class written against ``verl.tools.base_tool.BaseTool`` (or shaped like it: async ``create``
and ``execute``) is constructed the way verl constructs it, ``cls(config=..., tool_schema=...)``
with a pydantic ``OpenAIFunctionToolSchema``, and wrapped in ``VerlTool`` so the rollout loop
sees our lifecycle. Every shape verl's tools have returned is read:

- ``create``: an instance id (older verl) or ``(instance_id, ToolResponse)`` (verl 0.9);
- ``execute``: ``(ToolResponse, reward, metrics)`` (verl 0.9), ``(text, reward, metrics)``
  (older verl), a bare ToolResponse or text; a reward or metrics of None counts as 0 / {};
- verl's ``ToolResponse`` (text, image, video): the text is used; an image or a video comes
  back to the model as an error message, since rollouts are text-only.

verl itself is not needed: a class that never imports it gets our equivalent pydantic schema.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

from pydantic import BaseModel, Field

from tools.base import BaseTool, ToolError, ToolResponse

LIFECYCLE = ("create", "execute")
"""The coroutines that make a class a verl-style tool (``calc_reward`` and ``release`` are optional)."""


class OpenAIFunctionPropertySchema(BaseModel):
    """One parameter, as verl's ``verl.tools.schemas`` models it."""

    type: str | list[str]
    description: str | None = None
    enum: list[Any] | None = None


class OpenAIFunctionParametersSchema(BaseModel):
    type: str
    properties: dict[str, OpenAIFunctionPropertySchema]
    required: list[str] = Field(default_factory=list)


class OpenAIFunctionSchema(BaseModel):
    name: str
    description: str
    parameters: OpenAIFunctionParametersSchema = Field(
        default_factory=lambda: OpenAIFunctionParametersSchema(type="object", properties={}, required=[])
    )
    strict: bool = False


class OpenAIFunctionToolSchema(BaseModel):
    """verl's tool schema model, for verl-style classes used without verl installed."""

    type: str
    function: OpenAIFunctionSchema


def schema_dict(schema: Any) -> dict[str, Any] | None:
    """An OpenAI function schema as a plain dict, from a dict or a pydantic model (verl's or ours)."""
    if schema is None or isinstance(schema, dict):
        return schema
    if hasattr(schema, "model_dump"):
        return schema.model_dump(exclude_unset=True, exclude_none=True)
    raise TypeError(f"expected an OpenAI function schema (a mapping or a pydantic model), got {type(schema).__name__}")


def pydantic_schema(schema: dict[str, Any]) -> BaseModel:
    """``schema`` as the object a verl class expects: verl's own model when the tool's module has
    imported verl, else ours (importing verl only for this would pull in ray and torch extras)."""
    verl_schemas = sys.modules.get("verl.tools.schemas")
    model = getattr(verl_schemas, "OpenAIFunctionToolSchema", OpenAIFunctionToolSchema)
    return model.model_validate(schema)


def is_verl_style(obj: Any) -> bool:
    """A class that is not ours but has verl's async ``create`` and ``execute``."""
    return (
        inspect.isclass(obj)
        and not issubclass(obj, BaseTool)
        and all(inspect.iscoroutinefunction(getattr(obj, name, None)) for name in LIFECYCLE)
    )


class VerlTool(BaseTool):
    """A verl tool object behind our interface; ``self.tool`` is the user's own object."""

    def __init__(self, tool: Any, schema: dict[str, Any]):
        self.tool = tool
        super().__init__(config=getattr(tool, "config", None), schema=schema)

    @classmethod
    def build(cls, tool_class: type, config: dict[str, Any], schema: dict[str, Any] | None) -> VerlTool:
        """Construct ``tool_class`` as verl does; without a schema in the config, the class's own."""
        tool = tool_class(config=config, tool_schema=None if schema is None else pydantic_schema(schema))
        if schema is None:
            own = getattr(tool, "tool_schema", None) or tool.get_openai_tool_schema()
            schema = schema_dict(own)
        if not (isinstance(schema, dict) and isinstance(schema.get("function"), dict)):
            raise ValueError(f"{tool_class.__name__} has no tool schema: give one under 'tool_schema'")
        return cls(tool, schema)

    async def create(self, instance_id: str | None = None, **create_kwargs: Any) -> str:
        result = await self.tool.create(instance_id, **_create_arguments(self.tool.create, create_kwargs))
        instance_id = result[0] if isinstance(result, tuple) and result else result
        if not isinstance(instance_id, str):
            raise TypeError(f"create returned {result!r}: expected an instance id or (instance_id, ToolResponse)")
        return instance_id

    async def execute(self, instance_id: str, parameters: dict[str, Any], **execute_kwargs: Any) -> ToolResponse:
        return read_response(await self.tool.execute(instance_id, parameters, **execute_kwargs), self.name)

    async def calc_reward(self, instance_id: str, **calc_reward_kwargs: Any) -> float:
        calc_reward = getattr(self.tool, "calc_reward", None)
        if calc_reward is None:
            return 0.0
        reward = calc_reward(instance_id, **calc_reward_kwargs)
        return float(await reward if inspect.isawaitable(reward) else reward)

    async def release(self, instance_id: str, **release_kwargs: Any) -> None:
        release = getattr(self.tool, "release", None)
        if release is not None and inspect.isawaitable(done := release(instance_id, **release_kwargs)):
            await done


def read_response(result: Any, tool_name: str) -> ToolResponse:
    """Any of verl's execute results -> our ToolResponse (see the module docstring)."""
    if isinstance(result, ToolResponse):
        return result
    if isinstance(result, tuple):
        if not 1 <= len(result) <= 3:
            raise TypeError(f"returned a tuple of {len(result)}: expected (response, reward, metrics)")
        response, reward, metrics = (*result, None, None)[:3]
        text = _text(response, tool_name)
        reward = 0.0 if reward is None else float(reward)
        if metrics is not None and not isinstance(metrics, dict):
            raise TypeError(f"returned metrics of type {type(metrics).__name__}: expected a dict")
        return ToolResponse(text, reward, dict(metrics or {}))
    return ToolResponse(_text(result, tool_name))


def _text(response: Any, tool_name: str) -> str:
    if isinstance(response, str):
        return response
    if isinstance(response, ToolResponse):
        return response.text
    if is_verl_response(response):
        part = next((part for part in ("image", "video") if getattr(response, part)), None)
        if part is not None:
            article = "an" if part == "image" else "a"
            raise ToolError(f"tool {tool_name} returned {article} {part}; this rollout is text-only")
        return response.text or ""
    raise TypeError(f"returned {type(response).__name__}: expected a ToolResponse, its text or a tuple")


def is_verl_response(obj: Any) -> bool:
    """verl's ToolResponse (or one shaped like it: text, image and video)."""
    return all(hasattr(obj, part) for part in ("text", "image", "video"))


def _create_arguments(create: Any, create_kwargs: dict[str, Any]) -> dict[str, Any]:
    """A record's create_kwargs as ``create`` takes them: verl 0.9's agent loop passes one
    ``create_kwargs=`` dict, older verl spread them; both are given where the signature allows."""
    if "create_kwargs" in create_kwargs:  # the record says it itself
        return create_kwargs
    try:
        parameters = inspect.signature(create).parameters
    except (TypeError, ValueError):
        return create_kwargs
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return {**create_kwargs, "create_kwargs": dict(create_kwargs)}
    if "create_kwargs" in parameters:
        named = {k: v for k, v in create_kwargs.items() if k in parameters}
        return {**named, "create_kwargs": dict(create_kwargs)}
    return create_kwargs
