"""TRL's environment classes (``GRPOTrainer(environment_factory=MyEnv)``) as rallyrl tools.

Such a class has a ``reset(**row)`` (required), an optional ``get_reward()`` and public methods whose
type hints and Google-style docstrings make them tools (schemas by ``transformers.utils.get_json_schema``,
as TRL derives them). One tool config entry gives one rallyrl tool per public method::

    tools:
      - class_name: tools.environment_class:EnvironmentMethodTool
        config:
          environment: my_pkg.envs:IncrementEnv   # the class, by import path (also looked for next to the file)
          kwargs: {max_value: 6}                  # optional: IncrementEnv(**kwargs)
          methods: [increment]                    # optional: only these public methods become tools
          reward: get_reward                      # optional: the method or attribute read at the end
          threads: 256                            # optional: worker threads for the class's sync methods

Tools are the class's public methods (its own and inherited; regular methods and classmethods, by name),
except ``reset``, ``get_reward`` (or the configured ``reward``) and ``close``: TRL would offer ``close``
as a tool, here it is the environment's release. Per request:

- create: the request's tools share one instance of the class, keyed by the request id (the loop's
  ``instance_id``), a new one per request (TRL resets pooled instances again). Once every one of its
  tools has been created, the class is made and ``reset`` is called with the union of their
  ``create_kwargs`` (the record's ``tools_kwargs[<method>].create_kwargs``, usually under one method:
  ``{"increment": {"create_kwargs": {"target": 4}}}``; one key given two different values is an error).
  TRL passes the dataset row's columns; give them as create_kwargs. A rollout given only some of the
  entry's tools makes and resets it on first use.
- execute: the method with the model's arguments; ``str()`` of what it returns is the text the model
  reads, as in TRL; what it raises comes back as a ToolError with its message. Calls on one instance
  run one at a time; sync methods run in this entry's worker threads, async ones are awaited.
- calc_reward: ``get_reward()`` (or the ``reward`` attribute's value), reported by the first of the
  request's tools to be scored (the loop scores them in the tools' order: by name, or as ``methods``
  lists them), the others report 0, so the tools' rewards sum to the environment's.
- release: the last of the request's tools to be released drops the instance, calling its ``close()``
  when it has one (after a call that outlived its deadline, on that call's thread once it returns).

What ``reset`` returns (when not None) is appended to the prompt's last user message, as TRL appends it:
the rollout loop reads it from ``initial_observation`` after every tool is created.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import types
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout.user_threads import UserCall, UserThreads, counted, run_here
from tools.base import BaseTool, ToolError, ToolResponse
from tools.function_tool import derive_schema
from tools.loading import ToolConfigError, import_class

RESERVED = frozenset({"reset", "get_reward", "close"})
CONFIG_FIELDS = frozenset({"type", "environment", "kwargs", "methods", "reward", "threads"})
DEFAULT_THREADS = 256
_UNSET: Any = object()
_COUNTING = threading.Lock()  # closes are counted on worker threads too


@dataclass
class EnvironmentStats:
    """What the instances of one environment class cost, for tests and benchmarks."""

    opened: int = 0  # made and reset
    closed: int = 0  # released (``close()`` called when the class has one)
    calls: int = 0  # method calls
    errors: int = 0  # method, reset and reward calls that raised


@dataclass
class _Live:
    """One request's instance, shared by the request's tools of the same environment."""

    holders: set[str] = field(default_factory=set)  # tools that created it and have not released it
    reset_kwargs: dict[str, Any] = field(default_factory=dict)
    given_by: dict[str, str] = field(default_factory=dict)  # reset kwarg -> the tool whose create_kwargs gave it
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one call at a time on the instance
    env: Any = None
    opened: bool = False
    failed: str | None = None  # why making or resetting it failed
    observation: Any = None  # what reset returned
    observed: bool = False  # the loop took the observation for the prompt
    rewarded: bool = False
    pending: UserCall | None = None  # the last worker-thread call, possibly still running past its deadline


def public_methods(cls: type, reward: str | None) -> list[str]:
    """The names TRL would expose as tools (sorted, as ``inspect.getmembers`` gives them), but ``close``."""
    names = []
    for name in sorted(dir(cls)):
        if name.startswith("_") or name in RESERVED or name == reward:
            continue
        attr = inspect.getattr_static(cls, name)
        if inspect.isfunction(attr) or isinstance(attr, classmethod):
            names.append(name)
    return names


class EnvironmentClass:
    """One config entry's environment class: its instances by request id, its worker threads, its stats."""

    def __init__(self, cls: type, path: str, kwargs: dict[str, Any], reward: str | None, threads: int):
        self.cls, self.path, self.kwargs, self.reward, self.threads = cls, path, kwargs, reward, threads
        self.methods: list[str] = []
        self.live: dict[str, _Live] = {}
        self.stats = EnvironmentStats()
        self._pool: UserThreads | None = None

    async def call(self, live: _Live, fn: Any, kwargs: dict[str, Any], what: str) -> Any:
        """``fn(**kwargs)``: awaited when async, else on a daemon thread (never two at once on one instance);
        the tool's deadline (the loop's) leaves a call that never returns on its thread, stuck."""
        if inspect.iscoroutinefunction(fn):
            return await fn(**kwargs)
        if live.pending is not None and not live.pending.returned:
            raise ToolError(f"environment {self.path}: {what}: its previous call still runs past its deadline")
        live.pending = await self._workers().start(f"environment {self.path}", what, fn, **kwargs)
        result = await live.pending.result(None)
        return await result if inspect.isawaitable(result) else result

    async def ready(self, live: _Live) -> Any:
        """The instance, made and reset on first need (under ``live.lock``)."""
        if live.failed is not None:
            raise ToolError(live.failed)
        if not live.opened:
            try:
                if inspect.iscoroutinefunction(self.cls.reset):
                    await self.call(live, self._make, {"live": live}, "make")
                    live.observation = await live.env.reset(**live.reset_kwargs)
                else:
                    live.observation = await self.call(live, self._make_and_reset, {"live": live}, "reset")
            except Exception as exc:
                self.stats.errors += 1
                live.failed = f"environment {self.path}: reset failed: {type(exc).__name__}: {exc}"
                raise ToolError(live.failed) from exc
            live.opened = True
            self.stats.opened += 1
        return live.env

    def _make(self, live: _Live) -> None:
        live.env = self.cls(**self.kwargs)

    def _make_and_reset(self, live: _Live) -> Any:
        self._make(live)
        return live.env.reset(**live.reset_kwargs)

    async def close(self, live: _Live) -> None:
        """Close the instance once (counted once its close has run); after a call still running, on that
        call's thread once it returns."""
        close = getattr(live.env, "close", None)
        if live.env is None:
            return
        if not callable(close):
            self._count_closed()
            return
        closing = counted(close, self._count_closed)
        if live.pending is not None and live.pending.after(lambda: run_here(closing)):
            return
        if inspect.iscoroutinefunction(closing):
            await closing()
        else:
            await self.call(live, closing, {}, "close")

    def _count_closed(self) -> None:
        with _COUNTING:
            self.stats.closed += 1

    def _workers(self) -> UserThreads:
        if self._pool is None:
            self._pool = UserThreads(f"env-{self.cls.__name__}", self.threads)
        return self._pool


