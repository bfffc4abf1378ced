"""The engine protocol every backend implements (token ids in, token ids and logprobs out), and
the optional abilities some engines add, each a protocol of its own with one async signature."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from rollout.engines.config import WeightSyncConfig
    from rollout.engines.weight_buckets import WeightSpec

EngineFinish = Literal["stop", "length", "abort"]


@dataclass
class SamplingParams:
    """Per-request sampling settings, in SGLang's names.

    ``temperature`` 0 means greedy. ``top_k`` 0 or less means no top-k cut. The returned
    logprob of a sampled token is taken from the temperature-scaled distribution before the
    top-p/top-k cut (what a trainer recomputes from ``logits / temperature``).
    """

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    """Seed of this request's sampling: the same seed gives the same tokens whatever else is in
    the batch (None: the engine's shared generator)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")


@dataclass
class Generation:
    """One engine call's result. ``output_logprobs[i]`` is the logprob of ``output_ids[i]``.

    ``finish_reason`` is "stop" (a stop token was sampled; it ends ``output_ids``), "length"
    (``max_new_tokens`` or the context limit reached) or "abort". ``weight_version`` is the
    version that produced the last token; ``output_weight_versions[i]``, when the engine knows
    it, the version that produced ``output_ids[i]`` (a generation can span a weight update).
    """

    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: EngineFinish
    weight_version: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    output_weight_versions: list[int] | None = None

    def token_weight_versions(self) -> list[int]:
        """The weight version of every output token (``weight_version`` where not recorded)."""
        if self.output_weight_versions is not None:
            return self.output_weight_versions
        return [self.weight_version] * len(self.output_ids)


@dataclass
class PartialGeneration:
    """The tokens of a streamed generation so far (engines with ``generate_stream``)."""

    output_ids: list[int]
    output_logprobs: list[float]


class EngineError(RuntimeError):
    """An engine could not serve a request (after its own retries, where it has any)."""


@runtime_checkable
class Engine(Protocol):
    """What the rollout loop needs from an inference backend."""

    async def generate(self, input_ids: list[int], sampling: SamplingParams, rid: str) -> Generation:
        """Continue ``input_ids``; ``rid`` names the request for abort and routing."""
        ...

    async def update_weights(self, state_dict: dict[str, Any], weight_version: int | None = None) -> int:
        """Load new weights between decode steps; returns the new weight version."""
        ...

    async def abort(self, rid: str | None = None) -> None:
        """Abort one request (or all with ``None``); its ``generate`` returns finish "abort"."""
        ...

    async def health(self) -> bool:
        """True while the engine can serve."""
        ...


# ----- optional abilities ------------------------------------------------------------------------
# Test for one with ``isinstance(engine, FlushesCache)``. A runtime-checkable protocol checks only
# that the method exists, not its signature or that it is a coroutine function: every engine here
# declares these methods with exactly the signatures below (tests/test_engine_abilities.py checks).


@runtime_checkable
class FlushesCache(Protocol):
    """Engines with a prefix (KV) cache that can be dropped."""

    async def flush_cache(self) -> None:
        """Forget cached keys and values of finished prompts; EngineError when the engine refused."""
        ...


@runtime_checkable
class LoadsWeightsFromDisk(Protocol):
    """Servers: they load a saved model directory, not tensors (``/update_weights_from_disk``)."""

    async def sync_weights_from_disk(self, model_path: str, weight_version: int) -> int:
        """Pause generation, load the weights saved at ``model_path`` as ``weight_version``,
        continue; returns the new weight version."""
        ...


@runtime_checkable
class LoadsAdapters(Protocol):
    """Servers that can load a LoRA adapter at run time and serve it over their base model
    (``rollout/engines/server_adapters.py``)."""

    async def adapter_support(self, rank: int, modules: Sequence[str]) -> Any:
        """An ``AdapterSupport``: whether an adapter of ``rank`` on ``modules`` can be loaded, if not why."""
        ...

    async def sync_adapter_from_disk(self, adapter_path: str, weight_version: int) -> int:
        """Pause generation, load the adapter saved at ``adapter_path`` as ``weight_version``, have
        requests name it, continue; returns the new weight version."""
        ...


@runtime_checkable
class StreamsGenerations(Protocol):
    """Engines that can report a generation's tokens while it runs."""

    def generate_stream(
        self, input_ids: list[int], sampling: SamplingParams, rid: str
    ) -> AsyncIterator[PartialGeneration | Generation]:
        """Like ``generate`` (an async generator): the tokens so far after each decode step as
        ``PartialGeneration``, the final ``Generation`` last."""
        ...


class WeightSource(Protocol):
    """The trainer's weights as engines take them: Hugging Face names, a tied LM head once (under the
    embeddings' name)."""

    version: int | None
    """The version these weights are; None while they change (an optimizer step under way)."""
    aliases: dict[str, str]
    """{a tied parameter not sent: the name it travels under} (an engine that keeps its own copy of
    the tied LM head loads it under both names)."""

    def specs(self) -> list[WeightSpec]:
        """Every tensor a push sends, in the trainer's dtype, in the model's order."""
        ...

    def tensor(self, name: str) -> torch.Tensor:
        """The current value of ``name`` (any device; a LoRA weight merged on demand)."""
        ...

    async def saved(self, version: int) -> str:
        """The weights saved as a model directory a server can load (once per version): the disk transport."""
        ...

    def reading(self, version: int) -> AbstractAsyncContextManager[bool]:
        """Hold the weights as ``version`` for a push outside the trainer's own sync (a server brought
        back): enters True, and no optimizer step starts until it exits; False (nothing held) when they
        cannot be read as ``version`` now (changing, or readable only during a sync: FSDP)."""
        ...


@runtime_checkable
class PushesWeights(Protocol):
    """Servers behind a pool (``rollout/engines/pool.py``): they take a trainer's weights by the transport
    chosen for each before the first rollout (broadcast, tensor or disk: ``weight_plan.py``)."""

    async def plan_weight_sync(self, config: WeightSyncConfig, source: WeightSource, device: torch.device) -> list[str]:
        """Choose each server's transport (``WeightSyncConfig``) for the ``WeightSource``'s weights on
        ``device``; one line per server saying how it syncs."""
        ...

    async def push_weights(self, source: WeightSource, weight_version: int) -> dict[str, int | None]:
        """Every server takes ``source`` as ``weight_version``; each server's version after (None: failed)."""
        ...
