"""Colocation in ``rallyrl train`` (``trainer/colocation.py``): the embedded engine on the trainer's device
gives its memory back for every update and takes it back with the new weights (the rollouts after it
come from exactly the trainer's weights); in-process SGLang, against a recorded double of SGLang's
documented calls, is started with ``enable_memory_saver`` and called in verl's order; ``--async`` with
colocation runs synchronously and says so."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from types import ModuleType

import fake_sglang
import pytest
import torch
from test_grpo import config, digit_share

from data.config_tree import ConfigError
from rollout.engines.config import EngineConfig, WeightSyncConfig
from trainer.colocation import MISSING_SAVER, plan_colocation
from trainer.grpo import GRPOTrainer


def run(trainer: GRPOTrainer):
    return asyncio.run(trainer.train())


def test_the_embedded_engine_is_released_per_update_and_rebuilt_from_the_trainers_weights(tmp_path, tiny_model_dir):
    said: list[str] = []
    trainer = GRPOTrainer(config(tmp_path, tiny_model_dir, steps=2, colocate=True,
                                 weight_sync=WeightSyncConfig(check_logprobs=True)), reward_fn=digit_share)  # fmt: skip
    trainer.say = said.append  # type: ignore[method-assign]
    history = run(trainer)
    assert any(line.startswith("colocate: the embedded engine releases") for line in said)
    for metrics in history:
        assert metrics["colocate/released_gib"] > 0 and metrics["colocate/retaken_gib"] > 0
        assert metrics["colocate/release_s"] >= 0 and metrics["colocate/resume_s"] >= 0
        # the rebuilt copy generates with the trainer's weights: greedy logprobs agree
        assert metrics["sync/logprob_gap"] < 1e-4
    assert not trainer.engine.released and trainer.engine.weight_version == 2  # type: ignore[union-attr]


def test_colocation_is_off_by_default_on_the_cpu(tmp_path, tiny_model_dir):
    trainer = GRPOTrainer(config(tmp_path, tiny_model_dir, steps=1), reward_fn=digit_share)
    history = run(trainer)
    assert trainer.colocation is None and not any(key.startswith("colocate/") for key in history[0])


def test_async_with_colocation_runs_synchronously_and_says_so(tmp_path, tiny_model_dir):
    said: list[str] = []
    trainer = GRPOTrainer(config(tmp_path, tiny_model_dir, steps=2, colocate=True, async_rl=True),
                          reward_fn=digit_share)  # fmt: skip
    trainer.say = said.append  # type: ignore[method-assign]
    history = run(trainer)
    assert any("this --async run is synchronous" in line for line in said)
    assert [m["step"] for m in history] == [1, 2] and history[-1]["colocate/released_gib"] > 0


def test_async_without_colocate_set_keeps_the_engine_and_says_why(tmp_path, tiny_model_dir, sglang):
    trainer = GRPOTrainer(config(tmp_path, tiny_model_dir, async_rl=True, engine=EngineConfig(kind="sglang")),
                          reward_fn=digit_share)  # fmt: skip
    engine = trainer.open_engine()  # (SGLang's double: an in-process engine on the trainer's GPU)
    colocation, line = plan_colocation(trainer.config, engine, torch.device("cuda"))
    assert colocation is None and line is not None and "--async keeps the engine generating" in line
    synchronous = dataclasses.replace(trainer.config, async_rl=False)
    colocation, line = plan_colocation(synchronous, engine, torch.device("cuda"))
    assert colocation is not None and line is not None and "in-process SGLang releases" in line
    assert plan_colocation(synchronous, engine, torch.device("cpu")) == (None, None)  # (null: only on a GPU)


class Servers:
    """What a pool of servers looks like to the plan (it pushes weights)."""

    async def plan_weight_sync(self, *args):
        return []

    async def push_weights(self, *args):
        return {}


def test_colocate_true_with_servers_is_a_config_error(tmp_path, tiny_model_dir):
    trainer = GRPOTrainer(config(tmp_path, tiny_model_dir, colocate=True), reward_fn=digit_share)
    with pytest.raises(ConfigError, match="in-process engines"):
        plan_colocation(trainer.config, Servers(), trainer.accelerator.device)


# ----- in-process SGLang: a recorded double of its documented calls --------------------------------


@pytest.fixture
def sglang(monkeypatch):
    fake_sglang.install(monkeypatch)
    return monkeypatch


def sglang_config(tmp_path, model_dir, **overrides):
    return config(tmp_path, model_dir, steps=2, colocate=True, engine=EngineConfig(kind="sglang"), **overrides)


def test_in_process_sglang_is_started_with_the_memory_saver_and_called_in_verls_order(tmp_path, tiny_model_dir,
                                                                                     sglang):  # fmt: skip
    sglang.setitem(sys.modules, "torch_memory_saver", ModuleType("torch_memory_saver"))
    trainer = GRPOTrainer(sglang_config(tmp_path, tiny_model_dir), reward_fn=digit_share)
    history = run(trainer)
    fake = trainer.engine.engine  # type: ignore[union-attr]
    assert fake.kwargs["enable_memory_saver"] is True and fake.kwargs["model_path"] == str(tiny_model_dir)
    one_step = ["release:weights,kv_cache,cuda_graph", "resume:weights", "update_weights", "resume:kv_cache,cuda_graph"]
    assert fake.tokenizer_manager.events == one_step * 2
    assert [m["sync/weight_version"] for m in history] == [1, 2]
    assert all("colocate/release_s" in m and "colocate/resume_s" in m for m in history)


def test_in_process_sglang_without_torch_memory_saver_is_a_clear_error(tmp_path, tiny_model_dir, sglang):
    sglang.delitem(sys.modules, "torch_memory_saver", raising=False)
    sglang.setattr("importlib.util.find_spec", lambda name, *a: None)
    trainer = GRPOTrainer(sglang_config(tmp_path, tiny_model_dir), reward_fn=digit_share)
    with pytest.raises(ConfigError, match="torch_memory_saver") as error:
        run(trainer)
    assert str(error.value) == MISSING_SAVER


def test_a_memory_saver_turned_off_by_hand_is_refused(tmp_path, tiny_model_dir, sglang):
    engine = EngineConfig(kind="sglang")
    engine.sglang.server_args["enable_memory_saver"] = False
    trainer = GRPOTrainer(config(tmp_path, tiny_model_dir, colocate=True, engine=engine), reward_fn=digit_share)
    with pytest.raises(ConfigError, match="enable_memory_saver false"):
        trainer.open_engine()
