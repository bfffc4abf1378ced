"""The policy's weights as engines take them: the ``WeightSource`` a push reads
(``rollout/engines/weight_push.py``).

Hugging Face names; a LoRA run's weights merged with the adapter one tensor at a time, as a bucket
asks for them (never the whole merged model at once); a tied LM head sent once, under the input
embeddings' name (``aliases`` names it, for an engine that keeps a copy of the head: vLLM on a CPU);
under FSDP the full weights gathered for the sync by every process. ``version`` is the version the
weights are, None while the trainer changes them (``changing``: an optimizer step): a server that
comes back then waits for the next push rather than taking half-stepped weights, and a push that
brings one back holds them (``reading``) so that no step starts under it. Under FSDP the full
weights exist only during a sync, so a server that comes back waits for the next one. ``saved`` writes them as a model
directory, once per version, for the servers that load from disk.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch

from rollout.engines.weight_buckets import WeightSpec
from trainer.lora import lora_layers, merged_names, merged_state_dict, merged_weight
from trainer.weight_files import save_weights


def tied_aliases(lm: torch.nn.Module) -> dict[str, str]:
    """{the LM head's name: the input embeddings' name} when the head is the embeddings' weight."""
    head, embeddings = lm.get_output_embeddings(), lm.get_input_embeddings()  # type: ignore[operator]
    if head is None or embeddings is None or head.weight is not embeddings.weight:
        return {}
    names: dict[int, list[str]] = {}
    for name, parameter in lm.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name.replace(".base_layer.", "."))
    shared = names.get(id(embeddings.weight), [])
    kept = next((n for n in shared if "embed" in n), shared[0] if shared else None)
    return {n: kept for n in shared if n != kept} if kept else {}


class _Plain:
    """A model alone, as ``PolicyWeights`` reads a policy: no adapter, not sharded."""

    peft = None
    sharded = False

    def __init__(self, lm: torch.nn.Module):
        self.lm = lm

    def language_model(self) -> torch.nn.Module:
        return self.lm

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.lm.state_dict()


class PolicyWeights:
    """The weights of a ``trainer.policy.Policy`` for pushes into servers and loads from disk."""

    @classmethod
    def of_model(cls, lm: torch.nn.Module, tokenizer: Any, weights_dir: Path) -> PolicyWeights:
        """The weights of a plain Hugging Face model (benchmarks, tests, a trainer of your own)."""
        return cls(_Plain(lm), tokenizer, weights_dir)

    def __init__(self, policy: Any, tokenizer: Any, weights_dir: Path):
        self.policy = policy
        self.tokenizer = tokenizer
        self.weights_dir = weights_dir
        self.version: int | None = 0
        lm = policy.language_model()
        self.aliases = tied_aliases(lm)
        self.device = next(lm.parameters()).device
        self._layers = {f"{name}.weight": layer for name, layer in lora_layers(lm).items()} if policy.peft else {}
        self._keys = merged_names(lm) if policy.peft else {key: key for key in lm.state_dict()}
        for alias in self.aliases:
            self._keys.pop(alias, None)
        self._gathered: dict[str, torch.Tensor] | None = None
        self._current: dict[str, torch.Tensor] | None = None  # name -> tensor, read once per push
        self._saved: tuple[int, Path] | None = None
        self._saving = asyncio.Lock()
        self._held = asyncio.Lock()  # a push reading the weights (``reading``), or an optimizer step (``changing``)

    # ----- the WeightSource protocol -------------------------------------------------------------

    def specs(self) -> list[WeightSpec]:
        self._current = dict(self._tensors())  # (a push asks for the specs first)
        return [WeightSpec(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in self._current.items()]

    def tensor(self, name: str) -> torch.Tensor:
        layer = self._layers.get(name)
        if layer is not None:
            return merged_weight(layer)
        if self._current is None:
            self._current = dict(self._tensors())
        return self._current[name]

    async def saved(self, version: int) -> str:
        async with self._saving:
            if self._saved is None or self._saved[0] != version:
                path = await asyncio.to_thread(self._save, version)
                self._saved = (version, path)
            return str(self._saved[1].resolve())

    @contextlib.asynccontextmanager
    async def reading(self, version: int) -> AsyncIterator[bool]:
        readable = self.version == version and not self._held.locked()
        if self.policy.sharded and self._gathered is None:
            readable = False  # (the full weights exist only during a sync: every process gathers them)
        if not readable:
            yield False
            return
        async with self._held:  # (free: taken at once, with nothing run in between)
            yield True

    # ----- the trainer's side --------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def changing(self) -> AsyncIterator[None]:
        """The trainer changes its weights inside (an optimizer step): waits for a push reading them to
        end, and none starts until the next sync names their new version (``version`` is None)."""
        async with self._held:
            self.version = None
            yield

    def gather(self) -> None:
        """Under FSDP: the full weights of this version, gathered by every process (a collective)."""
        if self.policy.sharded:
            state = self.policy.state_dict()
            self._gathered = {name: value for name, value in state.items() if name not in self.aliases}

    def release(self) -> None:
        """Drop the gathered full weights (the push is over)."""
        self._gathered = self._current = None

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full state dict (LoRA merged) for an in-process engine (under FSDP: the one ``gather`` made)."""
        if self._gathered is not None:
            return {**self._gathered, **{alias: self._gathered[kept] for alias, kept in self.aliases.items()}}
        return self.policy.state_dict()

    def _state(self) -> dict[str, torch.Tensor]:
        return self.policy.language_model().state_dict()

    def _tensors(self) -> list[tuple[str, torch.Tensor]]:
        if self._gathered is not None:
            return list(self._gathered.items())
        state = self._state()
        out = []
        for name, key in self._keys.items():
            layer = self._layers.get(name)
            out.append((name, layer.get_base_layer().weight if layer is not None else state[key]))
        return out

    def _save(self, version: int) -> Path:
        lm = self.policy.language_model()
        state = self._gathered if self._gathered is not None else None
        if self.policy.peft is not None:
            state = merged_state_dict(lm)
        return save_weights(lm, self.tokenizer, self.weights_dir, version, state)
