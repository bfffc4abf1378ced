"""Model directories and training checkpoints, written so that a kill never leaves half of one.

Shared by GRPO and SFT. A training checkpoint (``out/checkpoints/step-N``) holds Accelerate's
state (model, optimizer, scheduler, RNG), the trainer's own state, and the model's config and
tokenizer files, so that it is also a model directory ``rallyrl eval/rollout/serve --model`` take.

Each write knows its size in advance (``*_bytes``): a disk without room for it is said before anything
is written, and one that fills up meanwhile takes the ``.partial`` with it (``data/disk_space.py``).
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from transformers.utils import logging as transformers_logging

from data.disk_space import DiskFull, check_room, directory_bytes, free_bytes, is_disk_full, tensor_bytes
from data.files import atomic_directory

TOKENIZER_FILES = ("tokenizer*", "vocab*", "merges*", "special_tokens_map*", "added_tokens*", "chat_template*")


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Keep transformers' per-file save/load bars out of our own progress display."""
    enabled = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            transformers_logging.enable_progress_bar()


def _readable(directory: Path) -> None:
    for file in directory.iterdir():  # some files come out of a private temp file (mode 600)
        if file.is_file():
            file.chmod(0o644)


def tokenizer_bytes(tokenizer: Any) -> int:
    """Bytes of the files ``tokenizer.save_pretrained`` writes, read from the directory it came from."""
    source = Path(str(getattr(tokenizer, "name_or_path", "") or ""))
    if tokenizer is None or not source.is_dir():
        return 0
    return sum(f.stat().st_size for pattern in TOKENIZER_FILES for f in source.glob(pattern) if f.is_file())


def model_dir_bytes(model: Any, tokenizer: Any, state_dict: dict[str, Any] | None = None) -> int:
    """Bytes of the model directory ``save_model_dir`` writes (weights, tokenizer; configs are small)."""
    return tensor_bytes(state_dict if state_dict is not None else model.state_dict()) + tokenizer_bytes(tokenizer)


def save_model_dir(model: Any, tokenizer: Any, directory: str | Path, state_dict: dict[str, Any] | None = None) -> Path:
    """A Hugging Face model directory (safetensors weights, configs, tokenizer), atomically; the
    weights are ``state_dict`` when given (the full one gathered from FSDP shards)."""

    def write(partial: Path) -> None:
        with quiet_transformers():
            model.save_pretrained(partial, state_dict=state_dict, safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(partial)
        _readable(partial)

    return atomic_directory(directory, write, model_dir_bytes(model, tokenizer, state_dict), "model directory")


def save_adapter_dir(peft_model: Any, tokenizer: Any, directory: str | Path, base_model: Path) -> Path:
    """Replace ``directory`` with the LoRA adapter of ``peft_model`` (peft's format, naming
    ``base_model``) and the tokenizer, atomically."""
    from trainer.lora import save_adapter

    def write(partial: Path) -> None:
        save_adapter(peft_model, partial, base_model)
        with quiet_transformers():
            tokenizer.save_pretrained(partial)
        _readable(partial)

    needed = adapter_bytes(peft_model) + tokenizer_bytes(tokenizer)
    return atomic_directory(Path(directory), write, needed, "LoRA adapter")


def adapter_bytes(peft_model: Any) -> int:
    """Bytes of a LoRA adapter's weights (its trainable tensors)."""
    return tensor_bytes([p for p in peft_model.parameters() if p.requires_grad])


def copy_model_dir(source: str | Path, directory: str | Path) -> Path:
    """Replace ``directory`` with a copy of the model directory ``source``, atomically."""

    def copy(partial: Path) -> None:
        shutil.copytree(source, partial, dirs_exist_ok=True)

    return atomic_directory(directory, copy, directory_bytes(source), "model directory")


def save_training_checkpoint(accelerator: Any, lm: Any, tokenizer: Any, directory: Path, trainer_state: dict[str, Any],
                             full_state: dict[str, Any] | None = None, adapter: Callable[[Path], None] | None = None,
                             needed: int | None = None) -> Path:  # fmt: skip
    """Accelerate's state of every process plus ``trainer_state.json``, the config and tokenizer of
    the model ``lm`` (so the checkpoint loads as a model), renamed into place by the main process.
    ``full_state``: the gathered weights of a sharded (FSDP) run, whose Accelerate state holds
    shards only, written as the checkpoint's ``model.safetensors``. ``adapter`` (LoRA): writes the
    adapter in peft's format into the checkpoint instead of the model's config, so that it loads as
    an adapter directory (base model named in its ``adapter_config.json``). ``needed``: its bytes
    (``checkpoint_bytes``), checked against the free space by every process before any writes."""
    partial = directory.with_name(directory.name + ".partial")
    if accelerator.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)
    accelerator.wait_for_everyone()
    if needed is not None:
        check_room(directory, needed, "checkpoint")
    try:
        accelerator.save_state(str(partial))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            _finish_checkpoint(partial, lm, tokenizer, trainer_state, full_state, adapter)
            shutil.rmtree(directory, ignore_errors=True)
            partial.replace(directory)
    except Exception as exc:
        full = is_disk_full(exc, partial)
        if accelerator.is_main_process:
            shutil.rmtree(partial, ignore_errors=True)
        if full:
            kept = "its .partial was removed; the checkpoints before it are kept"
            raise DiskFull(directory, needed, free_bytes(directory.parent), "checkpoint", kept) from None
        raise
    accelerator.wait_for_everyone()
    return directory


