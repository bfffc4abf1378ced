"""The shipped tiny-calc model: its size and layout, what it can do, and the commands that default to it."""

from __future__ import annotations

import json

import orjson
from conftest import run_cli
from safetensors import safe_open

from data.tiny_model import EMBEDDED_MODEL, char_vocab
from rollout.request import validate_trajectory
from rollout.tokens import load_tokenizer
from trainer.sft import calc_chat, evaluate_greedy


def test_the_embedded_model_is_a_qwen2_of_1_to_5_m_parameters_under_20_mb():
    config = json.loads((EMBEDDED_MODEL / "config.json").read_text())
    assert config["model_type"] == "qwen2"
    with safe_open(EMBEDDED_MODEL / "model.safetensors", "pt") as weights:
        params = sum(weights.get_tensor(name).numel() for name in weights.keys())  # noqa: SIM118
    assert 1_000_000 <= params <= 5_000_000
    assert sum(f.stat().st_size for f in EMBEDDED_MODEL.rglob("*") if f.is_file()) < 20 * 2**20


def test_the_embedded_tokenizer_is_the_character_tokenizer_with_the_tool_template():
    tokenizer = load_tokenizer(EMBEDDED_MODEL)
    assert len(tokenizer) == len(char_vocab())
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("<tool_call>{")) == ["<tool_call>", "{"]
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tools=[{"name": "calculator"}], tokenize=False
    )
    assert "# Tools" in rendered and "calculator" in rendered


async def test_the_embedded_model_calls_its_calculator_on_some_problems_and_then_mostly_gets_them_right():
    """Greedy on held-out problems: the habit RL is to unlearn (answering without the tool on
    many problems), well-formed and mostly exact calls when it does call, a moderate accuracy."""
    chat, tools = calc_chat(load_tokenizer(EMBEDDED_MODEL))
    metrics = await evaluate_greedy(EMBEDDED_MODEL, chat, tools, num_prompts=48, seed=12345, device="cpu")
    assert 0.2 <= metrics["tool_call_rate"] <= 0.8
    assert metrics["well_formed_calls"] >= 0.9
    assert metrics["exact_calls"] >= 0.5 * metrics["tool_call_rate"]
    assert 0.05 <= metrics["accuracy"] <= 0.5
    assert metrics["consistency_failures"] == 0


def test_rollout_with_no_model_option_runs_on_the_embedded_model(tmp_path):
    out = tmp_path / "rollouts.jsonl"
    done = run_cli("rollout", "--num-prompts", "8", "--out", str(out), "--no-progress")
    assert done.returncode == 0, done.stderr
    trajectories = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert len(trajectories) == 8
    for trajectory in trajectories:
        validate_trajectory(trajectory)
    assert any(t["tool_calls"] for t in trajectories)
