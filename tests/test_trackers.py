"""log_with: a real 2-step ``rallyrl train`` logs to TensorBoard, W&B (offline), trackio and MLflow under its
run directory, with every variable that would send them to a server pointing at one; each tracker's
files are read back with its own reader and hold each step's metrics (trainer/trackers.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sqlite3
import struct
import subprocess
from pathlib import Path

import numpy as np
import orjson
import pytest

from trainer.trackers import accelerator_options, flat_config, log_to_trackers, tracker_names

pytestmark = pytest.mark.xdist_group("trackers")  # one training run feeds every test of the file
TRACKERS = ("tensorboard", "wandb", "trackio", "mlflow")
MISSING = [name for name in TRACKERS if importlib.util.find_spec(name) is None]
NOWHERE = "http://127.0.0.1:9"
TO_A_SERVER = {"MLFLOW_TRACKING_URI": NOWHERE, "WANDB_MODE": "online", "WANDB_BASE_URL": NOWHERE,
               "TRACKIO_SPACE_ID": "nobody/nothing", "TRACKIO_SERVER_URL": NOWHERE}  # fmt: skip
"""What would send each tracker to a server: the run must log locally all the same."""
KEYS = ("rollout/reward_mean", "train/loss", "train/collapse_warning")
needs_trackers = pytest.mark.skipif(bool(MISSING), reason=f"pip install 'rallyrl[trackers]' ({MISSING})")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, list[dict], subprocess.CompletedProcess]:
    """A 2-step run of the embedded model with all four trackers; its directory and metrics."""
    work = tmp_path_factory.mktemp("trackers")
    args = ["train", "--steps", "2", "--prompts-per-step", "2", "-n", "2", "--out", "run", "--no-progress",
            "--set", "checkpoint_every=0", *(f"--log-with={name}" for name in TRACKERS)]  # fmt: skip
    env = {**os.environ, **TO_A_SERVER}
    done = subprocess.run([shutil.which("rallyrl"), *args], cwd=work, env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = work / "run"
    metrics = [orjson.loads(line) for line in (out / "metrics.jsonl").read_bytes().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    return out, metrics, done


def expected(metrics: list[dict], key: str) -> list[tuple[int, float]]:
    return [(m["step"], pytest.approx(m[key], rel=1e-6, abs=1e-9)) for m in metrics]


@needs_trackers
def test_tensorboard_event_files_hold_each_steps_metrics(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, metrics, done = run
    events = EventAccumulator(str(out / "tensorboard" / "rallyrl"))
    events.Reload()
    for key in KEYS:
        assert [(s.step, s.value) for s in events.Scalars(key)] == expected(metrics, key)
    assert f"tensorboard -> {Path('run') / 'tensorboard' / 'rallyrl'}" in done.stderr


def wandb_records(path: Path):
    """The records of an offline run's ``.wandb`` file: W&B's LevelDB-style log (a 7-byte header, 32 KiB
    blocks of chunks: checksum, length, type FULL/FIRST/MIDDLE/LAST) of protobuf ``Record``s."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    position, pending = 7, b""
    while position + 7 <= len(data):
        if (left := 32768 - position % 32768) < 7:
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        chunk = data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            yield wandb_internal_pb2.Record.FromString(pending + chunk if kind == 4 else chunk)
        pending = chunk if kind == 2 else pending + chunk if kind == 3 else b""


@needs_trackers
def test_wandb_writes_an_offline_run_holding_each_steps_metrics(run):
    out, metrics, _ = run
    (run_file,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    history = [r.history for r in wandb_records(run_file) if r.WhichOneof("record_type") == "history"]
    rows = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in h.item}
            | {"_step": h.step.num} for h in history]  # fmt: skip
    for key in KEYS:
        assert [(row["_step"], row[key]) for row in rows] == expected(metrics, key)


@needs_trackers
def test_trackio_store_under_the_run_holds_each_steps_metrics(run):
    out, metrics, _ = run
    with sqlite3.connect(out / "trackio" / "rallyrl.db") as db:
        rows = db.execute("SELECT step, metrics FROM metrics WHERE run_name = 'run' ORDER BY step").fetchall()
    for key in KEYS:
        assert [(step, json.loads(values)[key]) for step, values in rows] == expected(metrics, key)


@needs_trackers
def test_mlflow_file_store_under_the_run_holds_each_steps_metrics(run, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    from mlflow.tracking import MlflowClient

    out, metrics, _ = run
    client = MlflowClient(tracking_uri=(out / "mlruns").as_uri())
    (found,) = client.search_runs([client.get_experiment_by_name("rallyrl").experiment_id])
    assert found.info.run_name == "run" and found.data.params["lr"] == "0.0001"
    for key in KEYS:
        history = client.get_metric_history(found.info.run_id, key)
        assert [(m.step, m.value) for m in history] == expected(metrics, key)


def test_none_asks_for_no_tracker_and_names_are_kept_once_in_order():
    assert tracker_names("none") == [] and accelerator_options("none", "run") == {}
    assert tracker_names(["wandb", "none", "tensorboard", "wandb"]) == ["wandb", "tensorboard"]


def test_a_tracker_not_installed_is_named_with_the_extra_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ValueError, match=r"log_with: wandb is not installed: pip install 'rallyrl\[trackers\]'"):
        accelerator_options(["tensorboard", "wandb"], "run")


def test_the_config_goes_to_the_trackers_as_dotted_scalars():
    tree = {"lr": 0.1, "rollout": {"max_turns": 3, "stop": ["a"]}, "lora": None, "async_rl": False}
    assert flat_config(tree) == {"lr": 0.1, "rollout.max_turns": 3, "rollout.stop": "['a']", "lora": "None",
                                 "async_rl": False}  # fmt: skip


def test_only_finite_numbers_reach_the_trackers_at_the_metrics_step():
    class Recorder:  # what Accelerator.log receives
        def __init__(self) -> None:
            self.trackers, self.logged = ["a tracker"], []

        def log(self, values, step=None):
            self.logged.append((step, values))

    recorder = Recorder()
    metrics = {"step": 3, "train/kl": 0.5, "rollout/accuracy": float("nan"), "a": None, "b": "text",
               "rollout/trajectories": np.int64(12), "train/skipped_update": False}  # fmt: skip
    log_to_trackers(recorder, metrics)
    assert recorder.logged == [(3, {"train/kl": 0.5, "rollout/trajectories": 12.0, "train/skipped_update": 0.0})]


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="pip install 'rallyrl[trackers]'")
def test_sft_logs_its_loss_and_evaluations_to_tensorboard_under_its_out(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from trainer.config import SFTConfig
    from trainer.sft import run_sft

    config = SFTConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
                       num_examples=8, steps=4, batch_size=2, warmup_steps=1, eval_every=2, eval_prompts=0,
                       log_every=2, out=str(tmp_path / "sft"), progress=False, log_with="tensorboard")  # fmt: skip
    run_sft(config)
    logged = [orjson.loads(line) for line in (tmp_path / "sft" / "sft_log.jsonl").read_bytes().splitlines()]
    losses = [(entry["step"], pytest.approx(entry["loss"], rel=1e-6)) for entry in logged if entry["kind"] == "train"]
    events = EventAccumulator(str(tmp_path / "sft" / "tensorboard" / "rallyrl"))
    events.Reload()
    assert [(s.step, s.value) for s in events.Scalars("train/loss")] == losses
    assert [s.step for s in events.Scalars("eval/elapsed_s")] == [2, 4]