def _finish_checkpoint(partial: Path, lm: Any, tokenizer: Any, trainer_state: dict[str, Any],
                       full_state: dict[str, Any] | None, adapter: Callable[[Path], None] | None) -> None:  # fmt: skip
    """What the main process adds to Accelerate's state: trainer state, weights or adapter, config, tokenizer."""
    (partial / "trainer_state.json").write_text(json.dumps(trainer_state))
    if full_state is not None:
        with quiet_transformers():
            lm.save_pretrained(partial, state_dict=full_state, safe_serialization=True)
    if adapter is not None:
        adapter(partial)
    else:
        lm.config.save_pretrained(partial)
        if getattr(lm, "generation_config", None) is not None:
            lm.generation_config.save_pretrained(partial)
    with quiet_transformers():
        tokenizer.save_pretrained(partial)
    _readable(partial)


def checkpoint_bytes(model: Any, optimizer: Any, tokenizer: Any, full_state: dict[str, Any] | None = None,
                     adapter: Any = None) -> int:  # fmt: skip
    """Bytes of a training checkpoint: the model's and the optimizer's state as Accelerate saves them,
    the gathered weights of a sharded run, a LoRA adapter, the tokenizer (configs and RNG are small)."""
    optimizer_state = optimizer.state_dict()["state"] if optimizer is not None else {}
    extra = tensor_bytes(full_state) + (adapter_bytes(adapter) if adapter is not None else 0)
    weights = tensor_bytes([*model.parameters(), *model.buffers()])  # (not state_dict(): a collective under FSDP)
    return weights + tensor_bytes(optimizer_state) + extra + tokenizer_bytes(tokenizer)


def complete_checkpoints(parent: Path) -> list[Path]:
    """``parent/step-*`` directories that were renamed into place, oldest first."""
    return sorted(p for p in parent.glob("step-*") if not p.name.endswith(".partial"))


def prune_checkpoints(parent: Path, keep: int) -> None:
    """Remove all but the newest ``keep`` checkpoints under ``parent``."""
    for old in complete_checkpoints(parent)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def load_training_checkpoint(accelerator: Any, parent: Path) -> tuple[Path, dict[str, Any]]:
    """Restore the newest complete checkpoint under ``parent``; returns it and its trainer state."""
    found = complete_checkpoints(parent)
    if not found:
        raise ValueError(f"--resume: no checkpoint under {parent}")
    last = found[-1]
    accelerator.load_state(str(last))
    return last, json.loads((last / "trainer_state.json").read_text())
