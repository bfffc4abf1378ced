"""``rallyrl rollout`` with environments that hang (issue 50, items 1 and 5), as a real subprocess: the command
exits once its work is done, with exit 3 and one line naming what is still stuck; a start check whose reset
hangs is one line; Ctrl-C mid-call exits 130 and every environment is closed once its call returns."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from data.env_tasks import make_env_records

REPO = Path(__file__).resolve().parents[1]
HOSTILE = "tests.hostile_envs"


def write_inputs(tmp_path: Path, groups: list[tuple[str, int, dict[str, Any]]], **config: Any) -> list[str]:
    """Records of ``(class, how many, env_kwargs)`` groups, the interaction config; the command's arguments."""
    log = tmp_path / "log"
    lines = []
    for name, count, kwargs in groups:
        for record in make_env_records(f"{HOSTILE}:{name}", count, len(lines), env_kwargs={"log": str(log), **kwargs}):
            record.index = len(lines)
            lines.append(orjson.dumps(record.to_dict()))
    (tmp_path / "records.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    entry = {"name": "env", "class_name": "rollout.envs.interaction:EnvironmentInteraction",
             "config": {"check": False, "reset_timeout_s": 1.5, "step_timeout_s": 1.5, **config}}  # fmt: skip
    (tmp_path / "interactions.yaml").write_text(yaml.safe_dump({"interaction": [entry]}))
    inputs = ["--data", str(tmp_path / "records.jsonl"), "--interactions", str(tmp_path / "interactions.yaml")]
    return ["rollout", *inputs, "--out", str(tmp_path / "out.jsonl"), "--no-progress",
            "--max-new-tokens", "16", "--max-turns", "2"]  # fmt: skip


def rallyrl(*args: str) -> list[str]:
    path = shutil.which("rallyrl")
    if path is None:
        pytest.fail("the rallyrl command is not installed: run `pip install -e .[dev]`")
    return [path, *args]


def events(log: Path, event: str) -> int:
    return sum(1 for line in log.read_text().splitlines() if line.split()[0] == event) if log.exists() else 0


def test_the_command_exits_after_calls_that_never_return_naming_them_with_exit_3(tmp_path):
    args = write_inputs(tmp_path, [("HangingReset", 2, {}), ("HangingClose", 1, {}), ("Healthy", 3, {})])
    started = time.monotonic()
    done = subprocess.run(rallyrl(*args), cwd=REPO, capture_output=True, text=True, timeout=240)
    took = time.monotonic() - started
    assert done.returncode == 3, done.stderr[-3000:]
    assert took < 120  # (the model loads in seconds; the resets would sleep an hour)
    stuck = [line for line in done.stderr.splitlines() if "stuck:" in line]
    message = " ".join(done.stderr.split())
    assert len(stuck) == 1 and "Traceback" not in done.stderr
    assert (
        f"3 call(s) into environments or tools never returned and are left running as the command exits: "
        f"environment {HOSTILE}:HangingClose: 1 close; environment {HOSTILE}:HangingReset: 2 reset"
    ) in message
    out = [orjson.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(out) == 6  # every trajectory written
    assert sum("reset timed out after 1.5 s" in (line["error"] or "") for line in out) == 2


def test_a_start_check_whose_reset_hangs_is_one_line_and_the_command_exits(tmp_path):
    args = write_inputs(tmp_path, [("Healthy", 1, {})], env=f"{HOSTILE}:HangingReset", check=True)
    done = subprocess.run(rallyrl(*args), cwd=REPO, capture_output=True, text=True, timeout=240)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert f"environment {HOSTILE}:HangingReset failed its start check (one reset): environment " \
        f"{HOSTILE}:HangingReset: reset timed out after 1.5 s" in " ".join(done.stderr.split())  # fmt: skip


@pytest.mark.skipif(sys.platform != "linux", reason="signals as on Linux")
def test_ctrl_c_mid_reset_exits_130_and_every_environment_is_closed_once_its_call_returns(tmp_path):
    args = write_inputs(tmp_path, [("Healthy", 4, {"reset_s": 2.5})], reset_timeout_s=20)
    log = tmp_path / "log"
    process = subprocess.Popen(rallyrl(*args), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + 180
        while events(log, "reset") < 4 and time.monotonic() < end and process.poll() is None:
            time.sleep(0.05)
        assert events(log, "reset") == 4
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 130, stderr[-3000:]
    assert "interrupted: 0 of 4 trajectories finished" in stderr
    assert events(log, "made") == events(log, "close") == 4  # closed on their threads as the resets returned
    assert "stuck:" not in stderr
