"""The LLM judge: reply parsing, retries, the cache, the failure path (a missing reward, left out of
group statistics), its concurrency bound under a 500-request rollout, and a real loopback server."""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import orjson
import pytest
import torch
from conftest import CountingTool, ScriptedEngine, serving

from data.reward_fns import reward_for_records
from data.schema import Record
from data.tiny_model import EMBEDDED_MODEL
from rollout.engines.base import EngineError, Generation, SamplingParams
from rollout.engines.local import LocalEngine, LocalEngineConfig
from rollout.loop import RolloutConfig, run_request
from rollout.request import AsyncRolloutRequest, validate_trajectory
from rollout.runner import RolloutRunner, summarize
from rollout.serve.processes import free_port
from rollout.tokens import ChatTokenizer
from rollout.users.judge import Judge, JudgeConfig, JudgeError, chat_completions_url, parse_score, parse_verdict
from trainer.advantages import group_normalize
from trainer.config import GRPOConfig
from trainer.grpo import GRPOTrainer

FAST = dict(backoff_s=0.001, backoff_max_s=0.002)
_GRADED = re.compile(r"Reference answer:\n(.*?)\n\nAnswer to grade:\n(.*?)\n\nIs the answer", re.DOTALL)


def grade(prompt: str) -> str:
    """A judge model that knows its job: full marks when the answer contains the reference."""
    reference, answer = _GRADED.search(prompt).groups()
    return "score: 10" if reference in answer else "The answer is wrong.\nscore: 0"


@dataclass
class JudgeEngine(ScriptedEngine):
    """A scripted judge model that measures its own calls and their concurrency."""

    calls: int = 0
    in_flight: int = 0
    max_in_flight: int = 0

    async def generate(self, input_ids: list[int], sampling: SamplingParams, rid: str) -> Generation:
        self.calls += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await super().generate(input_ids, sampling, rid)
        finally:
            self.in_flight -= 1


@pytest.fixture
def chat(tokenizer):
    return ChatTokenizer(tokenizer)


def judge_on(chat, script=lambda turn, prompt, rid: grade(prompt), delay=lambda rid: 0.0, **config):
    engine = JudgeEngine(chat, script, delay=delay)
    return Judge(engine, JudgeConfig(**{**FAST, **config}), tokenizer=chat), engine


def finished(answer: str, ground_truth: str = "72", prompt_index: int = 0) -> AsyncRolloutRequest:
    request = AsyncRolloutRequest(f"r{prompt_index}", prompt_index, 0, [{"role": "user", "content": "How many?"}])
    request.ground_truth = ground_truth
    request.messages.append({"role": "assistant", "content": answer})
    return request


# ----- parsing the judge's reply ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ("score: 7", 0.7),
        ("Score = 10", 1.0),
        ("The answer matches.\n**Score:** 8", 0.8),
        ("score: 3/4", 0.75),
        ("I'd give it a score of 6 out of 10.", 0.6),
        ("First score: 2, on reflection score: 9", 0.9),
        ("score: 0", 0.0),
    ],
)
def test_a_score_is_read_and_scaled_to_0_1(reply, expected):
    assert parse_score(reply, 10) == pytest.approx(expected)


@pytest.mark.parametrize("reply", ["", "seven", "score: eleven", "score: 11", "score: -1", "score: 5/0", "scores"])
def test_a_reply_without_a_score_in_range_is_unparsable(reply):
    assert parse_score(reply, 10) is None


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ("YES", 1.0),
        ("no.", 0.0),
        ("**Yes**", 1.0),
        ("The answer has no error. Verdict: yes", 1.0),
        ("Comparing them, it is NO", 0.0),
        ("YES or NO? Hard to say", None),
        ("maybe", None),
        ("There is no way to tell", None),
    ],
)
def test_a_verdict_is_read_only_when_it_is_unambiguous(reply, expected):
    assert parse_verdict(reply) == expected


