"""FSDP is real: two CPU processes (gloo) under `accelerate launch --use_fsdp --fsdp_version 2`
shard the policy, make the same update as one plain process on the same global batch, gather the
full weights for their in-process engines and for `final/`, and resume from a checkpoint exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from data.tiny_model import TinyModelConfig, save_tiny_model
from tests import accelerate_runs

pytestmark = pytest.mark.slow  # two accelerate-launched processes, about 75 s

SCRIPT = Path(__file__).with_name("fsdp_grpo_run.py")
FSDP = ["--use_fsdp", "--fsdp_version", "2", "--num_processes", "2", "--fsdp_auto_wrap_policy",
        "TRANSFORMER_BASED_WRAP", "--fsdp_transformer_layer_cls_to_wrap", "Qwen2DecoderLayer"]  # fmt: skip
PLAIN = ["--num_processes", "1"]


def launch(spread: list[str], model_dir: Path, out: Path, steps: int, resume: bool = False) -> dict:
    result = out / f"result-{steps}{'-resumed' if resume else ''}.pt"
    accelerate_runs.launch(spread, SCRIPT, [str(model_dir), str(out / "run"), str(result), str(steps),
                                            "resume" if resume else ""], cwd=out)  # fmt: skip
    return torch.load(result)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("fsdp")
    # peaked logits, so that sampled rollouts do not hinge on float noise between shardings
    model_dir = save_tiny_model(root / "model", TinyModelConfig(hidden_size=64, num_layers=2, initializer_range=0.3,
                                                                intermediate_size=128))  # fmt: skip
    runs = {}
    plan = [("plain", PLAIN, 1, False), ("fsdp", FSDP, 1, False), ("fsdp-resumed", FSDP, 2, True),
            ("fsdp-straight", FSDP, 2, False)]  # fmt: skip
    for name, spread, steps, resume in plan:
        out = root / ("fsdp" if name == "fsdp-resumed" else name)  # the resumed run goes on in the first one's dir
        out.mkdir(exist_ok=True)
        runs[name] = launch(spread, model_dir, out, steps, resume) | {"dir": out / "run"}
    return runs


def test_two_fsdp_processes_shard_the_policy_and_make_the_one_process_update(runs):
    plain, fsdp = runs["plain"], runs["fsdp"]
    assert (plain["processes"], plain["sharded"]) == (1, False)
    assert (fsdp["processes"], fsdp["sharded"]) == (2, True)
    one, two = plain["history"][-1], fsdp["history"][-1]
    assert one["train/tokens"] == two["train/tokens"] and one["rollout/trajectories"] == 8
    assert two["train/grad_norm"] == pytest.approx(one["train/grad_norm"], rel=1e-4)
    assert two["train/kl"] == pytest.approx(one["train/kl"], rel=1e-4, abs=1e-7)  # the reference, sharded too
    scale = max(float(g.abs().max()) for g in plain["grads"].values())
    assert scale > 1e-3 and plain["grads"].keys() == fsdp["grads"].keys()
    for name, grad in plain["grads"].items():
        assert torch.allclose(grad, fsdp["grads"][name], atol=1e-5 * scale, rtol=1e-4), name


def test_final_and_checkpoints_hold_the_gathered_full_weights(runs):
    first, resumed = runs["fsdp"], runs["fsdp-resumed"]  # one directory: step 1, then steps 2 and final/
    checkpoint = first["dir"] / "checkpoints" / "step-000001"
    for directory, weights in ((checkpoint, first["weights"]), (first["dir"] / "final", resumed["weights"])):
        saved = load_file(directory / "model.safetensors")
        assert saved and saved.keys() <= weights.keys()
        for name, tensor in saved.items():
            assert torch.equal(tensor, weights[name]), (directory.name, name)
    assert (checkpoint / "config.json").exists() and (checkpoint / "tokenizer_config.json").exists()


def test_an_fsdp_run_resumes_from_its_checkpoint_exactly(runs):
    first, resumed, straight = runs["fsdp"], runs["fsdp-resumed"], runs["fsdp-straight"]
    for name, tensor in first["weights"].items():  # the checkpoint's shards, gathered again
        assert torch.equal(resumed["resumed"][name], tensor), name
    assert [m["step"] for m in resumed["history"]] == [1, 2]
    assert resumed["history"][-1]["rollout/weight_version"] == 1
    for name, tensor in straight["weights"].items():  # and the resumed run goes on as the uninterrupted one
        assert torch.allclose(resumed["weights"][name], tensor, rtol=1e-5, atol=1e-7), name
