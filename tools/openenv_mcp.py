"""OpenEnv MCP environments as rallyrl tools: every tool an ``MCPEnvironment`` lists becomes a ``BaseTool``.

```yaml
tools:
  - class_name: tools.openenv_mcp:OpenEnvMCPTools
    config:
      url: http://127.0.0.1:8000          # a running OpenEnv server of an MCP environment, or
      # app: my_pkg.envs:MyMCPEnv         # an MCPEnvironment class (or app) rallyrl serves on loopback
      tools: [guess]                      # optional: only these tools
      timeout: 30                         # seconds per call (optional); connect_timeout: 60 (optional)
```

The environment is the tools' shared state, one episode per request (the tool lifecycle):

    create        the request's first tool opens an episode (openenv's ``MCPToolClient``; its create_kwargs,
                  ``seed`` say, are the arguments of ``reset``); the request's other tools share it, keyed by
                  the instance id the rollout loop passes to every create (the request id)
    execute       one ``CallToolAction`` step; the observation's reward is the call's step reward; a
                  ``ToolError`` of the environment comes back to the model as an error
    calc_reward   the episode's return (the sum of the rewards on its observations), reported by the tool
                  that opened the episode and 0 by the others, so it is counted once
    release       the last of the request's tools to release closes the episode

The schemas are the environment's own (``ListToolsAction``: ``input_schema`` as the function's parameters),
read once when the tools are built.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from tools.base import BaseTool, ToolError, ToolResponse, function_schema
from tools.loading import ToolConfigError
from tools.openenv_server import LocalServer, died, local_server

CONFIG_FIELDS = {"url", "app", "tools", "timeout", "connect_timeout", "max_sessions"}
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_CONNECT_TIMEOUT_S = 60.0


@dataclass
class _Episode:
    opener: str  # the tool that opened it: it reports the episode's return
    opened: asyncio.Future[Any]  # the connected client, once reset
    refs: int = 1
    rewards: list[float] = field(default_factory=list)
    done: bool = False
    calls: asyncio.Lock = field(default_factory=asyncio.Lock)  # one call at a time on the episode's WebSocket


class OpenEnvMCPEnvironment:
    """One OpenEnv MCP environment server, shared by its tools: where it is, and the requests' episodes."""

    def __init__(self, name: str, url: str, timeout_s: float, connect_timeout_s: float,
                 server: LocalServer | None = None):  # fmt: skip
        self.name = name
        self.url = url
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.server = server
        self.episodes: dict[str, _Episode] = {}

    def client(self) -> Any:
        from openenv.core.mcp_client import MCPToolClient

        return MCPToolClient(base_url=self.url, connect_timeout_s=self.connect_timeout_s,
                             message_timeout_s=self.timeout_s)  # fmt: skip

    def list_tools(self) -> list[Any]:
        """The environment's tools (blocking: one short episode of openenv's sync client)."""
        from openenv.core import ListToolsAction

        with self.client().sync() as client:
            result = client.step(ListToolsAction())
        error = (result.observation.metadata or {}).get("error")
        tools = getattr(result.observation, "tools", None)
        if error or tools is None:
            raise RuntimeError(error or f"it answered {type(result.observation).__name__}, not a tool list")
        return list(tools)

    async def acquire(self, instance_id: str, tool: str, reset_kwargs: dict[str, Any]) -> None:
        """Open the request's episode, or share the one a sibling tool opened (or is opening)."""
        episode = self.episodes.get(instance_id)
        if episode is not None:
            episode.refs += 1
            try:
                await asyncio.shield(episode.opened)
            except BaseException:
                episode.refs -= 1  # the opener failed (its episode is gone) or this create was cancelled
                raise
            return
        episode = self.episodes[instance_id] = _Episode(tool, asyncio.get_running_loop().create_future())
        client = self.client()
        try:
            await client.reset(**reset_kwargs)
        except BaseException as exc:
            del self.episodes[instance_id]
            failure = await self._failure("reset", exc) if isinstance(exc, Exception) else ToolError("reset cancelled")
            episode.opened.set_exception(failure)
            episode.opened.exception()  # retrieved here: no sibling may be waiting for it
            await asyncio.shield(_close_quietly(client))
            if isinstance(exc, Exception):
                raise failure from exc
            raise
        episode.opened.set_result(client)

    async def call(self, instance_id: str, tool: str, arguments: dict[str, Any]) -> ToolResponse:
        from openenv.core import CallToolAction

        episode = self._episode(instance_id, tool)
        async with episode.calls:  # the calls of one turn run in turn: one WebSocket carries them
            if episode.done:
                raise ToolError(f"the episode of {self.name} is over: no more calls")
            try:
                result = await episode.opened.result().step(CallToolAction(tool_name=tool, arguments=arguments))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                raise await self._failure(f"call of {tool}", exc) from exc
            reward = float(result.reward or 0.0)
            episode.rewards.append(reward)
            episode.done = bool(result.done)
        observation = result.observation
        if getattr(observation, "error", None) is not None:
            raise ToolError(f"{tool}: {observation.error.message}")
        return ToolResponse(result_text(getattr(observation, "result", None)), reward,
                            {"done": episode.done} if episode.done else {})  # fmt: skip

    def episode_return(self, instance_id: str, tool: str) -> float:
        episode = self.episodes.get(instance_id)
        return float(sum(episode.rewards)) if episode is not None and episode.opener == tool else 0.0

    async def release(self, instance_id: str) -> None:
        episode = self.episodes.get(instance_id)
        if episode is None:
            return
        episode.refs -= 1
        if episode.refs > 0:
            return
        del self.episodes[instance_id]
        if episode.opened.done() and not episode.opened.cancelled() and episode.opened.exception() is None:
            await asyncio.wait_for(episode.opened.result().close(), self.timeout_s)

    def _episode(self, instance_id: str, tool: str) -> _Episode:
        episode = self.episodes.get(instance_id)
        if episode is None or not episode.opened.done():
            raise ToolError(f"tool {tool!r} has no live episode of {self.name} for instance {instance_id!r}")
        return episode

    async def _failure(self, what: str, exc: BaseException) -> Exception:
        """A failed call: what became of a server rallyrl started, else the client's error, naming the server."""
        if self.server is not None and await died(self.server, exc):
            return ConnectionError(f"{what}: {self.server.describe()} ({type(exc).__name__}: {exc})")
        return RuntimeError(f"{what} on the OpenEnv MCP environment {self.name} failed: {type(exc).__name__}: {exc}")


