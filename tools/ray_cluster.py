"""Ray for ``executor: ray``: one connection per process, and a pool of actors whose calls never hang
and whose instances are all accounted for (the ``ray:`` settings: ``tools/ray_options.py``).

A pool holds ``actors`` Ray actors of one host class (``tools/ray_executor.py``'s ``ToolHost``,
``rollout/envs/ray_env.py``'s ``EnvHost``); each actor holds many instances (one per request), and an
instance stays on the actor that created it. Every wait is bounded by ``timeout_s``. An actor that dies
(its node lost, its process killed) takes its instances with it: they are recorded as lost with their
node, later calls on them raise ``ToolError`` (``Error: ...`` to the model), and new instances go to
the actors left, or to a replacement (at most ``max_replacements`` over the run). ``close`` kills the
actors; ``shutdown`` (also at exit) closes every pool and stops a Ray this process started.

``ray`` is imported only here, and only once an ``executor: ray`` entry is loaded.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import pickle
import weakref
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

from tools.base import ToolError
from tools.ray_options import RayOptions

logger = logging.getLogger(__name__)

# ----- one connection per process ------------------------------------------------------------------

_POOLS: weakref.WeakSet[ActorPool] = weakref.WeakSet()
_connected: dict[str, Any] = {}  # {"address": ...} once this module called ray.init


def connect(options: RayOptions, where: str) -> None:
    """``ray.init`` once per process: ``options.address``, else a local Ray. A Ray the caller
    initialized already is used as it is (and left running at exit)."""
    import ray

    if _connected:
        if options.address != _connected["address"]:
            raise ValueError(f"{where}: ray.address {options.address!r}, but this process is connected to "
                             f"{_connected['address'] or 'a local Ray'}: one cluster per run")  # fmt: skip
        return
    if ray.is_initialized():
        return
    kwargs: dict[str, Any] = {"logging_level": logging.WARNING, "log_to_driver": False}
    if options.address is None:
        kwargs["include_dashboard"] = False  # a local Ray: no dashboard, nothing listening but Ray itself
    try:
        ray.init(address=options.address, **kwargs)
    except (ConnectionError, ValueError, RuntimeError) as exc:
        raise ValueError(f"{where}: cannot connect to Ray at {options.address or 'a local Ray'}: {exc}") from None
    _connected["address"] = options.address
    atexit.register(shutdown)  # after ray.init's own: runs first


def shutdown() -> None:
    """Close every pool (its actors killed) and disconnect from Ray, which stops a Ray started here."""
    for pool in list(_POOLS):
        pool.close()
    if _connected:
        _connected.clear()
        import ray

        ray.shutdown()


# ----- accounting -------------------------------------------------------------------------------------


@dataclass
class LostInstance:
    tool: str
    instance_id: str
    node_id: str | None
    reason: str


@dataclass
class RayStats:
    """What a pool did: every created instance is released, lost (with its node) or still live."""

    created: int = 0
    released: int = 0
    lost: list[LostInstance] = field(default_factory=list)
    actors_started: int = 0
    actors_lost: int = 0

    def live(self) -> int:
        return self.created - self.released - len(self.lost)

    def to_dict(self) -> dict[str, Any]:
        return {"created": self.created, "released": self.released, "lost": len(self.lost), "live": self.live(),
                "actors_started": self.actors_started, "actors_lost": self.actors_lost,
                "lost_nodes": sorted({lost.node_id or "unknown" for lost in self.lost})}  # fmt: skip


# ----- the pool ----------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Slot:
    actor: Any
    number: int
    node_id: str | None = None
    answered: bool = False
    dead: str | None = None
    instances: set[tuple[str, str]] = field(default_factory=set)


class ActorLost(ToolError):
    """An instance whose actor died: its calls and its release fail with this (the model reads it)."""


class ActorPool:
    """``options.actors`` actors of ``host_class(*host_args)``; instances are keyed by (name, instance id),
    and the instances of one id (the tools of one entry, for one request) share an actor."""

    def __init__(self, host_class: type, host_args: tuple[Any, ...], options: RayOptions, what: str, where: str):
        connect(options, where)
        import ray

        self._remote = ray.remote(host_class)
        self.host_args, self.options, self.what = host_args, options, what
        self.stats = RayStats()
        self.slots: list[_Slot] = []
        self.placement: dict[tuple[str, str], _Slot] = {}
        self.lost: dict[tuple[str, str], LostInstance] = {}
        self.broken: str | None = None  # an actor's constructor failed: every create fails with it
        self.closed = False
        _POOLS.add(self)

    # ----- the lifecycle -----

    async def create(self, name: str, instance_id: str, method: str, *args: Any) -> Any:
        """``method(*args)`` on the actor that holds ``instance_id`` (a fresh one: the least loaded); it
        makes the instance. A create whose actor dies is tried on another."""
        key = (name, instance_id)
        for _ in range(self.options.actors + 1):
            slot = self._slot_for(instance_id)
            slot.instances.add(key)  # counted while it is made: concurrent creates spread over the actors
            try:
                result = await self._call(slot, method, *args)
            except BaseException as exc:
                slot.instances.discard(key)
                if isinstance(exc, ActorLost):
                    continue
                raise
            self.stats.created += 1
            self.placement[key] = slot
            return result
        raise ToolError(f"{self.what}: create failed: every Ray actor tried was lost")

    async def call(self, name: str, instance_id: str, method: str, *args: Any) -> Any:
        """``method(*args)`` on the actor holding the instance; ToolError when it is lost or unknown."""
        return await self._call(self._holder(name, instance_id), method, *args)

    async def release(self, name: str, instance_id: str, method: str, *args: Any) -> Any:
        """``method(*args)`` to free the instance; counted released, or lost when its actor is gone."""
        key = (name, instance_id)
        if key in self.lost:
            return None  # recorded lost with its node when its actor died
        slot = self._holder(name, instance_id)
        try:
            result = await self._call(slot, method, *args)
        except ActorLost:
            return None  # _lose_slot recorded it
        except BaseException as exc:  # timed out, cancelled, or the release itself failed: still gone for us
            self._forget(key, f"release failed: {type(exc).__name__}: {exc}")
            raise
        self._forget(key, None)
        return result

    async def call_slot(self, slot: _Slot, method: str, *args: Any) -> Any:
        """``method(*args)`` on one actor of the pool, for no instance (a host's shutdown)."""
        return await self._call(slot, method, *args)

    def close(self) -> None:
        """Kill every actor (its sandboxes die with it); instances never released are recorded lost."""
        if self.closed:
            return
        self.closed = True
        import ray

        for key in list(self.placement):
            self._forget(key, "the run ended before its release")
        for slot in self.slots:
            try:
                ray.kill(slot.actor, no_restart=True)
            except Exception as exc:  # Ray gone already (its own exit handler ran): the actors went with it
                logger.debug("%s: ray.kill of actor %d: %s", self.what, slot.number, exc)
        level = logging.WARNING if self.stats.lost else logging.INFO
        logger.log(level, "%s on Ray: %s", self.what, self.stats.to_dict())

    # ----- internals -----

    def _slot_for(self, instance_id: str) -> _Slot:
        if self.closed:
            raise ToolError(f"{self.what}: its Ray actors were closed (the run is ending)")
        if self.broken is not None:
            raise ToolError(f"{self.what}: its Ray actor cannot be created: {self.broken}")
        for key, slot in self.placement.items():  # another tool of the entry made this id: the same actor
            if key[1] == instance_id and slot.dead is None:
                return slot
        live = [slot for slot in self.slots if slot.dead is None]
        if len(live) < self.options.actors:
            if self.stats.actors_started >= self.options.actors + self.options.max_replacements:
                if not live:
                    raise ToolError(f"{self.what}: no Ray actor left; {self.stats.actors_lost} were lost "
                                    f"(max_replacements {self.options.max_replacements} used up)")  # fmt: skip
            else:
                live.append(self._start())
        return min(live, key=lambda slot: len(slot.instances))

    def _start(self) -> _Slot:
        actor = self._remote.options(**self.options.actor_options()).remote(*self.host_args)
        self.stats.actors_started += 1
        slot = _Slot(actor, self.stats.actors_started)
        self.slots.append(slot)
        return slot

    def _holder(self, name: str, instance_id: str) -> _Slot:
        key = (name, instance_id)
        if key in self.lost:
            lost = self.lost[key]
            raise ActorLost(f"{self.what}: instance lost with its Ray actor on node {lost.node_id}: {lost.reason}")
        try:
            return self.placement[key]
        except KeyError:
            raise ToolError(f"{self.what} has no live instance {instance_id!r}") from None

    async def _call(self, slot: _Slot, method: str, *args: Any) -> Any:
        """One actor call under ``timeout_s``; the host's (ok, value) or (raise, exception) is unwrapped."""
        import ray
        from ray.exceptions import ActorUnavailableError, RayActorError, RayError

        if slot.dead is not None:
            raise ActorLost(f"{self.what}: its Ray actor on node {slot.node_id} was lost: {slot.dead}")
        ref = getattr(slot.actor, method).remote(*args)
        try:
            async with asyncio.timeout(self.options.timeout_s):
                kind, value, node_id = await ref
        except (TimeoutError, asyncio.CancelledError) as exc:
            _cancel(ray, ref)
            if isinstance(exc, asyncio.CancelledError):
                raise
            if not slot.answered:
                raise ToolError(f"{self.what}: its Ray actor did not start within {self.options.timeout_s:g} s "
                                f"(no node with room for {self.options.actor_options()}?)") from None  # fmt: skip
            raise ToolError(f"{self.what}: {method} got no answer from its Ray actor on node {slot.node_id} "
                            f"within {self.options.timeout_s:g} s") from None  # fmt: skip
        except ActorUnavailableError as exc:
            raise ToolError(f"{self.what}: its Ray actor is unavailable for now: {_last_line(exc)}") from None
        except RayActorError as exc:
            if exc.actor_init_failed:
                self.broken = _last_line(exc)
            self._lose_slot(slot, _last_line(exc))
            raise ActorLost(f"{self.what}: its Ray actor on node {slot.node_id} was lost: {slot.dead}") from None
        except RayError as exc:
            raise ToolError(f"{self.what}: Ray failed the call: {_last_line(exc)}") from None
        slot.answered, slot.node_id = True, node_id
        if kind == "raise":
            raise value
        return value

    def _lose_slot(self, slot: _Slot, reason: str) -> None:
        if slot.dead is not None:
            return
        slot.dead = reason
        self.stats.actors_lost += 1
        instances = list(slot.instances)
        for key in instances:
            self._forget(key, reason)
        logger.warning("%s: Ray actor %d on node %s lost (%s); %d instance(s) lost with it",
                       self.what, slot.number, slot.node_id, reason, len(instances))  # fmt: skip

    def _forget(self, key: tuple[str, str], lost_reason: str | None) -> None:
        """The instance is no longer live: released (``lost_reason`` None) or lost."""
        slot = self.placement.pop(key, None)
        if slot is None:
            return
        slot.instances.discard(key)
        if lost_reason is None:
            self.stats.released += 1
            return
        lost = LostInstance(key[0], key[1], slot.node_id, lost_reason)
        self.lost[key] = lost
        self.stats.lost.append(lost)


def _cancel(ray: Any, ref: Any) -> None:
    try:
        ray.cancel(ref)
    except Exception as exc:  # the call finished, or its actor is gone
        logger.debug("ray.cancel: %s", exc)


def _last_line(exc: BaseException) -> str:
    """Ray's messages run over several lines (the actor's id, pid, ip); the last one says what happened."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


async def outcome(call: Awaitable[Any], node_id: str) -> tuple[str, Any, str]:
    """What a host method gives back: ``("ok", result, node)``, or ``("raise", exception, node)`` for any
    failure but a cancel, so that the rollout process raises what the tool raised (``ActorPool._call``)."""
    try:
        return "ok", await call, node_id
    except Exception as exc:
        return "raise", portable(exc), node_id


def portable(exc: BaseException) -> BaseException:
    """``exc`` when it pickles (it reaches the rollout process as it was raised), else its text."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc
