"""Ctrl-C during ``rallyrl rollout`` keeps every finished trajectory and ``--resume`` runs the
rest; SIGKILL during ``rallyrl train`` and ``--resume`` continue from the last checkpoint."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import time
from pathlib import Path

import orjson
import pytest
import yaml

from rollout.output_file import read_finished
from tests.conftest import run_cli
from tests.servers import rallyrl_command

ROLLOUT = ["rollout", "--num-prompts", "64", "-n", "4", "--max-concurrency", "32", "--max-turns", "3",
           "--max-new-tokens", "96", "--no-progress"]  # fmt: skip


def pairs(path: Path) -> list[tuple[int, int]]:
    return [(d["prompt_index"], d["sample_index"]) for d in map(orjson.loads, path.read_bytes().splitlines())]


def interruptible() -> None:
    """In the child: Ctrl-C's default action, even when the suite runs as a background job (a shell
    without job control starts those with SIGINT ignored, and children inherit that)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def start_train(tmp_path: Path, **settings) -> tuple[subprocess.Popen[str], Path, Path]:
    """``rallyrl train --config`` in its own session: 4 prompts x 4 samples a step, a checkpoint
    every step, plus ``settings``; returns the process, its config file and its run directory."""
    run, config = tmp_path / "run", tmp_path / "grpo.yaml"
    values = {"prompts_per_step": 4, "samples_per_prompt": 4, "checkpoint_every": 1, "out": str(run),
              "progress": False, **settings}  # fmt: skip
    config.write_text(yaml.safe_dump(values))
    process = subprocess.Popen(
        [*rallyrl_command(), "train", "--config", str(config)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
        preexec_fn=interruptible,
    )  # fmt: skip
    return process, config, run


@pytest.mark.slow
def test_ctrl_c_keeps_finished_trajectories_and_resume_runs_the_rest(tmp_path):
    out = tmp_path / "rollouts.jsonl"
    # 8 in flight: trajectories finish a few at a time, so the interrupt surely lands mid-run
    command = [*rallyrl_command(), *ROLLOUT, "--out", str(out), "--max-concurrency", "8"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=interruptible)  # fmt: skip
    wait_for(lambda: out.exists() and out.read_bytes().count(b"\n") >= 20, 120, "trajectories")
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    finished = out.read_bytes().count(b"\n")
    assert f"interrupted: {finished} of 256 trajectories finished" in stderr
    assert 20 <= finished < 256
    assert run_cli("check", str(out)).returncode == 0  # every line a whole, valid trajectory

    resumed = run_cli(*ROLLOUT, "--out", str(out), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed: {finished} trajectories were already in" in resumed.stderr
    done = pairs(out)
    assert len(done) == 256 and set(done) == {(p, s) for p in range(64) for s in range(4)}
    assert run_cli("check", str(out)).returncode == 0


def test_read_finished_drops_a_line_cut_short_by_a_kill(tmp_path):
    out = tmp_path / "rollouts.jsonl"
    good = [orjson.dumps({"prompt_index": i, "sample_index": 0}) + b"\n" for i in range(2)]
    out.write_bytes(b"".join(good) + b'{"prompt_index": 2, "sampl')
    assert read_finished(out) == {(0, 0), (1, 0)}
    assert out.read_bytes() == b"".join(good)


def test_read_finished_names_a_broken_line_in_the_middle(tmp_path):
    out = tmp_path / "rollouts.jsonl"
    out.write_bytes(b'{"prompt_index": 0, "sample_index": 0}\nnot json\n{"prompt_index": 1, "sample_index": 0}\n')
    with pytest.raises(ValueError, match="line 2"):
        read_finished(out)


def test_resume_refuses_a_file_from_a_bigger_run(tmp_path):
    out = tmp_path / "rollouts.jsonl"
    out.write_bytes(orjson.dumps({"prompt_index": 500, "sample_index": 0}) + b"\n")
    made = run_cli("rollout", "--num-prompts", "4", "--out", str(out), "--resume", "--no-progress")
    assert made.returncode == 2
    assert "outside this run's 4 prompts x 1 samples" in made.stderr


def test_a_second_rollout_to_the_same_file_is_refused(tmp_path):
    out = tmp_path / "rollouts.jsonl"
    with open(tmp_path / "rollouts.jsonl.lock", "w") as held:  # what a running rollout holds
        fcntl.flock(held, fcntl.LOCK_EX)
        made = run_cli("rollout", "--num-prompts", "4", "--out", str(out), "--no-progress")
    assert made.returncode == 2
    assert "another rallyrl rollout is writing" in made.stderr
    assert not out.exists()


@pytest.mark.slow
def test_sigkill_during_train_then_resume_continues_from_the_last_checkpoint(tmp_path):
    process, config, run = start_train(tmp_path, steps=5)
    checkpoints = run / "checkpoints"
    wait_for(lambda: (checkpoints / "step-000002").exists(), 240, "the second checkpoint")
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
    killed_at = max(int(p.name.split("-")[1].split(".")[0]) for p in checkpoints.glob("step-*"))
    assert killed_at < 5

    resumed = run_cli("train", "--config", str(config), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stderr
    metrics = [orjson.loads(line) for line in (run / "metrics.jsonl").read_bytes().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5]  # none lost, none twice
    assert (run / "final" / "model.safetensors").is_file()
    assert not list(checkpoints.glob("*.partial"))
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-000004", "step-000005"]


@pytest.mark.slow
def test_sigkill_during_async_train_then_resume_loses_and_duplicates_no_prompt(tmp_path):
    process, config, run = start_train(tmp_path, steps=5, async_rl=True, max_staleness=1)
    checkpoints = run / "checkpoints"
    wait_for(lambda: (checkpoints / "step-000002").exists(), 240, "the second checkpoint")
    os.killpg(process.pid, signal.SIGKILL)  # groups in flight and queued die with it
    process.wait(timeout=30)
    killed_at = max(int(p.name.split("-")[1].split(".")[0]) for p in checkpoints.glob("step-*"))
    assert killed_at < 5

    resumed = run_cli("train", "--config", str(config), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    metrics = [orjson.loads(line) for line in (run / "metrics.jsonl").read_bytes().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5]
    # every prompt a step consumed (trained on or filtered out) is in the ledger once, and the
    # ledger holds nothing else: the groups lost with the process were rolled out again
    (stream,) = orjson.loads((checkpoints / "step-000005" / "trainer_state.json").read_bytes())["streams"]
    consumed = list(range(stream["mark"])) + stream["consumed"]
    assert len(consumed) == len(set(consumed)) == sum(m["rollout/prompts_drawn"] for m in metrics)
    assert all(m["rollout/staleness_max"] <= 1 for m in metrics)
    assert metrics[-1]["time/elapsed_s"] > metrics[killed_at - 1]["time/elapsed_s"]


@pytest.mark.slow
def test_ctrl_c_during_async_train_stops_soon_with_a_checkpoint(tmp_path):
    process, _, run = start_train(tmp_path, steps=50, async_rl=True)
    wait_for(lambda: (run / "checkpoints" / "step-000001").exists(), 240, "the first checkpoint")
    interrupted = time.monotonic()
    process.send_signal(signal.SIGINT)  # mid-rollout, mid-update, whatever is going on
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 75, stderr[-2000:]  # checkpointed, as on SIGTERM (trainer/preemption.py)
    assert time.monotonic() - interrupted < 30  # the update under way finishes; nothing waits for rollouts
    assert "Traceback" not in stderr
    assert not list((run / "checkpoints").glob("*.partial"))  # (resuming it: the SIGKILL test above)
