"""Rollout correction (``trainer/rollout_correction.py``): each weight and mask against numbers worked
out by hand, the presets, the settings' errors, bypass without the old-logprob pass, packing, and a
LoRA run of asynchronous RL; the slow suite trains two steps with every preset."""

from __future__ import annotations

import asyncio
import math

import orjson
import pytest
import torch

from benchmarks.rollout_correction import count_passes
from tests.conftest import run_cli
from tests.test_grpo import config as small_run
from tests.test_grpo import digit_share
from tests.test_policy_update import grpo_config, make_samples, make_trainer
from trainer.config import GRPOConfig, LoRAConfig, load_config
from trainer.grpo import GRPOTrainer
from trainer.losses import policy_loss
from trainer.rollout_correction import CorrectionStats, correct, correction_metrics
from trainer.rollout_correction_config import PRESETS, Correction, RolloutCorrection

# ----- two sequences of four tokens, worked by hand ----------------------------------------------

MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 1.0]])
"""Row A: three trained tokens, then tool output; row B: a prompt token, then three trained tokens."""
RATIOS = [[0.5, 1.0, 4.0, None], [None, 1.25, 0.8, 1.0]]
"""pi_trainer / pi_engine of each trained token. A: product 2, arithmetic mean 5.5 / 3, geometric
mean 2 ** (1/3) = 1.26; B: product 1, arithmetic mean 3.05 / 3 = 1.0167, geometric mean 1."""
ENGINE = torch.tensor([[-1.0, -2.0, -3.0, 0.0], [0.0, -1.5, -0.5, -2.5]])
"""The engine's logprobs; 0.0 where it recorded none (untrained tokens), as ``Sample`` holds them."""
TRAINER = ENGINE + torch.tensor([[math.log(0.5), 0.0, math.log(4.0), -9.0], [7.0, math.log(1.25), math.log(0.8), 0.0]])
"""The trainer's logprobs; far from the engine's 0.0 on the untrained tokens, which must not count."""
ADVANTAGES = torch.tensor([1.0, -1.0])


def corrected(**settings) -> torch.Tensor:
    """The loss weights (IS weight x kept) of ``Correction(**settings)`` on the hand-made batch."""
    return correct(TRAINER, ENGINE, MASK, Correction(**settings)).loss_weights


def same(weights: torch.Tensor, rows: list[list[float]]) -> bool:
    return torch.allclose(weights, torch.tensor(rows), rtol=1e-6, atol=1e-7)


def loss(weights: torch.Tensor | None) -> float:
    """token-mean of -A x weight over the 6 trained tokens: at the first pass the PPO ratio is 1."""
    return float(policy_loss(TRAINER, TRAINER, ADVANTAGES, MASK, is_weights=weights).loss)


def test_token_weights_are_each_tokens_ratio_truncated_at_the_cap():
    weights = corrected(weights="token", weight_cap=2.0)
    assert same(weights, [[0.5, 1.0, 2.0, 0.0], [0.0, 1.25, 0.8, 1.0]])
    assert loss(weights) == pytest.approx((-(0.5 + 1 + 2) + (1.25 + 0.8 + 1)) / 6)  # -0.075


@pytest.mark.parametrize(("cap", "a_weight"), [(3.0, 2.0), (1.5, 1.5)])
def test_sequence_weights_are_the_product_of_the_ratios_truncated_at_the_cap(cap, a_weight):
    weights = corrected(weights="sequence", weight_cap=cap)
    assert same(weights, [[a_weight] * 3 + [0.0], [0.0, 1.0, 1.0, 1.0]])
    assert loss(weights) == pytest.approx((-3 * a_weight + 3) / 6)


def test_icepop_drops_the_tokens_outside_the_bounds_which_are_kept_themselves():
    weights = corrected(token_mask=(0.5, 2.0))  # A's 4.0 is out, its 0.5 on the bound stays
    assert weights.tolist() == [[1.0, 1.0, 0.0, 0.0], [0.0, 1.0, 1.0, 1.0]]
    assert loss(weights) == pytest.approx((-2 + 3) / 6)


@pytest.mark.parametrize(
    ("mask", "bounds", "a_dropped", "b_dropped"),
    [
        ("seq_mean_mask", (0.5, 1.5), True, False),  # A 1.83 out, B 1.0167 in
        ("seq_mean_mask", (0.5, 1.01), True, True),  # B 1.0167 out too
        ("seq_geo_mask", (0.99, 1.01), True, False),  # A 1.26 out, B 1.0 in
        ("seq_geo_mask", (0.5, 1.3), False, False),
        ("seq_any_token_mask", (0.3, 3.0), True, False),  # A's 4.0
        ("seq_any_token_mask", (0.9, 3.0), True, True),  # B's 0.8
    ],
)
def test_sequence_masks_drop_whole_sequences(mask, bounds, a_dropped, b_dropped):
    weights = corrected(**{mask: bounds})
    row_a, row_b = [0.0 if a_dropped else 1.0] * 3 + [0.0], [0.0] + [0.0 if b_dropped else 1.0] * 3
    assert weights.tolist() == [row_a, row_b]
    assert loss(weights) == pytest.approx((-3 * (not a_dropped) + 3 * (not b_dropped)) / 6)


