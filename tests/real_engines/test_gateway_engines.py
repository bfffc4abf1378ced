"""The agent gateway in front of real SGLang and vLLM servers: an ``openai`` agent's sessions are
recorded with the servers' own token ids and logprobs (checked against the embedded model's forward
pass), from the CLI (``rallyrl rollout --agent --engine-url``) and the standalone ``rallyrl gateway``;
and ``rallyrl train --agent`` syncs its weights into a real SGLang server every step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import orjson
import pytest

from data.agents.calc_openai import CALCULATOR, calculator
from rollout.request import AsyncRolloutRequest, validate_trajectory
from tests.conftest import run_cli
from tests.real_engines.test_sglang import max_logprob_gap


def _requests(lines: list[dict]) -> list[AsyncRolloutRequest]:
    requests = []
    for line in lines:
        request = AsyncRolloutRequest(line["request_id"], line["prompt_index"], line["sample_index"], line["messages"])
        request.prompt_ids, request.response_ids = line["prompt_ids"], line["response_ids"]
        request.loss_mask, request.logprobs = line["loss_mask"], line["logprobs"]
        requests.append(request)
    return requests


@pytest.mark.parametrize("server", ["sglang", "vllm"])
def test_agent_sessions_through_the_gateway_carry_the_servers_tokens_and_logprobs(server, request, tmp_path,
                                                                                   embedded_model):  # fmt: skip
    url = request.getfixturevalue(f"{server}_url")
    out = tmp_path / "sessions.jsonl"
    done = run_cli("rollout", "--agent", "data.agents.calc_openai:run", "--num-prompts", "8", "-n", "2",
                   "--engine-url", url, "--max-new-tokens", "96", "--max-model-len", "1024", "--max-turns", "3",
                   "--out", str(out), "--no-progress")  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert len(lines) == 16
    for line in lines:
        validate_trajectory(line)
        assert line["finish_reason"] in ("stop", "length") and line["consistency_diff"] is None, line.get("error")
    assert sum(line["metrics"]["tool_calls"] for line in lines) >= 3  # the agent ran its calculator
    assert max_logprob_gap(embedded_model, _requests(lines)) < 1e-4


def test_the_standalone_gateway_over_real_sglang_records_an_openai_client(sglang_url, tmp_path):
    out = tmp_path / "sessions.jsonl"
    gateway = subprocess.Popen(
        [sys.executable, "-m", "cli", "gateway", "--engine-url", sglang_url, "--port", "0", "--out", str(out),
         "--max-new-tokens", "96", "--max-model-len", "1024"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "COLUMNS": "300"},
        # SIGINT left to its default: a shell without job control starts background jobs with it ignored,
        # children inherit that, and the gateway then (rightly) never hears the Ctrl-C this test sends
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        line = ""
        deadline = time.monotonic() + 120
        while "agent gateway" not in line and time.monotonic() < deadline:
            line = gateway.stdout.readline()  # type: ignore[union-attr]
        base = line.split(" on ", 1)[1].split()[0]
        opened = httpx.post(f"{base}/sessions", json={"ground_truth": "5"}).json()
        client = openai.OpenAI(base_url=opened["base_url"], api_key="x", max_retries=0)
        messages = [{"role": "user", "content": "Calculate 2 + 3."}]
        for _ in range(3):
            reply = client.chat.completions.create(model="m", messages=messages, tools=[CALCULATOR])
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                break
            messages += [{"role": "tool", "tool_call_id": c.id, "content": calculator(c.function.arguments)}
                         for c in message.tool_calls]  # fmt: skip
        assert httpx.post(f"{base}/sessions/{opened['session_id']}/reward", json={"reward": 0.5}).status_code == 200
        finished = httpx.post(f"{base}/sessions/{opened['session_id']}/finish").json()["trajectory"]
    finally:
        gateway.send_signal(signal.SIGINT)
        gateway.wait(60)
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [w["request_id"] for w in written] == [opened["session_id"]]
    assert written[0]["reward"] == 0.5 and written[0]["response_ids"] == finished["response_ids"]
    assert written[0]["consistency_diff"] is None and sum(written[0]["loss_mask"]) > 0


def test_training_an_agent_syncs_weights_into_real_sglang(sglang_scratch_url, tmp_path):
    done = run_cli("train", "--agent", "data.agents.calc_openai:run", "--engine-url", sglang_scratch_url, "--steps",
                   "2", "--prompts-per-step", "4", "-n", "4", "--out", str(tmp_path / "run"), "--no-progress",
                   timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr
    version = httpx.get(f"{sglang_scratch_url}/get_model_info").json()["weight_version"]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["rollout/weight_version"] for m in metrics] == [0, 1]
    assert all(m["rollout/response_length"] > 0 and m["rollout/error_rate"] == 0 for m in metrics)
    assert version == "2"
