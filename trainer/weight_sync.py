"""Weight sync from the trainer to its engine after each optimizer step.

In-process engines (the embedded one, in-process SGLang) take the state dict directly. Servers
(``--engine-url``) take a saved model directory: the policy is written in safetensors to
``out/weights/v{version}`` (a temporary directory renamed into place, so a server never reads
half a file), then every server is paused, loads it through ``/update_weights_from_disk`` and
continues. The servers must see the trainer's filesystem at that path.

With LoRA (``lora.sync``), servers that can load adapters get the adapter alone instead
(``save_adapter_version``, ``sync_adapter_from_disk``: ``rollout/engines/server_adapters.py``);
``adapter_sync_plan`` decides which, before the first rollout.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers.utils import logging as hf_logging

from data.config_tree import ConfigError
from data.files import atomic_directory
from rollout.engines.base import Engine, LoadsAdapters, LoadsWeightsFromDisk
from trainer.config import LoRAConfig

KEEP_WEIGHT_DIRS = 2
"""Saved versions kept on disk: the newest, which a restarted server loads, and the one before."""


def save_weights(model: torch.nn.Module, tokenizer: Any, weights_dir: Path, version: int,
                 state_dict: dict[str, torch.Tensor] | None = None) -> Path:  # fmt: skip
    """Save ``model`` (safetensors, config, tokenizer; ``state_dict`` for its weights when given, as
    gathered from FSDP shards) as ``weights_dir/v{version:06d}``, atomically; older versions beyond
    ``KEEP_WEIGHT_DIRS`` are removed."""

    def write(partial: Path) -> None:
        hf_logging.disable_progress_bar()  # one save per step: no "Writing model shards" bar each time
        try:
            model.save_pretrained(partial, state_dict=state_dict, safe_serialization=True)
        finally:
            hf_logging.enable_progress_bar()
        if tokenizer is not None:
            tokenizer.save_pretrained(partial)

    return _keep_newest(atomic_directory(weights_dir / f"v{version:06d}", write))


def save_adapter_version(peft_model: Any, base_model: Path, weights_dir: Path, version: int) -> Path:
    """The LoRA adapter alone (weights and config, in peft's format naming ``base_model``; a server
    takes the tokenizer from its base) as ``weights_dir/v{version:06d}``, atomically; older versions
    beyond ``KEEP_WEIGHT_DIRS`` are removed."""
    from trainer.lora import save_adapter

    def write(partial: Path) -> None:
        save_adapter(peft_model, partial, base_model)
        (partial / "README.md").unlink(missing_ok=True)  # (peft's model card: not for a server)

    return _keep_newest(atomic_directory(weights_dir / f"v{version:06d}", write))


def _keep_newest(final: Path) -> Path:
    saved = sorted(p for p in final.parent.glob("v*") if not p.name.endswith(".partial"))
    for old in saved[:-KEEP_WEIGHT_DIRS]:
        shutil.rmtree(old, ignore_errors=True)
    return final


async def sync_weights(engine: Engine, model: torch.nn.Module, state_dict: dict[str, torch.Tensor], tokenizer: Any,
                       weights_dir: Path, version: int) -> int:  # fmt: skip
    """Give ``engine`` the weights ``state_dict`` of ``model`` as ``version``; returns the version it reports."""
    if isinstance(engine, LoadsWeightsFromDisk):
        path = save_weights(model, tokenizer, weights_dir, version, state_dict)
        return await engine.sync_weights_from_disk(str(path.resolve()), version)
    return await engine.update_weights(state_dict, weight_version=version)


async def adapter_sync_plan(engine: Engine, lora: LoRAConfig, modules: Sequence[str]) -> tuple[bool, str]:
    """For servers and a LoRA run: whether each sync sends the adapter alone (True) or merged full
    weights, and the line that says so. ``lora.sync`` ``adapter`` or ``auto`` with a server that
    lacks a flag or a large enough ``--max-lora-rank`` is a ConfigError naming the fix."""
    merged = "lora: the servers get the adapter merged into full weights at each sync"
    if lora.sync == "merged" or not isinstance(engine, LoadsAdapters):
        return False, f"{merged} (lora.sync: {lora.sync})"
    support = await engine.adapter_support(lora.rank, modules)
    if support.ready:
        return True, "lora: the servers load each version's adapter alone through their LoRA endpoints"
    if support.impossible and lora.sync == "auto":
        return False, f"{merged}: {support.problem}"
    raise ConfigError(f"lora.sync {lora.sync}: {support.problem}: {support.fix or 'set lora.sync: merged'}")