def test_weights_and_masks_combine_and_no_correction_gives_no_weights():
    weights = corrected(weights="token", weight_cap=2.0, seq_geo_mask=(0.99, 1.01))
    assert same(weights, [[0.0] * 4, [0.0, 1.25, 0.8, 1.0]])
    assert corrected() is None  # policy_loss then runs exactly as without a correction


def test_untrained_tokens_are_never_masked_and_never_counted():
    engine = ENGINE.clone()
    engine[0, 3], engine[1, 0] = -50.0, 50.0  # anything at all where the engine recorded no logprob
    for settings in ({"token_mask": (0.5, 2.0)}, {"seq_any_token_mask": (0.3, 5.0)}, {"seq_mean_mask": (0.5, 2.0)}):
        result = correct(TRAINER, engine, MASK, Correction(**settings))
        assert result.dropped.tolist() == correct(TRAINER, ENGINE, MASK, Correction(**settings)).dropped.tolist()
    assert correct(TRAINER, engine, MASK, Correction(token_mask=(0.5, 2.0))).log_ratio.numel() == 6


def test_the_diagnostics_are_the_hand_computed_ones():
    result = correct(TRAINER, ENGINE, MASK, Correction(weights="token", weight_cap=2.0, token_mask=(0.5, 2.0)))
    metrics = correction_metrics(result.log_ratio, result.dropped, result.sequences, result.dropped_sequences,
                                 result.weights, result.capped)  # fmt: skip
    # trained ratios sorted: 0.5 0.8 1 1 1.25 4; quantiles interpolate linearly at 0.05 x 5 and 0.95 x 5
    expected = {
        "correction/ratio_p5": 0.5 + 0.25 * 0.3,
        "correction/ratio_p50": 1.0,
        "correction/ratio_p95": 1.25 + 0.75 * 2.75,
        "correction/ratio_max": 4.0,
        # k3 of KL(engine || trainer): mean of r - 1 - log r
        "correction/kl_k3": sum(r - 1 - math.log(r) for r in (0.5, 1.0, 4.0, 1.25, 0.8, 1.0)) / 6,
        "correction/logprob_gap": (math.log(2) + math.log(4) + 2 * math.log(1.25)) / 6,
        "correction/masked_token_fraction": 1 / 6,
        "correction/masked_sequence_fraction": 0.0,
        "correction/weight_mean": (0.5 + 1 + 2 + 1.25 + 0.8 + 1) / 6,
        "correction/capped_token_fraction": 1 / 6,
    }
    assert metrics == pytest.approx(expected, rel=1e-6)
    dropped = correct(TRAINER, ENGINE, MASK, Correction(seq_geo_mask=(0.99, 1.01)))
    metrics = correction_metrics(dropped.log_ratio, dropped.dropped, dropped.sequences, dropped.dropped_sequences)
    assert metrics["correction/masked_token_fraction"] == 0.5
    assert metrics["correction/masked_sequence_fraction"] == 0.5
    assert "correction/weight_mean" not in metrics


def test_the_diagnostics_of_two_processes_are_those_of_their_tokens_together():
    correction = Correction(weights="sequence", weight_cap=1.5, token_mask=(0.5, 2.0), seq_geo_mask=(0.99, 1.01))
    whole = CorrectionStats()
    whole.add(correct(TRAINER, ENGINE, MASK, correction))
    halves = [CorrectionStats(), CorrectionStats()]  # row A on one process, row B on the other
    for stats, row in zip(halves, (0, 1), strict=True):
        stats.add(correct(TRAINER[row : row + 1], ENGINE[row : row + 1], MASK[row : row + 1], correction))
    # what gather_rows and sum_across_processes give the first process: the other's rows and counts added
    (part,) = halves[1].parts
    other_rows = torch.stack([part.log_ratio, part.dropped.float(), part.weights, part.capped.float()], -1)
    counts = {"sequences": part.sequences, "dropped": part.dropped_sequences}
    together = halves[0].metrics(True, lambda mine: torch.cat([mine, other_rows]),
                                 lambda mine: {k: mine[k] + counts[k] for k in mine})  # fmt: skip
    assert together == pytest.approx(whole.metrics(True), rel=1e-6)
    assert together["correction/masked_sequence_fraction"] == 0.5