class EnvironmentMethodTool(BaseTool):
    """One public method of an environment class as a tool; the entry's tools share ``environment``."""

    def __init__(self, environment: EnvironmentClass, method: str, schema: dict[str, Any]):
        super().__init__(schema=schema)
        self.environment = environment
        self.method = method

    @classmethod
    def build_tools(cls, entry: dict[str, Any], where: str, source_dir: Path) -> list[BaseTool]:
        """The tools of a config entry (called by ``tools.registry``): one per public method of the class."""
        environment = _environment_from_config(entry, where, source_dir)
        names = environment.methods
        schemas = {}
        for name in names:
            fn = inspect.getattr_static(environment.cls, name)
            bound = getattr(environment.cls, name) if isinstance(fn, classmethod) else types.MethodType(fn, object())
            try:
                schemas[name] = derive_schema(bound)
            except ValueError as exc:
                raise ToolConfigError(f"{where}: method {environment.path}.{name}: {exc}") from None
        return [cls(environment, name, schemas[name]) for name in names]

    def initial_observation(self, instance_id: str) -> str | None:
        """What the instance's ``reset`` returned, once per instance (None until it ran, or when it returned
        None): the rollout loop appends it to the prompt's last user message, as TRL does."""
        live = self.environment.live.get(instance_id)
        if live is None or live.observation is None or live.observed:
            return None
        live.observed = True
        return str(live.observation)

    async def create(self, instance_id: str | None = None, **create_kwargs: Any) -> str:
        env = self.environment
        instance_id = instance_id or uuid.uuid4().hex
        live = env.live.setdefault(instance_id, _Live())
        if self.name in live.holders:
            raise ToolError(f"tool {self.name}: instance {instance_id!r} was already created")
        for key, value in create_kwargs.items():
            if key in live.reset_kwargs and live.reset_kwargs[key] != value:
                raise ToolError(
                    f"environment {env.path}: create_kwargs of tools {live.given_by[key]} and {self.name} give "
                    f"{key!r} two values; give it once"
                )
        if live.opened and any(key not in live.reset_kwargs for key in create_kwargs):
            raise ToolError(f"environment {env.path}: tool {self.name}'s create_kwargs came after reset ran")
        for key, value in create_kwargs.items():
            live.reset_kwargs[key] = value
            live.given_by.setdefault(key, self.name)
        live.holders.add(self.name)
        if live.holders.issuperset(env.methods):  # the last of the request's tools: make and reset it now
            try:
                async with live.lock:
                    await env.ready(live)
            except BaseException:
                await self.release(instance_id)
                raise
        return instance_id

    async def execute(self, instance_id: str, parameters: dict[str, Any], **execute_kwargs: Any) -> ToolResponse:
        env = self.environment
        live = self._live(instance_id)
        async with live.lock:
            instance = await env.ready(live)
            env.stats.calls += 1
            try:
                result = await env.call(live, getattr(instance, self.method), parameters, self.method)
            except (ToolError, asyncio.CancelledError):
                raise
            except Exception as exc:
                env.stats.errors += 1
                raise ToolError(str(exc) or type(exc).__name__) from exc
        return ToolResponse(str(result))

    async def calc_reward(self, instance_id: str, **calc_reward_kwargs: Any) -> float:
        env = self.environment
        live = self._live(instance_id)
        if env.reward is None or live.rewarded or live.failed is not None:  # a failed reset was reported already
            return 0.0
        live.rewarded = True  # one tool reports the environment's reward, even when reading it fails
        async with live.lock:
            instance = await env.ready(live)
            value = getattr(instance, env.reward, _UNSET)
            if value is _UNSET:
                raise ToolError(f"environment {env.path} has no {env.reward!r} to read its reward from")
            try:
                if callable(value):
                    value = await env.call(live, value, calc_reward_kwargs, env.reward)
                return float(value)
            except Exception:
                env.stats.errors += 1
                raise

    async def release(self, instance_id: str, **release_kwargs: Any) -> None:
        env = self.environment
        live = env.live.get(instance_id)
        if live is None or self.name not in live.holders:
            return
        live.holders.discard(self.name)
        if not live.holders:
            del env.live[instance_id]
            await env.close(live)

    def _live(self, instance_id: str) -> _Live:
        live = self.environment.live.get(instance_id)
        if live is None or self.name not in live.holders:
            raise ToolError(f"tool {self.name!r} has no live instance {instance_id!r}")
        return live


