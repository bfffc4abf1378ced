"""Out of memory in the update is an answer, not a crash (``Policy.update``): an injected device OOM is
answered by running the step again with half the micro-batch token budget, which gives the same update;
a second OOM, or one after an optimizer step, is an ``UpdateOutOfMemory`` naming the budget and the
longest sequence."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from test_policy_update import assert_same_update, grpo_config, make_samples, make_trainer, run_update

from trainer.policy import Policy, UpdateOutOfMemory

pytestmark = pytest.mark.usefixtures("one_thread")

BUDGET = 64
"""The run's micro_batch_tokens: every micro-batch of the test samples (7 to 20 tokens) fits in it."""


def inject_oom(monkeypatch, over_tokens: int, *, after_steps: int = 0) -> list[int]:
    """Micro-batches of more than ``over_tokens`` padded tokens raise a device OOM (once ``after_steps``
    optimizer steps were taken); returns the padded size of every micro-batch the loss saw."""
    seen: list[int] = []
    loss = Policy.micro_batch_loss

    def micro_batch_loss(self: Policy, batch: Any, *args: Any, **kwargs: Any) -> Any:
        size = int(batch.input_ids.numel())
        seen.append(size)
        if size > over_tokens and self.optimizer.state_steps >= after_steps:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {size} MiB (injected)")
        return loss(self, batch, *args, **kwargs)

    monkeypatch.setattr(Policy, "micro_batch_loss", micro_batch_loss)
    return seen


def count_steps(trainer) -> None:
    """``optimizer.state_steps``: the optimizer steps taken so far."""
    optimizer, step = trainer.policy.optimizer, trainer.policy.optimizer.step
    optimizer.state_steps = 0

    def counted(*args: Any, **kwargs: Any) -> Any:
        optimizer.state_steps += 1
        return step(*args, **kwargs)

    optimizer.step = counted


def test_an_oom_runs_the_step_again_with_half_the_budget_and_the_same_update(tmp_path, tiny_model_dir,
                                                                             monkeypatch, caplog):  # fmt: skip
    samples = make_samples()
    want = run_update(make_trainer(grpo_config(tmp_path / "a", tiny_model_dir, micro_batch_tokens=BUDGET)), samples)

    trainer = make_trainer(grpo_config(tmp_path / "b", tiny_model_dir, micro_batch_tokens=BUDGET))
    count_steps(trainer)
    seen = inject_oom(monkeypatch, over_tokens=BUDGET // 2)
    with caplog.at_level(logging.WARNING, logger="trainer.policy"):
        got = run_update(trainer, samples)

    assert got[0]["oom_retries"] == 1 and want[0]["oom_retries"] == 0
    assert_same_update(got, want)  # the micro-batches differ, the update does not
    first_oom = next(i for i, size in enumerate(seen) if size > BUDGET // 2)
    assert all(size <= BUDGET // 2 for size in seen[first_oom + 1 :])  # the retry kept under half the budget
    assert "out of memory in the update" in caplog.text and f"micro_batch_tokens {BUDGET // 2}" in caplog.text
    assert trainer.policy.optimizer.state_steps == 1  # one optimizer step: the failed try took none


def test_a_second_oom_is_a_clear_error_naming_the_budget_and_the_longest_sequence(tmp_path, tiny_model_dir,
                                                                                  monkeypatch):  # fmt: skip
    trainer = make_trainer(grpo_config(tmp_path, tiny_model_dir, micro_batch_tokens=BUDGET))
    count_steps(trainer)
    inject_oom(monkeypatch, over_tokens=0)  # every micro-batch
    samples = make_samples()
    longest = max(len(s.input_ids) for s in samples)
    with pytest.raises(UpdateOutOfMemory, match=rf"again with micro_batch_tokens {BUDGET // 2} .*"
                                                rf"longest sequence has {longest} tokens"):  # fmt: skip
        trainer.update(samples)
    assert trainer.policy.optimizer.state_steps == 0
    assert all(p.grad is None for p in trainer.policy.language_model().parameters())  # nothing half-applied


def test_an_oom_after_an_optimizer_step_is_not_run_again(tmp_path, tiny_model_dir, monkeypatch):
    trainer = make_trainer(grpo_config(tmp_path, tiny_model_dir, micro_batch_tokens=BUDGET, ppo_epochs=2))
    count_steps(trainer)
    inject_oom(monkeypatch, over_tokens=0, after_steps=1)  # the second epoch's first micro-batch
    with pytest.raises(UpdateOutOfMemory, match=r"after an optimizer step \(ppo_epochs > 1\)"):
        trainer.update(make_samples())
    assert trainer.policy.optimizer.state_steps == 1  # the first epoch's step was not taken twice
