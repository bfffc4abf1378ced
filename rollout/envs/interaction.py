"""A step environment as the other side of the conversation: ``EnvironmentInteraction``.

One environment per request, in the request's state machine (the INTERACTING state):

    start_interaction   make the environment (``env`` of the record's interaction_kwargs, else the config's)
    start_messages      reset it with the record's seed: the first observation is the first user message
    generate_response   the assistant's turn is the action: ``step``; the observation is the next user
                        turn (loss mask 0), the step's reward its turn score; done / truncated end the request
    calculate_score     the sum of the steps' rewards: the environment's return
    finalize            close it, exactly once, also on error and cancel

Sync environments run in this interaction's own worker threads (``threads``), so a slow ``step`` never
stalls the event loop; every call has a deadline (``reset_timeout_s``, ``step_timeout_s``). A call that
outlives its deadline ends its request with an error; its environment is closed once the call returns.

```yaml
interaction:
  - name: env
    class_name: rollout.envs.interaction:EnvironmentInteraction
    config: {env: "textarena:GuessTheNumber-v0", env_kwargs: {}, step_timeout_s: 30}
```

With ``executor: ray`` in the config (and ``ray: {actors, num_cpus, ...}``, as on a tool entry), the
environments live in Ray actors (``rollout/envs/ray_env.py``); the deadlines and accounting stay here.

Records name it in ``interaction_kwargs``: ``{name: env, seed: 7}`` (and ``env`` / ``env_kwargs`` to
override the config's). ``rallyrl rollout --task textarena:GuessTheNumber-v0`` writes both for you.
"""

from __future__ import annotations

import asyncio
import inspect
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from rollout.deadlines import within
from rollout.envs.bindings import binding_class
from rollout.envs.step import EnvError, as_step, first_messages
from rollout.users.interactions import BaseInteraction, last_assistant_text

if TYPE_CHECKING:
    from rollout.envs.ray_env import RayEnvironments


@dataclass
class EnvStats:
    """What every episode of this interaction cost: counted for metrics, benchmarks and tests."""

    opened: int = 0
    closed: int = 0
    steps: int = 0
    step_seconds: float = 0.0  # wall time inside reset and step calls, summed over requests
    errors: int = 0


@dataclass
class _Episode:
    spec: str
    seed: int | None
    binding: Any = None
    rewards: list[float] = field(default_factory=list)
    pending: Any = None  # a worker-thread call still running past its deadline
    done: bool = False
    closed: bool = False


