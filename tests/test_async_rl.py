"""Asynchronous GRPO: the prompt ledger, the staleness bound, regeneration of groups that finish
too late, importance weights of tokens from two policies, and dynamic sampling in both modes."""

from __future__ import annotations

import asyncio

import pytest
import torch

from data.schema import Record
from rollout.config import RolloutConfig
from rollout.engines.base import Generation, SamplingParams
from rollout.engines.local import LocalEngine
from rollout.loop import default_reward, run_request
from rollout.request import AsyncRolloutRequest
from rollout.runner import request_from_record
from tests.conftest import ScriptedEngine
from tests.test_grpo import config as grpo_config
from tests.test_grpo import digit_share
from trainer.async_rl import Group, GroupProducer, MeteredEngine, PromptLedger
from trainer.batch import collate, trajectory_sample
from trainer.config import GRPOConfig
from trainer.grpo import GRPOTrainer
from trainer.losses import truncated_is_weights


def records(count: int) -> list[Record]:
    return [Record(prompt=[{"role": "user", "content": f"q{i}"}], ground_truth=str(i)) for i in range(count)]


def config(tmp_path, model_dir, **overrides) -> GRPOConfig:
    """test_grpo's small run, asynchronous, checkpoints only at the end."""
    return grpo_config(
        tmp_path, model_dir, **{"async_rl": True, "max_staleness": 1, "checkpoint_every": 0, **overrides}
    )


# ----- the ledger --------------------------------------------------------------------------------


def test_ledger_consumes_each_prompt_once_and_resumes_where_it_stopped():
    ledger = PromptLedger(records(5), rank=0, world=1)
    drawn = [ledger.next() for _ in range(4)]
    assert drawn == [(0, 0), (1, 0), (2, 0), (3, 0)]
    ledger.consume(1)
    ledger.consume(3)
    assert ledger.state() == {"mark": 0, "consumed": [1, 3]}
    ledger.consume(0)
    assert ledger.state() == {"mark": 2, "consumed": [3]}
    with pytest.raises(RuntimeError, match="consumed twice"):
        ledger.consume(1)
    # after a restart, the prompt that was in flight (2) comes back, the consumed 3 is skipped
    resumed = PromptLedger(records(5), rank=0, world=1, state=ledger.state())
    assert [resumed.next()[0] for _ in range(3)] == [2, 4, 5]
    assert resumed.record(5).ground_truth == "0"  # the stream wraps around the records


def test_ledger_regenerates_a_dropped_prompt_first_with_the_next_attempt():
    ledger = PromptLedger(records(8), rank=0, world=1)
    ledger.next(), ledger.next()
    ledger.regenerate(0, attempt=0)
    assert ledger.next() == (0, 1)
    assert ledger.next() == (2, 0)


def test_ledgers_of_two_processes_take_disjoint_positions():
    left, right = PromptLedger(records(8), 0, 2), PromptLedger(records(8), 1, 2)
    positions = [left.position(left.next()[0]) for _ in range(3)] + [right.position(right.next()[0]) for _ in range(3)]
    assert sorted(positions) == [0, 1, 2, 3, 4, 5]
    right.consume(3)
    assert right.state() == {"mark": 0, "consumed": [1]}


def test_group_staleness_is_measured_on_its_oldest_token():
    request = AsyncRolloutRequest("r", 0, 0, [])
    request.append_generated([5, 6], [-1.0, -1.0], [2, 3])
    request.append_context([7])
    group = Group(position=0, record=records(1)[0], attempt=0, requests=[request])
    assert group.oldest_version() == 2
    assert group.staleness(4) == 2
    assert Group(0, records(1)[0], 0).staleness(4) == 0  # nothing generated yet


async def test_metered_engine_counts_idle_time_between_generations():
    class Slow:
        async def generate(self, input_ids, sampling, rid):
            await asyncio.sleep(0.2)
            return Generation([1], [0.0], "stop")

    engine = MeteredEngine(Slow())
    await asyncio.sleep(0.1)
    await asyncio.gather(*(engine.generate([1], SamplingParams(), f"r{i}") for i in range(3)))
    idle = engine.idle_seconds()
    assert 0.09 <= idle < 0.19  # the 0.1 s before; the three overlapping calls count once as busy
    await asyncio.sleep(0.1)
    assert engine.idle_seconds() >= idle + 0.09


async def test_a_failure_inside_the_producer_reaches_the_trainer_instead_of_hanging_it(chat):
    def broken(group: Group) -> bool:
        raise KeyError("a bug in the filter")

    engine = MeteredEngine(ScriptedEngine(chat, lambda turn, prompt, rid: "hello"))
    producer = GroupProducer(engine, chat, {}, RolloutConfig(max_turns=1), default_reward,
                             PromptLedger(records(4), 0, 1), 2, capacity=2, seed=0, discard=broken)  # fmt: skip
    async with producer:
        with pytest.raises(RuntimeError, match="the rollout producer failed"):
            await asyncio.wait_for(producer.next_finished(), 30)


