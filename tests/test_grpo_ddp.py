"""Data parallelism is real: 2 CPU processes (gloo) make the same update as 1 on the same global batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from data.tiny_model import TinyModelConfig, save_tiny_model
from tests import accelerate_runs

SCRIPT = Path(__file__).with_name("ddp_grpo_step.py")


def launch(processes: int, model_dir: Path, out: Path, mode: str = "sync") -> dict:
    result = out / "result.pt"
    # on a CPU machine, --multi_gpu starts torchrun workers and the trainer picks gloo; one process
    # is a plain launch
    spread = ["--multi_gpu"] if processes > 1 else []
    accelerate_runs.launch([*spread, "--num_processes", str(processes)], SCRIPT,
                           [str(model_dir), str(out / "run"), str(result), mode], cwd=out)  # fmt: skip
    return torch.load(result)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async", "lora", "auto"])
def test_two_process_update_equals_one_process_update(tmp_path, mode):
    # peaked logits, so that greedy rollouts do not hinge on float noise between batch shapes
    model_dir = save_tiny_model(tmp_path / "model", TinyModelConfig(hidden_size=64, num_layers=2,
                                initializer_range=0.3, intermediate_size=128))  # fmt: skip
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one = launch(1, model_dir, tmp_path / "one", mode)
    two = launch(2, model_dir, tmp_path / "two", mode)
    assert one["metrics"]["train/tokens"] == two["metrics"]["train/tokens"]
    assert two["metrics"]["train/grad_norm"] == pytest.approx(one["metrics"]["train/grad_norm"], rel=1e-4)
    assert one["metrics"]["rollout/trajectories"] == two["metrics"]["rollout/trajectories"] == 8
    assert (one["processes"], two["processes"]) == (1, 2)
    for key in ("correction/ratio_p5", "correction/ratio_p50", "correction/ratio_p95", "correction/ratio_max"):
        assert two["metrics"][key] == pytest.approx(one["metrics"][key], abs=1e-4), key  # gathered from both
    if mode == "auto":  # both probed (the two processes agreed on one budget, or the run would hang)
        assert one["metrics"]["train/micro_batch_tokens"] >= 256 and two["metrics"]["train/micro_batch_tokens"] >= 256
    scale = max(float(g.abs().max()) for g in one["grads"].values())
    assert scale > 1e-3  # a real gradient, not float noise
    assert one["grads"].keys() == two["grads"].keys()
    assert all(("lora_" in name) == (mode == "lora") for name in one["grads"])  # LoRA: the adapter's alone
    for name, grad in one["grads"].items():
        assert torch.allclose(grad, two["grads"][name], atol=1e-5 * scale, rtol=1e-4), name
