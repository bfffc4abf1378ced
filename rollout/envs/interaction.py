"""A step environment as the other side of the conversation: ``EnvironmentInteraction``.

One environment per request, in the request's state machine (the INTERACTING state):

    start_interaction   make the environment (``env`` of the record's interaction_kwargs, else the config's)
    start_messages      reset it with the record's seed: the first observation is the first user message
    generate_response   the assistant's turn is the action: ``step``; the observation is the next user
                        turn (loss mask 0), the step's reward its turn score; done / truncated end the request
    calculate_score     the sum of the steps' rewards: the environment's return
    finalize            close it, exactly once, also on error and cancel

Sync environments run on this interaction's own daemon threads (``rollout/user_threads.py``), so a slow
``step`` never stalls the event loop and a hung one never holds a thread the others need nor keeps the
command alive; async ones are awaited slice by slice (``rollout/user_coroutines.py``: one that blocks the
loop is named). Every call has a deadline (``reset_timeout_s``, ``step_timeout_s``; ``close`` has the
reset's). A call that outlives it ends its request with an error; its environment is closed once the
call returns, on the call's own thread.

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
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from rollout.envs.bindings import binding_class
from rollout.envs.step import EnvError, as_step, first_messages
from rollout.user_coroutines import BlockedLoop, run_user, stall_note, stalled
from rollout.user_threads import DEFAULT_MAX_STUCK, StuckCallsError, UserCall, UserThreads, counted, run_here
from rollout.users.interactions import BaseInteraction, last_assistant_text

if TYPE_CHECKING:
    from rollout.envs.ray_env import RayEnvironments


_COUNTING = threading.Lock()


@dataclass
class EnvStats:
    """What every episode of this interaction cost: counted for metrics, benchmarks and tests."""

    opened: int = 0
    closed: int = 0
    steps: int = 0
    step_seconds: float = 0.0  # wall time inside reset and step calls, summed over requests
    errors: int = 0

    def count(self, what: str) -> None:
        """One more ``opened`` or ``closed``: also from a worker thread (a close after a late return)."""
        with _COUNTING:
            setattr(self, what, getattr(self, what) + 1)


@dataclass
class _Episode:
    spec: str
    seed: int | None
    binding: Any = None
    rewards: list[float] = field(default_factory=list)
    pending: UserCall | None = None  # the last worker-thread call (it may still run past its deadline)
    done: bool = False
    closed: bool = False


class EnvironmentInteraction(BaseInteraction):
    """Runs a step environment (textarena, GEM, SkyRL-Gym, OpenEnv, or a class by import path) per request.

    Config: ``env`` (``family:id`` or ``pkg.module:Class``), ``env_kwargs``, ``reset_timeout_s`` (60),
    ``step_timeout_s`` (30), ``threads`` (256: sync calls at once, on daemon threads; a call stuck past its
    deadline gives its place to a new thread), ``max_stuck`` (1024: stuck calls before new ones are refused),
    ``max_info_chars`` (16384: a step's ``info`` kept up to this much JSON), ``check`` (True:
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
        self.max_stuck = int(self.config.get("max_stuck", DEFAULT_MAX_STUCK))
        self.max_info_chars = int(self.config.get("max_info_chars", 16_384))
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
        self._pool: UserThreads | None = None
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
            self._pool.shutdown()
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
            self.stats.count("opened")
        except BaseException:
            self._instances.pop(instance_id, None)
            making = episode.pending
            if making is not None:  # made after all, once the thread returns: closed there
                making.after(lambda: self._close_late(making))
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
            metadata["info"] = self._kept_info(step.info, episode.spec)
        return step.done, step.observation, step.reward, metadata

    def _kept_info(self, info: dict[str, Any], spec: str) -> Any:
        """A step's ``info`` as JSON, kept whole up to ``max_info_chars``; past that, a note of its size."""
        try:
            text = orjson.dumps(info, default=repr, option=orjson.OPT_NON_STR_KEYS)
        except TypeError as exc:  # a circular info, a key orjson cannot write
            raise EnvError(f"environment {spec}: step info cannot be written as JSON: {exc}") from None
        if len(text) > self.max_info_chars:
            return {"dropped": f"an info of {len(text):,} characters, over max_info_chars {self.max_info_chars:,}"}
        return orjson.loads(text)

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
        """``fn(*args, **kwargs)``: awaited when it is a coroutine function, else on a worker thread; under
        ``_timeout`` seconds (moved by the time other calls blocked the event loop meanwhile). Errors name
        the environment and the call."""
        started = time.monotonic()
        owner = f"environment {episode.spec}"
        try:
            if inspect.iscoroutinefunction(fn):
                return await self._awaited(fn(*args, **kwargs), owner, _what, _timeout)
            if episode.pending is not None and not episode.pending.returned:
                raise EnvError(f"{owner}: {_what}: its previous call still runs past its deadline")
            episode.pending = await self._workers().start(owner, _what, fn, *args, **kwargs)
            result = await episode.pending.result(_timeout, credit=_stalled_since)
            if inspect.isawaitable(result):  # a sync method that returned a coroutine
                result = await self._awaited(result, owner, _what, _timeout)
            return result
        except TimeoutError:
            self.stats.errors += 1
            note = stall_note(stalled(started, time.monotonic())[1])
            raise EnvError(f"{owner}: {_what} timed out after {_timeout:g} s{note}") from None
        except (EnvError, asyncio.CancelledError):
            raise
        except (BlockedLoop, StuckCallsError) as exc:
            self.stats.errors += 1
            raise EnvError(str(exc)) from None
        except Exception as exc:
            self.stats.errors += 1
            raise EnvError(f"{owner}: {_what} failed: {type(exc).__name__}: {exc}") from exc
        finally:
            self.stats.step_seconds += time.monotonic() - started

    async def _awaited(self, coroutine: Any, owner: str, what: str, timeout_s: float) -> Any:
        """A coroutine of the environment's, as a task waited on for ``timeout_s`` plus the time others
        blocked the loop meanwhile (its own stalls are its own); cancelled when that runs out."""
        token = object()
        task = asyncio.ensure_future(run_user(coroutine, owner, what, timeout_s, token))
        started = time.monotonic()
        deadline = started + timeout_s
        try:
            while True:
                done, _ = await asyncio.wait((task,), timeout=max(0.0, deadline - time.monotonic()))
                if done:
                    return task.result()
                extended = started + timeout_s + stalled(started, time.monotonic(), exclude=token)[0]
                if extended <= time.monotonic() + 0.01:
                    raise TimeoutError
                deadline = extended
        finally:
            if not task.done():
                task.cancel()

    async def _close(self, episode: _Episode) -> None:
        """Close the environment once (counted when its close has run); after a call still running past its
        deadline, on that call's thread once it returns."""
        if episode.closed or episode.binding is None:
            return
        episode.closed = True
        close = getattr(episode.binding, "close", None)
        if not callable(close):
            self.stats.count("closed")
            return
        closing = counted(close, lambda: self.stats.count("closed"))
        if episode.pending is not None and episode.pending.after(lambda: run_here(closing)):
            return
        await self._call(episode, closing, _what="close", _timeout=self.reset_timeout_s)

    def _close_late(self, call: UserCall) -> None:
        """On the thread of a make that outlived its deadline or its request: close what it made."""
        raised, made = call.outcome or (True, None)
        if raised:
            return
        self.stats.count("opened")
        close = getattr(made, "close", None)
        if callable(close):
            run_here(counted(close, lambda: self.stats.count("closed")))
        else:
            self.stats.count("closed")

    def _workers(self) -> UserThreads:
        if self._pool is None:
            self._pool = UserThreads(f"env-{self.name}", self.threads, self.max_stuck)
        return self._pool


def _stalled_since(since: float) -> float:
    return stalled(since, time.monotonic())[0]
