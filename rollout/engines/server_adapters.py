"""LoRA adapters loaded by SGLang and vLLM servers at run time, shared by their clients.

A training run with ``lora:`` syncs the adapter alone (a few MiB) instead of the merged model: the
trainer writes it in peft's format (``out/weights/v{N}``, atomically) and each server loads it
through its own endpoint under a new name per version (``rallyrl-v{N}-{tag}``, the tag this
client's own, so that a second run against the same server, or a resumed one, never collides with
names an earlier run left loaded); from then on every
request this client sends names it (vLLM: the request's ``model``; SGLang: ``lora_path``). The
version before is unloaded once no request of this client uses it. A sync is one pause of the
server (as a weight sync): requests in flight are aborted and resumed by the clients on the new
adapter, so each token keeps the weight version that produced it.

``adapter_support`` tells, before the first rollout, whether a server can load the adapter of a
given rank and modules and, if not, why in the server's terms and what would fix it; a server whose
engine cannot load adapters at all on its device (SGLang on CPU) says so with no fix, and the
trainer falls back to merged full weights.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass

from rollout.engines.base import EngineError

logger = logging.getLogger(__name__)

ADAPTER_PREFIX = "rallyrl-v"

SGLANG_CPU_LORA = (
    "SGLang 0.5's LoRA layers pin host memory whatever the device, so an SGLang server on CPU cannot start "
    'with --enable-lora ("RuntimeError: Found no NVIDIA driver on your system" from sglang/srt/lora/layers.py)'
)


@dataclass(frozen=True)
class AdapterSupport:
    """Whether a server can load an adapter at run time, and if not why."""

    ready: bool
    problem: str = ""
    """Why not, in the server's terms (its URL first)."""
    fix: str = ""
    """What would make it ready; empty when this engine cannot load adapters on its device at all."""

    @property
    def impossible(self) -> bool:
        """The engine's path cannot load adapters (no flag would change that)."""
        return not self.ready and not self.fix


def _rank_above(url: str, rank: int, max_rank: object) -> AdapterSupport | None:
    """The refusal of a ``rank`` above the server's ``--max-lora-rank`` (None: it fits, or unknown)."""
    if isinstance(max_rank, int) and rank > max_rank:
        return AdapterSupport(
            False, f"lora.rank {rank} is above {url}'s --max-lora-rank {max_rank}",
            f"set lora.rank to {max_rank} or less, or restart the server with --max-lora-rank {rank}",
        )  # fmt: skip
    return None


def sglang_adapter_support(url: str, info: dict, rank: int, modules: Sequence[str]) -> AdapterSupport:
    """What an SGLang server (``/get_server_info`` answered ``info``) can do with an adapter of
    ``rank`` on ``modules``; ``rallyrl serve`` (no ``enable_lora`` in its answer) loads none."""
    if "enable_lora" not in info:
        return AdapterSupport(False, f"{url} serves no LoRA endpoints (rallyrl serve, or not SGLang)")
    if not info.get("enable_lora"):
        if str(info.get("device", "")).startswith("cpu"):
            return AdapterSupport(False, f"{url}: {SGLANG_CPU_LORA}")
        return AdapterSupport(
            False, f"{url} was started without --enable-lora",
            f"restart it with --enable-lora --max-lora-rank {rank} --lora-target-modules all, or set lora.sync: merged",
        )  # fmt: skip
    too_high = _rank_above(url, rank, info.get("max_lora_rank"))
    if too_high is not None:
        return too_high
    served = info.get("lora_target_modules") or ["all"]
    missing = sorted(set(modules) - set(served)) if "all" not in served else []
    if missing:
        return AdapterSupport(
            False, f"{url}'s --lora-target-modules {served} leave out {missing}",
            "restart it with --lora-target-modules all, or narrow lora.target_modules",
        )  # fmt: skip
    return AdapterSupport(True)


def vllm_adapter_support(url: str, lora: dict | None, env: dict | None, rank: int) -> AdapterSupport:
    """What a vLLM server can do with an adapter of ``rank``, from its ``/server_info``:
    ``vllm_config.lora_config`` (``lora``) and ``vllm_env`` (``env``; None without the development
    endpoints)."""
    if env is None:
        return AdapterSupport(
            False, f"{url} serves no /server_info, so its LoRA settings are unknown",
            "restart it with VLLM_SERVER_DEV_MODE=1 (its weight syncs need the development endpoints too)",
        )  # fmt: skip
    flags = f"--enable-lora --max-lora-rank {rank} --max-loras 2 and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"
    if not lora:
        return AdapterSupport(False, f"{url} was started without --enable-lora",
                              f"restart it with {flags}, or set lora.sync: merged")  # fmt: skip
    too_high = _rank_above(url, rank, lora.get("max_lora_rank"))
    if too_high is not None:
        return too_high
    runtime = str(env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "")).lower()
    if runtime not in ("1", "true"):
        return AdapterSupport(
            False, f"{url} was started without VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, so it has no "
            "/v1/load_lora_adapter", "restart it with that variable set, or set lora.sync: merged",
        )  # fmt: skip
    return AdapterSupport(True)


