"""``micro_batch_tokens: auto`` (``trainer/memory_budget.py``): the probe's decisions on a meter whose
peaks follow a known law (the largest budget under the target; checkpointing off where the budget
without it holds the longest sequence; a size that runs out of memory does not fit; a verified peak
over the target moves the budget down; a longer step probes again), and on the real tiny policy: the
CPU without a limit keeps 8,192 tokens, and the probe leaves the update as the fixed budget makes it.
The real-vocabulary runs under a memory limit are ``tests/test_memory_budget_rss.py``."""

from __future__ import annotations

from typing import Any

import pytest
from test_policy_update import assert_same_update, grpo_config, make_samples, make_trainer, run_update

from trainer.memory_budget import FIXED_TOKENS, BudgetProbe, GiB, MemoryMeter

pytestmark = pytest.mark.usefixtures("one_thread")

FLOOR = 1 * GiB


class LawMeter(MemoryMeter):
    """A meter whose limit is fixed and whose floor is ``FLOOR``."""

    def __init__(self, limit: int):
        super().__init__()
        self.fixed = limit

    def limit(self) -> int:
        return self.fixed

    def current(self) -> int:
        return FLOOR

    def reset_peak(self) -> None:  # (the peaks come from ``by_law``, which replaces the measurement)
        pass

    def peak(self) -> int:
        return FLOOR

    def settle(self) -> None:
        pass


def by_law(monkeypatch, per_token: dict[bool, float], fixed: float = 0.0, oom_over: dict[bool, int] | None = None,
           extra_over: tuple[int, float] | None = None) -> list[tuple[bool, int, int]]:  # fmt: skip
    """``BudgetProbe.measure`` answers FLOOR + fixed + per_token[checkpointing] x tokens (None above
    ``oom_over[checkpointing]`` tokens; ``extra_over`` (tokens, bytes): more above that many); returns
    the probes made, as (checkpointing, rows, length)."""
    made: list[tuple[bool, int, int]] = []

    def measure(self: BudgetProbe, rows: int, length: int) -> int | None:
        checkpointing = self.policy.checkpointing
        made.append((checkpointing, rows, length))
        tokens = rows * length
        if oom_over and tokens > oom_over.get(checkpointing, 1 << 62):
            return None
        extra = extra_over[1] if extra_over and tokens > extra_over[0] else 0.0
        return int(FLOOR + fixed + per_token[checkpointing] * tokens + extra)

    monkeypatch.setattr(BudgetProbe, "measure", measure)
    return made


@pytest.fixture
def policy(tmp_path, tiny_model_dir):
    return make_trainer(grpo_config(tmp_path, tiny_model_dir, micro_batch_tokens="auto")).policy


def target(policy: Any, limit: int, headroom: float = 0.15) -> float:
    return (1 - headroom) * limit - BudgetProbe(policy, LawMeter(limit), headroom).optimizer_state_to_come()


