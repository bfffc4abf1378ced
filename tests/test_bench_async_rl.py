"""``benchmarks/async_rl.py``: the figures it reads from metrics lines, worked out by hand; the
slow calculator's seeded latencies; and a tiny end-to-end run of both modes whose report must be
well formed (the figures themselves are the benchmark's business, not the suite's)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import orjson
import pytest
import yaml

from benchmarks import async_rl
from benchmarks.async_rl import REQUIRED_KEYS, Settings, run_values
from benchmarks.async_rl_figures import (
    add_time_to_sync_final,
    dropped_groups,
    elapsed_times,
    idle_fractions,
    observed_elapsed,
    step_walls,
    time_to_accuracy,
    token_weighted_staleness,
)
from benchmarks.async_rl_report import clock_warning
from benchmarks.slow_tools import SlowCalculator
from data.config_tree import build
from tools.registry import load_tools
from trainer.config import GRPOConfig


def point(step: int, elapsed: float | None, accuracy: float | None) -> dict:
    return {"step": step, "elapsed_s": elapsed, "accuracy": accuracy}


def test_time_to_accuracy_is_the_wall_time_of_the_first_point_that_reaches_it():
    curve = [point(0, 0.0, 0.2), point(5, 10.0, 0.5), point(10, 20.0, 0.4), point(15, 30.0, 0.6)]
    assert time_to_accuracy(curve, 0.5) == 10.0
    assert time_to_accuracy(list(reversed(curve)), 0.55) == 30.0  # in step order, whatever the list's
    assert time_to_accuracy(curve, 0.2) == 0.0  # the initial model already reaches it
    assert time_to_accuracy(curve, 0.7) is None
    assert time_to_accuracy(curve, None) is None  # no sync run to compare with
    assert time_to_accuracy([point(0, 0.0, 0.1), point(5, None, 0.9)], 0.5) is None  # no time known


def test_staleness_is_the_mean_over_tokens_not_over_steps():
    lines = [
        {"step": 1, "rollout/staleness_mean": 0.0, "rollout/staleness_max": 0, "rollout/generated_tokens": 300},
        {"step": 2, "rollout/staleness_mean": 1.0, "rollout/staleness_max": 2, "rollout/generated_tokens": 100},
    ]
    assert token_weighted_staleness(lines) == (0.25, 2)
    assert token_weighted_staleness([]) == (None, None)


def test_idle_fractions_are_weighted_by_each_steps_wall():
    lines = [
        {"step": 1, "time/step_wall_s": 1.0, "time/engine_idle_fraction": 0.5, "time/trainer_idle_fraction": 1.0},
        {"step": 2, "time/step_wall_s": 3.0, "time/engine_idle_fraction": 0.1, "time/trainer_idle_fraction": 0.0},
    ]
    walls = step_walls(lines, None)
    assert walls == [1.0, 3.0]
    assert idle_fractions(lines, "async", walls) == pytest.approx((0.2, 0.25))


def test_elapsed_time_is_the_trainers_own_when_it_writes_it():
    lines = [{"step": 1, "time/elapsed_s": 2.0, "time/rollout_s": 9.0, "time/update_s": 9.0},
             {"step": 2, "time/elapsed_s": 5.0, "time/rollout_s": 9.0, "time/update_s": 9.0}]  # fmt: skip
    assert elapsed_times(lines, "sync") == ([2.0, 5.0], "time/elapsed_s")
    assert step_walls(lines, [2.0, 5.0]) == [2.0, 3.0]


def test_the_observed_clock_counts_from_the_first_steps_start_and_keeps_the_time_between_steps():
    lines = [{"step": 1, "time/step_wall_s": 2.0}, {"step": 2, "time/step_wall_s": 3.0}]
    arrivals = {1: 7.0, 2: 11.0}  # 1 s between the steps' lines and walls: a checkpoint save, say
    assert observed_elapsed(lines, arrivals, step_walls(lines, None)) == [2.0, 6.0]
    assert observed_elapsed(lines, {1: 7.0}, step_walls(lines, None)) is None  # a line never seen
    assert clock_warning("b/async", {"wall_s": 5.0, "wall_observed_s": 6.0}) is None  # within 1 s
    assert "60.0 s" in clock_warning("b/async", {"wall_s": 50.0, "wall_observed_s": 60.0})


def test_a_sync_run_without_time_keys_falls_back_to_its_phases_which_run_one_after_another():
    lines = [{"step": 1, "time/rollout_s": 3.0, "time/update_s": 1.0, "time/sync_s": 0.0},
             {"step": 2, "time/rollout_s": 1.0, "time/update_s": 0.5, "time/sync_s": 0.5}]  # fmt: skip
    elapsed, source = elapsed_times(lines, "sync")
    assert (elapsed, source) == ([4.0, 6.0], "phase sum")
    engine, trainer = idle_fractions(lines, "sync", step_walls(lines, elapsed))
    assert engine is None  # tool waits inside the rollout phase cannot be seen in phase times
    assert trainer == pytest.approx((0.75 * 4 + 0.5 * 2) / 6)
    assert dropped_groups(lines, "sync") == 0


def test_an_async_run_without_time_keys_has_no_elapsed_time_rather_than_a_wrong_one():
    lines = [{"step": 1, "time/rollout_s": 3.0, "time/update_s": 1.0}]
    assert elapsed_times(lines, "async") == (None, "missing")
    assert idle_fractions(lines, "async", step_walls(lines, None)) == (None, None)
    assert dropped_groups(lines, "async") is None
    assert dropped_groups([{"step": 1, "rollout/dropped": 2}, {"step": 2, "rollout/dropped": 1}], "async") == 3


def test_both_modes_are_timed_to_the_sync_runs_final_accuracy():
    results = {
        "sync": {"wall_s": 40.0, "final_accuracy": 0.5, "final_accuracy_stderr": 0.03,
                 "curve": [point(0, 0.0, 0.2), point(5, 20.0, 0.5), point(10, 40.0, 0.5)]},
        "async": {"wall_s": 20.0, "final_accuracy": 0.54, "final_accuracy_stderr": 0.04,
                  "curve": [point(0, 0.0, 0.2), point(5, 8.0, 0.45), point(10, 16.0, 0.54)]},
    }  # fmt: skip
    ratios = add_time_to_sync_final(results)
    assert results["sync"]["time_to_sync_final_accuracy_s"] == 20.0
    assert results["async"]["time_to_sync_final_accuracy_s"] == 16.0
    assert ratios["async_wall_over_sync_wall"] == 0.5
    assert ratios["async_time_to_sync_final_over_sync_wall"] == 0.4
    assert ratios["final_accuracy_async_minus_sync"] == pytest.approx(0.04)
    assert ratios["final_accuracy_diff_stderr"] == pytest.approx(0.05)


def test_the_slow_calculator_waits_the_same_latency_for_the_same_request_and_call():
    tool = SlowCalculator({"median_s": 0.3, "sigma": 1.0, "seed": 7})
    same = SlowCalculator({"median_s": 0.3, "sigma": 1.0, "seed": 7})
    assert tool.latency_s(3, 1) == same.latency_s(3, 1)
    assert len({tool.latency_s(request, call) for request in range(20) for call in range(3)}) == 60
    draws = sorted(tool.latency_s(request, 0) for request in range(4001))
    assert draws[2000] == pytest.approx(0.3, rel=0.1)  # the median
    assert tool.name == "calculator"


async def test_the_slow_calculator_numbers_requests_by_creation_and_answers_like_the_calculator():
    tool = SlowCalculator({"median_s": 0.2, "sigma": 0.0})
    first, second = await tool.create(), await tool.create()
    assert (tool.instance(first)["request"], tool.instance(second)["request"]) == (0, 1)
    start = time.monotonic()
    responses = await asyncio.gather(tool.execute(first, {"expression": "12*(3+4)"}), tool.execute(second, {}))
    assert 0.2 <= time.monotonic() - start < 0.35  # the waits overlap: asyncio.sleep, not a blocking one
    assert responses[0].text == "84" and responses[1].text.startswith("Error: ")
    assert tool.instance(first)["calls"] == 1


def test_only_workload_b_runs_the_slow_tool_and_the_benchmark_settings_win(tmp_path):
    settings = Settings(steps=3, seed=5, max_staleness=2, checkpoint_every=1, eval_prompts=8,
                        sets=("prompts_per_step=2", "rollout.max_turns=2"))  # fmt: skip
    a = build(GRPOConfig, run_values("a", "sync", settings, tmp_path / "a"))
    b = build(GRPOConfig, run_values("b", "async", settings, tmp_path / "b"))
    assert a.tools is None and not a.async_rl and b.async_rl and b.max_staleness == 2
    assert (a.steps, a.seed, a.prompts_per_step, a.rollout.max_turns) == (3, 5, 2, 2)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "slow_tools.yaml").write_text(async_rl.slow_tools_yaml(5))
    tool = load_tools(b.tools)["calculator"]
    assert isinstance(tool, SlowCalculator) and tool.seed == 5 and tool.latency.median == 0.3


def test_set_may_not_change_what_the_benchmark_sets_itself(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["async_rl", "--set", "async_rl=true"])
    with pytest.raises(SystemExit) as exited:
        async_rl.main()
    assert exited.value.code == 2 and "the benchmark sets it" in capsys.readouterr().err


def test_a_directory_that_is_not_a_run_of_the_benchmark_is_never_overwritten(tmp_path, monkeypatch, capsys):
    (tmp_path / "b-async").mkdir()
    (tmp_path / "b-async" / "notes.txt").write_text("mine")
    monkeypatch.setattr(sys, "argv", ["async_rl", "--workloads", "b", "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as exited:
        async_rl.main()
    assert exited.value.code == 2 and "not a run of this benchmark" in capsys.readouterr().err
    assert (tmp_path / "b-async" / "notes.txt").read_text() == "mine"


@pytest.mark.slow
def test_a_tiny_run_of_both_modes_gives_a_well_formed_report(tmp_path):
    json_path, plot_path = tmp_path / "report.json", tmp_path / "curves.png"
    command = [sys.executable, "-m", "benchmarks.async_rl", "--steps", "2", "--workloads", "b", "--checkpoint-every",
               "1", "--eval-prompts", "8", "--set", "prompts_per_step=2", "--set", "samples_per_prompt=4",
               "--out", str(tmp_path / "runs"), "--json", str(json_path), "--plot", str(plot_path)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "load average at start" in done.stdout and "workload b" in done.stdout
    report = orjson.loads(json_path.read_bytes())
    assert list(report["results"]) == ["b"] and list(report["results"]["b"]) == ["sync", "async"]
    for mode, result in report["results"]["b"].items():
        assert set(REQUIRED_KEYS) <= set(result), mode
        assert result["error"] is None and result["steps"] == 2
        assert result["elapsed_source"] == "time/elapsed_s"
        assert 0 < result["wall_s"] < result["process_wall_s"]
        assert result["wall_s"] - 0.2 <= result["wall_observed_s"] < result["process_wall_s"]  # polled every 0.1 s
        for key in ("engine_idle_fraction", "trainer_idle_fraction", "final_accuracy"):
            assert 0 <= result[key] <= 1, (mode, key)
        assert result["dropped"] >= 0
        assert [p["step"] for p in result["curve"]] == [0, 1, 2]
        assert result["curve"][0]["elapsed_s"] == 0.0 and result["curve"][-1]["elapsed_s"] == result["wall_s"]
        run = yaml.safe_load((tmp_path / "runs" / f"b-{mode}" / "train.yaml").read_text())
        assert run["async_rl"] is (mode == "async") and run["tools"].endswith("slow_tools.yaml")
    sync, asynchronous = report["results"]["b"]["sync"], report["results"]["b"]["async"]
    assert sync["staleness_mean"] == 0 and sync["staleness_max"] == 0 and sync["dropped"] == 0
    assert 0 <= asynchronous["staleness_mean"] <= asynchronous["staleness_max"] <= 1  # max_staleness 1
    assert sync["time_to_sync_final_accuracy_s"] <= sync["wall_s"]  # it reaches its own final accuracy
    assert sync["curve"][0]["accuracy"] == asynchronous["curve"][0]["accuracy"]  # one initial model
    assert set(report["ratios"]["b"]) >= {"async_wall_over_sync_wall", "async_time_to_sync_final_over_sync_wall"}
    assert plot_path.stat().st_size > 10_000


def test_a_training_run_past_its_deadline_is_stopped_and_reported_failed(tmp_path, monkeypatch):
    never_ends = tmp_path / "python"
    never_ends.write_text("#!/bin/sh\nexec sleep 300\n")
    never_ends.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(never_ends))  # (run_training starts `python -m cli train`)
    started = time.monotonic()
    training = async_rl.run_training(tmp_path, timeout_s=0.5)
    assert time.monotonic() - started < 5
    assert training.error is not None and "did not finish within 0.5 s (--run-timeout-s); stopped" in training.error