def test_the_prompt_keeps_braces_in_answers_and_says_when_there_is_no_reference(chat):
    judge, _ = judge_on(chat)
    prompt = judge.prompt("What is {answer}?", "\\boxed{\\frac{1}{2}}", None)
    assert "What is {answer}?" in prompt and "\\boxed{\\frac{1}{2}}" in prompt
    assert "Reference answer:\n(none given)" in prompt and 'score: X", where X is a whole number from 0' in prompt


def test_openai_urls_are_completed_to_the_chat_endpoint():
    assert chat_completions_url("http://h:1") == "http://h:1/v1/chat/completions"
    assert chat_completions_url("http://h:1/v1/") == "http://h:1/v1/chat/completions"
    assert chat_completions_url("https://h/x/v1/chat/completions") == "https://h/x/v1/chat/completions"
    with pytest.raises(ValueError, match="must start with http"):
        Judge("h:1")


# ----- retries, cache, failures ----------------------------------------------------------------------------


async def test_engine_errors_are_retried_with_backoff(chat):
    def flaky(turn, prompt, rid):
        flaky.count += 1
        return EngineError("server busy") if flaky.count <= 2 else grade(prompt)

    flaky.count = 0
    judge, engine = judge_on(chat, flaky, max_retries=3)
    assert await judge.score("How many?", "\\boxed{72}", "72") == 1.0
    assert engine.calls == 3 and judge.stats.retries == 2 and judge.stats.failures == 0


async def test_an_unparsable_reply_is_retried_then_fails_with_the_reply_in_the_error(chat):
    judge, engine = judge_on(chat, lambda turn, prompt, rid: "hmm, hard to say", max_retries=2)
    with pytest.raises(JudgeError, match="failed after 3 attempt\\(s\\): unparsable reply 'hmm, hard to say'"):
        await judge.score("How many?", "72", "72")
    assert engine.calls == 3 and judge.stats.unparsable == 3 and judge.stats.failures == 1


async def test_a_hung_judge_call_times_out_and_is_retried(chat):
    judge, engine = judge_on(chat, delay=lambda rid: 10.0 if engine.calls == 1 else 0.0, timeout_s=0.05)
    assert await judge.score("How many?", "72", "72") == 1.0
    assert engine.calls == 2 and judge.stats.retries == 1


async def test_a_cached_judgment_does_not_call_the_judge_again(chat):
    judge, engine = judge_on(chat)
    assert await judge.score("How many?", "\\boxed{72}", "72") == 1.0
    assert await judge.score("How many?", "\\boxed{72}", "72") == 1.0
    assert engine.calls == 1 and judge.stats.cache_hits == 1
    assert await judge.score("How many?", "\\boxed{71}", "72") == 0.0  # another answer: judged
    assert engine.calls == 2


async def test_identical_judgments_asked_at_once_call_the_judge_once(chat):
    judge, engine = judge_on(chat, delay=lambda rid: 0.02)
    scores = await asyncio.gather(*(judge.score("How many?", "72", "72") for _ in range(5)))
    assert scores == [1.0] * 5 and engine.calls == 1 and judge.stats.cache_hits == 4


async def test_failed_judgments_are_not_cached(chat):
    judge, engine = judge_on(chat, lambda turn, prompt, rid: EngineError("down"), max_retries=0)
    for _ in range(2):
        with pytest.raises(JudgeError, match="EngineError: down"):
            await judge.score("How many?", "72", "72")
    assert engine.calls == 2 and not judge.cache


async def test_the_cache_file_survives_the_judge(chat, tmp_path):
    path = tmp_path / "judge-cache.json"
    judge, engine = judge_on(chat, cache_path=str(path))
    async with judge:
        await judge.score("How many?", "72", "72")
    assert len(orjson.loads(path.read_bytes())["scores"]) == 1
    again, engine = judge_on(chat, cache_path=str(path))
    assert await again.score("How many?", "72", "72") == 1.0 and engine.calls == 0
    path.write_text("not json")
    with pytest.raises(ValueError, match="not a judge cache file"):
        judge_on(chat, cache_path=str(path))


