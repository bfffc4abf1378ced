"""The GRPO policy loss and its pieces, as plain functions over ``[B, T]`` token tensors.

- ``policy_loss``: the clipped surrogate with asymmetric clip range (``eps_low`` /
  ``eps_high``, DAPO's clip-higher), optional truncated importance-sampling weights, an
  optional KL penalty to a reference policy added to the loss (GRPO style; the k3 or k1
  estimator, ``kl_k3`` / ``kl_k1``), and one of three loss aggregations (``aggregate``).
- ``mask`` is the loss mask: 1 on the tokens the policy generated, 0 on prompt, tool output,
  template glue and padding. Every input is replaced by 0 where ``mask == 0`` before any
  arithmetic (``torch.where``), so masked-out positions get a gradient of exactly zero, even
  when they hold inf or NaN.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

import torch
from torch import Tensor

from trainer.config import KLEstimator
from trainer.config import LossAggregation as AggregationMode

_AGGREGATION_MODES = get_args(AggregationMode)
_KL_ESTIMATORS = get_args(KLEstimator)
_LOG_RATIO_CLAMP = 20.0


def _check_token_shapes(**tensors: Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    first = next(iter(shapes.values()))
    if len(first) != 2 or any(shape != first for shape in shapes.values()):
        raise ValueError(f"expected [B, T] tensors of one shape, got {shapes}")


def _masked_mean(values: Tensor, keep: Tensor) -> float:
    """Mean of ``values`` over ``keep``, as a Python float; 0.0 when nothing is kept."""
    count = int(keep.sum())
    if count == 0:
        return 0.0
    return float(torch.where(keep, values.detach(), 0.0).sum() / count)


def aggregate(values: Tensor, mask: Tensor, mode: AggregationMode, constant: float | None = None) -> Tensor:
    """Reduce per-token ``values [B, T]`` over the tokens where ``mask`` is nonzero to a scalar.

    - ``"token-mean"`` (DAPO): sum over all masked tokens / number of masked tokens in the batch.
    - ``"seq-mean-token-mean"`` (GRPO): mean over each sequence's masked tokens, then the mean
      over the sequences that have any.
    - ``"seq-mean-token-sum-norm"`` (Dr. GRPO): ``sum_i sum_t values / (B * constant)``, with
      ``constant`` (usually the max response length) defaulting to ``T``; ``constant`` is
      ignored by the other modes.

    ``mask`` is binary (nonzero = included). Rows with no masked tokens contribute nothing, and
    an all-masked batch gives 0, never NaN.
    """
    _check_token_shapes(values=values, mask=mask)
    keep = mask.bool()
    masked = torch.where(keep, values, torch.zeros_like(values))
    if mode == "token-mean":
        return masked.sum() / keep.sum().clamp(min=1)
    if mode == "seq-mean-token-mean":
        tokens = keep.sum(-1)
        seq_means = masked.sum(-1) / tokens.clamp(min=1)  # exactly 0 for rows without tokens
        return seq_means.sum() / (tokens > 0).sum().clamp(min=1)
    if mode == "seq-mean-token-sum-norm":
        batch_size, max_len = values.shape
        constant = float(max_len) if constant is None else constant
        if constant <= 0:
            raise ValueError(f"aggregation constant must be > 0, got {constant}")
        return masked.sum() / (max(batch_size, 1) * constant)
    raise ValueError(f"aggregation mode must be one of {_AGGREGATION_MODES}, got {mode!r}")


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Elementwise k3 estimator of KL(policy || ref) on tokens sampled from the policy.

    ``exp(ref - logp) - (ref - logp) - 1``: non-negative, exactly 0 where the two are equal.
    The log-ratio is clamped to [-20, 20] so that the exponential stays finite.
    """
    log_ratio = (ref_logprobs - logprobs).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return log_ratio.exp() - log_ratio - 1


