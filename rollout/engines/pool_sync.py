"""The weights of a pool of servers (``pool.py``): what every server must hold, how each takes it, the
push after each optimizer step, and the sync of a server that comes back.

Every server holds the pool's current weights before it gets requests:

- ``push`` (the trainer's weights in memory or through disk, ``weight_push.py``): every healthy server
  is paused (its requests in flight aborted; their clients resume them on the new weights), takes the
  weights by its transport, is asked which version it serves now, and continues; a server that fails
  or misses a deadline is taken out of rotation, and one that may hold part of the new weights stays
  paused. Every server failing is an error.
- ``load_from_disk`` (a saved model directory or LoRA adapter, the older path): the same order,
  each server loading the directory.
- ``bring_back``: a server that answers its health check again (restarted, or back after a failed
  push) takes the current weights first: by its transport, from the trainer's weights as they are
  (only while the trainer is not changing them: otherwise at the next check), falling back to
  the weights saved on disk; then it rejoins. A server that restarted between two health checks is
  found by ``drift`` (it reports another version than it was given) and taken out first.

Transports are chosen once per server (``plan``, ``weight_plan.py``) and said in one line each.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rollout.engines.base import EngineError, WeightSource
from rollout.engines.config import WeightSyncConfig
from rollout.engines.weight_plan import check_limits, check_shapes, choose_transport
from rollout.engines.weight_push import Receiver, push_buckets

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


class ServerSync:
    """How one server takes weights (None until planned; ``receiver`` None: through disk)."""

    def __init__(self) -> None:
        self.planned = False
        self.receiver: Receiver | None = None
        self.version: int | None = 0
        """The version it holds (None: unknown, it was out and may have restarted)."""
        self.waiting = False
        """It answers again but could not be synced then (the trainer's weights were changing, or are
        readable only during a sync: FSDP): the next push takes it."""


class PoolWeights:
    """What every server of a pool must hold, and the one lock every change of it takes."""

    def __init__(self) -> None:
        self.version = 0
        self.source: WeightSource | None = None  # pushed weights (the trainer's)
        self.path: str | None = None  # or a directory loaded from disk
        self.adapter = False  # (the directory is a LoRA adapter)
        self.config = WeightSyncConfig()
        self.device: torch.device | None = None
        self.lock = asyncio.Lock()

    # ----- plan ------------------------------------------------------------------------------------

    async def plan(self, servers: Sequence[Any], config: WeightSyncConfig, source: WeightSource,
                   device: torch.device) -> list[str]:  # fmt: skip
        """Each reachable server's transport (WeightSyncError when one cannot take what ``config`` asks,
        or serves a model of another shape); one line per server saying how it syncs."""
        self.config, self.device = config, device
        return [line for line in await asyncio.gather(*(self._plan_one(s, source) for s in servers)) if line]

    async def _plan_one(self, server: Any, source: WeightSource) -> str | None:
        from rollout.engines.server_http import ServerUnavailableError

        try:
            support = await server.engine.weight_support()
        except ServerUnavailableError:
            return None  # planned when it answers (bring_back)
        assert self.device is not None
        transport = choose_transport(support, self.config, self.device)
        check_shapes(source.specs(), support)
        if transport != "disk":
            check_limits(source.specs(), support, transport, self.config.bucket_bytes)
            dtype = support.dtype or source.specs()[0].dtype
            server.sync.receiver = server.engine.weight_receiver(transport, support, self.config, self.device, dtype,
                                                                 dict(source.aliases))  # fmt: skip
        server.sync.planned = True
        how = server.sync.receiver.describe() if server.sync.receiver else "disk (a saved model directory)"
        return f"weight sync: {how} into {support.label()}"

    # ----- push ------------------------------------------------------------------------------------

    async def push(self, servers: Sequence[Any], source: WeightSource, version: int,
                   eject: Any) -> dict[str, int | None]:  # fmt: skip
        """Every healthy server of ``servers`` takes ``source`` as ``version``; the ones that fail are
        ``eject``ed (``eject(server, reason)``). Returns each server's version (None: failed); an
        EngineError when every server failed."""
        async with self.lock:
            self.version, self.source, self.path, self.adapter = version, source, None, False
            targets = [s for s in servers if s.healthy or s.sync.waiting]
            errors = await self._push(targets, source, version)
            return self._settle(targets, errors, version, eject)

    async def _push(self, targets: Sequence[Any], source: WeightSource, version: int) -> dict[Any, str]:
        """Pause -> move the weights (each server by its transport) -> read back the version -> continue.
        Returns the servers that failed, with why."""
        errors: dict[Any, str] = {}
        if self.device is None:
            raise EngineError("plan_weight_sync before the first push (it chooses each server's transport)")
        for server in [s for s in targets if not s.sync.planned]:  # unreachable when the run planned
            try:
                if await self._plan_one(server, source) is None:
                    errors[server] = f"{server.url}: not reachable to plan its weight sync"
            except EngineError as exc:  # (a model of another shape: this server's failure, not the run's)
                errors[server] = str(exc)
        targets = [s for s in targets if s not in errors]
        paused = []
        for server, result in zip(targets, await asyncio.gather(
                *(s.engine.pause_for_update() for s in targets), return_exceptions=True), strict=True):  # fmt: skip
            if isinstance(result, Exception):
                errors[server] = f"{server.url}: pausing for the weight update: {result}"
            else:
                paused.append(server)
        moved = False
        try:  # (a failure of the trainer's own, a full disk say, is the caller's: it goes on up)
            await self._move(paused, source, version, errors)
            moved = True
        finally:  # every server paused is continued, or kept paused when it may hold part of the new weights
            await asyncio.gather(*(self._continue(s, (moved and s not in errors) or s.sync.receiver is None)
                                   for s in paused))  # fmt: skip
        return errors

    async def _move(self, paused: Sequence[Any], source: WeightSource, version: int, errors: dict[Any, str]) -> None:
        """The weights into the ``paused`` servers, each by its transport; then their versions read back."""
        by_disk = [s for s in paused if s.sync.receiver is None]
        in_memory = [s for s in paused if s.sync.receiver is not None]
        if by_disk:
            path = await source.saved(version)
            results = await asyncio.gather(*(s.engine.update_weights_from_disk(path, version) for s in by_disk),
                                           return_exceptions=True)  # fmt: skip
            errors.update({s: f"{s.url}: loading {path}: {r}" for s, r in zip(by_disk, results, strict=True)
                           if isinstance(r, Exception)})  # fmt: skip
        if in_memory:
            receivers = {s.sync.receiver: s for s in in_memory}
            failed = await push_buckets(list(receivers), source, version, self.config.bucket_bytes,
                                        self.config.timeout_s)  # fmt: skip
            errors.update({receivers[r]: reason for r, reason in failed.items()})
        await self._read_back([s for s in paused if s not in errors], version, errors)

    async def _read_back(self, servers: Sequence[Any], version: int, errors: dict[Any, str]) -> None:
        """Each server's version as it reports it now; one that reports another is an error."""

        async def one(server: Any) -> None:
            try:
                async with asyncio.timeout(self.config.timeout_s):
                    reported = await server.engine.get_weight_version()
            except (EngineError, TimeoutError) as exc:
                errors[server] = f"{server.url}: reading its weight version back: {exc or 'no answer'}"
                return
            if reported != version:
                errors[server] = f"{server.url} reports weight version {reported} after the update to {version}"

        await asyncio.gather(*(one(s) for s in servers))

    async def _continue(self, server: Any, complete: bool) -> None:
        try:
            await server.engine.continue_after_update(complete)
        except EngineError as exc:
            logger.warning("engine pool: %s did not continue after the weight update: %s", server.url, exc)

    def _settle(self, targets: Sequence[Any], errors: dict[Any, str], version: int,
                eject: Any) -> dict[str, int | None]:  # fmt: skip
        versions: dict[str, int | None] = {}
        for server in targets:
            if server in errors:
                eject(server, errors[server])
                versions[server.url] = None
            else:
                server.sync.version, server.sync.waiting = version, False
                versions[server.url] = version
        if targets and len(errors) == len(targets):
            raise EngineError(f"weight update {version} failed on every server: {'; '.join(errors.values())}")
        return versions

    # ----- from disk -------------------------------------------------------------------------------

    async def load_from_disk(self, servers: Sequence[Any], path: str, version: int, adapter: bool,
                             eject: Any) -> int:  # fmt: skip
        """Every healthy server: pause -> load ``path`` (a model directory, or a LoRA adapter) -> continue."""
        async with self.lock:
            self.version, self.source, self.path, self.adapter = version, None, str(path), adapter
            targets = [s for s in servers if s.healthy]
            calls = [s.engine.sync_adapter_from_disk if adapter else s.engine.sync_weights_from_disk for s in targets]
            results = await asyncio.gather(*(call(path, version) for call in calls), return_exceptions=True)
            errors = {s: f"{s.url}: {r}" for s, r in zip(targets, results, strict=True) if isinstance(r, Exception)}
            self._settle(targets, errors, version, eject)
        return version

    # ----- a server that comes back ------------------------------------------------------------------

    async def drift(self, server: Any) -> str | None:
        """Why a healthy server no longer holds the pool's weights (it restarted between two health
        checks and serves its checkpoint), or None; asked only between syncs, of a pool that syncs."""
        if self.lock.locked() or (self.source is None and self.path is None) or server.sync.version is None:
            return None
        try:
            reported = await server.engine.get_weight_version()
        except EngineError:
            return None  # (the health check's business)
        if reported == server.sync.version or self.lock.locked():
            return None
        return f"it reports weight version {reported}, not {server.sync.version} (restarted?)"

    async def bring_back(self, server: Any) -> bool:
        """Whether ``server`` (answering again) holds the pool's current weights, after syncing it when
        it does not; False: not now (the trainer is changing its weights, or the sync failed)."""
        async with self.lock:
            if server.sync.version == self.version or (self.source is None and self.path is None):
                return True
            if self.path is not None:
                engine = server.engine
                load = engine.update_adapter_from_disk if self.adapter else engine.update_weights_from_disk
                try:
                    await load(self.path, self.version)
                except EngineError:
                    return False
            elif not await self._bring_back_pushed(server):
                return False
            server.sync.version = self.version
            return True

    async def _bring_back_pushed(self, server: Any) -> bool:
        """Push the trainer's weights into ``server`` alone, holding them (``WeightSource.reading``) so
        that no optimizer step changes them meanwhile; when they cannot be read now, the next push
        takes it (``waiting``)."""
        source = self.source
        assert source is not None
        async with source.reading(self.version) as readable:
            if not readable:  # changing now, or readable only in a sync (FSDP): the next push takes it
                server.sync.waiting = True
                return False
            if server.sync.receiver is not None:
                await server.sync.receiver.abandon()  # its group and session died with the old process
            errors = await self._push([server], source, self.version)
            if not errors:
                return True
            logger.warning("engine pool: %s; loading the saved weights instead", errors[server])
            try:  # the weights saved on disk: a group that cannot be made again
                path = await source.saved(self.version)
                await server.engine.sync_weights_from_disk(path, self.version)
            except EngineError as exc:
                logger.warning("engine pool: %s could not load %s either: %s", server.url, self.version, exc)
                return False
        return True

    async def close(self, servers: Sequence[Any]) -> None:
        """Release every receiver's group (the run is over)."""
        for server in servers:
            if server.sync.receiver is not None:
                try:
                    async with asyncio.timeout(10):
                        await server.sync.receiver.close()
                except (EngineError, TimeoutError) as exc:
                    logger.warning("engine pool: closing %s's weight group: %s", server.url, exc)
