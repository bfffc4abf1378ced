"""The agent examples (data/agents/) run end to end as a user runs them: `rallyrl rollout|train --agent`
and the standalone `rallyrl gateway`, in real subprocesses with the embedded model. Each recorded
session is a valid, token-exact trajectory; the rewriting agent's sessions split into samples that
are all trained; the OpenAI Agents SDK's own history resend keeps a session one trajectory."""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import ScriptedEngine, call, run_cli

from data.agents import calc_openai, calc_openai_agents
from data.synthetic import make_calc_records
from data.tiny_model import EMBEDDED_MODEL
from rollout.config import GatewayConfig, RolloutConfig
from rollout.gateway import Gateway
from rollout.request import AsyncRolloutRequest, Segment, validate_trajectory
from rollout.tokens import ChatTokenizer, load_tokenizer
from tools.calculator import CalculatorError, evaluate, format_number
from trainer.batch import step_spans, trajectory_samples

CLOSE = "<|im_end|>"


def rollout_with(agent: str, out: Path) -> list[dict[str, Any]]:
    """`rallyrl rollout --agent agent` over 8 calc prompts, 2 samples each; the trajectories written."""
    result = run_cli("rollout", "--agent", agent, "--num-prompts", "8", "-n", "2", "--out", str(out),
                     "--no-progress", timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.fixture(scope="module")
def embedded_tokenizer() -> Any:
    return load_tokenizer(EMBEDDED_MODEL)


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> list[dict[str, Any]]:
    return rollout_with("data.agents.calc_openai:run", tmp_path_factory.mktemp("plain") / "plain.jsonl")


@pytest.fixture(scope="module")
def rewriting(tmp_path_factory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("rewriting") / "rewriting.jsonl"
    return out, rollout_with("data.agents.calc_openai:run_rewriting", out)


def calculator_text(expression: str) -> str:
    try:
        return format_number(evaluate(expression))
    except CalculatorError as exc:
        return f"Error: {exc}"


# ----- the plain openai.AsyncOpenAI agent --------------------------------------------------------------


@pytest.mark.slow
def test_plain_agent_sessions_are_valid_token_exact_trajectories(plain):
    assert len(plain) == 16
    assert sorted((r["prompt_index"], r["sample_index"]) for r in plain) == [(p, s) for p in range(8) for s in range(2)]
    for record in plain:
        validate_trajectory(record)
        assert record["consistency_diff"] is None, record["consistency_diff"]
        assert record["finish_reason"] != "error", record["error"]
        assert record["segments"] == []  # the agent only appends: one sample per session
        assert record["data_source"] == "calc" and record["ground_truth"]


def test_plain_agent_tool_calls_carry_the_calculators_result(plain, embedded_tokenizer):
    with_calls = [r for r in plain if r["tool_calls"]]
    assert with_calls, "no session called the calculator"
    for record in with_calls:
        pairs = zip(record["response_ids"], record["loss_mask"], strict=True)
        context = embedded_tokenizer.decode([token for token, mask in pairs if mask == 0])
        tool_messages = [m["content"] for m in record["messages"] if m["role"] == "tool"]
        for tool_call in record["tool_calls"]:
            assert tool_call["name"] == "calculator"
            assert tool_call["text"] == calculator_text(tool_call["arguments"]["expression"])
            assert tool_call["text"] in tool_messages and tool_call["text"] in context


def test_plain_agent_loss_mask_is_one_exactly_on_the_assistant_tokens(plain, embedded_tokenizer):
    for record in plain:
        mask, ids = record["loss_mask"], record["response_ids"]
        answers = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
        spans = step_spans(mask)
        assert len(spans) == len(answers) == record["turns"]
        for (start, end), answer in zip(spans, answers, strict=True):
            assert embedded_tokenizer.decode(ids[start:end]).removesuffix(CLOSE) == answer
        assert [lp is not None for lp in record["logprobs"]] == [m == 1 for m in mask]
        assert record["metrics"]["generated_tokens"] == sum(mask)


# ----- the history-rewriting agent -----------------------------------------------------------------------


@pytest.mark.slow
def test_rewriting_agent_sessions_split_into_checked_samples(rewriting):
    _, records = rewriting
    assert len(records) == 16
    split = [r for r in records if r["segments"]]
    assert split, "no session was split (no tool round happened)"
    for record in records:
        validate_trajectory(record)
        assert record["consistency_diff"] is None
    for record in split:
        first, *later = record["segments"]
        assert first["split_reason"] == "messages[2] (user) is not the answer the gateway gave"
        assert all(s["split_reason"].endswith("(user) is not the answer the gateway gave") for s in later)
        assert all(s["consistency_diff"] is None and s["turns"] == 1 for s in record["segments"])
        assert any(m["content"].startswith("Calculator results: ") for m in record["messages"] if m["role"] == "user")
        assert record["turns"] == len(record["segments"]) + len(step_spans(record["loss_mask"]))


def test_show_prints_a_split_session_sample_by_sample(rewriting):
    path, records = rewriting
    index = next(i for i, r in enumerate(records) if r["segments"])
    samples = len(records[index]["segments"]) + 1
    result = run_cli("show", str(path), "--index", str(index))
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())  # rich wraps long lines
    assert f"split session {samples} samples, one reward" in text
    assert f"sample 1 of {samples} — split: messages[2] (user) is not the answer the gateway gave" in text
    assert f"sample {samples} of {samples} — the session's last" in text


def test_every_sample_of_a_split_session_is_trained_with_its_one_advantage(rewriting):
    _, records = rewriting
    record = next(r for r in records if r["segments"])
    request = AsyncRolloutRequest(record["request_id"], record["prompt_index"], record["sample_index"],
                                  record["messages"])  # fmt: skip
    request.prompt_ids, request.response_ids = record["prompt_ids"], record["response_ids"]
    request.loss_mask, request.logprobs = record["loss_mask"], record["logprobs"]
    request.weight_versions = record["weight_versions"]
    request.segments = [Segment(**segment) for segment in record["segments"]]
    samples = trajectory_samples(request, advantage=0.5)
    pieces = [*record["segments"], record]
    assert len(samples) == len(pieces) >= 2
    for sample, piece in zip(samples, pieces, strict=True):
        assert sample.input_ids == piece["prompt_ids"] + piece["response_ids"]
        assert sum(sample.loss_mask) == sum(piece["loss_mask"]) > 0
        assert sample.advantage == 0.5 and sample.group_id == record["prompt_index"]


# ----- the OpenAI Agents SDK agent ---------------------------------------------------------------------------


@pytest.mark.slow
def test_openai_agents_sdk_agent_sessions_are_recorded_through_rollout(tmp_path):
    records = rollout_with("data.agents.calc_openai_agents:run", tmp_path / "sdk.jsonl")
    assert len(records) == 16
    for record in records:
        validate_trajectory(record)
        assert record["finish_reason"] in ("stop", "length"), record["error"]  # the SDK's own stops end cleanly
        assert record["finish_reason"] == "length" or record["error"] is None
        assert record["turns"] >= 1 and record["consistency_diff"] is None and record["segments"] == []
        assert record["messages"][0]["content"] == make_calc_records(1)[0].prompt[0]["content"]  # instructions


async def sdk_session(tokenizer: Any, answer: Any, ground_truth: str = "7580") -> dict[str, Any]:
    """The SDK agent through an in-process gateway whose engine writes ``answer(prompt_text)``."""
    engine = ScriptedEngine(ChatTokenizer(tokenizer, None), lambda turn, prompt, rid: answer(prompt))
    async with Gateway(engine, tokenizer, GatewayConfig(), RolloutConfig()) as gateway:
        request = AsyncRolloutRequest("r0", 0, 0, [], data_source="calc", ground_truth=ground_truth)
        session = gateway.open_session(request, "sdk-session")
        record = make_calc_records(1)[0]
        await calc_openai_agents.run(gateway.base_url(session.id), {"prompt": record.prompt})
        return (await gateway.finish_session(session)).to_record()


async def test_the_sdks_history_resend_extends_the_session_as_one_trajectory(tokenizer):
    def answer(prompt: str) -> str:
        return "\\boxed{7580}" if "<tool_response>" in prompt else call("calculator", expression="8290 - 710")

    record = await sdk_session(tokenizer, answer)
    validate_trajectory(record)
    assert record["segments"] == [] and record["consistency_diff"] is None
    assert [(c["name"], c["arguments"], c["text"]) for c in record["tool_calls"]] == [
        ("calculator", {"expression": "8290 - 710"}, "7580")]  # fmt: skip
    assert record["turns"] == 2 and record["finish_reason"] == "stop" and record["reward"] == 1.0


async def test_the_sdk_agent_ends_cleanly_past_its_max_turns(tokenizer):
    record = await sdk_session(tokenizer, lambda prompt: call("calculator", expression="1+1"))
    assert record["turns"] == calc_openai_agents.MAX_TURNS and len(record["tool_calls"]) == 2
    assert record["finish_reason"] == "stop" and record["error"] is None and record["reward"] == 0.0


async def test_the_sdk_agent_calling_a_tool_it_lacks_is_graded_not_an_error(tokenizer):
    record = await sdk_session(tokenizer, lambda prompt: call("calculatoxe", expression="1"))
    assert record["turns"] == 1 and record["tool_calls"] == []
    assert record["finish_reason"] == "stop" and record["error"] is None and record["reward"] == 0.0


# ----- the standalone gateway ---------------------------------------------------------------------------------


def start_gateway(out: Path) -> tuple[subprocess.Popen[str], str, queue.Queue[str]]:
    """`rallyrl gateway --port 0` in a subprocess (SIGINT left to its default, so Ctrl-C works even when
    this test runs in the background); its URL as it prints it, and its output lines."""
    process = subprocess.Popen(
        [shutil.which("rallyrl") or "rallyrl", "gateway", "--port", "0", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout or []], daemon=True).start()
    seen, deadline = "", time.monotonic() + 120
    while (found := re.search(r"on (http://127\.0\.0\.1:\d+)", seen)) is None:
        if time.monotonic() > deadline or process.poll() is not None:
            process.kill()
            pytest.fail(f"rallyrl gateway printed no URL:\n{seen}")
        with contextlib.suppress(queue.Empty):
            seen += lines.get(timeout=1)
    return process, found.group(1), lines


@pytest.mark.slow
def test_standalone_gateway_records_a_posted_reward_and_aborts_open_sessions_at_exit(tmp_path):
    out = tmp_path / "sessions.jsonl"
    process, url, lines = start_gateway(out)
    try:
        record = make_calc_records(1)[0]
        with httpx.Client(base_url=url, timeout=120) as client:
            opened = client.post("/sessions", json={"ground_truth": record.ground_truth, "data_source": "calc"})
            assert opened.status_code == 201, opened.text
            session = opened.json()
            left_open = client.post("/sessions", json={}).json()["session_id"]
            asyncio.run(calc_openai.run(session["base_url"], {"prompt": record.prompt}))
            sid = session["session_id"]
            assert client.post(f"/sessions/{sid}/reward", json={"reward": 0.75}).json()["reward"] == 0.75
            finished = client.post(f"/sessions/{sid}/finish", json={})
            assert finished.status_code == 200 and finished.json()["trajectory"]["reward"] == 0.75
            late = client.post(f"/sessions/{sid}/v1/chat/completions", json={"messages": record.prompt})
            assert late.status_code == 409 and late.json()["error"]["code"] == "session_finished"
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=120) == 0
    finally:
        if process.poll() is None:
            process.kill()
    output = "".join(lines.queue)
    assert f"gateway stopped; finished sessions are in {out}" in " ".join(output.split())
    done, aborted = [json.loads(line) for line in out.read_text().splitlines()]
    for trajectory in (done, aborted):
        validate_trajectory(trajectory)
    assert done["request_id"] == sid and done["reward"] == 0.75 and done["rewards"]["posted"] == 0.75
    assert done["finish_reason"] == "stop" and done["turns"] >= 1 and done["ground_truth"] == record.ground_truth
    assert done["messages"][:2] == record.prompt and done["consistency_diff"] is None
    assert aborted["request_id"] == left_open and aborted["finish_reason"] == "abort"
    assert aborted["error"] == "the gateway stopped"


