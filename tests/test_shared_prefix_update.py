"""The update with each micro-batch's shared prompt run once (``share_prompt_prefix``,
``trainer/batch.py``): which tokens are shared, and the same logprobs, metrics and gradients as the
update that runs every row in full, with the KL reference, truncated IS, several epochs and LoRA."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.test_policy_update import TEMPERATURE, assert_same_update, grpo_config, make_trainer, run_update
from trainer.batch import MIN_SHARED_PREFIX, Sample, collate, shared_prefix_length
from trainer.lora_config import LoRAConfig
from trainer.policy_model import PolicyModel

pytestmark = pytest.mark.usefixtures("one_thread")


def group(rng: random.Random, system: list[int], question: int, turns: list[list[tuple[int, int]]],
          advantages: list[float]) -> list[Sample]:  # fmt: skip
    """One GRPO group: ``system`` then a ``question`` of random tokens (the same for every sample),
    then each sample's turns of ``(generated, context)`` tokens (generated ones trained)."""
    prompt = system + [rng.randrange(8, 105) for _ in range(question)]
    samples = []
    for sample_turns, advantage in zip(turns, advantages, strict=True):
        ids, mask, engine = list(prompt), [0] * len(prompt), [0.0] * len(prompt)
        for generated, context in sample_turns:
            ids += [rng.randrange(8, 105) for _ in range(generated + context)]
            mask += [1] * generated + [0] * context
            engine += [rng.uniform(-5.6, -3.8) for _ in range(generated)] + [0.0] * context
        samples.append(Sample(ids, mask, engine, advantage))
    return samples


def two_groups(seed: int = 0) -> list[Sample]:
    """Two groups of four under one 40-token system prompt, questions of 6 and 9 tokens."""
    rng = random.Random(seed)
    system = [rng.randrange(8, 105) for _ in range(40)]
    first = group(rng, system, 6, [[(3, 0)], [(2, 3), (4, 0)], [(1, 2), (5, 0)], [(6, 4)]], [1.0, -0.5, 0.75, -1.25])
    second = group(rng, system, 9, [[(4, 2), (2, 0)], [(1, 1)], [(7, 0)], [(2, 0)]], [0.3, -0.8, 0.0, 0.5])
    return first + second


# ----- which tokens are shared --------------------------------------------------------------------


def test_the_shared_prefix_is_what_every_row_holds_and_ends_before_the_first_predicted_trained_token():
    samples = two_groups()
    assert shared_prefix_length(samples[:4]) == 45  # system + question (46) less the token predicting the first
    assert shared_prefix_length(samples) == 40  # two questions: the system prompt
    assert shared_prefix_length(samples[:1]) == 0  # one row: nothing to share
    short = [Sample(s.input_ids[20:], s.loss_mask[20:], s.engine_logprobs[20:]) for s in samples]
    assert shared_prefix_length(short) == 0 < 40 - 20 < MIN_SHARED_PREFIX
    early = samples[:3] + [Sample(samples[3].input_ids, [0] * 35 + [1] * (len(samples[3].input_ids) - 35),
                                  samples[3].engine_logprobs)]  # fmt: skip
    assert shared_prefix_length(early) == 34  # a row trained from token 35: its token 34 predicts it


def test_collate_indexes_the_trained_tokens_in_the_rows_without_the_prefix():
    samples = two_groups()
    shared, full = collate(samples, share_prefix=True), collate(samples)
    assert (shared.shared_prefix, full.shared_prefix) == (40, 0)
    assert collate(samples, packed=True, share_prefix=True).shared_prefix == 0  # packed rows: never
    length = full.input_ids.shape[1]
    rows, columns = shared.positions // (length - 40), shared.positions % (length - 40) + 40
    assert torch.equal(rows * length + columns, full.positions)  # the same tokens
    assert torch.equal(shared.targets, full.targets) and torch.equal(shared.slots, full.slots)
    assert shared.to("cpu").shared_prefix == 40


