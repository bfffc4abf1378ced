"""The run directory of a GRPO run: ``TrainerState`` (what a checkpoint holds beyond Accelerate's state),
checkpoints every ``checkpoint_every`` steps and ``final/`` with ``curves.png`` (``RunFiles``, a part of
``GRPOTrainer``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from accelerate.utils import gather_object

from trainer.checkpoints import (
    checkpoint_bytes,
    complete_checkpoints,
    load_training_checkpoint,
    prune_checkpoints,
    save_adapter_dir,
    save_model_dir,
    save_training_checkpoint,
)
from trainer.metrics_log import keep_metrics_until, plot_curves


@dataclass
class TrainerState:
    """What a checkpoint needs beyond model, optimizer, scheduler and RNG (Accelerate saves those)."""

    step: int = 0
    data_position: int = 0
    """Synchronous runs: the next prompt of the stream. Async runs: the lowest prompt not consumed."""
    streams: list[dict[str, Any]] | None = None
    """Async runs: each process's ``PromptLedger`` state (which prompts were consumed)."""
    elapsed_s: float = 0.0
    """Wall seconds of training up to this state (a resumed run's clock goes on from here)."""


class RunFiles:
    """Checkpoints and the final model of ``GRPOTrainer`` (its ``out``, ``policy``, ``state``, ...)."""

    def save_checkpoint(self) -> None:
        """``out/checkpoints/step-N``: Accelerate's state, step and data position, and the model's
        config and tokenizer (a model directory too); the oldest beyond ``keep_checkpoints`` go."""
        parent = self.out / "checkpoints"
        if self.ledger is not None:  # async: which prompts every process consumed
            self.state.streams = gather_object([self.ledger.state()])
            lowest = gather_object([self.ledger.lowest_unconsumed_position()])
            self.state.data_position = min(lowest)
        full = self.policy.state_dict() if self.policy.sharded else None
        directory = parent / f"step-{self.state.step:06d}"
        adapter = None if self.config.lora is None else lambda at: self.policy.save_adapter(at, self.model_dir)
        policy = self.policy
        lora = policy.peft if adapter is not None else None
        needed = checkpoint_bytes(policy.model, policy.optimizer, self.tokenizer, full, lora)
        save_training_checkpoint(self.accelerator, policy.language_model(), self.tokenizer, directory,
                                 dataclasses.asdict(self.state), full, adapter, needed)  # fmt: skip
        if self.is_main:
            prune_checkpoints(parent, self.config.keep_checkpoints)

    def load_checkpoint(self) -> list[dict[str, Any]]:
        """Restore the last complete checkpoint; returns the metrics logged up to it. A run that began
        but never completed a checkpoint (its first one, or its first weight sync, met a full disk)
        starts again at step 0."""
        metrics_file = self.out / "metrics.jsonl"
        if not complete_checkpoints(self.out / "checkpoints") and any(self.out.iterdir()):
            if self.is_main:
                keep_metrics_until(metrics_file, 0)
            self.console.print(f"--resume: {self.out} has no complete checkpoint yet: starting at step 0")
            return []
        last, state = load_training_checkpoint(self.accelerator, self.out / "checkpoints")
        self.state = TrainerState(**state)
        self.prompts.position = self.state.data_position
        history = keep_metrics_until(metrics_file, self.state.step) if self.is_main else []
        self.console.print(f"resumed from {last} (step {self.state.step})")
        return history

    def save_final(self, history: list[dict[str, Any]]) -> None:
        """``out/final/``: a Hugging Face model directory the engines load; ``out/curves.png``."""
        self.accelerator.wait_for_everyone()
        state = self.policy.state_dict()  # (gathered by all under FSDP)
        if not self.is_main:
            return
        if self.config.lora is not None:  # the adapter, in peft's format, naming the base model
            save_adapter_dir(self.policy.peft, self.tokenizer, self.out / "final", self.model_dir)
        else:
            save_model_dir(self.policy.language_model(), self.tokenizer, self.out / "final", state)
        if history:
            plot_curves(history, self.out / "curves.png")
