"""The agent gateway records what the native loop would: token for token, with one trajectory while
the agent only appends, and a new sample (a segment, with the reason) when it rewrites history."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest
import torch

from data.synthetic import make_task
from data.tiny_model import EMBEDDED_MODEL
from rollout.api import open_engine
from rollout.config import GatewayConfig, RolloutConfig
from rollout.engines.base import Generation, SamplingParams
from rollout.engines.config import EngineConfig, LocalEngineConfig
from rollout.gateway import Gateway
from rollout.gateway.agents import AgentDriver, agent_record
from rollout.loop import run_request
from rollout.request import AsyncRolloutRequest, FinishReason, validate_trajectory
from rollout.runner import request_from_record
from rollout.tokens import ChatTokenizer
from tests.conftest import ScriptedEngine, call
from tools.calculator import CalculatorTool
from trainer.batch import step_spans

CALC = CalculatorTool.default_schema()


def _turn(prompt: str) -> int:
    """The assistant turn a prompt asks for (the gateway gives every call its own rid)."""
    return prompt.count("<|im_start|>assistant") - 1


def _calc_script(turn: int, prompt: str, rid: str) -> str:
    turn = _turn(prompt)
    if turn == 0:
        return call("calculator", expression="2+3") + call("calculator", expression="7*6")
    if turn == 1:
        return "Let me check. " + call("calculator", expression="(2+3)*42")
    return "The answer is \\boxed{210}."


async def _calc_agent(base_url: str, record: dict[str, Any], rounds: int = 3) -> None:
    """A plain OpenAI tool loop with the calculator (what the native loop does with its tools)."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0)
    tool = CalculatorTool()
    messages = list(record["prompt"])
    async with client:
        for _ in range(rounds):
            reply = await client.chat.completions.create(model="m", messages=messages, tools=[CALC])
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return
            for tool_call in message.tool_calls:
                result = await tool.execute("", json.loads(tool_call.function.arguments))
                messages.append({"role": "tool", "tool_call_id": tool_call.id, "content": result.text})


def _same_tokens(a: AsyncRolloutRequest, b: AsyncRolloutRequest) -> None:
    assert a.prompt_ids == b.prompt_ids
    assert a.response_ids == b.response_ids
    assert a.loss_mask == b.loss_mask
    assert a.logprobs == b.logprobs
    assert a.weight_versions == b.weight_versions
    assert a.messages == b.messages


@pytest.fixture
def rollout_config() -> RolloutConfig:
    return RolloutConfig(max_turns=3, max_new_tokens=256, max_model_len=1024, seed=11)


@pytest.mark.slow
async def test_a_session_is_token_for_token_the_native_trajectory_with_the_embedded_model(tokenizer, rollout_config):
    records = make_task("calc", 16, 5)
    tools = {"calculator": CalculatorTool()}
    chat = ChatTokenizer(tokenizer, [CALC])
    # no prefix cache: a cached prefix changes logprobs in the 5th decimal, by what happened to be cached
    engine_config = EngineConfig(local=LocalEngineConfig(prefix_cache_mb=0))
    async with open_engine(engine_config, EMBEDDED_MODEL, max_model_len=1024) as engine:
        native, agent = [], []
        for i, record in enumerate(records):  # one at a time: the same batches, so bit-equal logprobs
            native.append(await run_request(request_from_record(record, i, 0, f"n{i}"), engine, chat, tools,
                                             rollout_config))  # fmt: skip
        async with Gateway(engine, tokenizer, GatewayConfig(), rollout_config) as gateway:
            driver = AgentDriver(gateway, _calc_agent, 60)
            for i, record in enumerate(records):
                agent.append(await driver.run(request_from_record(record, i, 0, f"g{i}"), rollout_config))
    compared = with_tools = 0
    for a, b in zip(native, agent, strict=True):
        assert b.consistency_diff is None and not b.segments
        validate_trajectory(b.to_record())
        if a.messages != b.messages:  # the native loop answers a malformed call with an error; an agent stops
            assert "<tool_call>" in a.messages[2]["content"] and a.tool_calls[0].error is not None
            continue
        _same_tokens(a, b)
        assert (a.rewards.final, a.finish_reason, a.metrics.turns) == (
            b.rewards.final, b.finish_reason, b.metrics.turns)  # fmt: skip
        assert [(c.name, c.arguments, c.text) for c in a.tool_calls] == [(c.name, c.arguments, c.text)
                                                                           for c in b.tool_calls]  # fmt: skip
        compared += 1
        with_tools += a.metrics.tool_calls > 0
    assert compared >= 12 and with_tools >= 3