# ----- settings ----------------------------------------------------------------------------------

PRESET_FIELDS = {
    "none": Correction(),
    "token-tis": Correction(weights="token", weight_cap=2.0),
    "seq-tis": Correction(weights="sequence", weight_cap=2.0),
    "icepop": Correction(token_mask=(0.5, 2.0)),
    "seq-geo-mask": Correction(seq_geo_mask=(0.99, 1.01)),
    "bypass": Correction(mode="bypass"),
    "bypass-pg": Correction(mode="bypass-pg", weights="token", weight_cap=2.0),
}
"""Each preset resolved with the default ``tis_cap`` (2.0): the table of docs/training.md."""


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_each_preset_resolves_to_its_documented_fields(preset):
    assert GRPOConfig(rollout_correction=RolloutCorrection(preset=preset)).correction == PRESET_FIELDS[preset]


def test_the_default_is_todays_token_tis_and_tis_cap_keeps_working():
    assert GRPOConfig().correction == Correction(weights="token", weight_cap=2.0)
    assert GRPOConfig(tis_cap=1.5).correction == Correction(weights="token", weight_cap=1.5)
    assert GRPOConfig(tis_cap=None).correction == Correction()  # tis_cap: null is off, as before
    assert GRPOConfig(tis_cap=None, rollout_correction=RolloutCorrection(preset="bypass-pg")).correction == Correction(
        mode="bypass-pg"
    )
    # weight_cap, where set, wins over tis_cap
    section = RolloutCorrection(weight_cap=3.0)
    assert GRPOConfig(tis_cap=1.5, rollout_correction=section).correction.weight_cap == 3.0


