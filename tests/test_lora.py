"""LoRA (peft) in the trainer: only the adapter trains, the KL reference is the base with the adapter
off, the in-process engine gets the merged weights, checkpoints and final/ hold the adapter, and an
adapter directory works as ``--model`` (merged on the way) and exports as a merged model."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import run_cli
from safetensors.torch import load_file
from test_grpo import config, digit_share, run
from transformers import AutoModelForCausalLM

from data.config_tree import ConfigError
from rollout.api import resolve_model
from rollout.engines.adapter_dirs import adapter_base, export_merged, is_adapter_dir
from trainer.config import LoRAConfig
from trainer.grpo import GRPOTrainer
from trainer.lora import lora_layers
from trainer.policy_model import PolicyModel, load_lm

LORA = LoRAConfig(rank=4, alpha=8.0)


def lora_trainer(tmp_path, model_dir, **overrides) -> GRPOTrainer:
    return GRPOTrainer(config(tmp_path, model_dir, **{"lora": LORA, **overrides}), reward_fn=digit_share)


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_only_the_adapter_trains_and_has_optimizer_state(tmp_path, tiny_model_dir):
    trainer = lora_trainer(tmp_path, tiny_model_dir, steps=2)
    lm = trainer.policy.language_model()
    before = {name: p.detach().clone() for name, p in lm.named_parameters()}
    run(trainer)
    adapter = {name for name, p in lm.named_parameters() if p.requires_grad}
    assert adapter and all("lora_" in name for name in adapter)
    assert all(torch.equal(before[name], p) for name, p in lm.named_parameters() if name not in adapter)
    assert any(not torch.equal(before[name], p) for name, p in lm.named_parameters() if "lora_B" in name)
    state = trainer.policy.optimizer.state
    assert len(state) == len(adapter)  # AdamW moments for the adapter alone
    assert sum(p.numel() for n, p in lm.named_parameters() if n in adapter) < 0.1 * sum(
        p.numel() for p in lm.parameters()
    )


def test_the_engine_gets_the_merged_weights_of_the_adapted_policy(tmp_path, tiny_model_dir):
    trainer = lora_trainer(tmp_path, tiny_model_dir, steps=2)
    run(trainer)
    ids = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    adapted = logits(trainer.policy.language_model(), ids)
    assert trainer.engine.weight_version == 2
    assert torch.allclose(logits(trainer.engine.model, ids), adapted, atol=1e-4)
    base = logits(load_lm(tiny_model_dir), ids)
    assert (adapted - base).abs().max() > 1e-3  # the adapter did something


def test_the_kl_reference_is_the_base_model_with_the_adapter_off(tmp_path, tiny_model_dir):
    trainer = lora_trainer(tmp_path, tiny_model_dir, kl_beta=0.1, steps=1)
    run(trainer)
    policy = trainer.policy
    assert policy.reference is None  # no copy
    ids = torch.randint(3, 100, (1, 12), generator=torch.Generator().manual_seed(1))
    positions, targets = torch.arange(11), ids[0, 1:]
    args = (ids, None, torch.arange(12)[None], positions, targets)
    with torch.no_grad(), policy.peft.disable_adapter():
        off = PolicyModel(policy.language_model())(*args)[0]
    base = PolicyModel(load_lm(tiny_model_dir))(*args)[0]
    adapted = PolicyModel(policy.language_model())(*args)[0]
    assert torch.allclose(off, base.detach(), atol=1e-6)
    assert (adapted - base).abs().max() > 1e-4


def test_final_and_checkpoints_hold_the_adapter_which_works_as_a_model(tmp_path, tiny_model_dir):
    trainer = lora_trainer(tmp_path, tiny_model_dir, steps=2)
    run(trainer)
    run_dir = tmp_path / "run"
    final = run_dir / "final"
    for directory in (final, run_dir / "checkpoints" / "step-000002"):
        assert is_adapter_dir(directory) and not (directory / "config.json").exists()
        assert adapter_base(directory) == tiny_model_dir.resolve()
    adapter_bytes = (final / "adapter_model.safetensors").stat().st_size
    adapter_numbers = sum(t.numel() for t in load_file(final / "adapter_model.safetensors").values())
    assert adapter_numbers == sum(
        p.numel() for n, p in trainer.policy.language_model().named_parameters() if "lora_" in n
    )
    assert adapter_bytes < 0.15 * (tiny_model_dir / "model.safetensors").stat().st_size
    ids = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(2))
    adapted = logits(trainer.policy.language_model(), ids)
    merged_dir = resolve_model(final)  # what --model of rollout and eval do with an adapter directory
    assert torch.allclose(logits(AutoModelForCausalLM.from_pretrained(merged_dir), ids), adapted, atol=1e-4)
    exported = export_merged(final, tmp_path / "merged")
    assert (exported / "config.json").is_file() and (exported / "tokenizer_config.json").is_file()
    assert torch.allclose(logits(AutoModelForCausalLM.from_pretrained(exported), ids), adapted, atol=1e-4)


def test_resuming_a_lora_run_gives_the_same_next_step(tmp_path, tiny_model_dir):
    straight = lora_trainer(tmp_path / "a", tiny_model_dir, steps=2)
    uninterrupted = run(straight)
    run(lora_trainer(tmp_path / "b", tiny_model_dir, steps=1))
    resumed = lora_trainer(tmp_path / "b", tiny_model_dir, steps=2)
    history = run(resumed, resume=True)
    for key in ("train/loss", "train/grad_norm", "train/tokens", "rollout/reward_mean"):
        assert history[1][key] == pytest.approx(uninterrupted[1][key], rel=1e-5, abs=1e-7)
    a, b = straight.policy.state_dict(), resumed.policy.state_dict()
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_a_target_module_the_model_lacks_is_an_error_naming_the_field(tmp_path, tiny_model_dir):
    with pytest.raises(ConfigError, match=r"lora.target_modules: \['qkv'\] not in Qwen2ForCausalLM; its linear"):
        lora_trainer(tmp_path, tiny_model_dir, lora=LoRAConfig(target_modules=["q_proj", "qkv"]))


def test_lora_settings_are_checked():
    with pytest.raises(ConfigError, match=r"lora\.rank must be a positive integer"):
        LoRAConfig(rank=0)
    with pytest.raises(ConfigError, match=r"lora\.base_dtype must be one of"):
        LoRAConfig(base_dtype="int8")


def test_an_adapter_naming_a_missing_base_is_a_clear_error(tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/nowhere"}))
    with pytest.raises(ValueError, match="base_model_name_or_path '/nowhere' is not a model directory"):
        resolve_model(tmp_path)


def test_adapter_layers_cover_every_linear_layer_but_the_head(tmp_path, tiny_model_dir):
    trainer = lora_trainer(tmp_path, tiny_model_dir)
    names = {name.rsplit(".", 1)[-1] for name in lora_layers(trainer.policy.language_model())}
    assert names == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_sft_with_lora_checkpoints_adapters_and_evaluates_the_merged_model(tmp_path, tiny_model_dir):
    from trainer.config import SFTConfig
    from trainer.sft import run_sft

    config = SFTConfig(model=str(tiny_model_dir), lora=LORA, num_examples=16, steps=4, batch_size=4,
                       warmup_steps=1, eval_every=2, eval_prompts=2, log_every=2, lr=1e-2, out=str(tmp_path / "sft"),
                       progress=False)  # fmt: skip
    history = run_sft(config)
    assert [entry["step"] for entry in history] == [2, 4]
    assert all(0.0 <= entry["accuracy"] <= 1.0 for entry in history)
    checkpoint = tmp_path / "sft" / "step-4"
    assert is_adapter_dir(checkpoint) and adapter_base(checkpoint) == tiny_model_dir.resolve()
    ids = torch.randint(3, 100, (1, 12), generator=torch.Generator().manual_seed(3))
    merged = AutoModelForCausalLM.from_pretrained(resolve_model(checkpoint))
    assert (logits(merged, ids) - logits(load_lm(tiny_model_dir), ids)).abs().max() > 1e-4


def test_sft_with_lora_needs_a_base_model(tmp_path):
    from trainer.config import SFTConfig
    from trainer.sft import run_sft

    with pytest.raises(ValueError, match="lora: needs `model`"):
        run_sft(SFTConfig(lora=LORA, out=str(tmp_path / "sft"), progress=False))


@pytest.fixture(scope="module")
def lora_final(tmp_path_factory, tiny_model_dir):
    """final/ of a one-step LoRA run: an adapter directory."""
    tmp_path = tmp_path_factory.mktemp("lora-run")
    run(lora_trainer(tmp_path, tiny_model_dir, steps=1))
    return tmp_path / "run" / "final"


def test_export_model_merge_writes_a_model_directory(lora_final, tmp_path):
    done = run_cli("export-model", "--merge", str(lora_final), str(tmp_path / "merged"))
    assert done.returncode == 0, done.stderr
    assert f"wrote the merged model to {tmp_path / 'merged'}" in done.stdout + done.stderr
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    ids = torch.randint(3, 100, (1, 12), generator=torch.Generator().manual_seed(4))
    assert torch.allclose(
        logits(merged, ids), logits(AutoModelForCausalLM.from_pretrained(resolve_model(lora_final)), ids)
    )


def test_export_model_refuses_a_directory_that_is_no_adapter(tiny_model_dir, tmp_path):
    done = run_cli("export-model", "--merge", str(tiny_model_dir), str(tmp_path / "merged"))
    assert done.returncode == 2 and "not a LoRA adapter directory (no adapter_config.json)" in done.stderr
    assert not (tmp_path / "merged").exists()


def test_rollout_takes_an_adapter_directory_as_its_model(lora_final, tmp_path):
    out = tmp_path / "rollouts.jsonl"
    done = run_cli("rollout", "--model", str(lora_final), "--num-prompts", "2", "--max-new-tokens", "16",
                   "--no-progress", "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert len(out.read_bytes().splitlines()) == 2


def test_async_training_with_lora_syncs_the_merged_adapter_every_step(tmp_path, tiny_model_dir):
    trainer = lora_trainer(tmp_path, tiny_model_dir, steps=3, async_rl=True, max_staleness=1, checkpoint_every=0)
    history = run(trainer)
    assert [m["step"] for m in history] == [1, 2, 3]
    assert trainer.engine.weight_version == 3
    ids = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(5))
    assert torch.allclose(logits(trainer.engine.model, ids), logits(trainer.policy.language_model(), ids), atol=1e-4)
    assert is_adapter_dir(tmp_path / "run" / "final")


@pytest.mark.slow
def test_train_with_lora_against_a_server_syncs_the_merged_weights(tmp_path):
    from test_serve_processes import get_json, read_jsonl

    from data.tiny_model import EMBEDDED_MODEL
    from rollout.serve.processes import serve_processes

    with serve_processes(EMBEDDED_MODEL, tmp_path, 1) as (server,):
        out = tmp_path / "run"
        trained = run_cli("train", "--steps", "2", "--prompts-per-step", "4", "-n", "4", "--out", str(out),
                          "--no-progress", "--set", "lora.rank=4", "--set", "lora.alpha=64", "--lr", "1e-2",
                          "--set", "weight_sync.check_logprobs=true", "--engine-url", server.url)  # fmt: skip
        assert trained.returncode == 0, trained.stderr
        assert get_json(f"{server.url}/get_model_info")["weight_version"] == "2"
    assert trained.stderr.count("lora: the servers get the adapter merged into full weights") == 1
    assert f"weight sync: broadcast (gloo) into {server.url}" in trained.stderr  # merged weights, in memory
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["rollout/weight_version"] for m in metrics] == [0, 1]
    # after each step the server's logprobs are the adapted policy's: the merge arrived whole (a lost or
    # stale merge is off by 1e-2 and more; float32 rounding of the strongly trained adapter reaches 1e-5)
    assert all(m["sync/logprob_gap"] < 1e-4 for m in metrics), [m["sync/logprob_gap"] for m in metrics]
    assert is_adapter_dir(out / "final") and not (out / "weights").exists()


def test_an_agent_trains_the_adapter_through_the_gateway(tmp_path, tiny_model_dir):
    settings = config(tmp_path, tiny_model_dir, lora=LORA, agent="tests.test_gateway:one_call_agent", steps=2,
                      checkpoint_every=0)  # fmt: skip
    trainer = GRPOTrainer(settings)
    lm = trainer.policy.language_model()
    before = {name: p.detach().clone() for name, p in lm.named_parameters()}
    history = run(trainer)
    assert trainer.agent is not None and trainer.agent.gateway.counters["sessions_finished"] >= 16
    assert all(m["rollout/error_rate"] == 0 and m["train/tokens"] > 0 for m in history)
    changed = {name for name, p in lm.named_parameters() if not torch.equal(before[name], p)}
    assert changed and all("lora_B" in name or "lora_A" in name for name in changed)
    ids = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(7))
    assert trainer.engine.weight_version == 2
    assert torch.allclose(logits(trainer.engine.model, ids), logits(lm, ids), atol=1e-4)


def test_lora_under_fsdp_is_refused_naming_data_parallel(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setattr("trainer.policy.is_fsdp", lambda accelerator: True)
    with pytest.raises(ConfigError, match=r"not with FSDP.*without --use_fsdp"):
        lora_trainer(tmp_path, tiny_model_dir)