# ----- the trainer, for real on the tiny model -------------------------------------------------------------


def test_async_staleness_never_exceeds_the_bound(tmp_path, tiny_model_dir):
    trainer = GRPOTrainer(config(tmp_path, tiny_model_dir, steps=4, max_staleness=1), reward_fn=digit_share)
    history = asyncio.run(trainer.train())
    assert [m["step"] for m in history] == [1, 2, 3, 4]
    assert all(m["rollout/staleness_max"] <= 1 for m in history)
    assert max(m["rollout/staleness_max"] for m in history) == 1  # rollouts did overlap the updates
    assert all(m["rollout/groups_trained"] == 2 and m["train/tokens"] > 0 for m in history)
    for key in ("time/elapsed_s", "time/step_wall_s", "time/engine_idle_fraction", "time/trainer_idle_fraction",
                "rollout/dropped", "rollout/prompts_drawn", "rollout/draw_cap_hit"):  # fmt: skip
        assert key in history[-1], key
    assert 0 <= history[-1]["time/engine_idle_fraction"] <= 1
    assert history[-1]["time/elapsed_s"] > history[0]["time/elapsed_s"]
    assert trainer.engine.weight_version == 4


def test_async_with_zero_staleness_is_on_policy(tmp_path, tiny_model_dir):
    trainer = GRPOTrainer(config(tmp_path, tiny_model_dir, steps=3, max_staleness=0), reward_fn=digit_share)
    history = asyncio.run(trainer.train())
    assert all(m["rollout/staleness_max"] == 0 for m in history)


class HoldsOneGroup:
    """The embedded engine, except that the first generation of prompt 0's first attempt returns
    only once the engine holds weight version ``until``: that group finishes too late to train on."""

    def __init__(self, engine: LocalEngine, until: int):
        self.engine, self.until = engine, until
        self.held = 0
        self.rids: set[str] = set()

    async def generate(self, input_ids: list[int], sampling: SamplingParams, rid: str) -> Generation:
        self.rids.add(rid)
        generation = await self.engine.generate(input_ids, sampling, rid)
        if rid.startswith("g0.0-"):
            self.held += 1
            while self.engine.weight_version < self.until:
                await asyncio.sleep(0.01)
        return generation

    async def update_weights(self, state_dict, weight_version=None) -> int:
        return await self.engine.update_weights(state_dict, weight_version)

    async def abort(self, rid=None) -> None:
        await self.engine.abort(rid)

    async def health(self) -> bool:
        return await self.engine.health()


def test_a_group_that_finishes_too_late_is_regenerated_not_trained(tmp_path, tiny_model_dir):
    trainer = GRPOTrainer(config(tmp_path, tiny_model_dir, steps=5, max_staleness=1), reward_fn=digit_share)

    async def main():
        async with trainer.open_engine() as local:
            trainer.engine = HoldsOneGroup(local, until=2)  # two updates later
            return await trainer.train(), trainer.engine

    history, engine = asyncio.run(main())
    assert engine.held == 4  # every sample of the group was held back
    assert sum(m["rollout/dropped"] for m in history) == 1
    assert all(m["rollout/staleness_max"] <= 1 for m in history)
    assert any(rid.startswith("g0.1-") for rid in engine.rids)  # prompt 0 rolled out again
    assert sum(m["rollout/prompts_drawn"] for m in history) == trainer.ledger.mark + len(trainer.ledger.consumed)


def test_dynamic_sampling_refills_until_the_step_is_full(tmp_path, tiny_model_dir):
    def every_third_prompt(request: AsyncRolloutRequest) -> float:  # only these groups have spread
        return float(request.sample_index == 0) if request.prompt_index % 3 == 0 else 0.0

    for async_rl in (False, True):
        settings = dict(steps=2, filter_groups=True, oversample=1.0, max_draws=6.0, async_rl=async_rl)
        trainer = GRPOTrainer(config(tmp_path / str(async_rl), tiny_model_dir, **settings),
                              reward_fn=every_third_prompt)  # fmt: skip
        history = asyncio.run(trainer.train())
        for m in history:
            assert m["rollout/groups_trained"] == 2, async_rl
            assert m["rollout/draw_cap_hit"] == 0
            assert m["rollout/prompts_drawn"] >= 4  # two rounds at least: 2 drawn first had one usable at most
            assert m["rollout/solve_none"] == m["rollout/prompts_drawn"] - 2


