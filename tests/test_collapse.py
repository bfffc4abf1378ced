"""The collapse warning on synthetic metric histories: quiet on a healthy run, once on a collapsing one,
naming the cause that holds first (trainer/collapse.py)."""

from __future__ import annotations

import math

import pytest

from trainer.collapse import CollapseWatch, first_collapse, grad_norm_ratio


def steps(**series: list[float]) -> list[dict[str, float]]:
    """Step metrics from per-key series of equal length (steps numbered from 1)."""
    lengths = {len(values) for values in series.values()}
    assert len(lengths) == 1
    return [{"step": i + 1, **{key.replace("__", "/"): values[i] for key, values in series.items()}}
            for i in range(lengths.pop())]  # fmt: skip


def healthy(n: int = 20) -> dict[str, list[float]]:
    """A run that learns: accuracy up, entropy down slowly, few malformed calls, steady gradients."""
    wobble = [0.01 * ((i * 7) % 5 - 2) for i in range(n)]
    return {
        "rollout__accuracy": [min(0.2 + 0.03 * i + w, 1.0) for i, w in enumerate(wobble)],
        "rollout__reward_mean": [min(0.2 + 0.03 * i + w, 1.0) for i, w in enumerate(wobble)],
        "rollout__malformed_call_share": [0.05 + w for w in wobble],
        "rollout__tool_error_share": [0.03 + w / 2 for w in wobble],
        "train__entropy": [0.5 - 0.01 * i for i in range(n)],
        "train__grad_norm": [0.4 + w for w in wobble],
    }


def watch_all(history: list[dict[str, float]]) -> tuple[CollapseWatch, list[str]]:
    watch = CollapseWatch()
    warnings = [w for metrics in history if (w := watch.observe(metrics)) is not None]
    return watch, warnings


def test_a_healthy_run_is_never_warned_about():
    history = steps(**healthy())
    _, warnings = watch_all(history)
    assert warnings == []
    assert [m["train/collapse_warning"] for m in history] == [0.0] * 20
    assert first_collapse(history) is None


def test_the_tool_call_format_breaking_is_warned_about_once_naming_the_malformed_calls():
    series = healthy(12)
    series["rollout__malformed_call_share"] = [0.05, 0.05, 0.06, 0.08, 0.15, 0.25, 0.35, 0.42, 0.45, 0.5, 0.5, 0.5]
    series["rollout__accuracy"] = [0.3, 0.32, 0.3, 0.28, 0.2, 0.1, 0.05, 0.0, 0.0, 0.0, 0.0, 0.0]
    history = steps(**series)
    _, warnings = watch_all(history)
    assert len(warnings) == 1
    (warning,) = warnings
    assert warning.startswith("collapse warning at step 7: tool-call format breaking: malformed tool calls 5% -> 35%")
    assert "rollout/accuracy 0.3 -> 0.05" in warning
    assert "lower lr" in warning and "kl_beta" in warning
    flags = [m["train/collapse_warning"] for m in history]
    assert flags == [0.0] * 6 + [1.0] * 6  # from the warning's step on
    assert first_collapse(history).cause == "format"


def test_one_noisy_step_is_not_a_collapse():
    series = healthy(10)
    series["rollout__malformed_call_share"][5] = 0.6
    series["train__grad_norm"][6] = 8.0
    series["rollout__accuracy"][7] = 0.0
    _, warnings = watch_all(steps(**series))
    assert warnings == []


@pytest.mark.parametrize(
    ("key", "values", "cause", "words"),
    [
        ("rollout__tool_error_share", [0.02, 0.03, 0.02, 0.05, 0.3, 0.4], "tool calls failing", "failing 2% -> 40%"),
        ("train__entropy", [0.5, 0.48, 0.5, 0.3, 0.03, 0.02], "entropy collapse", "train/entropy 0.5 -> 0.02"),
        ("train__grad_norm", [0.4, 0.41, 0.39, 0.4, 4.0, 6.0], "gradient spikes", "train/grad_norm_ratio 10.0x"),
        ("rollout__accuracy", [0.3, 0.4, 0.5, 0.45, 0.02, 0.0], "reward collapse", "rollout/accuracy 0.5 (best step)"),
    ],
)
def test_each_signal_names_its_cause(key, values, cause, words):
    series = healthy(6)
    series[key] = values
    _, warnings = watch_all(steps(**series))
    assert len(warnings) == 1
    assert warnings[0].startswith(f"collapse warning at step 6: {cause}: ")
    assert words in warnings[0]


