"""Colocation: an in-process engine on the trainer's device gives its memory back for each update and
takes it back for the next rollout (verl's hybrid engine, slime's ``--colocate``, TRL's vLLM sleep).

- The embedded engine (``LocalEngine.release_memory`` / ``resume_memory``): its KV cache, prefix cache
  and the storage of its weight copy go; the copy is rebuilt from the trainer's weights in memory.
- In-process SGLang: ``release_memory_occupation`` (weights, KV cache, CUDA graphs) before the update;
  after it, the order verl uses: resume the weights, load the new ones, let the trainer's freed blocks
  go (``torch.cuda.empty_cache``), resume the KV cache and the CUDA graphs. SGLang frees nothing unless
  it was started with ``enable_memory_saver`` and ``torch_memory_saver`` is installed: rallyrl sets the
  flag and checks the package before SGLang starts (``prepare_sglang``).

``colocate: null`` is on where the engine shares the trainer's CUDA device. An ``async_rl`` run keeps
its engine generating during the update, so it cannot release it: there colocation is off unless
``colocate: true``, which makes the run synchronous (said once).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import torch

from data.config_tree import ConfigError
from rollout.engines.base import PushesWeights
from rollout.engines.config import SGLangEngineConfig
from rollout.engines.heap import give_back_memory
from trainer.memory_budget import GiB

if TYPE_CHECKING:
    from trainer.config import GRPOConfig
    from trainer.weight_source import PolicyWeights

SGLANG_TAGS = ("weights", "kv_cache", "cuda_graph")
"""SGLang's memory tags (``sglang/srt/constants.py``): released together, resumed weights first."""
MISSING_SAVER = (
    "colocate: in-process SGLang gives its memory back through torch_memory_saver, which is not installed "
    "(pip install torch_memory_saver); without it SGLang frees nothing. Install it or set colocate: false"
)

NO_SAVER_FLAG = (
    "colocate: this SGLang engine was started without enable_memory_saver, so it frees nothing; start it with "
    "enable_memory_saver=True or set colocate: false"
)


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether two devices are one (``cuda`` is the current CUDA device)."""
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    current = torch.cuda.current_device() if torch.cuda.is_available() else 0
    return (current if a.index is None else a.index) == (current if b.index is None else b.index)


def wants_sglang_colocation(config: GRPOConfig, trainer_device: torch.device) -> bool:
    """Whether an in-process SGLang of this run will be colocated (decided before it starts)."""
    if config.engine.urls or config.engine.kind != "sglang" or config.colocate is False:
        return False
    if config.colocate is None:
        return trainer_device.type == "cuda" and not config.async_rl
    return True


def prepare_sglang(config: SGLangEngineConfig) -> SGLangEngineConfig:
    """The in-process SGLang's settings for colocation: ``enable_memory_saver`` on; a ConfigError where
    ``torch_memory_saver`` is missing (SGLang would only warn, and free nothing)."""
    if config.server_args.get("enable_memory_saver") is False:
        raise ConfigError("colocate: engine.sglang.server_args sets enable_memory_saver false; colocation needs it")
    if "torch_memory_saver" not in sys.modules and importlib.util.find_spec("torch_memory_saver") is None:
        raise ConfigError(MISSING_SAVER)
    return dataclasses.replace(config, server_args={**config.server_args, "enable_memory_saver": True})


class Colocation(ABC):
    """Releases an in-process engine's memory before the update and takes it back with the new weights;
    ``metrics`` are the last step's (``colocate/`` in metrics.jsonl)."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.released = False
        self.last: dict[str, float] = {}

    async def release(self) -> None:
        """Before the update: the engine's memory goes (nothing may be in flight)."""
        started = time.perf_counter()
        freed = await self.release_engine()
        self.released = True
        self.last = {"released_gib": freed / GiB, "release_s": time.perf_counter() - started}

    async def resume(self, weights: PolicyWeights, version: int) -> dict[str, float]:
        """After the update: the memory back, with the weights of ``version``; the ``sync/`` metrics.
        An engine that was not released (the first sync) just takes the weights."""
        started = time.perf_counter()
        taken = await self.resume_engine(weights, version)
        self.released = False
        self.last |= {"retaken_gib": taken / GiB, "resume_s": time.perf_counter() - started}
        return {"weight_version": float(version), "servers_failed": 0.0}

    def metrics(self) -> dict[str, float]:
        return dict(self.last)

    @abstractmethod
    async def release_engine(self) -> int:
        """Release the engine's memory; the bytes released."""

    @abstractmethod
    async def resume_engine(self, weights: PolicyWeights, version: int) -> int:
        """Take the memory back with the weights of ``version`` (a plain update where nothing was
        released); the bytes taken."""


