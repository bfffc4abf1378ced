"""The GRPO trainer on a real tiny model: steps, masked gradients, checkpoints and resume."""

from __future__ import annotations

import asyncio
import json

import orjson
import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout.config import RolloutConfig
from rollout.request import AsyncRolloutRequest
from trainer.batch import collate, trajectory_sample
from trainer.config import GRPOConfig, load_config
from trainer.grpo import GRPOTrainer


def digit_share(request: AsyncRolloutRequest) -> float:
    """A reward with spread even for a random model: the share of digits it wrote."""
    text = "".join(m["content"] for m in request.messages if m["role"] == "assistant")
    return sum(c.isdigit() for c in text) / max(len(text), 1)


def config(tmp_path, model_dir, **overrides) -> GRPOConfig:
    values = dict(
        model=str(model_dir), out=str(tmp_path / "run"), steps=3, prompts_per_step=2, samples_per_prompt=4,
        rollout=RolloutConfig(max_turns=2, max_new_tokens=12, max_model_len=768, max_concurrency=256),
        micro_batch_size=4, lr=1e-3, seed=3, checkpoint_every=1, filter_groups=False, progress=False,
    )  # fmt: skip
    values.update(overrides)
    return GRPOConfig(**values)


def run(trainer: GRPOTrainer, resume: bool = False):
    return asyncio.run(trainer.train(resume=resume))


def test_three_grpo_steps_update_the_policy_and_the_engine(tmp_path, tiny_model_dir):
    trainer = GRPOTrainer(config(tmp_path, tiny_model_dir), reward_fn=digit_share)
    before = {k: v.clone() for k, v in trainer.policy_state_dict().items()}
    history = run(trainer)
    assert [m["step"] for m in history] == [1, 2, 3]
    for key in (
        "rollout/reward_mean",
        "rollout/reward_std",
        "rollout/accuracy",
        "rollout/solve_all",
        "rollout/solve_none",
        "rollout/turns",
        "train/kl",
        "train/clip_fraction",
        "train/entropy",
        "train/grad_norm",
        "train/lr",
        "correction/ratio_p50",
        "correction/kl_k3",
        "time/rollout_s",
        "time/update_s",
        "time/sync_s",
        "time/rollout_cpu_s",
        "time/update_cpu_s",
        "time/sync_cpu_s",
        "time/update_tokens_per_s",
        "sync/weight_version",
        "sync/servers_failed",
    ):
        assert key in history[-1]
    families = ("rollout", "train", "correction", "sync", "time")
    assert set(history[-1]) - {"step"} == {k for k in history[-1] if k.split("/")[0] in families}
    assert [m["sync/weight_version"] for m in history] == [1, 2, 3]
    assert all(m["train/tokens"] > 0 and m["train/grad_norm"] > 0 for m in history)
    assert all(m["time/update_cpu_s"] > 0 for m in history)
    after = trainer.policy_state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert trainer.engine.weight_version == 3
    engine_weights = trainer.engine.model.state_dict()
    assert all(torch.equal(engine_weights[k], after[k]) for k in after)
    run_dir = tmp_path / "run"
    lines = [orjson.loads(line) for line in (run_dir / "metrics.jsonl").read_bytes().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3]
    assert (run_dir / "final" / "config.json").is_file() and (run_dir / "curves.png").stat().st_size > 0
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-000002", "step-000003"]
    checkpoint = AutoModelForCausalLM.from_pretrained(run_dir / "checkpoints" / "step-000003")  # a model directory
    assert all(torch.equal(checkpoint.state_dict()[k], after[k]) for k in after)


def test_threads_setting_sets_torchs_intra_op_threads(tmp_path, tiny_model_dir):
    before = torch.get_num_threads()
    try:
        GRPOTrainer(config(tmp_path, tiny_model_dir, threads=1))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_gradients_on_prompt_and_tool_output_tokens_are_exactly_zero(tmp_path, tiny_model_dir):
    trainer = GRPOTrainer(config(tmp_path, tiny_model_dir))
    request = AsyncRolloutRequest("r", 0, 0, [{"role": "user", "content": "q"}])
    request.prompt_ids = list(range(8, 20))
    request.append_generated([30, 31, 32], [-1.0, -1.0, -1.0], 0)
    request.append_context([2, 8, 40, 41])  # glue and a tool result
    request.append_generated([33, 34], [-1.0, -1.0], 0)
    batch = collate([trajectory_sample(request, 1.0)])
    captured = {}
    norm = trainer.policy.language_model().model.norm  # its output: the final hidden states
    handle = norm.register_forward_hook(lambda m, i, out: captured.update(hidden=out) or out.retain_grad())
    out = trainer.policy.micro_batch_loss(batch, None, normaliser=float(batch.loss_mask[:, 1:].sum()))
    out["scaled_loss"].backward()
    handle.remove()
    grad = captured["hidden"].grad[0]  # row t predicts token t + 1
    trained = batch.loss_mask[0, 1:].bool()
    assert grad[:-1][~trained].abs().sum() == 0
    assert grad[:-1][trained].abs().sum(-1).min() > 0


