"""``rallyrl show`` of a run's metrics.jsonl: a table and a PNG of its diagnostics, with the collapse
warning where the run had one (trainer/metrics_show.py); trajectory files still show as trajectories."""

from __future__ import annotations

import orjson
from conftest import run_cli
from matplotlib.image import imread
from rich.console import Console

from trainer.collapse import CollapseWatch
from trainer.metrics_show import diagnostic_panels, is_metrics_file, show_metrics

MALFORMED = [0.05, 0.05, 0.06, 0.08, 0.15, 0.25, 0.35, 0.42]
ACCURACY = [0.3, 0.32, 0.3, 0.28, 0.2, 0.1, 0.05, 0.0]


def write_metrics(path, corrections: bool = True) -> list[dict]:
    """A run whose tool-call format breaks at step 7, logged as the trainer logs it."""
    watch, history = CollapseWatch(), []
    for i, (malformed, accuracy) in enumerate(zip(MALFORMED, ACCURACY, strict=True)):
        metrics = {"step": i + 1, "rollout/accuracy": accuracy, "rollout/reward_mean": accuracy,
                   "rollout/malformed_call_share": malformed, "rollout/tool_error_share": 0.02,
                   "train/entropy": 0.4 + 0.02 * i, "train/grad_norm": 0.5 + 0.05 * i}  # fmt: skip
        if corrections:
            metrics |= {"correction/ratio_p95": 1.0 + 0.01 * i, "correction/kl_k3": 0.001 * i}
        watch.observe(metrics)
        history.append(metrics)
    path.write_bytes(b"".join(orjson.dumps(m) + b"\n" for m in history))
    return history


def text_of(renderable) -> str:
    console = Console(width=200, record=True)
    console.print(renderable)
    return console.export_text()


def test_the_cli_shows_a_metrics_files_diagnostics_and_writes_the_plot_beside_it(tmp_path):
    write_metrics(tmp_path / "metrics.jsonl")
    done = run_cli("show", str(tmp_path / "metrics.jsonl"))
    assert done.returncode == 0, done.stderr
    out = " ".join(done.stdout.replace("│", " ").split())  # (the table's columns as spaces)
    assert "rollout/malformed_call_share 0.05 0.42 0.05 0.42" in out  # first, last, min, max
    assert "collapse warning at step 7: tool-call format breaking: malformed tool calls 5% -> 35%" in out
    assert "correction/ratio_p95" in out
    height, width, _ = imread(tmp_path / "metrics-diagnostics.png").shape
    assert width > 1000 and height > 700  # three columns, three rows


def test_the_panels_are_the_diagnostics_the_file_has_then_each_correction_metric(tmp_path):
    history = write_metrics(tmp_path / "metrics.jsonl")
    titles = [title for title, _ in diagnostic_panels(history)]
    assert titles == ["accuracy and reward", "malformed tool calls (share of calls)",
                      "tool errors (share of calls run)", "entropy", "gradient norm",
                      "gradient norm / median of the 10 before",
                      "correction/kl_k3", "correction/ratio_p95"]  # fmt: skip
    assert [t for t, _ in diagnostic_panels(write_metrics(tmp_path / "b.jsonl", corrections=False))] == titles[:6]


def test_a_healthy_run_shows_no_collapse_warning_and_the_plot_goes_where_asked(tmp_path):
    history = write_metrics(tmp_path / "metrics.jsonl")
    healthy = [m | {"rollout/malformed_call_share": 0.05, "train/collapse_warning": 0.0} for m in history]
    for m in healthy:
        m["rollout/accuracy"] = 0.3
    (tmp_path / "metrics.jsonl").write_bytes(b"".join(orjson.dumps(m) + b"\n" for m in healthy))
    text = text_of(show_metrics(tmp_path / "metrics.jsonl", tmp_path / "plots" / "d.png"))
    assert "no collapse warning" in text
    assert (tmp_path / "plots" / "d.png").stat().st_size > 0


def test_a_metrics_file_is_told_from_a_trajectory_file(tmp_path):
    write_metrics(tmp_path / "metrics.jsonl")
    (tmp_path / "rollouts.jsonl").write_bytes(orjson.dumps({"request_id": "r0", "step": 1}) + b"\n")
    assert is_metrics_file(tmp_path / "metrics.jsonl")
    assert not is_metrics_file(tmp_path / "rollouts.jsonl")
    assert not is_metrics_file(tmp_path / "missing.jsonl")
