"""``executor: ray`` on an ``EnvironmentInteraction``: each episode's environment lives in a Ray actor.

```yaml
interaction:
  - name: env
    class_name: rollout.envs.interaction:EnvironmentInteraction
    config: {env: "textarena:GuessTheNumber-v0", executor: ray, ray: {actors: 4, num_cpus: 1}}
```

The interaction keeps its state machine, deadlines and accounting here; only the binding (make, reset,
step, close) runs in the actors of one pool (``tools/ray_cluster.py``): sync environments in the actor's
own threads. A lost actor fails the calls of its episodes (the request ends with an error) and records
them lost with their node (``RayEnvironments.stats``); ``close`` kills the actors.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson

from rollout.envs.bindings import binding_class
from rollout.envs.step import Step, as_step
from tools.ray_cluster import ActorPool, RayStats, outcome
from tools.ray_options import RayOptions


class EnvHost:
    """In a Ray actor: the bindings of the episodes placed on it, by key."""

    def __init__(self, threads: int):
        import ray

        self.node_id = ray.get_runtime_context().get_node_id()
        self.bindings: dict[str, tuple[str, Any]] = {}
        self.classes: set[type] = set()
        self.threads = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ray-env")

    async def make(self, key: str, spec: str, env_id: str, env_kwargs: dict[str, Any]) -> tuple[str, Any, str]:
        return await outcome(self._make(key, spec, env_id, env_kwargs), self.node_id)

    async def reset(self, key: str, seed: int | None, messages: list[dict[str, Any]]) -> tuple[str, Any, str]:
        return await outcome(self._run(self.bindings[key][1].reset, seed, messages), self.node_id)

    async def step(self, key: str, action: str) -> tuple[str, Any, str]:
        return await outcome(self._step(key, action), self.node_id)

    async def close(self, key: str) -> tuple[str, Any, str]:
        return await outcome(self._close(key), self.node_id)

    async def shutdown(self) -> tuple[str, Any, str]:
        """What the binding classes started on this node (OpenEnv's servers) is stopped."""
        return await outcome(self._shutdown(), self.node_id)

    async def _make(self, key: str, spec: str, env_id: str, env_kwargs: dict[str, Any]) -> None:
        cls, _ = binding_class(spec)
        self.classes.add(cls)
        self.bindings[key] = (spec, await self._run(cls, env_id, **env_kwargs))

    async def _step(self, key: str, action: str) -> Step:
        spec, binding = self.bindings[key]
        step = as_step(await self._run(binding.step, action), spec)
        if step.info:  # JSON-safe here: what the environment keeps in it may not pickle
            step.info = orjson.loads(orjson.dumps(step.info, default=repr, option=orjson.OPT_NON_STR_KEYS))
        return step

    async def _close(self, key: str) -> None:
        _, binding = self.bindings.pop(key)
        close = getattr(binding, "close", None)
        if callable(close):
            await self._run(close)

    async def _shutdown(self) -> None:
        for cls in self.classes:
            stop = getattr(cls, "shutdown", None)
            if callable(stop):
                await self._run(stop)

    async def _run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if inspect.iscoroutinefunction(fn):
            return await fn(*args, **kwargs)
        result = await asyncio.get_running_loop().run_in_executor(self.threads, functools.partial(fn, *args, **kwargs))
        return await result if inspect.isawaitable(result) else result


class RayEnvironments:
    """The pool of one interaction: ``maker(spec)`` makes bindings whose methods run in its actors."""

    def __init__(self, options: RayOptions, name: str, threads: int):
        self.name = name
        self.pool = ActorPool(EnvHost, (threads,), options, f"environment interaction {name}", f"interaction {name}")

    @property
    def stats(self) -> RayStats:
        return self.pool.stats

    def maker(self, spec: str) -> Any:
        """An async ``maker(env_id, **env_kwargs)`` for ``EnvironmentInteraction``: a binding in an actor."""
        return functools.partial(self._make, spec)

    async def _make(self, spec: str, env_id: str, **env_kwargs: Any) -> RayBinding:
        key = uuid.uuid4().hex
        await self.pool.create(self.name, key, "make", key, spec, env_id, env_kwargs)
        return RayBinding(self.pool, self.name, key)

    async def aclose(self) -> None:
        """Stop what the actors' binding classes started (bounded by ``timeout_s``), then kill the actors."""
        slots = [slot for slot in self.pool.slots if slot.dead is None and slot.answered]
        await asyncio.gather(*(self.pool.call_slot(slot, "shutdown") for slot in slots), return_exceptions=True)
        self.pool.close()


class RayBinding:
    """One episode's binding in an actor: ``reset``, ``step`` and ``close`` are forwarded."""

    def __init__(self, pool: ActorPool, name: str, key: str):
        self.pool, self.name, self.key = pool, name, key

    async def reset(self, seed: int | None, messages: list[dict[str, Any]]) -> Any:
        return await self.pool.call(self.name, self.key, "reset", self.key, seed, messages)

    async def step(self, action: str) -> Step:
        return await self.pool.call(self.name, self.key, "step", self.key, action)

    async def close(self) -> None:
        await self.pool.release(self.name, self.key, "close", self.key)