def test_the_forward_with_the_prefix_run_once_gives_every_rows_logprobs_and_entropy(tiny_model_dir):
    lm = PolicyModel(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32))
    samples = two_groups(seed=1)
    results = []
    for batch in (collate(samples, share_prefix=True), collate(samples)):
        with torch.no_grad():
            results.append(lm(batch.input_ids, None if batch.shared_prefix else batch.attention_mask,
                              batch.position_ids, batch.positions, batch.targets, temperature=TEMPERATURE,
                              chunk_tokens=5, with_entropy=True, shared_prefix=batch.shared_prefix))  # fmt: skip
    (got, got_entropy), (want, want_entropy) = results
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_entropy, want_entropy, rtol=1e-5, atol=1e-6)


# ----- the update ---------------------------------------------------------------------------------

CASES = {
    "token-mean": {},
    "seq-mean-token-mean": {"loss_aggregation": "seq-mean-token-mean"},
    "kl-k3": {"kl_beta": 0.1, "kl_estimator": "k3"},
    "tis": {"tis_cap": 1.5},
    "ppo-epochs-2": {"ppo_epochs": 2, "lr": 1.0},
}  # fmt: skip


@pytest.mark.parametrize("overrides", CASES.values(), ids=CASES.keys())
def test_an_update_with_the_prompt_shared_equals_the_update_running_every_row_in_full(tmp_path, tiny_model_dir,
                                                                                       overrides):  # fmt: skip
    samples = two_groups(seed=2)
    results = []
    for share in (True, False):
        config = grpo_config(tmp_path, tiny_model_dir, micro_batch_size=3, share_prompt_prefix=share, **overrides)
        trainer = make_trainer(config)
        batches = trainer.policy.batches(samples)
        assert len(batches) == 3 and [b.shared_prefix > 0 for b in batches] == [share] * 3
        results.append(run_update(trainer, samples))
    assert_same_update(results[0], results[1])
    assert results[1][0]["tokens"] > 0


def adapter_gradients(trainer) -> dict[str, torch.Tensor]:
    """Filled at the optimizer step with the gradient of every trained parameter (the adapter's)."""
    adapter = [(n, p) for n, p in trainer.policy.language_model().named_parameters() if p.requires_grad]
    gradients, step = {}, trainer.policy.optimizer.step

    def recording_step() -> None:
        gradients.update({n: p.grad.clone() for n, p in adapter})
        step()

    trainer.policy.optimizer.step = recording_step
    return gradients


def test_with_lora_and_the_kl_to_the_base_the_adapters_gradient_is_the_same_with_the_prompt_shared(
    tmp_path, tiny_model_dir
):
    samples = two_groups(seed=4)
    results = []
    for share in (True, False):
        config = grpo_config(tmp_path, tiny_model_dir, micro_batch_size=3, share_prompt_prefix=share, kl_beta=0.1,
                             lora=LoRAConfig(rank=4, alpha=8.0))  # fmt: skip
        trainer = make_trainer(config)
        assert all((b.shared_prefix > 0) == share for b in trainer.policy.batches(samples))
        gradients = adapter_gradients(trainer)
        results.append((trainer.update(samples), gradients))
    (got, got_gradients), (want, want_gradients) = results
    assert got_gradients.keys() == want_gradients.keys() and len(want_gradients) > 0
    for key in ("loss", "kl", "entropy", "grad_norm"):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
    assert abs(want["kl"]) > 1e-6 and want["grad_norm"] > 0
    scale = max(float(g.abs().max()) for g in want_gradients.values())
    for name, gradient in want_gradients.items():
        torch.testing.assert_close(got_gradients[name], gradient, rtol=1e-5, atol=1e-6 * scale, msg=name)


def test_under_gradient_checkpointing_every_row_runs_in_full(tmp_path, tiny_model_dir):
    config = grpo_config(tmp_path, tiny_model_dir, micro_batch_size=None, gradient_checkpointing=True)
    trainer = make_trainer(config)
    assert [b.shared_prefix for b in trainer.policy.batches(two_groups())] == [0]
    trainer.policy.set_checkpointing(False)
    assert [b.shared_prefix for b in trainer.policy.batches(two_groups())] == [40]