async def test_a_failed_judgment_is_recorded_and_its_reward_is_missing_not_zero(chat, tokenizer):
    judge, _ = judge_on(chat, lambda turn, prompt, rid: EngineError("judge down"), max_retries=1)
    request = AsyncRolloutRequest("r0", 0, 0, [{"role": "user", "content": "How many?"}], ground_truth="72")
    policy = ScriptedEngine(chat, lambda turn, prompt, rid: "\\boxed{72}")
    reward_fn = reward_for_records("judge", rewards={"judge": judge.reward})
    await run_request(request, policy, chat, {}, RolloutConfig(), reward_fn)
    assert request.rewards.final is None and request.rewards.judge is None
    assert request.rewards.judge_error == "the judge failed after 2 attempt(s): EngineError: judge down"
    assert request.error == request.rewards.judge_error
    assert request.rewards.answer == 1.0  # the rule-based grade is still there
    record = orjson.loads(orjson.dumps(request.to_record()))
    assert record["reward"] is None
    validate_trajectory(record)  # null reward: allowed, the judgment failed
    record["rewards"]["judge_error"] = None
    with pytest.raises(ValueError, match="null is allowed only for a failed judgment"):
        validate_trajectory(record)


async def test_a_combination_with_a_failed_judgment_is_missing_too(chat):
    judge, _ = judge_on(chat, lambda turn, prompt, rid: "no idea", max_retries=0)
    reward = reward_for_records("math+0.5*judge", rewards={"judge": judge.reward})
    request = finished("\\boxed{72}")
    assert await reward(request) is None
    assert "unparsable reply 'no idea'" in request.rewards.judge_error
    ok, _ = judge_on(chat)
    reward = reward_for_records("math+0.5*judge", rewards={"judge": ok.reward})
    assert await reward(finished("\\boxed{72}")) == 1.5


def test_the_summary_counts_missing_rewards_and_averages_the_others():
    requests = [finished("a", prompt_index=i) for i in range(3)]
    requests[0].rewards.final, requests[1].rewards.final = 1.0, 0.5
    requests[2].rewards.final, requests[2].rewards.judge_error = None, "the judge failed"
    summary = summarize(requests, wall_s=1.0, samples_per_prompt=1)
    assert summary.rewards_missing == 1 and summary.reward_mean == 0.75


def test_missing_rewards_are_left_out_of_group_mean_and_std():
    values = torch.tensor([1.0, 0.0, math.nan, 5.0])
    advantages = group_normalize(values, torch.tensor([0, 0, 0, 1]), "group")
    assert advantages[:2].tolist() == pytest.approx([1.0, -1.0], abs=1e-4)  # not pulled by a 0 for the NaN
    assert math.isnan(advantages[2]) and advantages[3] == 0.0


def test_a_request_with_a_missing_reward_gets_no_training_sample(tmp_path, tiny_model_dir):
    config = GRPOConfig(model=str(tiny_model_dir), out=str(tmp_path / "run"), prompts_per_step=2, progress=False)
    trainer = GRPOTrainer(config)
    requests = []
    for prompt_index, rewards in enumerate([(1.0, 0.0, None), (None, None, None)]):
        for sample_index, reward in enumerate(rewards):
            request = AsyncRolloutRequest(f"r{prompt_index}-{sample_index}", prompt_index, sample_index, [])
            request.prompt_ids, request.response_ids = [1, 2, 3], [4, 5]
            request.loss_mask, request.logprobs = [1, 1], [-0.5, -0.5]
            request.rewards.final = reward
            request.rewards.judge_error = None if reward is not None else "the judge failed"
            requests.append(request)
    samples, stats = trainer.build_samples(requests, wanted_groups=2)
    assert [(s.group_id, s.advantage) for s in samples] == [(0, pytest.approx(1.0, abs=1e-4)),
                                                            (0, pytest.approx(-1.0, abs=1e-4))]  # fmt: skip
    assert stats["groups_trained"] == 1
    metrics = trainer.rollout_metrics(requests)
    assert metrics["rewards_missing"] == 4 and metrics["reward_mean"] == 0.5 and metrics["reward_std"] == 0.5


