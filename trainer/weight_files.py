"""The trainer's weights as files a server loads: a model directory per version (``save_weights``), or
a LoRA adapter alone (``save_adapter_version``), each under ``out/weights/v{version:06d}``, written to
a temporary directory renamed into place so a server never reads half a file; the newest two kept.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from transformers.utils import logging as hf_logging

from data.files import atomic_directory
from trainer.checkpoints import adapter_bytes, model_dir_bytes

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

    needed = model_dir_bytes(model, tokenizer, state_dict)
    return _keep_newest(atomic_directory(weights_dir / f"v{version:06d}", write, needed, "weights for the servers"))


def save_adapter_version(peft_model: Any, base_model: Path, weights_dir: Path, version: int) -> Path:
    """The LoRA adapter alone (weights and config, in peft's format naming ``base_model``; a server
    takes the tokenizer from its base) as ``weights_dir/v{version:06d}``, atomically; older versions
    beyond ``KEEP_WEIGHT_DIRS`` are removed."""
    from trainer.lora import save_adapter

    def write(partial: Path) -> None:
        save_adapter(peft_model, partial, base_model)
        (partial / "README.md").unlink(missing_ok=True)  # (peft's model card: not for a server)

    final = atomic_directory(weights_dir / f"v{version:06d}", write, adapter_bytes(peft_model), "LoRA adapter")
    return _keep_newest(final)


def _keep_newest(final: Path) -> Path:
    """Remove older versions beyond ``KEEP_WEIGHT_DIRS``, never ``final`` (just written: a run that
    starts again in the same directory writes versions below those an earlier run left)."""
    saved = sorted(p for p in final.parent.glob("v*") if not p.name.endswith(".partial") and p != final)
    for old in saved[: max(0, len(saved) - (KEEP_WEIGHT_DIRS - 1))]:
        shutil.rmtree(old, ignore_errors=True)
    return final
