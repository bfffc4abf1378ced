"""A full disk (issue 41): on a small tmpfs of their own (``tests/small_disk.py``; skipped where this
machine does not let the tests mount one), rollout, train (at its first checkpoint and a later one), a
LoRA adapter save and the disk weight sync each stop with exit 1 and one line naming the path, the bytes
needed and the free space, no traceback; what was written stays whole, a directory that did not fit is
removed, and ``--resume`` once there is room completes with nothing lost or duplicated."""

from __future__ import annotations

import functools
import json
import re
import tempfile
from pathlib import Path
from typing import Any

import pytest
from small_disk import can_mount_small_disk, on_small_disk

from data.tiny_model import EMBEDDED_MODEL

DISK_LINE = re.compile(r"error: disk full: (.+?) (\S+) needs ([\d.]+ (?:bytes|KB|MB|GB)), ([\d.]+ (?:bytes|KB|MB|GB)) "
                       r"free on (\S+)")  # fmt: skip
TRAIN = ["train", "--steps", "3", "--prompts-per-step", "2", "-n", "2", "--out", "run", "--no-progress",
         "--set", "checkpoint_every=1", "--set", "keep_checkpoints=1"]  # fmt: skip
TRAIN_AND_RESUME = [{"cli": TRAIN}, {"grow": "300m"}, {"cli": [*TRAIN, "--resume"]}]


@functools.cache
def _mountable() -> bool:
    return can_mount_small_disk(Path(tempfile.mkdtemp(prefix="rallyrl-disk-probe-")))


@pytest.fixture(autouse=True)
def _small_disks_allowed() -> None:
    if not _mountable():
        pytest.skip("this machine does not let the tests mount a tmpfs in a mount namespace (unshare --mount)")


def printed(run: dict[str, Any]) -> str:
    return run["out"] + run["err"]


def disk_full_line(run: dict[str, Any]) -> re.Match[str]:
    """The one line a full disk prints (exit 1, no traceback), parsed: what, path, needed, free, mount."""
    assert run["rc"] == 1, printed(run)
    assert "Traceback" not in printed(run), printed(run)
    lines = [line for line in printed(run).splitlines() if line.startswith("error: disk full:")]
    assert len(lines) == 1, printed(run)
    found = DISK_LINE.match(lines[0])
    assert found is not None, lines[0]
    return found


def steps_of(facts: dict[str, Any], name: str = "run/metrics.jsonl") -> list[int]:
    return [m["step"] for m in facts["jsonl"][name]["lines"]]


WRITERS = f"""
import json, torch
from pathlib import Path
from safetensors.torch import save_file
from data.disk_space import DiskFull
from data.files import atomic_directory, atomic_write_bytes
from data.line_files import LineAppender
from trainer.checkpoints import save_model_dir
from transformers import AutoModelForCausalLM

said = {{}}
def attempt(name, fn):
    try:
        fn()
        said[name] = "written"
    except DiskFull as exc:
        said[name] = str(exc)
big = {{"w": torch.zeros(300_000)}}  # 1.2 MB: more than the disk
attempt("torch.save", lambda: atomic_directory("ckpt", lambda p: torch.save(big, p / "state.pt")))
attempt("safetensors", lambda: atomic_directory("st", lambda p: save_file(big, str(p / "w.safetensors"))))
attempt("bytes", lambda: atomic_write_bytes("blob.bin", b"x" * 2_000_000))
model = AutoModelForCausalLM.from_pretrained("{EMBEDDED_MODEL}")
attempt("model (known size)", lambda: save_model_dir(model, None, "model"))
lines = LineAppender("lines.jsonl", what="trajectory")
try:
    for i in range(100_000):
        lines.write(json.dumps({{"i": i, "pad": "y" * 200}}).encode() + b"\\n")
except DiskFull as exc:
    said["lines"] = str(exc)
said["lines_written"] = lines.lines
Path("/dev/stdout").write_text(json.dumps(said))
"""


def test_every_writer_turns_a_full_disk_into_one_error_and_keeps_only_whole_files(tmp_path):
    result = on_small_disk(tmp_path, [{"mount": "512k"}, {"python": WRITERS}])
    (run,) = result["runs"]
    assert run["rc"] == 0, run["err"]
    said = json.loads(run["out"].strip().splitlines()[-1])
    for name in ("torch.save", "safetensors", "bytes", "model (known size)", "lines"):
        assert said[name].startswith("disk full: "), (name, said[name])
        assert "free on " in said[name] and str(tmp_path / "disk") in said[name], said[name]
    assert "ckpt did not fit" in said["torch.save"] and "nothing of it was kept" in said["torch.save"]
    assert "blob.bin needs 2.0 MB" in said["bytes"]
    assert "model needs" in said["model (known size)"] and "nothing was written" in said["model (known size)"]
    assert "a trajectory for lines.jsonl needs" in said["lines"]
    files = result["facts"]["files"]
    assert not [f for f in files if f.endswith(".partial") or ".tmp" in f or f in ("ckpt", "st", "model")], files
    kept = result["facts"]["jsonl"]["lines.jsonl"]
    assert kept["whole"] and len(kept["lines"]) == said["lines_written"] > 100
    assert [line["i"] for line in kept["lines"]] == list(range(said["lines_written"]))


