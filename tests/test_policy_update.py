"""The policy's update on chunked logprobs (``trainer/policy.py``): the same numbers as the
computation it replaces, the full logits of every position (``lm(...).logits``, ``token_logprobs``
and ``entropy_from_logits``), whatever the chunk size, and whether micro-batches are packed or
padded, layers checkpointed or not."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from rollout.config import RolloutConfig
from trainer.batch import Sample, collate, micro_batches
from trainer.config import GRPOConfig
from trainer.grpo import GRPOTrainer
from trainer.losses import entropy_from_logits, token_logprobs
from trainer.policy_model import PolicyModel

TEMPERATURE = 0.7
"""The rollout temperature of every test here: logits are divided by it, in both computations."""

METRICS = ("loss", "pg_loss", "kl", "entropy", "approx_kl", "grad_norm")
"""Real-valued metrics of ``Policy.update``, compared to 1e-5 relative."""

COUNTS = ("clip_fraction", "tokens", "sequences", "skipped_update")
"""Metrics that count tokens: equal (up to float summation)."""


pytestmark = pytest.mark.usefixtures("one_thread")


# ----- the computation before chunking, as a test double of PolicyModel ------------------------


class FullLogits(torch.nn.Module):
    """Today's computation behind PolicyModel's signature: the HF model's full logits of every
    position, divided by the temperature, ``token_logprobs`` / ``entropy_from_logits`` of their
    float32 copy, then the trained positions picked out, as ``[M]`` tensors."""

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm  # a child: its parameters are the policy's, the optimizer's

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor,
                positions: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, chunk_tokens: int = 1024,
                with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        logits = self.lm(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=False).logits[:, :-1]  # fmt: skip
        logits = logits / temperature
        # flat index p of input_ids [R, N] predicts token p + 1: row p // N, column p % N of [R, N - 1]
        assert torch.equal(input_ids.flatten()[positions + 1], targets)

        def trained(values: torch.Tensor) -> torch.Tensor:  # [R, N - 1] -> [M]
            return F.pad(values, (0, 1)).flatten().index_select(0, positions)

        logprobs = trained(token_logprobs(logits.float(), input_ids[:, 1:]))
        entropy = trained(entropy_from_logits(logits.float()).detach()) if with_entropy else None
        return logprobs, entropy


def use_full_logits(trainer: GRPOTrainer) -> None:
    """The policy (and the KL reference) compute today's way, on the same parameters."""
    policy = trainer.policy
    policy.model = FullLogits(policy.language_model())
    if policy.reference is not None:
        policy.reference = FullLogits(policy.reference.lm)


# ----- samples, trainers, and what an update does ------------------------------------------------


def make_sample(rng: random.Random, prompt: int, turns: list[tuple[int, int]], advantage: float) -> Sample:
    """``prompt`` tokens, then per turn ``(generated, context)``: engine tokens (trained), then
    tool output / glue (not trained). Engine logprobs are near the policy's own (~ log 1/105) but
    differ, so truncated importance weights spread on both sides of a cap of 1.5."""
    ids = [rng.randrange(8, 105) for _ in range(prompt)]
    mask, engine = [0] * prompt, [0.0] * prompt
    for generated, context in turns:
        ids += [rng.randrange(8, 105) for _ in range(generated + context)]
        mask += [1] * generated + [0] * context
        engine += [rng.uniform(-5.6, -3.8) for _ in range(generated)] + [0.0] * context
    return Sample(input_ids=ids, loss_mask=mask, engine_logprobs=engine, advantage=advantage)


def make_samples(seed: int = 0) -> list[Sample]:
    """Seven sequences of 7 to 20 tokens, one to three assistant turns, advantages of both signs
    (and one of 0), one ending in a tool output, one with a single trained token."""
    rng = random.Random(seed)
    return [
        make_sample(rng, 5, [(3, 0)], 1.0),
        make_sample(rng, 4, [(2, 3), (4, 0)], -0.5),
        make_sample(rng, 6, [(1, 2), (2, 2), (5, 0)], 0.75),
        make_sample(rng, 3, [(6, 4)], -1.25),
        make_sample(rng, 8, [(4, 2), (3, 1), (2, 0)], 0.3),
        make_sample(rng, 5, [(1, 1)], -0.8),
        make_sample(rng, 9, [(7, 0)], 0.0),
    ]


