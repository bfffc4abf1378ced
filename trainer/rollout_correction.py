"""Rollout correction as pure functions over ``[B, T]`` token tensors: IS weights and rejection
masks from the ratio pi_trainer / pi_engine of each trained token, and the step's diagnostics.

Rows are sequences (a packed micro-batch is unflattened to one row per sequence first, so the
per-sequence reductions see each sequence's own tokens). Only tokens where ``mask`` is 1 are
weighed, masked or counted; the engine records logprobs exactly for those, so a token without an
engine logprob (prompt, tool output, template glue, padding) is never masked. Settings:
``trainer/rollout_correction_config.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch import Tensor

from trainer.rollout_correction_config import Correction

LOG_RATIO_BOUND = 20.0
"""Log-ratios (and a sequence's sum of them) are clamped to [-20, 20]: weights stay finite."""


def token_log_ratio(trainer_logprobs: Tensor, engine_logprobs: Tensor, mask: Tensor) -> Tensor:
    """log pi_trainer - log pi_engine per token, detached, clamped to [-20, 20], 0 where ``mask`` is 0."""
    gap = trainer_logprobs.detach().float() - engine_logprobs.detach().float()
    return torch.where(mask.bool(), gap.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND), 0.0)


def importance_weights(log_ratio: Tensor, mask: Tensor, level: str, cap: float) -> Tensor:
    """Truncated IS weights ``[B, T]``, 0 where ``mask`` is 0: ``token`` min(exp(log_ratio), cap);
    ``sequence`` min(exp(sum of the row's log-ratios), cap) on each of the row's tokens."""
    if cap <= 0:
        raise ValueError(f"the importance-weight cap must be > 0, got {cap}")
    keep = mask.bool()
    if level == "token":
        weights = log_ratio.exp()
    elif level == "sequence":
        total = torch.where(keep, log_ratio, 0.0).sum(-1, keepdim=True).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        weights = total.exp().expand_as(log_ratio)
    else:
        raise ValueError(f"importance-weight level must be token or sequence, got {level!r}")
    return torch.where(keep, weights.clamp(max=cap), 0.0)


def _outside(values: Tensor, bounds: tuple[float, float]) -> Tensor:
    low, high = bounds
    return (values < low) | (values > high)


def rejection_keep(log_ratio: Tensor, mask: Tensor, correction: Correction) -> Tensor:
    """``[B, T]`` bool: False where a mask drops the token's loss (only ever where ``mask`` is 1).

    ``token_mask``: the token's ratio outside [lo, hi]; the row is dropped whole when the arithmetic
    mean (``seq_mean_mask``) or the geometric mean (``seq_geo_mask``) of its token ratios is outside,
    or any of its token ratios is (``seq_any_token_mask``). A row without trained tokens is kept.
    """
    trained = mask.bool()
    ratio = log_ratio.exp()
    dropped = torch.zeros_like(trained)
    if correction.token_mask is not None:
        dropped |= _outside(ratio, correction.token_mask)
    count = trained.sum(-1, keepdim=True).clamp(min=1)
    rows = torch.zeros_like(trained[:, :1])
    if correction.seq_mean_mask is not None:
        rows |= _outside(torch.where(trained, ratio, 0.0).sum(-1, keepdim=True) / count, correction.seq_mean_mask)
    if correction.seq_geo_mask is not None:
        mean_log = torch.where(trained, log_ratio, 0.0).sum(-1, keepdim=True) / count
        rows |= _outside(mean_log.exp(), correction.seq_geo_mask)
    if correction.seq_any_token_mask is not None:
        rows |= (_outside(ratio, correction.seq_any_token_mask) & trained).any(-1, keepdim=True)
    return ~((dropped | rows) & trained)


@dataclass
class Corrected:
    """What the correction does to one micro-batch: the loss weights and the diagnostics' inputs."""

    loss_weights: Tensor | None
    """IS weight x kept (0 where dropped), for ``policy_loss``'s ``is_weights``; None: no correction."""
    log_ratio: Tensor
    """``[M]`` the trained tokens' log-ratios (row by row)."""
    dropped: Tensor
    """``[M]`` bool: the trained tokens a mask dropped."""
    weights: Tensor | None
    """``[M]`` the trained tokens' IS weights before the masks (None: no weights)."""
    capped: Tensor | None
    """``[M]`` bool: the trained tokens whose weight is the cap."""
    sequences: int
    """Rows with trained tokens."""
    dropped_sequences: int
    """Rows with trained tokens all of which are dropped."""


