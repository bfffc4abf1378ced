"""Settings given in a training YAML reach the rollouts: tool_parser, tool_timeout_s,
max_parallel_calls, top_k and a judge reward (a judge behind a real loopback HTTP server, and
``rallyrl train`` against a judge served by ``rallyrl serve``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from data.tiny_model import EMBEDDED_MODEL
from rollout.engines.base import Generation, SamplingParams
from rollout.parsers import ParsedTurn, ToolCall, register_parser
from rollout.runner import RolloutRunner
from rollout.serve.processes import serve_processes
from rollout.tokens import ChatTokenizer, load_tokenizer
from tests.conftest import ScriptedEngine, run_cli, serving
from trainer.config import load_config
from trainer.grpo import GRPOTrainer

TOOLS_YAML = "tools:\n  - class_name: tests.conftest:CountingTool\n"


@register_parser("test-call-lines")
def call_lines(text: str) -> ParsedTurn:
    """A test format: one ``CALL name {json}`` per line."""
    calls = [ToolCall(m[1], json.loads(m[2])) for m in re.finditer(r"^CALL (\w+) (\{.*\})$", text, re.M)]
    return ParsedTurn(re.sub(r"^CALL .*$", "", text, flags=re.M).strip(), calls)


class TrainableScriptedEngine(ScriptedEngine):
    """A scripted policy that takes weight updates (and ignores them) and records its sampling."""

    sampling: list[SamplingParams]

    async def generate(self, input_ids: list[int], sampling: SamplingParams, rid: str) -> Generation:
        self.__dict__.setdefault("sampling", []).append(sampling)
        return await super().generate(input_ids, sampling, rid)

    async def update_weights(self, state_dict: dict[str, Any], weight_version: int | None = None) -> int:
        self.weight_version = weight_version or 0
        return self.weight_version


def write_config(tmp_path: Path, model_dir: Path, **sections: Any) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    sections["rollout"] = {"max_new_tokens": 400, "max_model_len": 2048, **sections.get("rollout", {})}
    tools = tmp_path / "tools.yaml"
    tools.write_text(TOOLS_YAML)
    values = {"model": str(model_dir), "out": str(tmp_path / "run"), "steps": 1, "prompts_per_step": 2,
              "samples_per_prompt": 2, "tools": str(tools), "filter_groups": False, "progress": False,
              "checkpoint_every": 0, **sections}  # fmt: skip
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def one_step(config_path: Path, chat_script) -> tuple[list, TrainableScriptedEngine]:
    """One GRPO step of the config at ``config_path`` on a scripted policy; its requests."""
    config = load_config(config_path)
    trainer = GRPOTrainer(config)
    engine = TrainableScriptedEngine(trainer.chat, chat_script)
    trainer.engine = engine
    with recorded_rollouts() as seen:
        asyncio.run(trainer.train())
    return seen, engine


def calls_in(format_: str, count: int, **arguments: Any) -> str:
    body = json.dumps({"text": "hi", **arguments})
    if format_ == "lines":
        return "\n".join(f"CALL echo {body}" for _ in range(count))
    return "".join(f'<tool_call>{{"name": "echo", "arguments": {body}}}</tool_call>' for _ in range(count))


def test_tool_parser_from_the_training_yaml_parses_the_calls(tmp_path, tiny_model_dir):
    script = lambda turn, prompt, rid: calls_in("lines", 1) if turn == 0 else "done"  # noqa: E731
    path = write_config(tmp_path, tiny_model_dir, rollout={"tool_parser": "test-call-lines"})
    requests, _ = one_step(path, script)
    assert requests and all(len(r.tool_calls) == 1 and r.tool_calls[0].error is None for r in requests)
    # the same script under the default parser calls nothing: the setting is what made the difference
    requests, _ = one_step(write_config(tmp_path / "b", tiny_model_dir), script)
    assert all(not r.tool_calls for r in requests)


def test_tool_timeout_from_the_training_yaml_cuts_slow_calls(tmp_path, tiny_model_dir):
    script = lambda turn, prompt, rid: calls_in("qwen25", 1, sleep=2.0) if turn == 0 else "done"  # noqa: E731
    path = write_config(tmp_path, tiny_model_dir, rollout={"tool_timeout_s": 0.1})
    requests, _ = one_step(path, script)
    assert requests
    for request in requests:
        assert request.tool_calls[0].error == "tool echo timed out after 0.1 s"
        assert request.tool_calls[0].latency_s < 1.5


def test_max_parallel_calls_from_the_training_yaml_skips_extra_calls(tmp_path, tiny_model_dir):
    script = lambda turn, prompt, rid: calls_in("qwen25", 3) if turn == 0 else "done"  # noqa: E731
    path = write_config(tmp_path, tiny_model_dir, rollout={"max_parallel_calls": 1})
    requests, _ = one_step(path, script)
    for request in requests:
        errors = [call.error for call in request.tool_calls]
        assert errors[0] is None and all(e and "at most 1 tool calls" in e for e in errors[1:]) and len(errors) == 3


def test_top_k_from_the_training_yaml_reaches_the_engine(tmp_path, tiny_model_dir):
    path = write_config(tmp_path, tiny_model_dir, rollout={"top_k": 7, "temperature": 0.7})
    _, engine = one_step(path, lambda turn, prompt, rid: "done")
    assert engine.sampling and {(s.top_k, s.temperature) for s in engine.sampling} == {(7, 0.7)}


@contextlib.contextmanager
def recorded_rollouts():
    """Every request the trainer's rollouts finish, collected as ``RolloutRunner.run`` returns them."""
    seen: list = []
    run = RolloutRunner.run

    async def recording_run(self, *args, **kwargs):
        result = await run(self, *args, **kwargs)
        seen.extend(result.requests)
        return result

    RolloutRunner.run = recording_run  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        RolloutRunner.run = run  # type: ignore[method-assign]