async def _close_quietly(client: Any) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(client.close(), 10.0)


def result_text(result: Any) -> str:
    """An MCP call's result as text: the text parts of its content, else its data, else JSON."""
    if isinstance(result, dict) and isinstance(result.get("content"), list):
        texts = [part.get("text", "") for part in result["content"] if isinstance(part, dict) and "text" in part]
        if texts:
            return "\n".join(texts)
        result = result.get("data", result.get("structured_content"))
    if isinstance(result, str):
        return result
    return orjson.dumps(result, default=str).decode()


class OpenEnvMCPTool(BaseTool):
    """One tool of an OpenEnv MCP environment; built by ``OpenEnvMCPTools.build_tools``, never alone."""

    def __init__(self, config: dict[str, Any] | None = None, schema: dict[str, Any] | None = None, *,
                 environment: OpenEnvMCPEnvironment | None = None):  # fmt: skip
        if environment is None or schema is None:
            raise ValueError("tools.openenv_mcp tools come from an environment: use tools.openenv_mcp:OpenEnvMCPTools")
        super().__init__(config, schema)
        self.environment = environment

    async def create(self, instance_id: str | None = None, **create_kwargs: Any) -> str:
        instance_id = instance_id or uuid.uuid4().hex
        await self.environment.acquire(instance_id, self.name, create_kwargs)
        return instance_id

    async def execute(self, instance_id: str, parameters: dict[str, Any], **execute_kwargs: Any) -> ToolResponse:
        return await self.environment.call(instance_id, self.name, parameters)

    async def calc_reward(self, instance_id: str, **calc_reward_kwargs: Any) -> float:
        return self.environment.episode_return(instance_id, self.name)

    async def release(self, instance_id: str, **release_kwargs: Any) -> None:
        await self.environment.release(instance_id)


class OpenEnvMCPTools:
    """The tool config entry of an OpenEnv MCP environment: ``build_tools`` gives one tool per listed tool."""

    @classmethod
    def build_tools(cls, entry: dict[str, Any], where: str, source_dir: Path) -> list[BaseTool]:
        config = entry.get("config") or {}
        if not isinstance(config, dict):
            raise ToolConfigError(f"{where}.config: expected a mapping, got {type(config).__name__}")
        unknown = set(config) - CONFIG_FIELDS
        if unknown:
            raise ToolConfigError(f"{where}.config: unknown field(s) {', '.join(sorted(unknown))}")
        if ("url" in config) == ("app" in config):
            raise ToolConfigError(f"{where}.config: give exactly one of 'url' (a running server) and 'app' "
                                  "(an MCPEnvironment class or app that rallyrl serves)")  # fmt: skip
        timeout_s = _positive(config.get("timeout", DEFAULT_TIMEOUT_S), f"{where}.config.timeout")
        connect_s = _positive(config.get("connect_timeout", DEFAULT_CONNECT_TIMEOUT_S),
                              f"{where}.config.connect_timeout")  # fmt: skip
        selected = config.get("tools")
        if selected is not None and not (isinstance(selected, list) and all(isinstance(s, str) for s in selected)):
            raise ToolConfigError(f"{where}.config.tools: expected a list of tool names")
        server = None
        try:
            if "url" in config:
                name = url = str(config["url"]).rstrip("/")
            else:
                name = str(config["app"])
                sessions = config.get("max_sessions")
                server = local_server(name, "tools", connect_s, (str(source_dir),), max_sessions=sessions)
                url = server.url
            environment = OpenEnvMCPEnvironment(name, url, timeout_s, connect_s, server)
            listed = environment.list_tools()
        except Exception as exc:
            what = config.get("url") or config.get("app")
            dead = f"; {server.describe()}" if server is not None and server.exit_code() is not None else ""
            raise ToolConfigError(f"{where}.config: cannot list the tools of the OpenEnv MCP environment {what}: "
                                  f"{type(exc).__name__}: {exc}{dead}") from None  # fmt: skip
        names = [tool.name for tool in listed]
        missing = sorted(set(selected or ()) - set(names))
        if missing:
            raise ToolConfigError(f"{where}.config.tools: {name} has no tool(s) {', '.join(missing)} "
                                  f"(its tools: {', '.join(names) or 'none'})")  # fmt: skip
        schemas = [function_schema(t.name, t.description, t.input_schema) for t in listed]
        return [
            OpenEnvMCPTool({"timeout": timeout_s}, schema, environment=environment)
            for schema in schemas
            if selected is None or schema["function"]["name"] in selected
        ]


def _positive(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ToolConfigError(f"{where}: expected a positive number of seconds, got {value!r}")
    return float(value)