# ----- judging alongside the rollout --------------------------------------------------------------------


async def test_a_slow_judgment_does_not_hold_up_other_requests(chat):
    gate = asyncio.Event()
    judge, engine = judge_on(chat)
    original = engine.generate

    async def gated(input_ids, sampling, rid):  # the judge model answers when the gate opens
        await gate.wait()
        return await original(input_ids, sampling, rid)

    engine.generate = gated  # type: ignore[method-assign]
    reward_fn = reward_for_records({"judged": "judge", "default": "math"}, rewards={"judge": judge.reward})
    policy = ScriptedEngine(chat, lambda turn, prompt, rid: "\\boxed{72}")

    def request(rid: str, source: str) -> AsyncRolloutRequest:
        messages = [{"role": "user", "content": "How many?"}]
        return AsyncRolloutRequest(rid, 0, 0, messages, data_source=source, ground_truth="72")

    judged = asyncio.create_task(run_request(request("a", "judged"), policy, chat, {}, RolloutConfig(), reward_fn))
    fast = await asyncio.wait_for(run_request(request("b", "other"), policy, chat, {}, RolloutConfig(), reward_fn), 5)
    assert fast.rewards.final == 1.0
    assert not judged.done() and judge.in_flight == 1
    gate.set()
    assert (await judged).rewards.final == 1.0


async def test_500_judged_requests_keep_at_most_16_judge_calls_in_flight_and_lose_no_reward(chat, tokenizer):
    """Acceptance: concurrency 16 measured (never above, and reached); every request has a judge
    score or a recorded failure; a flaky judge's failures are retried."""
    seen: dict[int, int] = {}
    rng = random.Random(0)

    def flaky_judge(turn, prompt, rid):
        question = int(re.search(r"What is (\d+) doubled", prompt)[1])
        seen[question] = seen.get(question, 0) + 1
        if question % 50 == 7:  # a judge that never answers these: recorded failures
            return EngineError("judge overloaded")
        if question % 5 == 0 and seen[question] == 1:  # flaky: the first try fails
            return EngineError("connection reset")
        return grade(prompt)

    judge, judge_engine = judge_on(
        chat, flaky_judge, delay=lambda rid: rng.uniform(0.001, 0.01), max_concurrency=16, max_retries=2
    )
    question = [[{"role": "user", "content": f"What is {i} doubled?"}] for i in range(500)]
    records = [Record(prompt=question[i], data_source="judged", ground_truth=str(2 * i)) for i in range(500)]

    def policy_script(turn, prompt, rid):
        question = int(re.search(r"What is (\d+) doubled", prompt)[1])
        return f"\\boxed{{{2 * question if question % 3 else 2 * question + 1}}}"  # every third is wrong

    tool = CountingTool()
    policy_chat = ChatTokenizer(tokenizer, [tool.schema])
    policy = ScriptedEngine(policy_chat, policy_script)
    reward_fn = reward_for_records({"judged": "judge"}, rewards={"judge": judge.reward})
    runner = RolloutRunner(policy, policy_chat, {"echo": tool}, max_concurrency=128, reward_fn=reward_fn,
                           progress=False)  # fmt: skip
    started = time.monotonic()
    result = await runner.run(records)
    elapsed = time.monotonic() - started

    assert judge.max_in_flight == 16 and judge_engine.max_in_flight == 16  # measured: reached, never above
    assert judge.in_flight == 0 and judge.queued == 0
    failed = [r for r in result.requests if r.rewards.judge_error is not None]
    scored = [r for r in result.requests if r.rewards.judge is not None]
    assert len(failed) == 10 and len(scored) == 490 and not set(map(id, failed)) & set(map(id, scored))
    for request in failed:
        assert request.rewards.final is None and "judge overloaded" in request.error
    for request in scored:
        question = request.prompt_index
        assert request.rewards.final == (1.0 if question % 3 else 0.0), request.request_id
    assert judge.stats.retries == 100 + 10 * 2  # each flaky one once, each hopeless one max_retries times
    assert judge_engine.calls == 490 + 100 + 10 * 3 and judge.stats.failures == 10
    assert result.summary.rewards_missing == 10
    print(f"500 judged requests in {elapsed:.2f}s, judge max in flight {judge.max_in_flight}")