class EnvironmentInteraction(BaseInteraction):
    """Runs a step environment (textarena, GEM, SkyRL-Gym, OpenEnv, or a class by import path) per request.

    Config: ``env`` (``family:id`` or ``pkg.module:Class``), ``env_kwargs``, ``reset_timeout_s`` (60),
    ``step_timeout_s`` (30), ``threads`` (256: worker threads for sync environments), ``check`` (True:
    one episode is reset and closed when the rollout starts, so an environment that needs a download
    fails then, not mid-run), ``executor`` ("local", or "ray": the environments in Ray actors, with the
    ``ray`` settings of ``tools/ray_cluster.RayOptions``).
    """

    def __init__(self, config: dict[str, Any] | None = None):
        super().__init__(config)
        self.env = self.config.get("env")
        self.env_kwargs = dict(self.config.get("env_kwargs") or {})
        self.reset_timeout_s = float(self.config.get("reset_timeout_s", 60.0))
        self.step_timeout_s = float(self.config.get("step_timeout_s", 30.0))
        self.threads = int(self.config.get("threads", 256))
        self.check = bool(self.config.get("check", True))
        if self.env is not None:
            binding_class(str(self.env))  # an unknown family or a missing extra fails here, at load
        self.executor = self.config.get("executor", "local")
        if self.executor not in ("local", "ray"):
            raise ValueError(f"interaction {self.name}: executor {self.executor!r} is not one of local, ray")
        self.ray: RayEnvironments | None = None
        """The Ray actors the environments live in, with ``executor: ray`` (``ray.stats``: their accounting)."""
        if self.executor == "ray":
            from rollout.envs.ray_env import RayEnvironments
            from tools.ray_options import RayOptions

            options = RayOptions.parse(self.config.get("ray"), f"interaction {self.name}")
            self.ray = RayEnvironments(options, self.name, self.threads)
        elif "ray" in self.config:
            raise ValueError(f"interaction {self.name}: 'ray' settings, but executor is {self.executor!r}")
        self.stats = EnvStats()
        self._pool: ThreadPoolExecutor | None = None
        self._binding_classes: set[type] = set()  # their shutdown() stops what they started (OpenEnv's servers)

    # ----- startup and shutdown -------------------------------------------------------------------

    async def __aenter__(self) -> EnvironmentInteraction:
        if self.check and self.env is not None:
            instance_id = await self.start_interaction(None, seed=0)
            try:
                await self.start_messages(instance_id, [])
            except Exception as exc:
                raise EnvError(f"environment {self.env} failed its start check (one reset): {exc}") from None
            finally:
                await self.finalize_interaction(instance_id)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.ray is not None:
            await self.ray.aclose()
        for cls in self._binding_classes:
            shutdown = getattr(cls, "shutdown", None)
            if callable(shutdown):
                await asyncio.to_thread(shutdown)  # blocking: stops server processes
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    # ----- the interaction's coroutines -------------------------------------------------------------

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        spec = kwargs.get("env", self.env)
        if not isinstance(spec, str) or not spec:
            raise ValueError("EnvironmentInteraction needs an environment: 'env' in its config or interaction_kwargs")
        env_kwargs = {**self.env_kwargs, **dict(kwargs.get("env_kwargs") or {})}
        seed = kwargs.get("seed")
        episode = _Episode(spec, None if seed is None else int(seed))
        cls, env_id = binding_class(spec)
        self._binding_classes.add(cls)
        make = cls if self.ray is None else self.ray.maker(spec)
        instance_id = instance_id or uuid.uuid4().hex
        self._instances[instance_id] = {"episode": episode}
        try:
            episode.binding = await self._call(episode, make, env_id, **env_kwargs, _what="make",
                                               _timeout=self.reset_timeout_s)  # fmt: skip
            self.stats.opened += 1
        except BaseException:
            self._instances.pop(instance_id, None)
            made = episode.pending
            if made is not None and not made.done():  # made after all, once the thread returns: close it then
                made.add_done_callback(self._close_late)
            raise
        return instance_id

    async def start_messages(self, instance_id: str, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Reset the environment with the record's seed; the conversation starts from its first observation."""
        episode = self._episode(instance_id)
        result = await self._call(episode, episode.binding.reset, episode.seed, messages, _what="reset",
                                  _timeout=self.reset_timeout_s)  # fmt: skip
        return first_messages(result, messages, episode.spec)

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        episode = self._episode(instance_id)
        result = await self._call(episode, episode.binding.step, last_assistant_text(messages), _what="step",
                                  _timeout=self.step_timeout_s)  # fmt: skip
        step = as_step(result, episode.spec)
        self.stats.steps += 1
        episode.rewards.append(step.reward)
        episode.done = step.done
        metadata = {"reward": step.reward, "done": step.done, "truncated": step.truncated}
        if step.info:
            metadata["info"] = orjson.loads(orjson.dumps(step.info, default=repr, option=orjson.OPT_NON_STR_KEYS))
        return step.done, step.observation, step.reward, metadata

    async def calculate_score(self, instance_id: str, **kwargs: Any) -> float:
        return float(sum(self._episode(instance_id).rewards))

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        state = self._instances.pop(instance_id, None)
        if state is not None:
            await self._close(state["episode"])

    # ----- calls into the environment ---------------------------------------------------------------

    def _episode(self, instance_id: str) -> _Episode:
        try:
            return self._instances[instance_id]["episode"]
        except KeyError:
            raise EnvError(f"{self.name}: no live environment {instance_id!r}") from None

    async def _call(self, episode: _Episode, fn: Any, *args: Any, _what: str, _timeout: float, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``: awaited when it is a coroutine function, else in a worker thread;
        under ``_timeout`` seconds. Errors name the environment and the call."""
        started = time.monotonic()
        try:
            if inspect.iscoroutinefunction(fn):
                return await within(fn(*args, **kwargs), _timeout)
            if episode.pending is not None and not episode.pending.done():
                raise EnvError(f"environment {episode.spec}: {_what}: its previous call still runs past its deadline")
            future = asyncio.get_running_loop().run_in_executor(self._workers(), lambda: fn(*args, **kwargs))
            episode.pending = future
            result = await within(asyncio.shield(future), _timeout)
            if inspect.isawaitable(result):  # a sync method that returned a coroutine
                result = await within(result, _timeout)
            return result
        except TimeoutError:
            self.stats.errors += 1
            raise EnvError(f"environment {episode.spec}: {_what} timed out after {_timeout:g} s") from None
        except (EnvError, asyncio.CancelledError):
            raise
        except Exception as exc:
            self.stats.errors += 1
            raise EnvError(f"environment {episode.spec}: {_what} failed: {type(exc).__name__}: {exc}") from exc
        finally:
            self.stats.step_seconds += time.monotonic() - started

    async def _close(self, episode: _Episode) -> None:
        """Close the environment once; after a call still running past its deadline, once that call returns."""
        if episode.closed or episode.binding is None:
            return
        episode.closed = True
        close = getattr(episode.binding, "close", None)
        if not callable(close):
            self.stats.closed += 1
            return
        if inspect.iscoroutinefunction(close):
            try:
                await within(close(), self.reset_timeout_s)
            finally:
                self.stats.closed += 1
            return
        pending = episode.pending
        if pending is not None and not pending.done():  # close after the stuck call, off this request's path
            pending.add_done_callback(lambda _: self._workers().submit(self._close_sync, close))
            return
        await asyncio.get_running_loop().run_in_executor(self._workers(), self._close_sync, close)

    def _close_late(self, made: Any) -> None:
        """Close an environment whose making outlived its deadline or its request."""
        if made.cancelled() or made.exception() is not None:
            return
        self.stats.opened += 1
        close = getattr(made.result(), "close", None)
        if callable(close) and not inspect.iscoroutinefunction(close):
            self._workers().submit(self._close_sync, close)
        else:
            self.stats.closed += 1

    def _close_sync(self, close: Any) -> None:
        try:
            close()
        finally:
            self.stats.closed += 1

    def _workers(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix=f"env-{self.name}")
        return self._pool
