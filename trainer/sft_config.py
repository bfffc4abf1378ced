"""``SFTConfig``: the config tree of ``rallyrl sft`` (``trainer/sft.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from rollout.config import CommonConfig
from trainer.lora_config import LoRAConfig
from trainer.trackers import LogWith


@dataclass
class SFTConfig(CommonConfig):
    """An SFT run (``rallyrl sft``); the defaults train a fresh tiny Qwen2 on calc traces (the
    embedded model's stages are ``trainer.sft.TINY_CALC_RECIPE``)."""

    model: str | None = None
    """Hugging Face model directory to start from; None builds a fresh tiny Qwen2 (sizes below)."""
    hidden_size: int = 128
    """Fresh model only: hidden size."""
    num_layers: int = 4
    """Fresh model only: decoder layers."""
    num_heads: int = 8
    """Fresh model only: attention heads (8 of size 16 learn to copy operands much sooner than 4)."""
    num_kv_heads: int = 8
    """Fresh model only: key/value heads (no grouping: 2 groups slowed copying down)."""
    intermediate_size: int = 512
    """Fresh model only: MLP size."""
    data: str | None = None
    """JSONL of conversations (dataset records whose prompt holds the whole chat) or of rollout
    trajectories; None generates ``calc`` traces with ``seed``."""
    tool_call_share: float = 1.0
    """Generated traces only: the share that calls the calculator; the rest answer at once (a guess)."""
    num_examples: int = 20000
    """Examples to use: generated traces, or the first N of ``data`` (0 = all of ``data``)."""
    min_reward: float | None = None
    """Trajectory data only: keep trajectories whose reward is at least this (rejection sampling)."""
    max_length: int = 2048
    """Longer examples are cut to this many tokens."""
    steps: int = 1200
    """Optimizer steps."""
    schedule_steps: int | None = None
    """Length of the learning-rate schedule (default: ``steps``); a longer one stops the run partway."""
    batch_size: int = 32
    """Examples per step."""
    lr: float = 3e-3
    """Peak learning rate (AdamW)."""
    warmup_steps: int = 30
    """Linear warmup steps before the cosine decay to 0."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm."""
    eval_every: int = 50
    """Evaluate and save a checkpoint every this many steps (and after the last step)."""
    eval_prompts: int = 128
    """Held-out calc problems rolled out greedily at each evaluation (0 = save checkpoints only)."""
    eval_seed: int = 1000
    """Seed of the held-out problems; must differ from ``seed``."""
    log_every: int = 10
    """Print and log the training loss every this many steps."""
    stop_accuracy: float | None = None
    """Stop at the first evaluation whose held-out accuracy reaches this (None: run every step)."""
    out: str = "runs/sft"
    """Output directory: ``step-N/`` checkpoints and ``sft_log.jsonl``."""
    log_with: LogWith = "none"
    """Also log the training loss and each evaluation to Accelerate's trackers under ``out``, offline (as
    ``rallyrl train``'s ``log_with``: tensorboard, wandb, trackio, mlflow or a list); none: sft_log.jsonl only."""
    export: str | None = None
    """Also copy the last checkpoint here (``data/assets/tiny-calc`` rebuilds the embedded model)."""
    export_head_dim: int = 32
    """The export's attention heads are widened to this size and its hidden size to heads x
    this, zero-padded (the same function, ``data/model_padding.py``): vLLM's CPU attention
    refuses heads under 32 and SGLang on CPU takes hidden / heads as the head size. 0 exports
    the checkpoint as it is."""
    device: str = "cpu"
    """"cpu", or "auto" to let Accelerate pick (CUDA when present)."""
    gradient_checkpointing: bool | None = None
    """Recompute each decoder layer in backward (as ``rallyrl train``'s); null: on for models of
    100 M parameters or more. On, a batch's shared prefix is not cached (rows run in full)."""
    logprob_chunk_tokens: int = 1024
    """Trained tokens per chunk through the LM head (as ``rallyrl train``'s); 0: all at once."""
    lora: LoRAConfig | None = None
    """Train a LoRA adapter instead of the whole model (as ``rallyrl train``'s); null: full fine-tuning."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("steps", "batch_size", "eval_every", "log_every", "max_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"SFTConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_examples", "eval_prompts", "warmup_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"SFTConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.data is None and self.num_examples < 1:
            raise ValueError("SFTConfig.num_examples must be >= 1 when traces are generated (data is None)")
        if self.eval_seed == self.seed:
            raise ValueError(f"SFTConfig.eval_seed must differ from the training seed ({self.seed}): it is held out")
        if self.schedule_steps is not None and self.schedule_steps < self.steps:
            raise ValueError(f"SFTConfig.schedule_steps must be >= steps ({self.steps}), got {self.schedule_steps}")
        if self.lr <= 0:
            raise ValueError(f"SFTConfig.lr must be > 0, got {self.lr}")
        if self.stop_accuracy is not None and (self.eval_prompts == 0 or not 0 < self.stop_accuracy <= 1):
            raise ValueError("SFTConfig.stop_accuracy must be in (0, 1] and needs eval_prompts > 0")