class ServesAdapters(abc.ABC):
    """The adapter half of a server client: which adapter requests name, loading a new one per
    version, unloading old ones once unused. Each client supplies the server's calls (the abstract
    methods below)."""

    url: str
    weight_version: int

    def _init_adapters(self) -> None:
        self.adapter: str | None = None  # the adapter requests name; None: the base model
        self.adapter_tag = uuid.uuid4().hex[:8]  # this client's part of every adapter name
        self._adapter_uses: Counter[str] = Counter()  # name -> attempts in flight naming it
        self._retired: set[str] = set()  # names replaced, unloaded once unused
        self._unloads: set[asyncio.Task[None]] = set()
        self._adapter_names: set[str] = set()  # every name this client has loaded

    # ----- the server's calls (each client) ------------------------------------------------------

    @abc.abstractmethod
    async def adapter_support(self, rank: int, modules: Sequence[str]) -> AdapterSupport:
        """Whether an adapter of ``rank`` on ``modules`` can be loaded, and if not why."""

    @abc.abstractmethod
    async def _load_adapter(self, name: str, path: str) -> None:
        """Load the adapter at ``path`` under ``name``; EngineError with the server's reason."""

    @abc.abstractmethod
    async def _unload_adapter(self, name: str) -> None:
        """Drop the adapter ``name``."""

    @abc.abstractmethod
    async def _name_weight_version(self, weight_version: int) -> None:
        """Have the server report ``weight_version``."""

    @abc.abstractmethod
    def _paused(self) -> contextlib.AbstractAsyncContextManager[None]:
        """Generation paused (in-flight requests aborted) for the block's length."""

    # ----- requests ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def adapter_in_use(self) -> Iterator[str | None]:
        """The adapter an attempt names (None: the base model), counted while the attempt runs."""
        name = self.adapter
        if name is None:
            yield None
            return
        self._adapter_uses[name] += 1
        try:
            yield name
        finally:
            self._adapter_uses[name] -= 1
            if not self._adapter_uses[name]:
                del self._adapter_uses[name]
                if name in self._retired:
                    self._unload_later(name)

    # ----- sync ----------------------------------------------------------------------------------

    async def update_adapter_from_disk(self, adapter_path: str, weight_version: int) -> int:
        """Load the adapter at ``adapter_path`` (peft's format, a directory the server can read) under
        a new name and make it the one requests name, as ``weight_version``; generation is not paused
        (``sync_adapter_from_disk`` does)."""
        name = f"{ADAPTER_PREFIX}{weight_version}-{self.adapter_tag}"
        suffix = 1
        while name in self._adapter_names:  # the same version again (a server that came back)
            suffix += 1
            name = f"{ADAPTER_PREFIX}{weight_version}-{self.adapter_tag}.{suffix}"
        await self._load_adapter(name, str(adapter_path))
        self._adapter_names.add(name)
        old, self.adapter = self.adapter, name
        await self._name_weight_version(weight_version)
        self.weight_version = weight_version
        if old is not None:
            self._retired.add(old)
            if not self._adapter_uses[old]:
                self._unload_later(old)
        return weight_version

    async def sync_adapter_from_disk(self, adapter_path: str, weight_version: int) -> int:
        """pause -> load the new adapter -> name it in requests -> continue; generation continues
        even if the load fails (with the adapter before)."""
        await self.finish_unloads()
        async with self._paused():
            return await self.update_adapter_from_disk(adapter_path, weight_version)

    def _unload_later(self, name: str) -> None:
        self._retired.discard(name)
        task = asyncio.ensure_future(self._unload_quietly(name))
        self._unloads.add(task)
        task.add_done_callback(self._unloads.discard)

    async def _unload_quietly(self, name: str) -> None:
        try:
            await self._unload_adapter(name)
        except EngineError as exc:  # a server that restarted no longer has it
            logger.warning("%s: unloading adapter %s failed: %s", self.url, name, exc)

    async def finish_unloads(self) -> None:
        """Wait for the unloads under way (before a sync, and before the client closes)."""
        if self._unloads:
            await asyncio.gather(*list(self._unloads), return_exceptions=True)


@contextlib.asynccontextmanager
async def pause_and_continue(client: object) -> AsyncIterator[None]:
    """``pause_generation`` ... ``continue_generation`` of a server client, continued whatever happens."""
    await client.pause_generation()  # type: ignore[attr-defined]
    try:
        yield
    finally:
        await client.continue_generation()  # type: ignore[attr-defined]
