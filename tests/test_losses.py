"""The GRPO policy loss: masking, clipping, KL, aggregation modes and importance weights."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from trainer.losses import (
    aggregate,
    entropy_from_logits,
    kl_k1,
    kl_k3,
    policy_loss,
    token_logprobs,
    truncated_is_weights,
)


def logprobs_for_ratios(ratios: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """One-row logprobs (leaf, requires grad) and zero old logprobs giving the ``ratios``."""
    logprobs = torch.tensor([[math.log(r) for r in ratios]], dtype=torch.float64, requires_grad=True)
    return logprobs, torch.zeros_like(logprobs)


def test_gradients_on_masked_out_tokens_are_exactly_zero() -> None:
    torch.manual_seed(0)
    batch, length, features, vocab = 2, 8, 6, 11
    head = nn.Linear(features, vocab)
    logits = head(torch.randn(batch, length, features))
    targets = torch.randint(vocab, (batch, length))
    logprobs = token_logprobs(logits, targets)
    logprobs.retain_grad()
    mask = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1], [1, 1, 0, 0, 1, 1, 0, 0]])  # prompt / tool output = 0
    # Old and reference logprobs are garbage (NaN, inf) where masked out, as padding may be.
    old = torch.where(mask.bool(), logprobs.detach() + 0.3 * torch.randn(batch, length), float("nan"))
    ref = torch.where(mask.bool(), logprobs.detach() - 0.2, float("inf"))
    out = policy_loss(
        logprobs,
        old,
        torch.tensor([1.5, -0.5]),
        mask,
        ref_logprobs=ref,
        kl_beta=0.1,
        is_weights=torch.full((batch, length), 0.9),
    )
    out.loss.backward()
    assert (logprobs.grad[mask == 0] == 0).all()
    assert (logprobs.grad[mask == 1] != 0).all()
    assert torch.isfinite(head.weight.grad).all()


def test_inside_the_clip_range_nothing_is_clipped_and_the_gradient_is_the_unclipped_one() -> None:
    logprobs, old = logprobs_for_ratios([0.85, 1.0, 1.1, 1.25])
    advantages = torch.tensor([[1.0, -1.0, 2.0, -0.5]], dtype=torch.float64)
    out = policy_loss(logprobs, old, advantages, torch.ones_like(logprobs))
    out.loss.backward()
    assert out.clip_fraction == 0.0

    reference = logprobs.detach().clone().requires_grad_(True)
    (-(reference.exp() * advantages).mean()).backward()
    torch.testing.assert_close(logprobs.grad, reference.grad)


@pytest.mark.parametrize(
    ("ratio", "advantage", "clipped"),
    [
        (1.5, 1.0, True),  # above 1 + eps_high with A > 0: no more push up
        (0.5, -1.0, True),  # below 1 - eps_low with A < 0: no more push down
        (0.5, 1.0, False),  # below the range with A > 0: min picks the unclipped branch
        (1.5, -1.0, False),  # above the range with A < 0: min picks the unclipped branch
    ],
)
def test_the_clip_bites_only_outside_the_range_in_the_direction_of_the_advantage(
    ratio: float, advantage: float, clipped: bool
) -> None:
    logprobs, old = logprobs_for_ratios([ratio])
    out = policy_loss(logprobs, old, torch.tensor([advantage], dtype=torch.float64), torch.ones_like(logprobs))
    out.loss.backward()
    assert out.clip_fraction == (1.0 if clipped else 0.0)
    expected_grad = 0.0 if clipped else -ratio * advantage  # d(-ratio * A) / d logp
    assert logprobs.grad.item() == pytest.approx(expected_grad)


def test_clip_fraction_counts_only_masked_tokens() -> None:
    logprobs, old = logprobs_for_ratios([1.5, 1.5, 1.0, 1.0])
    mask = torch.tensor([[1, 0, 1, 1]])
    out = policy_loss(logprobs, old, torch.tensor([1.0], dtype=torch.float64), mask)
    assert out.clip_fraction == pytest.approx(1 / 3)


def test_kl_is_zero_when_the_policy_equals_the_reference() -> None:
    torch.manual_seed(0)
    logprobs = torch.log_softmax(torch.randn(2, 5, 7), -1)[..., 0]
    assert (kl_k3(logprobs, logprobs) == 0).all()
    advantages = torch.tensor([1.0, -1.0])
    with_kl = policy_loss(logprobs, logprobs, advantages, torch.ones(2, 5), ref_logprobs=logprobs, kl_beta=0.5)
    without_kl = policy_loss(logprobs, logprobs, advantages, torch.ones(2, 5))
    assert with_kl.kl == 0.0
    assert with_kl.loss.item() == without_kl.loss.item()


def test_kl_is_positive_and_added_to_the_loss_when_the_policy_differs_from_the_reference() -> None:
    logprobs = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    mask = torch.ones(1, 2)
    out = policy_loss(logprobs, logprobs, torch.tensor([0.0]), mask, ref_logprobs=ref, kl_beta=0.5)
    expected_kl = kl_k3(logprobs, ref).mean().item()
    assert out.kl == pytest.approx(expected_kl)
    assert expected_kl > 0
    assert out.loss.item() == pytest.approx(0.5 * expected_kl)
    assert out.pg_loss == 0.0


def test_k3_is_non_negative() -> None:
    torch.manual_seed(0)
    logprobs, ref = -5 * torch.rand(1000), -5 * torch.rand(1000)
    assert (kl_k3(logprobs, ref) >= 0).all()


def test_k1_is_the_log_ratio_to_the_reference_and_can_be_negative() -> None:
    logprobs = torch.tensor([[-1.0, -2.0, -0.5]])
    ref = torch.tensor([[-1.5, -1.0, -0.5]])
    assert kl_k1(logprobs, ref).tolist() == [[0.5, -1.0, 0.0]]


def test_k1_chosen_in_the_loss_gives_its_value_and_can_make_the_kl_negative() -> None:
    logprobs = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])  # k1: 0.5 and -1.0, mean -0.25; k3 would be positive
    out = policy_loss(logprobs, logprobs, torch.tensor([0.0]), torch.ones(1, 2), ref_logprobs=ref, kl_beta=0.5,
                      kl_estimator="k1")  # fmt: skip
    assert out.kl == pytest.approx(-0.25)
    assert out.loss.item() == pytest.approx(0.5 * -0.25)
    assert out.pg_loss == 0.0


def test_the_gradient_of_the_k1_term_is_beta_per_token_whatever_the_reference() -> None:
    """d(logp - ref)/d logp = 1; k3's would be 1 - exp(ref - logp), which depends on the reference."""
    logprobs = torch.tensor([[-1.0, -2.0, -0.3, -4.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -0.3, -9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0]])
    advantages = torch.tensor([0.0], dtype=torch.float64)
    out = policy_loss(logprobs, logprobs.detach(), advantages, mask, ref_logprobs=ref, kl_beta=0.3, kl_estimator="k1")
    out.loss.backward()
    assert logprobs.grad[0].tolist() == pytest.approx([0.1, 0.1, 0.1, 0.0])  # beta / 3 masked tokens
    k3_grad = 0.3 / 3 * (1 - torch.exp(ref - logprobs.detach()))
    logprobs.grad = None
    policy_loss(logprobs, logprobs.detach(), advantages, mask, ref_logprobs=ref, kl_beta=0.3).loss.backward()
    assert logprobs.grad[0, :3].tolist() == pytest.approx(k3_grad[0, :3].tolist())  # the default is k3