def grpo_config(tmp_path, model_dir, **overrides: Any) -> GRPOConfig:
    values = dict(
        model=str(model_dir), out=str(tmp_path / "run"), progress=False, seed=3, micro_batch_size=2,
        micro_batch_tokens=None, tis_cap=None, logprob_chunk_tokens=3, lr=1e-3,
        rollout=RolloutConfig(max_turns=2, max_new_tokens=12, max_model_len=768, max_concurrency=256,
                              temperature=TEMPERATURE),
    )  # fmt: skip
    values.update(overrides)
    return GRPOConfig(**values)


def make_trainer(config: GRPOConfig) -> GRPOTrainer:
    """A trainer whose policy is moved off the initial weights (the same way every time), so that
    the KL reference differs from it, and whose AdamW has ``eps`` 1.

    Adam's first step is ``lr * g / (|g| + eps)``: with the default eps (1e-8) it maps a float32
    rounding difference in a gradient element near 1e-8 to a weight difference of a sizeable share
    of ``lr``, so a second epoch compared after it would measure Adam's conditioning (2e-5 relative
    here), not the loss. With eps 1 the step is about ``lr * g``, and as large as the tests need
    with lr near 1 (gradients are clipped to norm 1)."""
    trainer = GRPOTrainer(config)
    for group in trainer.policy.optimizer.param_groups:
        group["eps"] = 1.0
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for parameter in trainer.policy.language_model().parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.02)
    return trainer


def record_gradients(trainer: GRPOTrainer) -> list[dict[str, torch.Tensor]]:
    """The gradient of every parameter at each optimizer step (which then goes on as usual)."""
    steps: list[dict[str, torch.Tensor]] = []
    optimizer, step = trainer.policy.optimizer, trainer.policy.optimizer.step
    named = list(trainer.policy.language_model().named_parameters())

    def recording_step(*args: Any, **kwargs: Any) -> Any:
        missing = [name for name, p in named if p.grad is None]
        assert not missing, f"parameters without a gradient: {missing}"
        steps.append({name: p.grad.detach().clone() for name, p in named})
        return step(*args, **kwargs)

    optimizer.step = recording_step
    return steps


def run_update(trainer: GRPOTrainer, samples: list[Sample]) -> tuple[dict[str, float], list[dict[str, torch.Tensor]]]:
    """``trainer.update(samples)``: its metrics and the gradients of each of its optimizer steps."""
    gradients = record_gradients(trainer)
    metrics = trainer.update(samples)
    return metrics, gradients


def assert_same_update(got: tuple[dict, list], want: tuple[dict, list], metrics: tuple[str, ...] = METRICS) -> None:
    """Metrics, and every parameter's gradient at every optimizer step, to 1e-5 relative: as a
    whole (the norm of the difference) and element by element, with an absolute slack of 1e-6 of
    the step's largest gradient for the elements that float32 sums cancel to near 0."""
    (got_metrics, got_grads), (want_metrics, want_grads) = got, want
    for key in metrics:  # the loss sums per-token terms of both signs, of order 1: 1e-7 is float32's grain
        assert got_metrics[key] == pytest.approx(want_metrics[key], rel=1e-5, abs=1e-7), key
    for key in COUNTS:
        assert got_metrics[key] == pytest.approx(want_metrics[key], rel=1e-6, abs=1e-9), key
    assert len(got_grads) == len(want_grads) > 0
    for step, (got_step, want_step) in enumerate(zip(got_grads, want_grads, strict=True)):
        assert got_step.keys() == want_step.keys()
        scale = max(float(g.abs().max()) for g in want_step.values())
        assert scale > 0
        for name, want_grad in want_step.items():
            where = f"step {step}, {name}"
            error = float((got_step[name] - want_grad).norm() / want_grad.norm().clamp(min=1e-30))
            assert error <= 1e-5, f"{where}: relative error {error:.2e}"
            torch.testing.assert_close(got_step[name], want_grad, rtol=1e-5, atol=1e-6 * scale,
                                       msg=lambda m, where=where: f"{where}: {m}")  # fmt: skip


# ----- the policy's forward ----------------------------------------------------------------------


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_the_policy_forward_gives_the_full_logits_logprobs_and_entropy_of_the_trained_tokens(tiny_model_dir, packed):
    lm = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    batch = collate(make_samples(), pad_id=0, packed=packed)
    arguments = (batch.input_ids, batch.attention_mask, batch.position_ids, batch.positions, batch.targets)
    with torch.no_grad():
        got = PolicyModel(lm)(*arguments, temperature=TEMPERATURE, chunk_tokens=3, with_entropy=True)
        want = FullLogits(lm)(*arguments, temperature=TEMPERATURE, with_entropy=True)
    assert got[0].shape == got[1].shape == (int(batch.loss_mask[:, 1:].sum()),)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)