def test_a_judge_reward_from_the_training_yaml_scores_every_trajectory(tmp_path, tiny_model_dir):
    async def main() -> list:
        chat = ChatTokenizer(load_tokenizer(EMBEDDED_MODEL))
        judge_model = ScriptedEngine(chat, lambda turn, prompt, rid: "The answer matches. score: 8")
        async with serving(judge_model) as url:
            path = write_config(tmp_path, tiny_model_dir, reward="judge", judge={"url": url, "max_concurrency": 2})
            trainer = GRPOTrainer(load_config(path))
            trainer.engine = TrainableScriptedEngine(trainer.chat, lambda turn, prompt, rid: "\\boxed{4}")
            with recorded_rollouts() as seen:
                await trainer.train()
            assert trainer.judge is not None and trainer.judge.max_in_flight <= 2
            return seen

    requests = asyncio.run(main())
    assert len(requests) == 4
    assert all(r.rewards.judge == pytest.approx(0.8) and r.rewards.final == pytest.approx(0.8) for r in requests)


@pytest.mark.slow
def test_rallyrl_train_with_a_judge_served_by_rallyrl_serve(tmp_path):
    """End to end through the CLI: the judge is the embedded model behind ``rallyrl serve``. It is a
    calculator, not a grader, so its replies do not parse: every judgment is recorded as failed, the
    rewards are missing (never a silent 0), and the run still completes."""
    (tmp_path / "logs").mkdir()
    with serve_processes(EMBEDDED_MODEL, tmp_path / "logs") as (server,):
        config = {"steps": 1, "prompts_per_step": 2, "samples_per_prompt": 2, "out": str(tmp_path / "run"),
                  "reward": "judge", "judge": {"url": server.url, "max_retries": 0, "max_new_tokens": 16},
                  "rollout": {"max_new_tokens": 48}, "checkpoint_every": 0, "filter_groups": False}  # fmt: skip
        path = tmp_path / "train.yaml"
        path.write_text(yaml.safe_dump(config))
        done = run_cli("train", "--config", str(path), "--no-progress", timeout=600)
    assert done.returncode == 0, done.stderr
    [metrics] = [orjson.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_bytes().splitlines()]
    assert metrics["rollout/trajectories"] == 4
    assert metrics["rollout/rewards_missing"] == 4 and metrics["train/skipped_update"] == 1
    log = server.output()
    assert "Traceback" not in log
