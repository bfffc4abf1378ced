"""``lora:`` of ``rallyrl train`` and ``rallyrl sft``: the adapter's settings (``trainer/lora.py`` applies them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from data.config_tree import ConfigError

LORA_BASE_DTYPES = ("float32", "bfloat16", "float16")
LORA_SYNCS = ("auto", "adapter", "merged")


@dataclass
class LoRAConfig:
    """``lora:`` of ``rallyrl train`` and ``rallyrl sft``: train a low-rank adapter instead of the model."""

    rank: int = 16
    """r: the adapter's rank (A is rank x in, B is out x rank)."""
    alpha: float = 32.0
    """lora_alpha: the update is scaled by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapter's input while training."""
    target_modules: list[str] | str = "all-linear"
    """Module names (suffixes, e.g. q_proj, v_proj) to adapt, or ``all-linear``: every linear layer
    but the output head."""
    base_dtype: str = "float32"
    """The frozen base weights' dtype: float32, bfloat16 (halves their memory on a GPU) or float16.
    The adapter trains in float32."""
    exclude: list[str] = field(default_factory=list)
    """Module names never adapted (e.g. a vision tower)."""
    sync: str = "auto"
    """How servers (``--engine-url``) get each version: ``adapter`` (the adapter alone, loaded by the
    server's LoRA endpoint; an error before the first rollout where it cannot), ``merged`` (full
    weights with the adapter merged in) or ``auto`` (the adapter where the server can load it, merged
    weights where its engine cannot load adapters at all, e.g. SGLang on CPU; a server that only
    lacks a flag is still an error). In-process engines always get merged weights."""

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ConfigError(f"lora.rank must be a positive integer, got {self.rank!r}")
        if not isinstance(self.alpha, (int, float)) or self.alpha <= 0:
            raise ConfigError(f"lora.alpha must be a positive number, got {self.alpha!r}")
        if not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ConfigError(f"lora.dropout must be in [0, 1), got {self.dropout!r}")
        if self.base_dtype not in LORA_BASE_DTYPES:
            raise ConfigError(f"lora.base_dtype must be one of {list(LORA_BASE_DTYPES)}, got {self.base_dtype!r}")
        if isinstance(self.target_modules, str) and self.target_modules != "all-linear":
            self.target_modules = [self.target_modules]
        if self.sync not in LORA_SYNCS:
            raise ConfigError(f"lora.sync must be one of {list(LORA_SYNCS)}, got {self.sync!r}")
        if not self.target_modules:
            raise ConfigError("lora.target_modules is empty: name modules (q_proj, v_proj, ...) or all-linear")