# ----- the update: chunked against today's computation -------------------------------------------

UPDATE_CASES = {
    "token-mean": {"loss_aggregation": "token-mean"},
    "seq-mean-token-mean": {"loss_aggregation": "seq-mean-token-mean"},
    "dr-grpo": {"loss_aggregation": "seq-mean-token-sum-norm"},
    "kl-k1": {"kl_beta": 0.1, "kl_estimator": "k1"},
    "kl-k3": {"kl_beta": 0.1, "kl_estimator": "k3"},
    "tis": {"tis_cap": 1.5},
    "ppo-epochs-2": {"ppo_epochs": 2, "lr": 1.0},
    "everything": {"loss_aggregation": "seq-mean-token-mean", "kl_beta": 0.05, "kl_estimator": "k3",
                   "tis_cap": 1.5, "ppo_epochs": 2, "lr": 1.0},
}  # fmt: skip


@pytest.mark.parametrize("overrides", UPDATE_CASES.values(), ids=UPDATE_CASES.keys())
def test_the_chunked_update_equals_todays_full_logits_update(tmp_path, tiny_model_dir, overrides):
    samples = make_samples()
    config = grpo_config(tmp_path, tiny_model_dir, **overrides)
    chunked = make_trainer(config)
    assert len(chunked.policy.batches(samples)) > 1 and config.logprob_chunk_tokens < 5  # many micro-batches, chunks
    got = run_update(chunked, samples)
    today = make_trainer(config)
    use_full_logits(today)
    want = run_update(today, samples)
    assert_same_update(got, want)
    # each setting had something to act on
    assert want[0]["tokens"] > 0 and want[0]["entropy"] > 0
    if config.kl_beta > 0:
        assert abs(want[0]["kl"]) > 1e-6
    if config.ppo_epochs > 1:
        assert len(want[1]) == config.ppo_epochs and want[0]["clip_fraction"] > 0


def test_the_chunk_size_does_not_change_the_update(tmp_path, tiny_model_dir):
    samples = make_samples(seed=1)
    results = []
    for chunk in (1, 1024, 0):  # one token at a time, all at once, the unchunked reference
        config = grpo_config(tmp_path, tiny_model_dir, logprob_chunk_tokens=chunk, kl_beta=0.1, tis_cap=1.5)
        results.append(run_update(make_trainer(config), samples))
    assert_same_update(results[0], results[2])
    assert_same_update(results[1], results[2])


# ----- packing ------------------------------------------------------------------------------------


def test_collate_packed_puts_the_samples_in_one_row_with_positions_restarting_at_zero():
    samples = make_samples()[:3]
    lengths = [len(s.input_ids) for s in samples]
    packed, padded = collate(samples, pad_id=0, packed=True), collate(samples, pad_id=0, packed=False)
    assert packed.packed and packed.attention_mask is None and not padded.packed
    assert packed.input_ids.shape == packed.position_ids.shape == (1, sum(lengths))
    assert packed.input_ids[0].tolist() == [token for s in samples for token in s.input_ids]
    assert packed.position_ids[0].tolist() == [p for n in lengths for p in range(n)]
    # the same trained tokens, their logprobs going to the same [B, T - 1] slots
    assert torch.equal(packed.targets, padded.targets) and torch.equal(packed.slots, padded.slots)
    assert torch.equal(packed.input_ids.flatten()[packed.positions + 1], packed.targets)
    assert torch.equal(padded.input_ids.flatten()[padded.positions + 1], padded.targets)
    for name in ("loss_mask", "engine_logprobs", "advantages"):
        assert torch.equal(getattr(packed, name), getattr(padded, name)), name