# ----- training and bad entry points ------------------------------------------------------------------------


@pytest.mark.slow
def test_train_with_the_agent_config_completes_a_step(tmp_path):
    out = tmp_path / "run"
    result = run_cli("train", "--config", "data/configs/grpo_calc_agent.yaml", "--steps", "1", "--set",
                     "prompts_per_step=4", "--set", "samples_per_prompt=4", "--out", str(out), timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    (metrics,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert metrics["step"] == 1 and 0.0 <= metrics["rollout/accuracy"] <= 1.0
    assert metrics["rollout/trajectories"] >= 16 and metrics["rollout/excluded_errors"] == 0
    assert metrics["rollout/consistency_failures"] == 0
    assert (out / "final" / "config.json").is_file()


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["train", "--agent", "nonexistent.module:run"],
         "error: agent: cannot import 'nonexistent.module': ModuleNotFoundError: No module named 'nonexistent'"),
        (["train", "--agent", "data/agents/calc_openai.py:nope"],
         "error: agent: 'data/agents/calc_openai.py' has no function 'nope'"),
        (["rollout", "--agent", "data.agents.calc_openai:run", "--tools", "tools.yaml"],
         "error: RolloutJobConfig: agent: the agent brings its own tools and plays its own user turns; "
         "leave tools and interactions unset"),
    ],
)  # fmt: skip
@pytest.mark.slow
def test_a_bad_agent_entry_point_fails_with_one_clear_line(tmp_path, args, error):
    result = run_cli(*args, "--out", str(tmp_path / "out"), timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert [line for line in output.splitlines() if line.startswith("error:")] == [error]
    assert "Traceback" not in output and not (tmp_path / "out").exists()
