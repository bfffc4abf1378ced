"""``executor: ray`` on a tool entry: the entry's tools run in Ray actors, the rollout process keeps proxies.

```yaml
tools:
  - class_name: tools.python_sandbox:PythonTool
    config: {timeout_s: 10, max_concurrent: 8}
    executor: ray
    ray: {actors: 4, num_cpus: 2, memory_mb: 4096, label_selector: {pool: tools}, address: auto}
```

The entry is built twice: here, for its names, schemas and argument checks (a bad config fails at
load, as without Ray), and in every actor of its pool (``tools/ray_cluster.py``), where create /
execute / calc_reward / release run. An actor holds many instances (one per request, each on the
actor that created it); a python tool's sandbox runs on the actor's node with all its protections
(``max_concurrent`` is per actor). A lost actor or node turns the calls of its instances into
``Error: ...`` for the model and records the instances lost with their node (``RayTool.stats``);
``close_executor`` (at the end of the rollout session, and at exit) kills the actors.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from tools.base import BaseTool, ToolResponse
from tools.ray_cluster import ActorPool, RayStats, outcome
from tools.ray_options import RayOptions


class ToolHost:
    """In a Ray actor: the entry's tools, built on the worker by ``build`` (a picklable function)."""

    def __init__(self, build: Callable[[], list[BaseTool]]):
        import ray

        self.tools = {tool.name: tool for tool in build()}
        self.node_id = ray.get_runtime_context().get_node_id()

    async def create(self, name: str, instance_id: str, kwargs: dict[str, Any]) -> tuple[str, Any, str]:
        """The instance id, and the tool's first observation of it (an environment class's ``reset``)."""
        return await outcome(self._create(name, instance_id, kwargs), self.node_id)

    async def _create(self, name: str, instance_id: str, kwargs: dict[str, Any]) -> tuple[str, str | None]:
        tool = self.tools[name]
        made = await tool.create(instance_id, **kwargs)
        observe = getattr(tool, "initial_observation", None)
        return made, observe(made) if callable(observe) else None

    async def execute(self, name: str, instance_id: str, parameters: dict[str, Any],
                      kwargs: dict[str, Any]) -> tuple[str, Any, str]:  # fmt: skip
        return await outcome(self.tools[name].execute(instance_id, parameters, **kwargs), self.node_id)

    async def calc_reward(self, name: str, instance_id: str, kwargs: dict[str, Any]) -> tuple[str, Any, str]:
        return await outcome(self.tools[name].calc_reward(instance_id, **kwargs), self.node_id)

    async def release(self, name: str, instance_id: str, kwargs: dict[str, Any]) -> tuple[str, Any, str]:
        return await outcome(self.tools[name].release(instance_id, **kwargs), self.node_id)


class RayTool(BaseTool):
    """A tool whose instances live in the Ray actors of ``pool``; ``local`` (built in this process, never
    called) gives the name, schema and argument checks the model and the loop see."""

    def __init__(self, local: BaseTool, pool: ActorPool):
        super().__init__(local.config, local.schema)
        self.local, self.pool = local, pool
        self._observations: dict[str, str] = {}
        self._their_ids: dict[str, str] = {}  # a tool that chose its own instance id: ours -> its

    @property
    def stats(self) -> RayStats:
        """The pool's accounting (shared by the tools of one entry): created, released, lost with their node."""
        return self.pool.stats

    def check_arguments(self, arguments: dict[str, Any]) -> str | None:
        return self.local.check_arguments(arguments)

    async def create(self, instance_id: str | None = None, **create_kwargs: Any) -> str:
        instance_id = instance_id or uuid.uuid4().hex
        made, observation = await self.pool.create(self.name, instance_id, "create", self.name, instance_id,
                                                   create_kwargs)  # fmt: skip
        if made != instance_id:  # the tool chose its own id: the pool (and the loop) know it by ours
            self._their_ids[instance_id] = made
        if observation is not None:
            self._observations[instance_id] = observation
        return instance_id

    def initial_observation(self, instance_id: str) -> str | None:
        """What the tool's ``initial_observation`` gave on the actor right after create (once)."""
        return self._observations.pop(instance_id, None)

    async def execute(self, instance_id: str, parameters: dict[str, Any], **execute_kwargs: Any) -> ToolResponse:
        return await self.pool.call(self.name, instance_id, "execute", self.name, self._theirs(instance_id),
                                    parameters, execute_kwargs)  # fmt: skip

    async def calc_reward(self, instance_id: str, **calc_reward_kwargs: Any) -> float:
        return await self.pool.call(self.name, instance_id, "calc_reward", self.name, self._theirs(instance_id),
                                    calc_reward_kwargs)  # fmt: skip

    async def release(self, instance_id: str, **release_kwargs: Any) -> None:
        self._observations.pop(instance_id, None)
        theirs = self._their_ids.pop(instance_id, instance_id)
        await self.pool.release(self.name, instance_id, "release", self.name, theirs, release_kwargs)

    def _theirs(self, instance_id: str) -> str:
        return self._their_ids.get(instance_id, instance_id)

    def close_executor(self) -> None:
        """Kill the pool's actors (and the sandboxes in them); instances not released are recorded lost."""
        self.pool.close()


def on_ray(tools: list[BaseTool], build: Callable[[], list[BaseTool]], options: RayOptions,
           where: str) -> list[BaseTool]:  # fmt: skip
    """The entry's ``tools`` as proxies to one pool of actors that each run ``build()``."""
    names = ", ".join(tool.name for tool in tools)
    pool = ActorPool(ToolHost, (build,), options, f"tool {names}", where)
    return [RayTool(tool, pool) for tool in tools]