@pytest.mark.slow
def test_a_rollout_on_a_full_disk_keeps_whole_trajectories_and_resume_adds_the_rest(tmp_path):
    rollout = ["rollout", "--num-prompts", "32", "-n", "4", "--max-new-tokens", "64", "--no-progress"]
    result = on_small_disk(tmp_path, [{"mount": "160k"}, {"cli": rollout}, {"grow": "20m"},
                                      {"cli": [*rollout, "--resume"]}])  # fmt: skip
    full, resumed = result["runs"]
    line = disk_full_line(full)
    assert (line[1], line[2]) == ("a trajectory for", "rollouts.jsonl")
    first = full["facts"]["jsonl"]["rollouts.jsonl"]
    assert first["whole"] and 0 < len(first["lines"]) < 128
    assert resumed["rc"] == 0, printed(resumed)
    assert f"resumed: {len(first['lines'])} trajectories were already in rollouts.jsonl" in printed(resumed)
    final = result["facts"]["jsonl"]["rollouts.jsonl"]
    pairs = [(r["prompt_index"], r["sample_index"]) for r in final["lines"]]
    assert final["whole"] and len(pairs) == 128 and len(set(pairs)) == 128


@pytest.mark.slow
def test_train_without_room_for_its_first_checkpoint_says_so_and_resume_completes(tmp_path):
    result = on_small_disk(tmp_path, [{"mount": "30m"}, *TRAIN_AND_RESUME])
    full, resumed = result["runs"]
    line = disk_full_line(full)
    assert (line[1], line[2]) == ("checkpoint", "run/checkpoints/step-000001") and "nothing was written" in line.string
    assert not [f for f in full["facts"]["files"] if f.startswith("run/checkpoints/")], full["facts"]["files"]
    assert resumed["rc"] == 0, printed(resumed)
    assert "has no complete checkpoint yet: starting at step 0" in printed(resumed)
    assert steps_of(result["facts"]) == [1, 2, 3] and "run/final/model.safetensors" in result["facts"]["files"]


@pytest.mark.slow
def test_train_that_fills_the_disk_at_a_later_checkpoint_resumes_from_the_one_before(tmp_path):
    result = on_small_disk(tmp_path, [{"mount": "50m"}, *TRAIN_AND_RESUME])
    full, resumed = result["runs"]
    line = disk_full_line(full)
    assert (line[1], line[2]) == ("checkpoint", "run/checkpoints/step-000002")
    assert "holds fewer than two more" in printed(full)  # warned at the first checkpoint
    files = full["facts"]["files"]
    assert "run/checkpoints/step-000001/trainer_state.json" in files
    assert not [f for f in files if f.endswith(".partial")], files
    assert resumed["rc"] == 0, printed(resumed)
    assert "resumed from run/checkpoints/step-000001 (step 1)" in printed(resumed)
    assert steps_of(result["facts"]) == [1, 2, 3]


@pytest.mark.slow
def test_a_lora_adapter_save_on_a_full_disk_is_one_line_and_keeps_nothing_half_written(tmp_path):
    sft = ["sft", "--out", "sft", "--model", str(EMBEDDED_MODEL), "--steps", "2", "--eval-every", "1",
           "--eval-prompts", "0", "--no-progress", "--set", "lora.rank=4"]  # fmt: skip
    result = on_small_disk(tmp_path, [{"mount": "64k"}, {"cli": sft}, {"grow": "20m"}, {"cli": sft}])
    full, again = result["runs"]
    line = disk_full_line(full)
    assert (line[1], line[2]) == ("LoRA adapter", "sft/step-1")
    assert full["facts"]["files"] == ["sft", "sft/sft_log.jsonl"]
    assert again["rc"] == 0, printed(again)
    assert "sft/step-2/adapter_model.safetensors" in result["facts"]["files"]


@pytest.mark.slow
def test_the_disk_weight_sync_to_a_real_server_on_a_full_disk_says_so_and_resume_completes(tmp_path):
    train = ["train", "--steps", "2", "--prompts-per-step", "2", "-n", "2", "--out", "run", "--no-progress",
             "--weight-sync", "disk", "--engine-url", "{url}"]  # fmt: skip
    result = on_small_disk(tmp_path, [{"mount": "8m"}, {"serve": True}, {"cli": train}, {"grow": "300m"},
                                      {"cli": [*train, "--resume"]}])  # fmt: skip
    full, resumed = result["runs"]
    line = disk_full_line(full)
    assert (line[1], line[2]) == ("weights for the servers", "run/weights/v000000")
    assert not [f for f in full["facts"]["files"] if f.startswith("run/weights/")], full["facts"]["files"]
    assert resumed["rc"] == 0, printed(resumed)
    assert steps_of(result["facts"]) == [1, 2]
