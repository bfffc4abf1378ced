"""Every GRPO setting in one dataclass; YAML files and CLI overrides map onto its fields."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import yaml


@dataclass
class GRPOConfig:
    """A GRPO run. The defaults train the embedded model on the synthetic calculator task on
    2 CPU cores in a few minutes."""

    # --- model and data ---
    model: str | None = None
    """Hugging Face model directory to start from (default: the embedded tiny-calc model)."""
    task: str = "calc"
    """Synthetic task to draw prompts from (ignored when ``data`` is set)."""
    data: str | None = None
    """Dataset file (.jsonl, .json or .parquet) instead of a synthetic task."""
    tools: str | None = None
    """Tool config (YAML/JSON); default: the calculator."""
    reward: str | None = None
    """Reward by data_source, e.g. "openai/gsm8k=math+0.1*format,default=math" (data/reward_fns.py);
    None: the graded answer, else the tools' rewards."""
    seed: int = 1
    """Seed of prompts, sampling and initialisation (keep it apart from evaluation seeds)."""
    out: str = "runs/grpo"
    """Output directory: metrics.jsonl, checkpoints/, final/, curves.png."""

    # --- steps and rollout ---
    steps: int = 40
    """GRPO steps (one rollout and one update each)."""
    prompts_per_step: int = 16
    """Prompts per step, over all processes (each prompt is one group)."""
    samples_per_prompt: int = 8
    """Samples per prompt (the group size)."""
    max_turns: int = 3
    max_new_tokens: int = 96
    max_model_len: int = 1024
    temperature: float = 1.0
    top_p: float = 1.0
    max_concurrency: int = 256
    """Requests in flight during a rollout (per process)."""
    engine_urls: list[str] = field(default_factory=list)
    """SGLang (or ``rallyrl serve``) servers to roll out on; empty: the embedded engine in-process."""

    # --- advantages ---
    advantage_mode: Literal["trajectory", "broadcast", "per_step"] = "trajectory"
    """trajectory: one sample per trajectory; broadcast: step samples share it; per_step: MC returns."""
    advantage_scale: Literal["group", "batch", "none"] = "group"
    """Divide centred rewards by the group's std (GRPO), the batch's, or nothing (Dr. GRPO)."""
    gamma: float = 1.0
    """Discount of per-step returns."""
    filter_groups: bool = True
    """Drop groups whose rewards are all equal (no signal), counted as solve_all / solve_none."""
    oversample: float = 1.5
    """With filter_groups: roll out this many times the prompts, keep prompts_per_step groups."""

    # --- loss ---
    eps_low: float = 0.2
    eps_high: float = 0.28
    loss_aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    loss_constant: float | None = None
    """Normaliser of seq-mean-token-sum-norm (Dr. GRPO); default: the longest sequence."""
    kl_beta: float = 0.0
    """Weight of the k3 KL to the initial policy; 0 loads no reference model."""
    tis_cap: float | None = 2.0
    """Cap of truncated importance sampling between trainer and engine logprobs (None: off)."""

    # --- optimisation ---
    lr: float = 2e-4
    weight_decay: float = 0.0
    warmup_steps: int = 0
    max_grad_norm: float = 1.0
    ppo_epochs: int = 1
    """mu: passes over each step's samples (one optimizer step per pass)."""
    micro_batch_size: int = 16
    """Sequences per forward/backward; gradients accumulate over a step's micro-batches."""

    # --- bookkeeping ---
    checkpoint_every: int = 10
    """Save a checkpoint every N steps (and at the end); 0 only at the end."""
    keep_checkpoints: int = 2
    device: str = "auto"
    """Engine device: "auto", "cpu" or "cuda" (the trainer's comes from Accelerate)."""
    progress: bool = True
    """Show a progress bar of the steps (main process only)."""

    def __post_init__(self) -> None:
        positive = ("steps", "prompts_per_step", "samples_per_prompt", "max_turns", "max_new_tokens")
        for name in (*positive, "max_model_len", "max_concurrency", "ppo_epochs", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.eps_low < 1 or self.eps_high < 0:
            raise ValueError(f"eps_low must be in [0, 1) and eps_high >= 0, got {self.eps_low}, {self.eps_high}")
        if self.oversample < 1:
            raise ValueError(f"oversample must be >= 1, got {self.oversample}")
        for name, allowed in (
            ("advantage_mode", ("trajectory", "broadcast", "per_step")),
            ("advantage_scale", ("group", "batch", "none")),
            ("loss_aggregation", ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> GRPOConfig:
    """A GRPOConfig from a YAML file (every key a field) and then ``overrides`` (None values skipped)."""
    values: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except OSError as exc:
            raise ValueError(f"{path}: cannot read config: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise ValueError(f"{path}: not valid YAML: {exc}") from None
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: expected a mapping of GRPOConfig fields")
        known = {f.name for f in fields(GRPOConfig)}
        unknown = sorted(set(loaded) - known)
        if unknown:
            raise ValueError(f"{path}: unknown field(s) {', '.join(unknown)}; see trainer/config.py")
        values.update(loaded)
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return GRPOConfig(**values)