async def test_a_session_with_parallel_calls_and_two_tool_rounds_matches_the_native_loop(tokenizer, rollout_config):
    chat = ChatTokenizer(tokenizer, [CALC])
    engine = ScriptedEngine(chat, _calc_script)
    record = make_task("calc", 1, 0)[0]
    native = await run_request(request_from_record(record, 0, 0, "n"), engine, chat, {"calculator": CalculatorTool()},
                               rollout_config)  # fmt: skip
    async with Gateway(engine, tokenizer, GatewayConfig(), rollout_config) as gateway:
        session = await AgentDriver(gateway, _calc_agent, 30).run(request_from_record(record, 0, 0, "g"))
    assert native.metrics.tool_calls == 3 and native.metrics.turns == 3
    _same_tokens(native, session)
    assert [c.text for c in session.tool_calls] == ["5", "42", "210"]
    assert [c.turn for c in session.tool_calls] == [1, 1, 2]
    assert session.consistency_diff is None and session.finish_reason is FinishReason.STOP
    assert [e.state.value for e in session.trace][:4] == ["pending", "running", "tool_calling", "running"]


class _Agent:
    """A scripted OpenAI client of one session: each call sends what ``edit`` makes of the history."""

    def __init__(self, url: str):
        self.client = openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0)

    async def ask(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                  **extra: Any) -> dict[str, Any]:  # fmt: skip
        reply = await self.client.chat.completions.create(model="m", messages=messages, tools=tools or openai.omit,
                                                          **extra)  # fmt: skip
        return reply.choices[0].message.model_dump(exclude_none=True)


async def _session(gateway: Gateway) -> tuple[Any, _Agent]:
    session = gateway.open_session()
    return session, _Agent(gateway.base_url(session.id))


async def _conversation(gateway: Gateway, edit: Any) -> AsyncRolloutRequest:
    """Two tool rounds and an answer; ``edit(call_number, messages)`` rewrites the history before each call."""
    session, agent = await _session(gateway)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "2+3?"}]
    for number in range(3):
        messages = edit(number, messages)
        answer = await agent.ask(messages, [CALC])
        messages.append(answer)
        for tool_call in answer.get("tool_calls", []):
            messages.append({"role": "tool", "tool_call_id": tool_call["id"], "content": f"result {number}"})
    await agent.client.close()
    return await gateway.finish_session(session)


@pytest.fixture
async def scripted_gateway(tokenizer, rollout_config):
    engine = ScriptedEngine(ChatTokenizer(tokenizer, [CALC]), _calc_script)
    async with Gateway(engine, tokenizer, GatewayConfig(), rollout_config) as gateway:
        yield gateway


