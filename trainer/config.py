"""The training side of the config tree: ``GRPOConfig`` (``rallyrl train``), ``EvalConfig``
(``rallyrl eval``) and ``SFTConfig`` (``rallyrl sft``).

Each holds the shared sections (``rollout``, ``engine``, ``judge``) from ``rollout/config.py``, with
its own preset where the command needs other limits than a plain rollout (the calc task needs
few, short turns). YAML layout and loading: ``data/config_tree.py``; ``rallyrl config --show``
prints any command's resolved tree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from data.config_tree import ConfigError, check_fields, load_tree, to_dict
from rollout.config import GatewayConfig, JudgeConfig, PromptsConfig, RolloutConfig
from rollout.engines.config import EngineConfig, WeightSyncConfig
from trainer.lora_config import LoRAConfig
from trainer.preemption import signal_number
from trainer.rollout_correction_config import Correction, RolloutCorrection
from trainer.sft_config import SFTConfig
from trainer.trackers import LogWith

AdvantageMode = Literal["trajectory", "broadcast", "per_step"]
AdvantageScale = Literal["group", "batch", "none"]
LossAggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLEstimator = Literal["k1", "k3"]


def _calc_rollout(**changes: Any) -> RolloutConfig:
    """The rollout preset of training and evaluation on the calc task: few, short turns."""
    return RolloutConfig(**{"max_turns": 3, "max_new_tokens": 96, "max_model_len": 1024, **changes})


@dataclass
class GRPOConfig(PromptsConfig):
    """A GRPO run (``rallyrl train``). The defaults train the embedded model on the synthetic
    calculator task on 2 CPU cores in about 15 minutes (17.7 % -> 61 % held-out accuracy)."""

    seed: int = 1
    """Seed of prompts, sampling and initialisation (keep it apart from evaluation's 12345)."""
    samples_per_prompt: int = 8
    """The group size G: samples per prompt, whose rewards are compared with each other."""
    out: str = "runs/grpo"
    """Run directory: metrics.jsonl, checkpoints/step-N/ (each a model directory), final/, curves.png."""

    # --- steps and groups ---
    steps: int = 40
    """GRPO steps (one rollout and one update each)."""
    prompts_per_step: int = 16
    """Prompts per step, over all processes (each prompt is one group of ``samples_per_prompt``)."""
    filter_groups: bool = True
    """Drop groups whose rewards are all equal (no signal; counted as solve_all / solve_none), as
    DAPO's dynamic sampling does. Missing rewards (a failed judgment) are left out first."""
    oversample: float = 1.5
    """With ``filter_groups``: a step first draws this many times ``prompts_per_step`` prompts
    (the synchronous trainer's first round; a guess of how many groups filtering leaves)."""
    max_draws: float = 4.0
    """With ``filter_groups``: DAPO's dynamic sampling refills a step that filtering left short,
    drawing more prompts until it has ``prompts_per_step`` groups with signal, but at most this many
    times ``prompts_per_step`` prompts per step; a step that hits the cap trains on the groups it
    has (counted as ``rollout/draw_cap_hit``). Both modes."""

    # --- advantages ---
    advantage_mode: AdvantageMode = "trajectory"
    """trajectory: one sample per trajectory (GRPO); broadcast: one sample per assistant turn, each
    with its trajectory's advantage; per_step: each turn gets its discounted Monte-Carlo return of
    step rewards (tool rewards + final), normalised within the group (``gamma``)."""
    advantage_scale: AdvantageScale = "group"
    """Divide centred rewards by the group's std (GRPO), the batch's std, or nothing (Dr. GRPO,
    Liu et al. 2025, which removes the std's difficulty bias)."""
    gamma: float = 1.0
    """Discount of per-step returns (``advantage_mode: per_step`` only)."""

    # --- the loss ---
    eps_low: float = 0.2
    """Lower clip of the ratio (PPO's epsilon): the ratio is clipped at 1 - eps_low."""
    eps_high: float = 0.28
    """Upper clip, 1 + eps_high. Above eps_low is DAPO's clip-higher (Yu et al. 2025): more room for
    raising unlikely tokens keeps entropy from collapsing."""
    loss_aggregation: LossAggregation = "token-mean"
    """token-mean: every trained token weighs the same (DAPO); seq-mean-token-mean: each sequence
    weighs the same (original GRPO); seq-mean-token-sum-norm: token sums divided by one constant
    (Dr. GRPO, no length bias; ``loss_constant``). Normalised by global counts across processes."""
    loss_constant: float | None = None
    """Normaliser of seq-mean-token-sum-norm (Dr. GRPO): a fixed generation budget in tokens, the
    same every step. None: the rollout's token budget, ``rollout.max_turns x rollout.max_new_tokens``
    (capped by ``rollout.max_model_len``)."""
    kl_beta: float = 0.0
    """Weight of the KL estimate to the initial policy; 0 loads no reference model (DAPO and
    Dr. GRPO drop the KL term)."""
    kl_estimator: KLEstimator = "k3"
    """Per-token estimator of KL(policy || reference) on the sampled tokens (Schulman's note):
    k1 = logp - ref (unbiased, can be negative, high variance); k3 = exp(ref - logp) - (ref - logp)
    - 1 (unbiased, never negative, low variance; GRPO's choice)."""
    tis_cap: float | None = 2.0
    """Truncated importance sampling (Yao et al. 2025): each token's loss is weighted by
    min(exp(trainer logprob - engine logprob), tis_cap), correcting the gap between the engine
    that sampled and the trainer (kernels, top-k/top-p cuts, stale weights). None: off. The cap of
    token-level weights wherever ``rollout_correction.weight_cap`` is unset (the default preset
    ``token-tis`` is exactly this); the rest of the family: ``rollout_correction``."""

    # --- asynchronous RL ---
    async_rl: bool = False
    """Overlap rollout and training (``trainer/async_rl.py``): rollouts run continuously into a
    queue of finished groups, the trainer steps as soon as it has ``prompts_per_step`` usable
    groups, and new weights reach the engine while requests go on (a request in flight continues
    from its tokens on the new weights; each token keeps the version that produced it). Off: each
    step rolls out, then updates, then syncs (the synchronous trainer)."""
    max_staleness: int = 1
    """Async only: the most a trained token may lag, in policy versions (the version being updated
    minus the version that sampled the token). Groups are admitted only while they can still be
    trained within it; a group that finishes too late is regenerated from its prompt (counted as
    ``rollout/dropped``). 0 is on-policy (rollout waits for each update). Stale tokens are kept
    honest by ``tis_cap``: their loss is weighted by min(pi_trainer / pi_engine, cap) (or by
    another ``rollout_correction``)."""

    # --- optimisation ---
    lr: float = 1e-4
    """AdamW learning rate (constant after ``warmup_steps``). 1e-4 holds across seeds at twice itself on
    the calc task and on reasoning-gym, where 4e-4 broke the tool-call format (docs/training.md, "Seeds")."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    warmup_steps: int = 5
    """Updates over which the learning rate rises linearly to ``lr`` (update s runs at lr x (s + 1) /
    (warmup_steps + 1)). AdamW's first updates move every weight by about ``lr`` whatever its gradient;
    without a warmup they can break a small model's tool-call format (docs/training.md, "Why a run
    collapses"). 0: ``lr`` from the first update."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm."""
    ppo_epochs: int = 1
    """mu: passes over each step's samples (one optimizer step per pass); above 1 the ratio and
    clipping act against the policy before the step's first pass."""
    micro_batch_size: int | None = None
    """Most sequences per forward/backward; None: no count limit, ``micro_batch_tokens`` alone sizes
    them. Gradients accumulate over a step's micro-batches (the result does not depend on it)."""
    micro_batch_tokens: int | Literal["auto"] | None = "auto"
    """Most tokens per forward/backward (padded: sequences x the longest; packed: their sum): long
    conversations go in smaller micro-batches (verl's dynamic batch size). ``auto``: on CUDA, the
    largest budget the card holds, found by a probe at the first step (``trainer/memory_budget.py``;
    with ``gradient_checkpointing: null`` it also decides checkpointing); on the CPU 8,192 unless
    ``memory_limit_gib`` is set. None: ``micro_batch_size`` alone. The result does not depend on it."""
    memory_limit_gib: float | None = None
    """The memory the update may use, for ``micro_batch_tokens: auto``. None: on CUDA the card (what is
    free plus what this process holds); on the CPU auto then keeps 8,192 tokens. Set on the CPU, it
    bounds the process's resident memory (RSS)."""
    memory_headroom: float = 0.15
    """``auto`` aims the update's peak at (1 - headroom) x ``memory_limit_gib`` (allocator
    fragmentation, the optimizer step's temporaries and longer-than-probed tails live there)."""
    colocate: bool | None = None
    """Give the in-process engine's memory back for each update and take it back for the next rollout
    (the embedded engine: its KV cache and its weight copy, rebuilt from the trainer's weights;
    in-process SGLang: ``release_memory_occupation``, started with ``enable_memory_saver``). null: on
    where the engine shares the trainer's CUDA device, off on the CPU and with servers. With
    ``async_rl`` the engine cannot stop for the update: ``colocate: true`` makes such a run synchronous."""

    # --- memory at a real model's size ---
    gradient_checkpointing: bool | None = None
    """Recompute each decoder layer in backward instead of keeping its activations: a micro-batch's
    activations shrink to one layer's (Qwen2.5-1.5B shape, 64 x 1,024 tokens on an H200: 54 -> 29
    GiB) for 1.2-1.35x the update time at the same micro-batch. null: decided by memory where
    ``micro_batch_tokens: auto`` probes (off where the budget without it holds the step's longest
    sequence), else on for models of 100 M parameters or more (any real LM), off for tiny ones."""
    packing: bool | None = None
    """Concatenate a micro-batch's sequences into one row without padding (position ids restart per
    sequence). null: where the attention implementation reads packed sequences (flash_attention_2/3,
    flex_attention); sdpa and eager pad instead (packed, they would need a mask over the whole
    row). The result does not depend on it."""
    share_prompt_prefix: bool = True
    """In the update, run the leading tokens every sequence of a micro-batch holds (the prompt, or its
    system part and tool schemas where the prompts differ; none trained) once, and let every sequence
    read their keys and values: a group's 8 samples of one 450-token calc prompt cost one prompt, not
    8. The logprobs and gradients are the same (float rounding aside). Off under gradient checkpointing
    (recomputed layers cannot read a cache), FSDP (a sharded layer runs once per forward) and packing;
    32 tokens at least."""
    logprob_chunk_tokens: int = 1024
    """Trained tokens per chunk through the LM head: one chunk's float32 logits (chunk x vocabulary
    x 4 bytes: 0.6 GB for Qwen2.5's 151,936) are the most that exists at a time, recomputed in
    backward. 0: the whole micro-batch's logits at once (the unchunked reference, for benchmarks)."""
    lora: LoRAConfig | None = None
    """Train a LoRA adapter (peft) instead of the whole model: only the adapter has gradients and
    optimizer state, the KL reference is the base with the adapter off, checkpoints and final/ hold
    the adapter, and the engine gets the adapter merged into its weights. null: full fine-tuning."""

    # --- bookkeeping ---
    checkpoint_every: int = 10
    """Save a checkpoint every N steps (and at the end); 0: only at the end. Each checkpoint is also
    a model directory that ``eval``, ``rollout`` and ``serve`` take as ``--model``."""
    keep_checkpoints: int = 2
    """Checkpoints kept (oldest removed first)."""
    checkpoint_on_signal: str | None = None
    """A signal that, like SIGTERM and SIGINT, stops the run at its next safe point with a checkpoint
    and exit 75 (``trainer/preemption.py``), e.g. SIGUSR1 with SLURM's ``--signal=B:USR1@120``."""
    log_with: LogWith = "none"
    """Also log each step's metrics to Accelerate's trackers: tensorboard, wandb (offline), trackio or
    mlflow (a local file store), or a list of them; each writes under ``out`` and none reaches the
    network (``trainer/trackers.py``; ``pip install 'rallyrl[trackers]'``). none: metrics.jsonl only."""

    # --- sections ---
    rollout: RolloutConfig = field(default_factory=lambda: _calc_rollout(max_concurrency=256))
    """Per-request limits and sampling of every step's rollout (``seed`` is set per step)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Where rollouts run: the embedded engine on a copy of the policy (synced in-process after
    each step), or servers (``urls``), synced after each step as ``weight_sync`` says."""
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    """How the servers get each step's weights: broadcast, tensor or disk, in buckets, with deadlines."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """The LLM judge of a ``judge`` reward."""
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    """The agent gateway, in-process, when ``agent`` is set (the agent's calls are sampled with
    ``rollout``'s settings, so the trainer's logprobs match the engine's)."""
    rollout_correction: RolloutCorrection = field(default_factory=RolloutCorrection)
    """The correction of the engine/trainer gap: IS weights, masks, bypass, by preset (``token-tis``)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("steps", "prompts_per_step", "ppo_epochs", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.logprob_chunk_tokens < 0:
            raise ValueError(f"logprob_chunk_tokens must be >= 0 (0: unchunked), got {self.logprob_chunk_tokens}")
        if isinstance(self.micro_batch_tokens, int) and self.micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens must be >= 1 (or auto, or null), got {self.micro_batch_tokens}")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1 (or null: no count limit), got {self.micro_batch_size}")
        if self.memory_limit_gib is not None and not self.memory_limit_gib > 0:
            raise ValueError(f"memory_limit_gib must be > 0 (or null: the device), got {self.memory_limit_gib}")
        if not 0 <= self.memory_headroom < 1:
            raise ValueError(f"memory_headroom must be in [0, 1), got {self.memory_headroom}")
        if self.checkpoint_every < 0 or self.warmup_steps < 0:
            raise ValueError("checkpoint_every and warmup_steps must be >= 0")
        if not 0 <= self.eps_low < 1 or self.eps_high < 0:
            raise ValueError(f"eps_low must be in [0, 1) and eps_high >= 0, got {self.eps_low}, {self.eps_high}")
        if self.oversample < 1:
            raise ValueError(f"oversample must be >= 1, got {self.oversample}")
        if self.max_draws < self.oversample:
            raise ValueError(f"max_draws must be >= oversample ({self.oversample}), got {self.max_draws}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.loss_constant is not None and self.loss_constant <= 0:
            raise ValueError(f"loss_constant must be > 0 (or null: the rollout's budget), got {self.loss_constant}")
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ValueError(f"tis_cap must be > 0 (or null: off), got {self.tis_cap}")
        self.rollout_correction.resolve(self.tis_cap)  # (a bad combination fails here, naming the field)
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.checkpoint_on_signal is not None:
            self.checkpoint_on_signal = signal_number(self.checkpoint_on_signal).name
        self.check_judge(self.judge)

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    @property
    def correction(self) -> Correction:
        """The rollout correction in force: ``rollout_correction`` resolved, ``tis_cap`` included."""
        return self.rollout_correction.resolve(self.tis_cap)

    @property
    def generation_budget(self) -> float:
        """Dr. GRPO's fixed normaliser: ``loss_constant``, or the rollout's token budget."""
        if self.loss_constant is not None:
            return self.loss_constant
        return float(min(self.rollout.max_turns * self.rollout.max_new_tokens, self.rollout.max_model_len))


@dataclass
class EvalConfig(PromptsConfig):
    """``rallyrl eval``: greedy accuracy and unbiased pass@k, overall and per data_source."""

    seed: int = 12345
    """Seed of the task's prompts: kept apart from training seeds, so these prompts are held out."""
    samples_per_prompt: int = 4
    """Sampled answers per prompt for pass@k (besides the greedy one)."""
    json: str | None = None
    """Write the report as JSON here."""
    report: str | None = None
    """Write a Markdown report here (overall, per data_source, example failures)."""
    rollout: RolloutConfig = field(default_factory=lambda: _calc_rollout(max_model_len=2048))
    """Limits and sampling of the sampled answers (the greedy pass sets temperature 0)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    """The agent gateway, when ``agent`` is set."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_judge(self.judge)

    @property
    def prompts_wanted(self) -> int | None:
        """300 held-out prompts of a task; all records of a data file."""
        return self.num_prompts or (None if self.data else 300)


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None,
                sets: list[str] | None = None) -> GRPOConfig:  # fmt: skip
    """A GRPOConfig from a YAML file, then ``overrides`` (dotted keys; None values skipped), then
    ``--set`` items."""
    return load_tree(GRPOConfig, path, overrides, sets)


__all__ = ["ConfigError", "EvalConfig", "GRPOConfig", "LoRAConfig", "SFTConfig", "check_fields", "load_config"]