def test_fields_override_the_preset_and_none_turns_a_mechanism_off(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("rollout_correction: {preset: icepop, token_mask: [0.2, 5], weights: token}\n")
    assert load_config(path).correction == Correction(weights="token", weight_cap=2.0, token_mask=(0.2, 5.0))
    off = load_config(sets=["rollout_correction.preset=seq-geo-mask", "rollout_correction.seq_geo_mask=none"])
    assert off.correction == Correction()
    # a preset's weights give way to bypass (its ratio is the weight); weights set by hand are an error
    assert load_config(sets=["rollout_correction.mode=bypass"]).correction == Correction(mode="bypass")


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"token_mask": [2.0, 2.0]}, "rollout_correction.token_mask"),
        ({"seq_geo_mask": [1.01, 0.99]}, "rollout_correction.seq_geo_mask"),
        ({"seq_mean_mask": [0.5]}, "rollout_correction.seq_mean_mask"),
        ({"seq_any_token_mask": [-1.0, 2.0]}, "rollout_correction.seq_any_token_mask"),
        ({"weight_cap": 0.0}, "rollout_correction.weight_cap"),
        ({"weight_cap": -1.0}, "rollout_correction.weight_cap"),
        ({"preset": "tis"}, "RolloutCorrection.preset"),
        ({"weights": "tokens"}, "RolloutCorrection.weights"),
    ],
)
def test_bad_settings_are_value_errors_naming_the_field(settings, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        RolloutCorrection(**settings)


def test_bad_combinations_are_value_errors_naming_the_field():
    with pytest.raises(ValueError, match=r"rollout_correction\.weights: token with mode: bypass"):
        GRPOConfig(rollout_correction=RolloutCorrection(mode="bypass", weights="token"))
    with pytest.raises(ValueError, match=r"rollout_correction\.weights: token needs a cap"):
        GRPOConfig(tis_cap=None, rollout_correction=RolloutCorrection(weights="token"))
    with pytest.raises(ValueError, match=r"rollout_correction\.preset: must be"):
        load_config(sets=["rollout_correction.preset=tis"])
    with pytest.raises(ValueError, match="tis_cap must be > 0"):
        GRPOConfig(tis_cap=0.0)


# ----- in the update -----------------------------------------------------------------------------


@pytest.mark.parametrize(("preset", "passes"), [("token-tis", 3), ("bypass", 2), ("bypass-pg", 2)])
def test_bypass_skips_the_old_logprob_pass(tmp_path, tiny_model_dir, preset, passes):
    config = grpo_config(tmp_path, tiny_model_dir, ppo_epochs=2, rollout_correction=RolloutCorrection(preset=preset))
    trainer = make_trainer(config)
    samples = make_samples()
    batches = len(trainer.policy.batches(samples))
    counted = count_passes(trainer)
    metrics = trainer.update(samples)
    assert len(counted) == passes * batches  # decoupled: the pass before the step, then one per epoch
    assert metrics["correction/ratio_p50"] > 0 and metrics["grad_norm"] > 0


def test_bypass_clips_the_ratio_against_the_engine(tmp_path, tiny_model_dir):
    """One pass, advantage 1: bypass's surrogate per token is -clip(pi / pi_engine, 0.8, 1.28)
    (the min picks the clipped value above 1.28, the unclipped one below 0.8)."""
    config = grpo_config(tmp_path, tiny_model_dir, rollout_correction=RolloutCorrection(preset="bypass"))
    trainer = make_trainer(config)
    batch = trainer.policy.batches([s for s in make_samples() if s.advantage != 0][:1])[0]
    batch.advantages.fill_(1.0)
    mask = batch.loss_mask[:, 1:].bool()
    with torch.no_grad():
        ratio = (trainer.policy.logprobs(batch)[0] - batch.engine_logprobs[:, 1:]).exp()[mask]
    out = trainer.policy.micro_batch_loss(batch, None, normaliser=float(mask.sum()))
    assert out["pg_loss"] == pytest.approx(-float(torch.where(ratio > 1.28, 1.28, ratio).mean()), rel=1e-5)
    assert out["clip_fraction"] == pytest.approx(float((ratio > 1.28).float().mean()))


PACKING_CORRECTION = RolloutCorrection(preset="seq-tis", weight_cap=5.0, seq_geo_mask=[0.5, 1.5],
                                       seq_any_token_mask=[0.2, 6.0], token_mask=[0.3, 3.0])  # fmt: skip
"""Every per-sequence reduction at once, with bounds that keep some of make_samples' sequences."""


def test_packed_and_padded_micro_batches_give_the_same_weights_masks_and_metrics(tmp_path, tiny_model_dir):
    samples = make_samples(seed=2)
    weights, updates = [], []
    for packing in (True, False):
        config = grpo_config(tmp_path, tiny_model_dir, packing=packing, micro_batch_size=3,
                             rollout_correction=PACKING_CORRECTION)  # fmt: skip
        trainer = make_trainer(config)
        batches = trainer.policy.batches(samples)
        assert all(b.packed == packing for b in batches) and len(batches) > 1
        with torch.no_grad():
            weights.append([
                correct(trainer.policy.logprobs(b)[0], b.engine_logprobs[:, 1:], b.loss_mask[:, 1:],
                        config.correction).loss_weights
                for b in batches
            ])  # fmt: skip
        updates.append(trainer.update(samples))
    for packed, padded in zip(*weights, strict=True):
        torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-6)
    for key, value in updates[1].items():
        if key.startswith("correction/"):
            assert updates[0][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    assert 0 < updates[1]["correction/masked_sequence_fraction"] < 1
    assert updates[0]["loss"] == pytest.approx(updates[1]["loss"], rel=1e-5)


def test_async_rl_with_lora_and_bypass_trains_and_logs_the_correction(tmp_path, tiny_model_dir):
    section = RolloutCorrection(preset="bypass", token_mask=[0.5, 2.0])
    trainer = GRPOTrainer(small_run(tmp_path, tiny_model_dir, lora=LoRAConfig(rank=4, alpha=8.0), async_rl=True,
                                    max_staleness=1, checkpoint_every=0, steps=2, ppo_epochs=2,
                                    rollout_correction=section), reward_fn=digit_share)  # fmt: skip
    history = asyncio.run(trainer.train())
    assert [m["step"] for m in history] == [1, 2]
    lines = [orjson.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_bytes().splitlines()]
    for metrics in lines:
        p5, p50, p95, top = (metrics[f"correction/ratio_{q}"] for q in ("p5", "p50", "p95", "max"))
        assert 0 < p5 <= p50 <= p95 <= top
        assert metrics["correction/kl_k3"] >= 0 and metrics["correction/logprob_gap"] >= 0
        assert 0 <= metrics["correction/masked_token_fraction"] <= 1
        assert "train/correction/ratio_p50" not in metrics


# ----- the slow suite: two steps of rallyrl train with each preset ------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_rallyrl_train_runs_two_steps_with_each_preset(tmp_path, preset):
    out = tmp_path / "run"
    done = run_cli("train", "--steps", "2", "--prompts-per-step", "2", "-n", "2", "--out", str(out), "--no-progress",
                   "--set", f"rollout_correction.preset={preset}", "--set", "ppo_epochs=2",
                   "--set", "checkpoint_every=0")  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = [orjson.loads(line) for line in (out / "metrics.jsonl").read_bytes().splitlines()]
    assert [m["step"] for m in lines] == [1, 2]
    for metrics in lines:
        assert metrics["train/skipped_update"] == 1 or metrics["correction/ratio_p50"] > 0
        assert ("correction/weight_mean" in metrics) == (PRESET_FIELDS[preset].weights != "none")