class LocalColocation(Colocation):
    """The embedded engine: bytes counted from its tensors (the same on the CPU and on CUDA)."""

    async def release_engine(self) -> int:
        return await self.engine.release_memory()

    async def resume_engine(self, weights: PolicyWeights, version: int) -> int:
        return await self.engine.resume_memory(weights.state_dict(), version)  # (not released: an update)


class SGLangColocation(Colocation):
    """In-process SGLang: its memory lives in its scheduler's processes, so it is read as the device's
    free memory before and after each call."""

    def __init__(self, engine: Any, device: torch.device):
        super().__init__(engine)
        self.device = device

    def free(self) -> int:
        return torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else 0

    async def release_engine(self) -> int:
        before = self.free()
        await self.engine.release_memory_occupation(list(SGLANG_TAGS))
        return max(0, self.free() - before)

    async def resume_engine(self, weights: PolicyWeights, version: int) -> int:
        if not self.released:
            await self.engine.update_weights(weights.state_dict(), weight_version=version)
            return 0
        before = self.free()
        await self.engine.resume_memory_occupation(["weights"])
        await self.engine.update_weights(weights.state_dict(), weight_version=version)
        give_back_memory(self.device)  # the trainer's freed blocks, for the KV cache
        await self.engine.resume_memory_occupation(["kv_cache", "cuda_graph"])
        return max(0, before - self.free())


def plan_colocation(config: GRPOConfig, engine: Any, device: torch.device) -> tuple[Colocation | None, str | None]:
    """The colocation of this run's engine, or None, and the line that says so (None: nothing to say)."""
    from rollout.engines.local import LocalEngine
    from rollout.engines.sglang_engine import SGLangEngine

    asked = config.colocate
    if asked is False:
        return None, None
    if isinstance(engine, PushesWeights) or not isinstance(engine, LocalEngine | SGLangEngine):
        if asked:
            raise ConfigError("colocate: true is for in-process engines (engine.kind local or sglang); servers "
                              "(--engine-url) hold their own memory")  # fmt: skip
        return None, None
    if isinstance(engine, LocalEngine) and not same_device(engine.device, device):
        line = f"colocate: the engine runs on {engine.device}, the trainer on {device}: nothing to give back"
        return None, line if asked else None
    if asked is None and device.type != "cuda":
        return None, None
    if config.async_rl and asked is None:
        return None, ("colocate: off, since --async keeps the engine generating during the update (colocate: "
                      "true releases its memory, and makes the run synchronous)")  # fmt: skip
    if isinstance(engine, SGLangEngine):
        if getattr(getattr(engine.engine, "server_args", None), "enable_memory_saver", None) is False:
            raise ConfigError(NO_SAVER_FLAG)
        colocation: Colocation = SGLangColocation(engine, device)
        where = "in-process SGLang releases its weights, KV cache and CUDA graphs"
    else:
        colocation = LocalColocation(engine)
        where = "the embedded engine releases its KV cache and weight copy"
    line = f"colocate: {where} for each update and takes them back with the new weights"
    if config.async_rl:
        line += "; the engine and the update share one device, so this --async run is synchronous"
    return colocation, line
