"""``rallyrl rollout`` exits 1 when the share of its trajectories that ended in an error reaches
``fail_at_error_rate`` (default: all of them), naming the first error; every trajectory is still
written (issue 42, class 8: a rollout whose every request failed used to exit 0)."""

from __future__ import annotations

import orjson

from data.tiny_model import EMBEDDED_MODEL
from rollout.serve.processes import serve_processes
from tests.conftest import run_cli

NO_RETRIES = ("--set", "engine.http.max_retries=0", "--set", "engine.http.backoff_s=0.01")


def test_a_rollout_whose_every_request_failed_exits_1_naming_the_first_error(tmp_path):
    out = tmp_path / "out.jsonl"
    with serve_processes(EMBEDDED_MODEL, tmp_path, 1, "--fault-error-rate", "1.0") as (server,):
        done = run_cli("rollout", "--engine-url", server.url, "--task", "calc", "--num-prompts", "2", "-n", "2",
                       "--out", str(out), "--no-progress", *NO_RETRIES, timeout=300)  # fmt: skip
        lenient = run_cli("rollout", "--engine-url", server.url, "--task", "calc", "--num-prompts", "1", "-n", "1",
                          "--out", str(tmp_path / "lenient.jsonl"), "--no-progress", *NO_RETRIES,
                          "--set", "fail_at_error_rate=1.0", timeout=300)  # fmt: skip
    assert done.returncode == 1, done.stderr[-2000:]
    message = " ".join(done.stderr.split())
    assert "error: 100% of the trajectories ended in an error (fail_at_error_rate 1); the first: " in message
    assert "the first: record 0 (sample 0): " in message
    assert "HTTP 500" in message and "Traceback" not in done.stderr
    lines = [orjson.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 4 and all(line["finish_reason"] == "error" for line in lines)  # all kept
    assert lenient.returncode == 1


def test_a_rollout_without_errors_exits_0_and_a_share_out_of_range_is_refused(tmp_path):
    bad = run_cli("rollout", "--task", "calc", "--num-prompts", "1", "--set", "fail_at_error_rate=0", timeout=120)
    assert bad.returncode == 2 and "fail_at_error_rate must be a share in (0, 1], got 0" in " ".join(bad.stderr.split())
    fine = run_cli("rollout", "--task", "calc", "--num-prompts", "2", "-n", "1", "--out", str(tmp_path / "o.jsonl"),
                   "--no-progress", "--set", "fail_at_error_rate=0.5", timeout=300)  # fmt: skip
    assert fine.returncode == 0, fine.stderr[-2000:]
