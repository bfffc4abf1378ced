"""A plain Python function as a tool (verl 0.9's ``@function_tool`` and TRL's style).

The function's type hints and Google-style docstring are its schema, derived as verl and TRL
derive it (``transformers.utils.get_json_schema``)::

    def multiply(a: float, b: float) -> float:
        \"\"\"Multiply two numbers.

        Args:
            a: The first factor.
            b: The second factor.
        \"\"\"
        return a * b

A sync function runs on a daemon thread of the tool's (``rollout/user_threads.py``: one that never
returns is left behind when the call's deadline passes, and reported as the command ends), an async
one on the loop. What
it returns becomes the text the model reads: a str as it is; a ToolResponse (ours or verl's) or
``(text, reward[, metrics])`` as verl reads them; anything else as JSON. A function decorated with
verl's ``@function_tool`` keeps the name and schema it was registered with.
"""

from __future__ import annotations

import inspect
import json
import math
import sys
from collections.abc import Callable
from numbers import Real
from typing import Any

from rollout.user_threads import UserThreads
from tools.base import BaseTool, ToolResponse
from tools.verl_compat import is_verl_response, read_response, schema_dict

THREADS = 64
"""Calls of one function tool that run at once (a stuck one gives its place to a new thread)."""


class FunctionTool(BaseTool):
    """``fn(**arguments)`` as a tool: no per-request state, no reward at the end."""

    def __init__(self, fn: Callable[..., Any], schema: dict[str, Any] | None = None):
        self.fn = fn
        super().__init__(schema=schema or derive_schema(fn))
        self._threads: UserThreads | None = None

    async def execute(self, instance_id: str, parameters: dict[str, Any], **execute_kwargs: Any) -> ToolResponse:
        if inspect.iscoroutinefunction(self.fn):
            result = await self.fn(**parameters)
        else:  # on a daemon thread: a call that never returns is left there when its deadline passes
            if self._threads is None:
                self._threads = UserThreads(f"tool-{self.name}", THREADS)
            call = await self._threads.start(f"tool {self.name}", "call", self.fn, **parameters)
            result = await call.result(None)
        return function_result(result, self.name)


def is_function(obj: Any) -> bool:
    """A function (or another callable that is not a class) that can be a tool."""
    return callable(obj) and not inspect.isclass(obj)


def derive_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The OpenAI function schema of ``fn``: verl's registration when ``@function_tool`` made one,
    else ``transformers.utils.get_json_schema``. A ValueError says what the function lacks."""
    registered = _verl_registration(fn)
    if registered is not None:
        return schema_dict(registered.tool_schema)
    from transformers.utils import get_json_schema

    parameters = inspect.signature(fn).parameters.values()
    variadic = [p.name for p in parameters if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if variadic:
        raise ValueError(f"its parameter(s) {', '.join(variadic)} are variadic: name each parameter")
    try:
        return get_json_schema(fn)
    except Exception as exc:  # transformers' DocstringParsingException / TypeHintParsingException
        raise ValueError(
            f"its schema comes from its type hints and Google-style docstring (a summary line and "
            f"'Args:' describing every parameter): {exc}"
        ) from None


def function_result(result: Any, tool_name: str) -> ToolResponse:
    """What a function returned -> the ToolResponse the model reads (see the module docstring)."""
    if isinstance(result, str):
        return ToolResponse(result)
    if isinstance(result, ToolResponse) or is_verl_response(result) or _is_verl_triple(result):
        return read_response(result, tool_name)
    return ToolResponse(json.dumps(result, ensure_ascii=False, default=str))


def _is_verl_triple(result: Any) -> bool:
    """``(text or ToolResponse, reward[, metrics])``, as verl's function tools return a reward."""
    if not (isinstance(result, tuple) and 1 <= len(result) <= 3):
        return False
    response, reward, metrics = (*result, None, None)[:3]
    return (
        (isinstance(response, str | ToolResponse) or is_verl_response(response))
        and (reward is None or (isinstance(reward, Real) and not isinstance(reward, bool) and math.isfinite(reward)))
        and (metrics is None or isinstance(metrics, dict))
    )


def _verl_registration(fn: Callable[..., Any]) -> Any:
    """verl's registry entry of ``fn`` when ``@function_tool`` decorated it (verl is then imported)."""
    registry = getattr(sys.modules.get("verl.tools.function_tool"), "FUNCTION_TOOL_REGISTRY", {})
    return next((entry for entry in registry.values() if getattr(entry, "fn", None) is fn), None)