def _keep(number: int, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return messages


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        (lambda n, m: m[:2] + m[-2:] if n == 2 else m, "messages[2] (assistant) is not the answer the gateway gave"),
        (
            lambda n, m: [{"role": "system", "content": "Be brief."}, *m[1:]] if n == 1 else m,
            "messages[0] (system) is not the recorded message",
        ),
        (
            lambda n, m: [*m[:2], {**m[2], "content": "edited"}, *m[3:]] if n == 1 else m,
            "messages[2] (assistant) is not the answer the gateway gave",
        ),
        (lambda n, m: m[:-4] if n == 2 else m, "the conversation was cut"),
        (
            lambda n, m: [*m, {"role": "assistant", "content": "a prefill"}] if n == 1 else m,
            "an answer the gateway did not give",
        ),
    ],
    ids=["summarised", "system-prompt-edited", "answer-edited", "truncated", "assistant-injected"],
)
async def test_a_rewritten_history_starts_a_new_sample_and_says_why(scripted_gateway, edit, reason):
    request = await _conversation(scripted_gateway, edit)
    assert request.segments and reason in request.segments[0].split_reason
    for segment in request.segments:
        assert segment.consistency_diff is None and sum(segment.loss_mask) > 0 and segment.turns >= 1
    assert request.consistency_diff is None
    assert request.metrics.turns == sum(s.turns for s in request.segments) + len(step_spans(request.loss_mask))
    validate_trajectory(request.to_record())
    assert scripted_gateway.counters["samples_split"] == len(request.segments)


async def test_an_agent_that_only_appends_stays_one_trajectory(scripted_gateway):
    request = await _conversation(scripted_gateway, _keep)
    assert not request.segments and request.metrics.turns == 3 and request.consistency_diff is None
    assert [c.text for c in request.tool_calls] == ["result 0", "result 0", "result 1"]