def test_the_reward_stands_in_for_accuracy_when_nothing_is_graded():
    series = healthy(6)
    series["rollout__accuracy"] = [math.nan] * 6
    series["rollout__reward_mean"] = [0.6, 0.7, 0.8, 0.7, 0.05, 0.01]
    _, warnings = watch_all(steps(**series))
    assert len(warnings) == 1 and "reward collapse: rollout/reward_mean 0.8 (best step) -> 0.01" in warnings[0]


def test_the_malformed_calls_are_named_before_the_accuracy_they_cost():
    series = healthy(6)
    series["rollout__malformed_call_share"] = [0.05, 0.05, 0.05, 0.1, 0.4, 0.5]
    series["rollout__accuracy"] = [0.4, 0.5, 0.5, 0.3, 0.0, 0.0]
    _, warnings = watch_all(steps(**series))
    assert "tool-call format breaking" in warnings[0]


def test_a_resumed_run_that_warned_already_stays_quiet_and_keeps_its_flag():
    series = healthy(10)
    series["rollout__malformed_call_share"] = [0.05, 0.05, 0.05, 0.1, 0.3, 0.4, 0.5, 0.5, 0.5, 0.5]
    history = steps(**series)
    _, warnings = watch_all(history[:6])
    assert len(warnings) == 1
    resumed = CollapseWatch()
    resumed.replay(history[:6])
    assert [resumed.observe(m) for m in history[6:]] == [None] * 4
    assert all(m["train/collapse_warning"] == 1.0 for m in history[6:])


def test_the_gradient_norm_ratio_is_over_the_median_of_the_steps_that_updated():
    before = [{"train/grad_norm": n} for n in (1.0, 2.0, 100.0)] + [{"train/grad_norm": 0.0, "train/skipped_update": 1}]
    assert grad_norm_ratio(before, 4.0) == 2.0  # median 2.0 of the three that updated
    assert math.isnan(grad_norm_ratio(before[:2], 4.0))  # fewer than 3 steps before
    assert math.isnan(grad_norm_ratio(before, None))  # a step that did not update
    many = [{"train/grad_norm": 1.0}] * 10 + [{"train/grad_norm": 9.0}] * 3
    assert grad_norm_ratio(many, 9.0, window=10) == 9.0  # only the last 10: seven 1.0s, three 9.0s


REPRODUCED = [  # `rallyrl train --lr 2e-3 --set tis_cap=null --set warmup_steps=0 --seed 1`, its first six steps
    (0.0189, 0.2596, 0.1672, 0.2889),
    (0.4288, 0.1576, 0.0586, 0.4023),
    (0.1845, 0.2907, 0.0469, 0.3484),
    (0.3615, 0.0820, 0.0945, 0.4327),
    (0.4489, 0.0215, 0.0852, 0.8854),
    (0.6080, 0.0078, 0.1117, 0.5575),
]


def test_a_format_that_breaks_from_the_first_update_is_named_though_it_rose_within_the_early_steps():
    history = [
        {"step": i + 1, "rollout/malformed_call_share": malformed, "rollout/accuracy": accuracy,
         "train/entropy": entropy, "train/grad_norm": norm}
        for i, (malformed, accuracy, entropy, norm) in enumerate(REPRODUCED)
    ]  # fmt: skip
    found = first_collapse(history)
    assert found is not None and found.step == 5 and found.cause == "format"
    assert "malformed tool calls 2% -> 45%" in found.message and "warmup_steps" in found.message


def reasoning_gym_history(pairs: list[tuple[float, float]]) -> list[dict]:
    return [{"step": i + 1, "rollout/malformed_call_share": m, "rollout/accuracy": a} for i, (m, a) in enumerate(pairs)]


def test_a_share_is_measured_against_the_start_models_own():
    """Two reasoning-gym runs at twice the default rate (docs/training.md, "Seeds"): seed 1's format breaks
    (8 % -> 28 %, accuracy 0.36 -> 0.12); seed 2 starts at 11 % and wanders to 23 % while its accuracy climbs."""
    broke = reasoning_gym_history([
        (0.077, 0.064), (0.119, 0.113), (0.062, 0.133), (0.11, 0.203), (0.158, 0.215),
        (0.215, 0.355), (0.116, 0.277), (0.266, 0.236), (0.278, 0.115), (0.257, 0.232),
    ])  # fmt: skip
    found = first_collapse(broke)
    assert found is not None and found.step == 9 and found.cause == "format"
    held = reasoning_gym_history([
        (0.11, 0.104), (0.104, 0.109), (0.018, 0.227), (0.105, 0.207), (0.098, 0.232), (0.13, 0.258),
        (0.127, 0.214), (0.178, 0.208), (0.171, 0.215), (0.232, 0.229), (0.214, 0.266), (0.188, 0.254),
    ])  # fmt: skip
    assert first_collapse(held) is None