def test_checkpointing_stays_off_where_the_budget_without_it_holds_the_longest_sequence(policy, monkeypatch):
    limit = 10 * GiB
    made = by_law(monkeypatch, {False: 200_000, True: 50_000})
    budget = BudgetProbe(policy, LawMeter(limit), 0.15).decide(1024, step_tokens=10**6, setting=None)
    assert budget.checkpointing is False and budget.fits
    room = target(policy, limit) - FLOOR
    assert budget.tokens == int(room // 200_000) // 1024 * 1024  # whole rows of the longest sequence
    assert budget.tokens > 16 * 1024
    assert all(not checkpointing for checkpointing, _, _ in made)  # (never probed with it on)
    assert made[-1] == (False, budget.tokens // 1024, 1024)  # the budget itself was measured


def test_checkpointing_turns_on_where_one_sequence_does_not_fit_without_it(policy, monkeypatch):
    limit = 10 * GiB
    made = by_law(monkeypatch, {False: 2_000_000, True: 100_000}, oom_over={False: 4096})
    budget = BudgetProbe(policy, LawMeter(limit), 0.15).decide(8192, step_tokens=10**6, setting=None)
    assert budget.checkpointing is True and budget.fits and budget.tokens >= 8192
    assert (False, 1, 8192) not in made  # predicted from the smaller probes, or out of memory: not run
    assert budget.expected_peak <= 0.85 * limit + 1


def test_an_explicit_setting_is_kept_and_only_the_budget_is_decided(policy, monkeypatch):
    made = by_law(monkeypatch, {False: 100_000, True: 100_000})
    budget = BudgetProbe(policy, LawMeter(10 * GiB), 0.15).decide(1024, step_tokens=10**6, setting=True)
    assert budget.checkpointing is True and {checkpointing for checkpointing, _, _ in made} == {True}


def test_a_verified_peak_over_the_target_moves_the_budget_down(policy, monkeypatch):
    limit = 10 * GiB
    room = target(policy, limit) - FLOOR
    # linear up to 32 k tokens, then a jump the line cannot see: the verification finds it
    by_law(monkeypatch, {False: 50_000, True: 50_000}, extra_over=(32_768, room))
    probe = BudgetProbe(policy, LawMeter(limit), 0.15)
    budget = probe.decide(1024, step_tokens=10**6, setting=False)
    assert 4096 <= budget.tokens <= 32_768  # (the line alone: about 160 k)
    assert budget.expected_peak <= target(policy, limit) + probe.optimizer_state_to_come()


def test_the_budget_stops_at_the_step_and_says_so(policy, monkeypatch):
    by_law(monkeypatch, {False: 1_000, True: 1_000})
    budget = BudgetProbe(policy, LawMeter(10 * GiB), 0.15).decide(512, step_tokens=8 * 512, setting=None)
    assert budget.tokens == 8 * 512 and budget.capped


def test_nothing_fits_is_said_and_the_budget_is_the_longest_sequence(policy, monkeypatch):
    by_law(monkeypatch, {False: 10**9, True: 10**9})
    budget = BudgetProbe(policy, LawMeter(2 * GiB), 0.15).decide(1024, step_tokens=10**6, setting=None)
    assert not budget.fits and budget.tokens == 1024 and budget.checkpointing is True
    assert "sequence does not fit under 85% of 2.0 GiB with gradient checkpointing on" in budget.describe()


def test_auto_on_the_cpu_without_a_limit_keeps_8192_tokens_and_does_not_probe(tmp_path, tiny_model_dir,
                                                                              monkeypatch):  # fmt: skip
    trainer = make_trainer(grpo_config(tmp_path, tiny_model_dir, micro_batch_tokens="auto"))
    monkeypatch.setattr(BudgetProbe, "decide", lambda *a, **k: pytest.fail("probed without a limit"))
    metrics = trainer.update(make_samples())
    assert metrics["micro_batch_tokens"] == FIXED_TOKENS
    assert metrics["peak_memory_gib"] > 0


def test_auto_probes_once_and_updates_as_its_budget_fixed_does(tmp_path, tiny_model_dir, monkeypatch):
    """The tiny model on the CPU with a limit: the real probe (peak RSS), said once, kept for a step
    with no longer sequence, re-run for a longer one; the update equals the fixed budget's."""
    samples = make_samples()
    auto = make_trainer(grpo_config(tmp_path / "auto", tiny_model_dir, micro_batch_tokens="auto",
                                    micro_batch_size=None, memory_limit_gib=16.0))  # fmt: skip
    said: list[str] = []
    auto.policy.say = said.append
    decide = BudgetProbe.decide
    lengths: list[int] = []

    def counted(self: BudgetProbe, longest: int, *args: Any, **kwargs: Any) -> Any:
        lengths.append(longest)
        return decide(self, longest, *args, **kwargs)

    monkeypatch.setattr(BudgetProbe, "decide", counted)
    got = run_update(auto, samples)
    budget = auto.policy.budget
    assert budget is not None and budget.probed_length == 256 and lengths == [256]
    assert len(said) == 1 and said[0].startswith("micro_batch_tokens auto: ")
    assert got[0]["micro_batch_tokens"] == budget.tokens

    fixed = make_trainer(grpo_config(tmp_path / "fixed", tiny_model_dir, micro_batch_tokens=budget.tokens,
                                     micro_batch_size=None, gradient_checkpointing=budget.checkpointing))  # fmt: skip
    assert_same_update(got, run_update(fixed, samples))

    auto.update(make_samples(seed=1))  # no longer than probed: the decision holds
    assert lengths == [256]
    longer = make_samples(seed=2)
    longer[0].input_ids += [3] * 300
    longer[0].loss_mask += [1] * 300
    longer[0].engine_logprobs += [-1.0] * 300
    auto.update(longer)
    assert lengths == [256, 512] and len(said) == 2
