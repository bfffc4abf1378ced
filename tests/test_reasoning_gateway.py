"""The agent gateway and ``rallyrl serve``'s OpenAI endpoint with a reasoning model (Qwen3-style
test models, ``tests/families.py``): answers carry ``reasoning_content`` and parsed ``tool_calls`` as
SGLang's do with ``--reasoning-parser qwen3 --tool-call-parser qwen25``, through the openai SDK, and
the session's tokens stay those generated, reasoning included."""

from __future__ import annotations

from typing import Any

import openai
from conftest import CountingTool, ScriptedEngine
from families import family

from rollout.config import GatewayConfig, RolloutConfig
from rollout.gateway import Gateway
from rollout.gateway.session import answer_message
from rollout.tokens import ChatTokenizer

ECHO = CountingTool.default_schema()
TURNS = [
    '<think>\nI need the tool.\n</think>\n\n<tool_call>\n{"name": "echo", "arguments": {"text": "6*7"}}\n</tool_call>',
    "<think>\nIt said 42.\n</think>\n\nIt is \\boxed{42}.",
]


async def test_the_gateway_answers_a_qwen3_model_with_reasoning_content_and_tool_calls():
    spec = family("qwen3")
    script = lambda turn, prompt, rid: TURNS[1] if "<tool_response>" in prompt else TURNS[0]  # noqa: E731
    engine = ScriptedEngine(ChatTokenizer(spec.tokenizer, [ECHO]), script)  # (each call is a new rid)
    config = RolloutConfig(max_new_tokens=128, tool_parser="qwen25", reasoning_parser="qwen3")
    async with Gateway(engine, spec.tokenizer, GatewayConfig(), config) as gateway:
        session = gateway.open_session()
        client = openai.AsyncOpenAI(base_url=gateway.base_url(session.id), api_key="x", max_retries=0)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 6*7?"}]
        first = (await client.chat.completions.create(model="m", messages=messages, tools=[ECHO])).choices[0]
        reply = first.message.model_dump(exclude_none=True)
        assert first.finish_reason == "tool_calls"
        assert reply["reasoning_content"] == "I need the tool." and not reply.get("content")
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in reply["tool_calls"]] == [
            ("echo", '{"text": "6*7"}')]  # fmt: skip
        messages += [reply, {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "42"}]
        second = (await client.chat.completions.create(model="m", messages=messages, tools=[ECHO])).choices[0]
        assert second.message.content == "It is \\boxed{42}."
        assert second.message.model_dump()["reasoning_content"] == "It said 42."
        await client.close()
        request = await gateway.finish_session(session)
        other = gateway.open_session()  # the same first call, streamed
        async with openai.AsyncOpenAI(base_url=gateway.base_url(other.id), api_key="x", max_retries=0) as streaming:
            chunks = await streaming.chat.completions.create(model="m", messages=messages[:1], tools=[ECHO],
                                                              stream=True)  # fmt: skip
            deltas = [chunk.choices[0].delta.model_dump() async for chunk in chunks if chunk.choices]
        assert "".join(d.get("reasoning_content") or "" for d in deltas) == "I need the tool."
        assert [c["function"]["name"] for d in deltas for c in d.get("tool_calls") or []] == ["echo"]
    assert request.segments == [] and request.consistency_diff is None  # the session went on token for token
    assert [m.get("reasoning") for m in request.messages if m["role"] == "assistant"] == ["I need the tool.",
                                                                                        "It said 42."]  # fmt: skip
    assert "I need the tool." in spec.tokenizer.decode(request.response_ids)
    assert request.metrics.reasoning_tokens > 0


def test_an_answer_message_splits_reasoning_before_reading_tool_calls():
    message = answer_message(TURNS[0], "qwen25", "qwen3")
    assert message["reasoning_content"] == "I need the tool." and message["content"] is None
    assert message["tool_calls"][0]["function"]["name"] == "echo"
    plain = answer_message("No thinking here.", "qwen25", "qwen3")
    assert plain == {"role": "assistant", "content": "No thinking here.", "reasoning_content": None}


async def test_rallyrl_serve_answers_with_reasoning_content_and_tool_calls_and_writes_history_back_in_family_format():
    from test_server import post, served

    spec = family("qwen3-coder")  # XML calls: the agent's history is written back in that format
    prompts: list[str] = []

    def script(turn: int, prompt: str, rid: str) -> str:
        prompts.append(prompt)
        call = "<tool_call>\n<function=echo>\n<parameter=text>\n6*7\n</parameter>\n</function>\n</tool_call>"
        return f"<think>\nCall it.\n</think>\n\n{call}"

    engine = ScriptedEngine(ChatTokenizer(spec.tokenizer, [ECHO]), script)
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "echo", "arguments": '{"text": "x"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "x"}]  # fmt: skip
    async with served(engine, spec.tokenizer, tool_parser="qwen3_coder", reasoning_parser="qwen3") as client:
        status, completion = await post(client, "/v1/chat/completions", {"messages": history, "tools": [ECHO]})
    assert status == 200, completion
    message = completion["choices"][0]["message"]
    assert message["reasoning_content"] == "Call it." and completion["choices"][0]["finish_reason"] == "tool_calls"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("echo", '{"text": "6*7"}')]  # fmt: skip
    assert "<function=echo>\n<parameter=text>\nx\n</parameter>" in prompts[0]  # not Hermes JSON