def _environment_from_config(entry: dict[str, Any], where: str, source_dir: Path) -> EnvironmentClass:
    """The entry's ``config`` checked: the class imported, the methods and the reward chosen."""
    config = entry.get("config") or {}
    for key in ("schema", "tool_schema"):
        if entry.get(key) is not None:
            raise ToolConfigError(f"{where}.{key}: an environment's tool schemas come from its methods' docstrings")
    unknown = set(config) - CONFIG_FIELDS
    if unknown:
        raise ToolConfigError(f"{where}.config: unknown field(s) {', '.join(sorted(unknown))}")
    path = config.get("environment")
    if not isinstance(path, str) or not path:
        raise ToolConfigError(f"{where}.config.environment: expected the class's import path, like 'pkg.module:MyEnv'")
    try:
        cls = import_class(path, (Path.cwd(), source_dir))
    except Exception as exc:
        raise ToolConfigError(
            f"{where}.config.environment: cannot import {path!r}: {type(exc).__name__}: {exc}"
        ) from None
    if not isinstance(cls, type):
        raise ToolConfigError(f"{where}.config.environment: {path!r} is not a class")
    if not callable(getattr(cls, "reset", None)):
        raise ToolConfigError(f"{where}.config.environment: {path} has no reset method (TRL requires one)")
    kwargs = config.get("kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ToolConfigError(f"{where}.config.kwargs: expected a mapping, got {type(kwargs).__name__}")
    reward = config.get("reward", "get_reward" if callable(getattr(cls, "get_reward", None)) else None)
    if reward is not None and not (isinstance(reward, str) and reward.isidentifier()):
        raise ToolConfigError(f"{where}.config.reward: expected a method or attribute name, got {reward!r}")
    threads = config.get("threads", DEFAULT_THREADS)
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ToolConfigError(f"{where}.config.threads: expected a positive integer, got {threads!r}")
    available = public_methods(cls, reward)
    if not available:
        raise ToolConfigError(f"{where}.config.environment: {path} has no public method to offer as a tool")
    methods = config.get("methods", available)
    if not (isinstance(methods, list) and methods and all(isinstance(m, str) for m in methods)):
        raise ToolConfigError(f"{where}.config.methods: expected a non-empty list of method names, got {methods!r}")
    missing = [m for m in methods if m not in available]
    if missing:
        raise ToolConfigError(
            f"{where}.config.methods: {path} has no public method {', '.join(missing)} to offer as a tool; "
            f"its tools: {', '.join(available) or 'none'}"
        )
    environment = EnvironmentClass(cls, path, dict(kwargs), reward, threads)
    environment.methods = list(dict.fromkeys(methods))
    return environment