def correct(trainer_logprobs: Tensor, engine_logprobs: Tensor, mask: Tensor, correction: Correction) -> Corrected:
    """Weights and masks of ``correction`` on the ratio pi_trainer / pi_engine of the tokens where
    ``mask`` is 1 (all three ``[B, T]``, rows are sequences)."""
    trained = mask.bool()
    log_ratio = token_log_ratio(trainer_logprobs, engine_logprobs, mask)
    keep = rejection_keep(log_ratio, mask, correction)
    weights = None
    if correction.weights != "none":
        weights = importance_weights(log_ratio, mask, correction.weights, correction.weight_cap)
    loss_weights = None
    if weights is not None or correction.masks:
        loss_weights = (weights if weights is not None else trained.float()) * keep
    has_tokens = trained.any(-1)
    all_dropped = has_tokens & ~(keep & trained).any(-1)
    uncapped = None if weights is None else importance_weights(log_ratio, mask, correction.weights, float("inf"))
    return Corrected(
        loss_weights=loss_weights,
        log_ratio=log_ratio[trained],
        dropped=~keep[trained],
        weights=None if weights is None else weights[trained],
        capped=None if uncapped is None else (uncapped >= correction.weight_cap)[trained],
        sequences=int(has_tokens.sum()),
        dropped_sequences=int(all_dropped.sum()),
    )


def correction_metrics(log_ratio: Tensor, dropped: Tensor, sequences: int, dropped_sequences: int,
                       weights: Tensor | None = None, capped: Tensor | None = None) -> dict[str, float]:  # fmt: skip
    """The step's ``correction/`` metrics over its trained tokens (``[M]`` each):

    ratio_p5 / p50 / p95 / max of pi_trainer / pi_engine; kl_k3, the k3 estimate of KL(engine ||
    trainer) on the engine's samples, mean of (r - 1) - log r; logprob_gap, the mean |trainer -
    engine| logprob; masked_token_fraction and masked_sequence_fraction, the shares dropped by the
    masks; with weights, weight_mean (before the masks) and capped_token_fraction. NaN (0 for the
    shares) without trained tokens."""
    nan = float("nan")
    log_ratio = log_ratio.detach().double().cpu()
    count = log_ratio.numel()
    metrics = {f"correction/{name}": nan for name in ("ratio_p5", "ratio_p50", "ratio_p95", "ratio_max", "kl_k3",
                                                      "logprob_gap")}  # fmt: skip
    if count:
        ratio = log_ratio.exp()
        p5, p50, p95 = np.quantile(ratio.numpy(), [0.05, 0.5, 0.95])
        metrics.update({
            "correction/ratio_p5": float(p5), "correction/ratio_p50": float(p50), "correction/ratio_p95": float(p95),
            "correction/ratio_max": float(ratio.max()),
            "correction/kl_k3": float(((ratio - 1) - log_ratio).mean()),
            "correction/logprob_gap": float(log_ratio.abs().mean()),
        })  # fmt: skip
    metrics["correction/masked_token_fraction"] = float(dropped.sum()) / count if count else 0.0
    metrics["correction/masked_sequence_fraction"] = dropped_sequences / sequences if sequences else 0.0
    if weights is not None:
        metrics["correction/weight_mean"] = float(weights.double().mean()) if count else nan
        metrics["correction/capped_token_fraction"] = float(capped.sum()) / count if count else 0.0
    return metrics


@dataclass
class CorrectionStats:
    """The step's corrections, micro-batch by micro-batch (the first pass's), for ``correction_metrics``."""

    parts: list[Corrected] = field(default_factory=list)

    def add(self, corrected: Corrected) -> None:
        self.parts.append(replace(corrected, loss_weights=None))  # (the [B, T] weights are not needed)

    def metrics(self, weighted: bool, gather: Callable[[Tensor], Tensor] | None = None,
                total: Callable[[dict[str, float]], dict[str, float]] | None = None) -> dict[str, float]:  # fmt: skip
        """The metrics over every part; ``gather`` concatenates a ``[M, k]`` tensor over processes and
        ``total`` sums counts over them (both the identity in one process)."""
        columns = [
            torch.stack([part.log_ratio.float(), part.dropped.float(),
                         *((part.weights.float(), part.capped.float()) if weighted else ())], -1)
            for part in self.parts
        ]  # fmt: skip
        rows = torch.cat(columns) if columns else torch.zeros(0, 4 if weighted else 2)
        rows = gather(rows) if gather is not None else rows
        counts = {"sequences": sum(p.sequences for p in self.parts),
                  "dropped": sum(p.dropped_sequences for p in self.parts)}  # fmt: skip
        counts = total(counts) if total is not None else counts
        return correction_metrics(
            rows[:, 0], rows[:, 1].bool(), int(counts["sequences"]), int(counts["dropped"]),
            weights=rows[:, 2] if weighted else None, capped=rows[:, 3].bool() if weighted else None,
        )  # fmt: skip