def test_an_unknown_kl_estimator_is_a_value_error() -> None:
    logprobs = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=r"kl_estimator must be one of \('k1', 'k3'\), got 'k2'"):
        policy_loss(logprobs, logprobs, torch.tensor([1.0]), torch.ones(1, 2), ref_logprobs=logprobs, kl_beta=0.1,
                    kl_estimator="k2")  # fmt: skip


def test_kl_beta_without_reference_logprobs_is_an_error() -> None:
    logprobs = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(logprobs, logprobs, torch.tensor([1.0]), torch.ones(1, 2), kl_beta=0.1)


# Hand-computed aggregation example; the last row is all masked and holds garbage.
VALUES = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 0.0, 0.0], [float("nan"), float("inf"), 9.0, 9.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])


def test_token_mean_divides_by_the_number_of_masked_tokens_in_the_batch() -> None:
    assert aggregate(VALUES, MASK, "token-mean").item() == pytest.approx((1 + 2 + 3 + 5 + 6) / 5)


def test_seq_mean_token_mean_averages_sequences_that_have_tokens() -> None:
    assert aggregate(VALUES, MASK, "seq-mean-token-mean").item() == pytest.approx((2.0 + 5.5) / 2)


def test_seq_mean_token_sum_norm_divides_by_batch_size_times_the_constant() -> None:
    assert aggregate(VALUES, MASK, "seq-mean-token-sum-norm").item() == pytest.approx(17 / (3 * 4))
    assert aggregate(VALUES, MASK, "seq-mean-token-sum-norm", constant=10).item() == pytest.approx(17 / (3 * 10))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_an_all_masked_batch_aggregates_to_zero_with_zero_gradient(mode: str) -> None:
    values = VALUES.clone().requires_grad_(True)
    result = aggregate(values, torch.zeros_like(MASK), mode)  # type: ignore[arg-type]
    result.backward()
    assert result.item() == 0.0
    assert (values.grad == 0).all()


def test_truncated_is_weights_are_capped_and_detached() -> None:
    engine = torch.zeros(4)
    old = torch.tensor([0.0, math.log(2.0), math.log(10.0), -math.log(2.0)], requires_grad=True)
    weights = truncated_is_weights(old, engine, cap=3.0)
    torch.testing.assert_close(weights, torch.tensor([1.0, 2.0, 3.0, 0.5]))
    assert not weights.requires_grad


def test_is_weights_scale_the_per_token_surrogate() -> None:
    logprobs = torch.zeros(1, 2)
    out = policy_loss(logprobs, logprobs, torch.tensor([1.0]), torch.ones(1, 2), is_weights=torch.tensor([[0.5, 2.0]]))
    assert out.loss.item() == pytest.approx(-(0.5 + 2.0) / 2)
    assert out.importance_weight_mean == pytest.approx(1.25)


def test_token_logprobs_match_log_softmax_and_entropy_matches_its_definition() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5)
    targets = torch.randint(5, (2, 3))
    logp = torch.log_softmax(logits, -1)
    torch.testing.assert_close(token_logprobs(logits, targets), logp.gather(-1, targets[..., None])[..., 0])
    torch.testing.assert_close(entropy_from_logits(logits), -(logp.exp() * logp).sum(-1))


def test_entropy_ignores_minus_infinity_logits() -> None:
    logits = torch.tensor([[[0.0, 0.0, float("-inf")]]], requires_grad=True)
    entropy = entropy_from_logits(logits)
    entropy.sum().backward()
    assert entropy.item() == pytest.approx(math.log(2))
    assert torch.isfinite(logits.grad).all()