# ----- a real judge server (rallyrl serve in-process, OpenAI chat completions) ------------------------------


@contextlib.asynccontextmanager
async def embedded_server() -> AsyncIterator[str]:
    """The embedded model behind ``rallyrl serve`` on a loopback port of this event loop."""
    engine = LocalEngine.from_pretrained(EMBEDDED_MODEL, LocalEngineConfig(max_batch_size=8, device="cpu"))
    async with engine, serving(engine) as url:
        yield url


async def test_a_real_judge_server_that_answers_nonsense_gives_recorded_failures(chat):
    """The embedded calculator model does not grade: whatever it replies is judged or recorded,
    and nothing comes back as a silent 0."""
    async with embedded_server() as url:
        config = JudgeConfig(max_new_tokens=24, max_retries=1, max_concurrency=2, **FAST)
        async with Judge(url, config) as judge:
            reward_fn = reward_for_records("judge", rewards={"judge": judge.reward})
            policy = ScriptedEngine(chat, lambda turn, prompt, rid: f"\\boxed{{{len(rid)}}}")
            requests = [
                AsyncRolloutRequest(f"r{i}", i, 0, [{"role": "user", "content": f"What is {i}+{i}?"}],
                                    ground_truth=str(2 * i))
                for i in range(4)
            ]  # fmt: skip
            await asyncio.gather(*(run_request(r, policy, chat, {}, RolloutConfig(), reward_fn) for r in requests))
        assert judge.stats.calls >= 4 and judge.max_in_flight <= 2
        for request in requests:
            if request.rewards.judge is None:  # what the tiny model says is no score
                assert request.rewards.final is None
                assert request.rewards.judge_error.startswith("the judge failed after 2 attempt(s): unparsable reply")
                validate_trajectory(orjson.loads(orjson.dumps(request.to_record())))
            else:
                assert request.rewards.judge_error is None and 0.0 <= request.rewards.final <= 1.0
        assert judge.stats.failures == sum(r.rewards.judge is None for r in requests) > 0


async def test_a_wrong_judge_url_fails_at_once_and_a_dead_one_after_its_retries():
    async with embedded_server() as url:
        async with Judge(url + "/nope/v1", JudgeConfig(max_retries=3, **FAST)) as judge:
            with pytest.raises(JudgeError, match="answered HTTP 404"):
                await judge.score("q", "a", "r")
        assert judge.stats.calls == 1 and judge.stats.retries == 0  # a 404 is not retried
    async with Judge(f"http://127.0.0.1:{free_port()}", JudgeConfig(max_retries=2, **FAST)) as judge:
        request = finished("\\boxed{72}")
        assert await judge.reward(request) is None
    assert judge.stats.calls == 3 and request.rewards.judge_error.startswith("the judge failed after 3 attempt(s)")


async def test_a_judge_on_a_url_must_be_opened():
    judge = Judge("http://127.0.0.1:1", JudgeConfig(max_retries=2, **FAST))
    with pytest.raises(JudgeError, match="use it inside 'async with judge:'"):
        await judge.score("q", "a")
    assert judge.stats.calls == 1