def test_packed_micro_batches_count_the_sum_of_lengths_padded_ones_rows_times_the_longest():
    rng = random.Random(0)
    samples = [make_sample(rng, n - 1, [(1, 0)], 1.0) for n in (5, 2, 3)]
    assert [[len(s.input_ids) for s in chunk] for chunk in micro_batches(samples, 8, 10, packed=True)] == [[2, 3, 5]]
    assert [[len(s.input_ids) for s in chunk] for chunk in micro_batches(samples, 8, 10)] == [[2, 3], [5]]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_and_padded_micro_batches_give_the_same_update(tmp_path, tiny_model_dir, attention):
    samples = make_samples(seed=2)
    results = []
    for packing in (True, False):
        config = grpo_config(tmp_path, tiny_model_dir, packing=packing, micro_batch_size=3, kl_beta=0.1,
                             tis_cap=1.5, loss_aggregation="seq-mean-token-mean")  # fmt: skip
        trainer = make_trainer(config)
        models = [trainer.policy.language_model(), trainer.policy.reference.lm]
        for lm in models:
            lm.set_attn_implementation(attention)
        assert [lm.config._attn_implementation for lm in models] == [attention] * 2
        batches = trainer.policy.batches(samples)
        assert len(batches) > 1 and all(b.packed == packing for b in batches)
        assert all(b.input_ids.shape[0] == 1 for b in batches) or not packing
        results.append(run_update(trainer, samples))
    assert_same_update(results[0], results[1])


BUDGET_SAMPLES = 2
"""``make_samples(2)``: lengths 7, 8, 13, 13, 16, 18, 20; under a budget of 45 tokens, packed
micro-batches (the sum of lengths) hold 4, 2, 1 samples and padded ones (rows x the longest) 3, 2, 2."""


def budget_update(tmp_path, model_dir, packing: bool, aggregation: str) -> tuple[dict, list]:
    config = grpo_config(tmp_path, model_dir, packing=packing, micro_batch_size=8, micro_batch_tokens=45,
                         loss_aggregation=aggregation, kl_beta=0.1, tis_cap=1.5)  # fmt: skip
    trainer = make_trainer(config)
    samples = make_samples(seed=BUDGET_SAMPLES)
    assert [len(b) for b in trainer.policy.batches(samples)] == ([4, 2, 1] if packing else [3, 2, 2])
    return run_update(trainer, samples)


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_under_a_token_budget_packed_and_padded_micro_batches_differ_but_the_gradients_agree(
    tmp_path, tiny_model_dir, aggregation
):
    packed = budget_update(tmp_path, tiny_model_dir, True, aggregation)
    padded = budget_update(tmp_path, tiny_model_dir, False, aggregation)
    assert_same_update(packed, padded, metrics=("loss", "pg_loss", "kl", "entropy", "approx_kl", "grad_norm"))


@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_the_logged_loss_does_not_depend_on_the_micro_batches(tmp_path, tiny_model_dir, aggregation):
    packed = budget_update(tmp_path, tiny_model_dir, True, aggregation)
    padded = budget_update(tmp_path, tiny_model_dir, False, aggregation)
    for key in ("loss", "pg_loss"):
        assert packed[0][key] == pytest.approx(padded[0][key], rel=1e-5, abs=1e-7), key


# ----- gradient checkpointing ---------------------------------------------------------------------


def count_runs(module: torch.nn.Module) -> list[int]:
    """A list that grows by one at each run of ``module.forward``, the recomputation in backward
    included (module hooks do not see it: checkpointing wraps ``forward``, not ``__call__``)."""
    runs: list[int] = []
    forward = module.forward

    def counted(*args: Any, **kwargs: Any) -> Any:
        runs.append(1)
        return forward(*args, **kwargs)

    module.forward = counted
    return runs


def test_gradient_checkpointing_recomputes_the_layers_and_gives_the_same_update(tmp_path, tiny_model_dir):
    samples = make_samples(seed=3)
    results, layer_runs = [], []
    for checkpointing in (True, False):
        config = grpo_config(tmp_path, tiny_model_dir, gradient_checkpointing=checkpointing, kl_beta=0.1,
                             tis_cap=1.5)  # fmt: skip
        trainer = make_trainer(config)
        lm = trainer.policy.language_model()
        assert trainer.policy.checkpointing == checkpointing
        assert all(layer.gradient_checkpointing == checkpointing for layer in lm.model.layers)
        runs = count_runs(lm.model.layers[0].mlp)  # the policy's (the frozen reference's is another module)
        results.append(run_update(trainer, samples))
        layer_runs.append(len(runs) / len(trainer.policy.batches(samples)))
    assert_same_update(results[0], results[1])
    assert layer_runs == [2, 1]  # checkpointed, each micro-batch's layers run again in backward