def test_resuming_from_a_checkpoint_gives_the_same_next_step(tmp_path, tiny_model_dir):
    # seeded sampling makes each step's rollouts a function of (weights, step, prompts)
    straight = GRPOTrainer(config(tmp_path / "a", tiny_model_dir, steps=2), reward_fn=digit_share)
    uninterrupted = run(straight)

    first = GRPOTrainer(config(tmp_path / "b", tiny_model_dir, steps=1), reward_fn=digit_share)
    run(first)
    resumed = GRPOTrainer(config(tmp_path / "b", tiny_model_dir, steps=2), reward_fn=digit_share)
    history = run(resumed, resume=True)

    assert [m["step"] for m in history] == [1, 2]
    assert uninterrupted[1]["train/grad_norm"] > 1e-3
    for key in ("train/loss", "train/pg_loss", "train/grad_norm", "train/tokens", "rollout/reward_mean"):
        assert history[1][key] == pytest.approx(uninterrupted[1][key], rel=1e-5, abs=1e-7)
    a, b = straight.policy_state_dict(), resumed.policy_state_dict()
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    state = json.loads((tmp_path / "b" / "run" / "checkpoints" / "step-000002" / "trainer_state.json").read_text())
    assert (state["step"], state["data_position"], state["streams"]) == (2, 4, None)
    assert state["elapsed_s"] > 0


def test_resume_without_a_checkpoint_is_a_clear_error(tmp_path, tiny_model_dir):
    trainer = GRPOTrainer(config(tmp_path, tiny_model_dir))
    with pytest.raises(ValueError, match="--resume: no checkpoint under"):
        run(trainer, resume=True)


def test_yaml_config_with_overrides_and_unknown_keys(tmp_path):
    path = tmp_path / "grpo.yaml"
    path.write_text("steps: 7\nlr: 0.01\nadvantage_mode: per_step\nrollout: {max_turns: 5}\n")
    assert load_config(path, {"steps": 9, "seed": None}).steps == 9
    assert load_config(path).advantage_mode == "per_step"
    assert load_config(path).rollout.max_turns == 5
    assert load_config(path, {"rollout.max_turns": 2}).rollout.max_turns == 2
    path.write_text("stepz: 7\n")
    with pytest.raises(ValueError, match="stepz: unknown field; did you mean 'steps'"):
        load_config(path)
    with pytest.raises(ValueError, match="advantage_mode: must be 'trajectory' or 'broadcast' or 'per_step'"):
        GRPOConfig(advantage_mode="nope")


def test_a_step_whose_groups_are_all_filtered_out_leaves_the_policy_alone(tmp_path, tiny_model_dir):
    trainer = GRPOTrainer(config(tmp_path, tiny_model_dir, steps=1, filter_groups=True), reward_fn=lambda r: 1.0)
    before = {k: v.clone() for k, v in trainer.policy_state_dict().items()}
    history = run(trainer)
    # dynamic sampling drew to its cap, max_draws (4) x prompts_per_step (2), and found no signal
    assert history[0]["rollout/solve_all"] == 8 and history[0]["train/skipped_update"] == 1
    assert history[0]["rollout/draw_cap_hit"] == 1
    after = trainer.policy_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("micro_batch_tokens", [1, 40])
def test_the_update_does_not_depend_on_the_micro_batch_token_budget(tmp_path, tiny_model_dir, micro_batch_tokens):
    def sample(n: int, advantage: float):
        request = AsyncRolloutRequest("r", 0, 0, [{"role": "user", "content": "q"}])
        request.prompt_ids = list(range(8, 8 + n))
        request.append_generated([30 + n, 31, 32], [-1.0, -1.2, -0.9], 0)
        return trajectory_sample(request, advantage)

    samples = [sample(n, a) for n, a in ((3, 1.0), (9, -0.5), (5, 0.25), (14, -0.75))]
    gradients = []
    for tokens in (None, micro_batch_tokens):
        trainer = GRPOTrainer(config(tmp_path, tiny_model_dir, micro_batch_tokens=tokens))
        seen: dict[str, torch.Tensor] = {}

        def record(seen=seen, model=trainer.model) -> None:  # the gradient the optimizer would apply
            seen.update({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})

        trainer.optimizer.step = record
        trainer.update(samples)
        gradients.append(seen)
    assert gradients[0].keys() == gradients[1].keys() and gradients[0]
    for name, grad in gradients[0].items():
        assert torch.allclose(grad, gradients[1][name], rtol=1e-5, atol=1e-8), name