def _reserialised(number: int, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What client libraries do to an answer they send back: null for empty content, arguments re-dumped
    with other spacing, content as text parts, extra fields."""
    out = []
    for message in messages:
        message = dict(message)
        if message["role"] == "assistant":
            if message.get("tool_calls"):
                message["content"] = message.get("content") or None
                message["tool_calls"] = [
                    {**c, "function": {"name": c["function"]["name"],
                                       "arguments": json.dumps(json.loads(c["function"]["arguments"]), indent=2)}}
                    for c in message["tool_calls"]
                ]  # fmt: skip
            else:
                message["content"] = [{"type": "text", "text": message["content"]}]
            message["refusal"] = None
        out.append(message)
    return out


async def test_an_answer_sent_back_reserialised_still_extends_the_session(scripted_gateway):
    request = await _conversation(scripted_gateway, _reserialised)
    assert not request.segments and request.metrics.turns == 3 and request.consistency_diff is None


async def test_changing_the_tools_starts_a_new_sample(scripted_gateway):
    session, agent = await _session(scripted_gateway)
    messages = [{"role": "user", "content": "2+3?"}]
    messages.append(await agent.ask(messages, [CALC]))
    messages += [{"role": "tool", "tool_call_id": c["id"], "content": "5"} for c in messages[-1]["tool_calls"]]
    other = {"type": "function", "function": {"name": "search", "description": "d", "parameters": {"type": "object"}}}
    await agent.ask(messages, [CALC, other])
    request = await scripted_gateway.finish_session(session)
    assert request.segments[0].split_reason == "the tools changed"


async def test_a_retried_call_leaves_the_answer_in_the_first_sample(scripted_gateway):
    session, agent = await _session(scripted_gateway)
    messages = [{"role": "user", "content": "2+3?"}]
    await agent.ask(messages, [CALC])
    await agent.ask(messages, [CALC])  # the agent lost the first answer and asks again
    request = await scripted_gateway.finish_session(session)
    assert request.segments[0].split_reason == "the conversation was cut: 1 messages, 2 recorded"
    assert request.metrics.turns == 2 and sum(request.segments[0].loss_mask) == sum(request.loss_mask)


async def test_the_turn_budget_and_the_context_are_refused_with_a_code_and_end_the_session(tokenizer):
    engine = ScriptedEngine(ChatTokenizer(tokenizer, [CALC]), _calc_script)
    config = RolloutConfig(max_turns=1, max_new_tokens=200, max_model_len=800)
    async with Gateway(engine, tokenizer, GatewayConfig(), config) as gateway:
        session, agent = await _session(gateway)
        messages = [{"role": "user", "content": "2+3?"}]
        messages.append(await agent.ask(messages, [CALC]))
        messages += [{"role": "tool", "tool_call_id": c["id"], "content": "5"} for c in messages[-1]["tool_calls"]]
        with pytest.raises(openai.BadRequestError) as refused:
            await agent.ask(messages, [CALC])
        assert refused.value.code == "max_turns_exceeded"
        request = await gateway.finish_session(session)
        assert request.finish_reason is FinishReason.MAX_TURNS and request.metrics.turns == 1

        session, agent = await _session(gateway)
        with pytest.raises(openai.BadRequestError) as refused:
            await agent.ask([{"role": "user", "content": "x" * 900}], [CALC])
        assert refused.value.code == "context_length_exceeded" and "max_model_len 800" in str(refused.value)
        request = await gateway.finish_session(session)
        assert request.finish_reason is FinishReason.LENGTH


class _RecordingEngine(ScriptedEngine):
    sampled: list[SamplingParams]

    async def generate(self, input_ids: list[int], sampling: SamplingParams, rid: str) -> Generation:
        self.sampled.append(sampling)
        return await super().generate(input_ids, sampling, rid)


@pytest.mark.parametrize("mode", ["rollout", "request"])
async def test_sampling_is_the_rollouts_unless_the_gateway_takes_the_requests(tokenizer, rollout_config, mode):
    engine = _RecordingEngine(ChatTokenizer(tokenizer, [CALC]), lambda *a: "fine")
    engine.sampled = []
    async with Gateway(engine, tokenizer, GatewayConfig(sampling=mode), rollout_config) as gateway:
        session, agent = await _session(gateway)
        await agent.ask([{"role": "user", "content": "hi"}], temperature=0.3, top_p=0.5, seed=4, max_tokens=500)
        await gateway.finish_session(session)
    sampled = engine.sampled[0]
    if mode == "rollout":
        assert (sampled.temperature, sampled.top_p, sampled.max_new_tokens) == (1.0, 1.0, 256)
        assert sampled.seed is not None and sampled.seed != 4
    else:
        assert (sampled.temperature, sampled.top_p, sampled.seed, sampled.max_new_tokens) == (0.3, 0.5, 4, 256)


async def _returns(value: Any) -> Any:
    async def agent(base_url: str, record: dict[str, Any]) -> Any:
        client = openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0)
        async with client:
            await client.chat.completions.create(model="m", messages=record["prompt"])
        if value == "post":
            import aiohttp

            async with aiohttp.ClientSession() as http:
                sid = base_url.rstrip("/").split("/")[-2]
                root = base_url.split("/sessions/")[0]
                async with http.post(f"{root}/sessions/{sid}/reward", json={"reward": 0.25}) as response:
                    assert response.status == 200
            return 0.75
        if isinstance(value, Exception):
            raise value
        if value == "hang":
            await asyncio.sleep(60)
        return value

    return agent


@pytest.mark.parametrize(
    ("returned", "final", "finish", "error"),
    [
        (0.5, 0.5, FinishReason.STOP, None),
        ("post", 0.25, FinishReason.STOP, None),  # a posted reward wins over the returned one
        (None, 1.0, FinishReason.STOP, None),  # the reward function grades the answer
        (ValueError("tool broke"), 1.0, FinishReason.ERROR, "the agent raised ValueError: tool broke"),
        ("hang", 1.0, FinishReason.ERROR, "did not return within 0.5 s"),
    ],
    ids=["returned", "posted", "graded", "raised", "timed-out"],
)
async def test_the_reward_and_the_end_of_an_agent_run(tokenizer, rollout_config, returned, final, finish, error):
    engine = ScriptedEngine(ChatTokenizer(tokenizer), lambda *a: "\\boxed{5}")
    request = AsyncRolloutRequest("s1", 0, 0, [{"role": "user", "content": "2+3?"}], ground_truth="5")
    async with Gateway(engine, tokenizer, GatewayConfig(), rollout_config) as gateway:
        done = await AgentDriver(gateway, await _returns(returned), 0.5).run(request)
    assert done.finish_reason is finish and done.rewards.final == final
    assert (done.error is None) if error is None else (error in done.error)
    assert done.rewards.answer == 1.0 and not gateway.sessions


async def test_cancelling_an_agent_run_finishes_its_session_as_aborted(tokenizer, rollout_config):
    engine = ScriptedEngine(ChatTokenizer(tokenizer), lambda *a: "ok")
    request = AsyncRolloutRequest("s1", 0, 0, [{"role": "user", "content": "hi"}])
    async with Gateway(engine, tokenizer, GatewayConfig(), rollout_config) as gateway:
        task = asyncio.create_task(AgentDriver(gateway, await _returns("hang"), 30).run(request))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert request.finish_reason is FinishReason.ABORT and not gateway.sessions


def test_the_agent_is_given_a_copy_of_its_record():
    request = request_from_record(make_task("calc", 1, 0)[0], 3, 1, "r")
    record = agent_record(request)
    record["prompt"].append({"role": "user", "content": "x"})
    assert len(request.messages) == 2 and record["ground_truth"] == request.ground_truth
    assert (record["prompt_index"], record["sample_index"]) == (3, 1)


def _sync_agent(base_url: str, record: dict[str, Any]) -> float:
    """A synchronous agent (``openai.OpenAI``): run on the driver's own threads."""
    with openai.OpenAI(base_url=base_url, api_key="x", max_retries=0) as client:
        client.chat.completions.create(model="m", messages=record["prompt"])
    return 1.0


class _CountingEngine(ScriptedEngine):
    in_flight: int = 0
    most: int = 0

    async def generate(self, input_ids: list[int], sampling: SamplingParams, rid: str) -> Generation:
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        try:
            return await super().generate(input_ids, sampling, rid)
        finally:
            self.in_flight -= 1


async def test_synchronous_agents_run_side_by_side_on_their_own_threads(tokenizer, rollout_config):
    engine = _CountingEngine(ChatTokenizer(tokenizer), lambda *a: "ok", delay=lambda rid: 0.5)
    async with Gateway(engine, tokenizer, GatewayConfig(), rollout_config) as gateway:
        driver = AgentDriver(gateway, _sync_agent, 30)
        requests = [AsyncRolloutRequest(f"s{i}", i, 0, [{"role": "user", "content": "hi"}]) for i in range(24)]
        done = await asyncio.gather(*(driver.run(r) for r in requests))
        driver.close()
    assert all(r.rewards.final == 1.0 and r.finish_reason is FinishReason.STOP for r in done)
    assert engine.most > 8  # more than asyncio's default pool (min(32, cores + 4) threads) would run at once


async def test_sft_on_gateway_sessions_takes_every_sample_of_a_split_one(scripted_gateway, tmp_path):
    from trainer.config import SFTConfig
    from trainer.sft_data import load_examples

    split = await _conversation(scripted_gateway, lambda n, m: m[:2] + m[-2:] if n == 2 else m)
    whole = await _conversation(scripted_gateway, _keep)
    path = tmp_path / "sessions.jsonl"
    path.write_bytes(b"".join(json.dumps(r.to_record()).encode() + b"\n" for r in (split, whole)))
    examples = load_examples(SFTConfig(data=str(path), max_length=4096), ChatTokenizer(scripted_gateway.tokenizer))
    assert len(examples) == 3
    assert examples[0].input_ids == split.segments[0].prompt_ids + split.segments[0].response_ids


async def test_an_agent_that_recovers_from_a_full_context_ends_as_its_last_answer(tokenizer):
    engine = ScriptedEngine(ChatTokenizer(tokenizer), lambda *a: "short answer")
    async with Gateway(engine, tokenizer, GatewayConfig(), RolloutConfig(max_new_tokens=64, max_model_len=400)) as gw:
        session, agent = await _session(gw)
        messages = [{"role": "user", "content": "x" * 390}]
        with pytest.raises(openai.BadRequestError):
            await agent.ask(messages)
        await agent.ask([{"role": "user", "content": "a summary of it"}])  # the agent shortens its history
        request = await gw.finish_session(session)
    assert request.finish_reason is FinishReason.STOP and request.error is None and request.metrics.turns == 1


async def test_a_template_that_rewrites_earlier_turns_gives_a_new_sample_per_call(tokenizer, rollout_config):
    # like Qwen3's template: an earlier answer renders differently once a later turn follows it
    rewriting = (
        "{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}[old]{% else %}"
        "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    clone = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer, chat_template=rewriting,
                                eos_token="<|im_end|>")  # fmt: skip
    engine = ScriptedEngine(ChatTokenizer(clone), lambda *a: "fine")
    async with Gateway(engine, clone, GatewayConfig(), rollout_config) as gateway:
        session, agent = await _session(gateway)
        messages = [{"role": "user", "content": "hi"}]
        messages.append(await agent.ask(messages))
        messages.append({"role": "user", "content": "and then?"})
        await agent.ask(messages)
        request = await gateway.finish_session(session)
    assert "changes earlier turns" in request.segments[0].split_reason
    assert request.consistency_diff is None and request.metrics.turns == 2


async def one_call_agent(base_url: str, record: dict[str, Any]) -> float:
    """One answer, rewarded by its share of digits (a signal a random model's answers vary in)."""
    async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as client:
        reply = await client.chat.completions.create(model="m", messages=record["prompt"])
    text = reply.choices[0].message.content or ""
    return sum(c.isdigit() for c in text) / max(len(text), 1)


@pytest.mark.parametrize("async_rl", [False, True], ids=["sync", "async"])
def test_grpo_trains_on_an_agents_sessions(tmp_path, tiny_model_dir, async_rl):
    from tests.test_grpo import config
    from trainer.grpo import GRPOTrainer

    settings = config(tmp_path, tiny_model_dir, agent="tests.test_gateway:one_call_agent", steps=2,
                      async_rl=async_rl, max_staleness=1, checkpoint_every=0)  # fmt: skip
    trainer = GRPOTrainer(settings)
    before = {k: v.clone() for k, v in trainer.policy_state_dict().items()}
    history = asyncio.run(trainer.train())
    assert trainer.agent is not None and trainer.agent.gateway.counters["sessions_finished"] >= 16
    assert [m["step"] for m in history] == [1, 2]
    assert all(m["rollout/error_rate"] == 0 and m["train/tokens"] > 0 for m in history)
    after = trainer.policy_state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert trainer.engine.weight_version == 2


async def test_tool_results_are_matched_to_their_calls_by_id_in_any_order(scripted_gateway):
    session, agent = await _session(scripted_gateway)
    messages = [{"role": "user", "content": "2+3 and 7*6?"}]
    answer = await agent.ask(messages, [CALC])
    messages.append(answer)
    first, second = answer["tool_calls"]
    messages += [{"role": "tool", "tool_call_id": second["id"], "content": "42"},
                 {"role": "tool", "tool_call_id": first["id"], "content": "5"}]  # fmt: skip
    await agent.ask(messages, [CALC])
    request = await scripted_gateway.finish_session(session)
    assert [(c.arguments["expression"], c.text) for c in request.tool_calls] == [("7*6", "42"), ("2+3", "5")]
    assert not request.segments


async def test_a_run_the_gateway_has_no_room_for_ends_with_an_error_not_the_batch(tokenizer, rollout_config):
    engine = ScriptedEngine(ChatTokenizer(tokenizer), lambda *a: "ok")
    async with Gateway(engine, tokenizer, GatewayConfig(max_sessions=1), rollout_config) as gateway:
        gateway.open_session()  # the one session allowed
        request = AsyncRolloutRequest("r", 0, 0, [{"role": "user", "content": "hi"}])
        done = await AgentDriver(gateway, await _returns(1.0), 5).run(request)
    assert done.finish_reason is FinishReason.ERROR and "gateway.max_sessions" in done.error