def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Elementwise k1 estimator of KL(policy || ref) on tokens sampled from the policy.

    ``logp - ref``: unbiased like k3 but negative wherever the reference gives the token more
    probability, and of higher variance. Added to the loss, its gradient is ``grad logp`` alone,
    whose expectation over the policy's own samples is 0: it does not pull towards the reference
    on average (k3's gradient does), so k1 is mostly for comparison and logging.
    """
    return logprobs - ref_logprobs


def truncated_is_weights(trainer_old_logprobs: Tensor, engine_logprobs: Tensor, cap: float) -> Tensor:
    """Truncated importance-sampling weights ``min(exp(old - engine), cap)``, detached.

    Corrects for the mismatch between the engine that sampled the tokens and the trainer's
    own log-probs of them under the same weights (Yao et al., "Your efficient RL framework
    secretly brings you off-policy RL training").
    """
    if cap <= 0:
        raise ValueError(f"the importance-weight cap must be > 0, got {cap}")
    log_ratio = (trainer_old_logprobs - engine_logprobs).detach().clamp(max=_LOG_RATIO_CLAMP)
    return log_ratio.exp().clamp(max=cap)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy ``[B, T]`` of the softmax over the last dim of ``logits [B, T, V]``, in float32.

    Computed from ``log_softmax`` (logsumexp based); ``-inf`` logits contribute 0.
    """
    logp = logits.float().log_softmax(-1)
    safe_logp = logp.clamp(min=torch.finfo(logp.dtype).min)  # 0 * -inf would be NaN
    return -(logp.exp() * safe_logp).sum(-1)


def token_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    """Log-probability ``[B, T]`` of ``targets [B, T]`` under ``logits [B, T, V]``, in float32.

    ``targets`` must be valid token ids everywhere (mask padding with the loss mask, not with
    an ignore index).
    """
    if targets.shape != logits.shape[:-1]:
        raise ValueError(
            f"targets must be shaped like logits without the vocab dim: {tuple(logits.shape)}, "
            f"got {tuple(targets.shape)}"
        )
    return logits.float().log_softmax(-1).gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)


@dataclass
class PolicyLossOutput:
    """The loss to backprop and its diagnostics (Python floats, over the masked tokens)."""

    loss: Tensor
    """Scalar to call ``backward`` on: aggregated surrogate (times IS weights) + ``kl_beta`` * KL."""
    pg_loss: float
    """The aggregated clipped-surrogate part of ``loss`` alone (IS weights included, no KL)."""
    kl: float
    """Mean KL estimate (``kl_estimator``) to the reference over masked tokens; 0.0 without ``ref_logprobs``."""
    clip_fraction: float
    """Share of masked tokens where the clip bites (the clipped branch is selected and differs)."""
    approx_kl: float
    """Mean over masked tokens of k3 between old and new: ``(ratio - 1) - log(ratio)`` (CleanRL's)."""
    entropy: float | None
    """Mean entropy over masked tokens, when ``entropy`` was given."""
    importance_weight_mean: float | None
    """Mean IS weight over masked tokens, when ``is_weights`` was given."""


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    aggregation: AggregationMode = "token-mean",
    agg_constant: float | None = None,
    ref_logprobs: Tensor | None = None,
    kl_beta: float = 0.0,
    kl_estimator: KLEstimator = "k3",
    is_weights: Tensor | None = None,
    entropy: Tensor | None = None,
) -> PolicyLossOutput:
    """Clipped-surrogate policy loss of GRPO over the tokens where ``mask`` is nonzero.

    Per token: ``ratio = exp(logp - old)`` (log-ratio clamped to [-20, 20]),
    ``-min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)``, times ``is_weights`` when
    given, plus ``kl_beta * kl(logp, ref)`` when ``kl_beta > 0``, ``kl`` being ``kl_k3`` or ``kl_k1``
    as ``kl_estimator`` says; then ``aggregate``.
    ``advantages`` is ``[B]`` (one per sequence) or ``[B, T]``. ``old_logprobs``,
    ``advantages``, ``ref_logprobs`` and ``is_weights`` are treated as constants (detached).
    ``entropy`` (``[B, T]``) only feeds the metric; no entropy bonus is added.
    """
    _check_token_shapes(logprobs=logprobs, old_logprobs=old_logprobs, mask=mask)
    if not 0 <= eps_low < 1 or eps_high < 0:
        raise ValueError(f"clip range needs 0 <= eps_low < 1 and eps_high >= 0, got {eps_low=} {eps_high=}")
    if kl_estimator not in _KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {_KL_ESTIMATORS}, got {kl_estimator!r}")
    if kl_beta > 0 and ref_logprobs is None:
        raise ValueError(f"kl_beta={kl_beta} > 0 needs ref_logprobs; pass them or set kl_beta to 0")
    if advantages.dim() == 1:
        if advantages.shape[0] != logprobs.shape[0]:
            raise ValueError(f"advantages [B] has {advantages.shape[0]} entries for a batch of {logprobs.shape[0]}")
        advantages = advantages[:, None].expand_as(logprobs)
    _check_token_shapes(logprobs=logprobs, advantages=advantages)

    keep = mask.bool()
    zeros = torch.zeros_like(logprobs)

    def masked_constant(t: Tensor) -> Tensor:
        return torch.where(keep, t.detach().to(logprobs.dtype), zeros)

    logp = torch.where(keep, logprobs, zeros)
    old = masked_constant(old_logprobs)
    adv = masked_constant(advantages)

    log_ratio = (logp - old).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = log_ratio.exp()
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high) * adv
    pg_tokens = -torch.minimum(unclipped, clipped)
    weights = None
    if is_weights is not None:
        _check_token_shapes(logprobs=logprobs, is_weights=is_weights)
        weights = masked_constant(is_weights)
        pg_tokens = pg_tokens * weights
    per_token = pg_tokens
    kl_tokens = None
    if ref_logprobs is not None:
        _check_token_shapes(logprobs=logprobs, ref_logprobs=ref_logprobs)
        estimator = {"k1": kl_k1, "k3": kl_k3}[kl_estimator]
        kl_tokens = estimator(logp, masked_constant(ref_logprobs))
        if kl_beta > 0:
            per_token = per_token + kl_beta * kl_tokens
    loss = aggregate(torch.where(keep, per_token, zeros), keep, aggregation, agg_constant)

    with torch.no_grad():
        pg_loss = float(aggregate(pg_tokens, keep, aggregation, agg_constant))
        kl = _masked_mean(kl_tokens, keep) if kl_tokens is not None else 0.0
        clip_fraction = _masked_mean((clipped < unclipped).to(logprobs.dtype), keep)
        approx_kl = _masked_mean((ratio - 1) - log_ratio, keep)
        entropy_mean = _masked_mean(entropy, keep) if entropy is not None else None
        weight_mean = _masked_mean(weights, keep) if weights is not None else None
    return PolicyLossOutput(
        loss=loss,
        pg_loss=pg_loss,
        kl=kl,
        clip_fraction=clip_fraction,
        approx_kl=approx_kl,
        entropy=entropy_mean,
        importance_weight_mean=weight_mean,
    )