def test_dynamic_sampling_stops_at_the_cap_and_says_so(tmp_path, tiny_model_dir):
    for async_rl in (False, True):
        settings = dict(steps=1, filter_groups=True, oversample=1.0, max_draws=3.0, async_rl=async_rl)
        trainer = GRPOTrainer(config(tmp_path / str(async_rl), tiny_model_dir, **settings), reward_fn=lambda r: 0.0)
        (metrics,) = asyncio.run(trainer.train())
        assert metrics["rollout/prompts_drawn"] == 6, async_rl  # 3 x prompts_per_step
        assert metrics["rollout/groups_trained"] == 0
        assert metrics["rollout/draw_cap_hit"] == 1
        assert metrics["train/skipped_update"] == 1


def test_synchronous_mode_is_the_default_and_draws_exactly_the_steps_prompts(tmp_path, tiny_model_dir):
    assert GRPOConfig().async_rl is False
    trainer = GRPOTrainer(config(tmp_path, tiny_model_dir, async_rl=False, steps=2), reward_fn=digit_share)
    history = asyncio.run(trainer.train())
    assert [m["rollout/prompts_drawn"] for m in history] == [2, 2]
    assert [m["rollout/draw_rounds"] for m in history] == [1, 1]
    assert trainer.ledger is None and trainer.state.data_position == 4


# ----- tokens from two policies: the loss weighs each by its own sampler ------------------------------------


def test_a_trajectory_spanning_an_update_is_weighted_by_the_policy_that_sampled_each_token(tmp_path, tiny_model_dir):
    trainer = GRPOTrainer(config(tmp_path, tiny_model_dir, tis_cap=1e9))
    old = {k: v.clone() for k, v in trainer.policy_state_dict().items()}
    new = {k: v + 0.05 * torch.randn_like(v) for k, v in old.items()}
    chat = trainer.chat
    sampling_turns = RolloutConfig(max_turns=1, max_new_tokens=40, max_model_len=768, temperature=1.0, seed=1)

    class UpdatesMidway:
        """The embedded engine; the first time 10 tokens exist, the new weights are loaded."""

        def __init__(self, engine):
            self.engine = engine

        async def generate(self, input_ids, sampling, rid):
            sampling = SamplingParams(**{**sampling.__dict__, "stop_token_ids": []})  # no early stop
            chunks = self.engine.generate_stream(input_ids, sampling, rid)
            async for part in chunks:
                if isinstance(part, Generation):
                    return part
                if len(part.output_ids) >= 10 and self.engine.weight_version == 0:
                    await self.engine.update_weights(new, weight_version=1)

    async def main():
        async with trainer.open_engine() as local:
            request = request_from_record(records(1)[0], 0, 0, "span")
            await run_request(request, UpdatesMidway(local), chat, {}, sampling_turns)
            return request

    request = asyncio.run(main())
    versions = [v for v in request.weight_versions if v is not None]
    assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)

    sample = trajectory_sample(request, 1.0)
    batch = collate([sample])
    mask = batch.loss_mask[0, 1:].bool()
    by_version = torch.tensor([v if v is not None else -1 for v in [None] * len(request.prompt_ids)
                               + request.weight_versions][1:])  # fmt: skip

    def teacher_forced(weights) -> torch.Tensor:
        trainer.policy.language_model().load_state_dict(weights)
        with torch.no_grad():
            return trainer.policy.logprobs(batch)[0][0]

    under_old, under_new = teacher_forced(old), teacher_forced(new)
    engine = batch.engine_logprobs[0, 1:]
    # the engine's logprob of each token is that of the policy that sampled it
    assert torch.allclose(engine[mask & (by_version == 0)], under_old[mask & (by_version == 0)], atol=2e-4)
    assert torch.allclose(engine[mask & (by_version == 1)], under_new[mask & (by_version == 1)], atol=2e-4)
    # trained at version 1: its own tokens weigh ~1, the stale ones pi_new / pi_old
    weights = truncated_is_weights(under_new, engine, 1e9)
    fresh, stale = mask & (by_version == 1), mask & (by_version == 0)
    assert torch.allclose(weights[fresh], torch.ones(int(fresh.sum())), atol=1e-3)
    expected = (under_new[stale] - under_old[stale]).exp()
    assert torch.allclose(weights[stale], expected, rtol=1e-3)
    assert not torch.allclose(expected, torch.ones_like(expected), atol=1e-2)  # the update moved them
    # and the loss takes exactly these weights: with advantage 1 and one pass, each token's
    # surrogate is -weight (AReaL's decoupled objective, proximal policy = the trainer's)
    out = trainer.policy.micro_batch_loss(batch, None, normaliser=float(mask.sum()))
    assert out["pg_loss"] == pytest.approx(-float(weights[mask].mean()), rel=1e-4)
