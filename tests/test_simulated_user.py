"""The simulated user (``rollout/users/simulated_user.py``): what the simulator sees (roles flipped), the
done marker and the user-turn limit, config mistakes, its concurrency bound on the embedded
model, a real ``rallyrl serve`` subprocess through an interaction YAML, a dead and a hanging
backend, and user turns inside ``run_request`` (loss mask 0)."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
import pytest
from aiohttp import web
from conftest import ScriptedEngine, run_cli

from data.synthetic import make_calc_records
from data.tiny_model import EMBEDDED_MODEL
from rollout.config import RolloutConfig
from rollout.engines.base import EngineError, Generation, SamplingParams
from rollout.engines.local import LocalEngine, LocalEngineConfig
from rollout.loop import run_request
from rollout.request import AsyncRolloutRequest, FinishReason
from rollout.serve.processes import free_port, serve_processes
from rollout.tokens import ChatTokenizer, load_tokenizer
from rollout.users.chat_model import ChatModelError
from rollout.users.interactions import InteractionConfigError, load_interactions
from rollout.users.simulated_user import SimulatedUser, simulator_view

FAST = {"backoff_s": 0.001, "backoff_max_s": 0.002}
PERSONA = "a retired teacher who writes short messages"
GOAL = "learn what 6 times 7 is"
CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant with a calculator."},
    {"role": "user", "content": "What is 6 times 7?"},
    {"role": "assistant", "content": 'Let me check.<tool_call>{"name": "calc", "arguments": {}}</tool_call>'},
    {"role": "tool", "content": "42"},
    {"role": "assistant", "content": "It is 42."},
]


@pytest.fixture
def plain_chat(tokenizer) -> ChatTokenizer:
    """The real chat tokenizer without tools, as a simulator's."""
    return ChatTokenizer(tokenizer)


def scripted_user(chat: ChatTokenizer, replies: Callable[[str], str | Exception], **config: Any):
    """A SimulatedUser on a scripted engine double: ``replies(prompt_text)`` is each call's reply."""
    engine = ScriptedEngine(chat, lambda turn, prompt, rid: replies(prompt))
    return SimulatedUser({"name": "user", **FAST, **config}, engine=engine, tokenizer=chat)


# ----- what the simulator sees -------------------------------------------------------------------------


def test_the_simulator_sees_the_chat_window_with_roles_flipped():
    assert simulator_view(CONVERSATION) == [
        {"role": "assistant", "content": "What is 6 times 7?"},  # what the user said: the simulator's own words
        {"role": "user", "content": "Let me check.\n\nIt is 42."},  # tool call cut, tool result left out, joined
    ]


def test_messages_with_nothing_the_user_would_see_are_left_out():
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image", "image": "x.png"}]},
        {"role": "assistant", "content": '<tool_call>{"name": "calc"}</tool_call>'},
        {"role": "tool", "content": "1"},
        {"role": "assistant", "content": None},
    ]
    assert simulator_view(messages) == [{"role": "assistant", "content": "Hi"}]


async def test_the_simulator_prompt_is_persona_goal_and_the_flipped_conversation(plain_chat):
    prompts: list[str] = []
    user = scripted_user(plain_chat, lambda prompt: prompts.append(prompt) or "Thanks!")
    instance = await user.start_interaction(persona=PERSONA, goal=GOAL)
    await user.generate_response(instance, CONVERSATION)
    (prompt,) = prompts
    system = re.match(r"<\|im_start\|>system\n(.*?)<\|im_end\|>", prompt, re.DOTALL)[1]
    assert f"Your persona: {PERSONA}" in system and f"Your goal: {GOAL}" in system and "[DONE]" in system
    assert "helpful assistant with a calculator" not in prompt and "tool_call" not in prompt
    assert prompt.endswith(
        "<|im_start|>assistant\nWhat is 6 times 7?<|im_end|>\n"
        "<|im_start|>user\nLet me check.\n\nIt is 42.<|im_end|>\n<|im_start|>assistant\n"
    )


async def test_a_template_of_ones_own_keeps_braces_in_the_persona(plain_chat):
    prompts: list[str] = []
    template = "Be {persona}. Want: {goal}. Say END when done."
    user = scripted_user(plain_chat, lambda p: prompts.append(p) or "ok", system_template=template, done_marker="END")
    instance = await user.start_interaction(persona="a {json} fan", goal="x")
    await user.generate_response(instance, CONVERSATION)
    assert "<|im_start|>system\nBe a {json} fan. Want: x. Say END when done.<|im_end|>" in prompts[0]


# ----- the done marker, the turn limit, the scores -------------------------------------------------------


async def test_the_done_marker_ends_the_conversation_is_cut_and_scores_1(plain_chat):
    user = scripted_user(plain_chat, lambda prompt: "Great, thank you! [DONE]")
    instance = await user.start_interaction(persona=PERSONA, goal=GOAL)
    terminate, text, score, metadata = await user.generate_response(instance, CONVERSATION)
    assert (terminate, text, score) == (True, "Great, thank you!", 0.0)
    assert metadata["goal_met"] is True and metadata["attempts"] == 1 and metadata["latency_s"] >= 0
    assert await user.calculate_score(instance) == 1.0
    await user.finalize_interaction(instance)
    assert user.live_instances == 0


async def test_without_the_marker_the_user_goes_on_and_the_score_is_0(plain_chat):
    user = scripted_user(plain_chat, lambda prompt: "Why 42?")
    instance = await user.start_interaction(persona=PERSONA, goal=GOAL)
    assert (await user.generate_response(instance, CONVERSATION))[:3] == (False, "Why 42?", 0.0)
    assert await user.calculate_score(instance) == 0.0


async def test_after_max_user_turns_replies_the_next_turn_ends_it_without_calling_the_simulator(plain_chat):
    user = scripted_user(plain_chat, lambda prompt: "Go on.", max_user_turns=2)
    engine = user.chat_model.engine
    instance = await user.start_interaction(persona=PERSONA, goal=GOAL)
    assert [(await user.generate_response(instance, CONVERSATION))[0] for _ in range(2)] == [False, False]
    terminate, text, _, metadata = await user.generate_response(instance, CONVERSATION)
    assert (terminate, text, metadata["stopped"]) == (True, "", "max_user_turns")
    assert user.stats.calls == 2 and len(engine.turns) == 2
    one = await user.start_interaction(persona=PERSONA, goal=GOAL, max_user_turns=1)  # the record's own limit
    assert [(await user.generate_response(one, CONVERSATION))[0] for _ in range(2)] == [False, True]


async def test_an_empty_reply_is_retried_and_a_simulator_that_only_says_nothing_fails(plain_chat):
    said = iter(["", "  [DONE]  "])
    user = scripted_user(plain_chat, lambda prompt: next(said))
    instance = await user.start_interaction(persona=PERSONA, goal=GOAL)
    terminate, text, _, metadata = await user.generate_response(instance, CONVERSATION)
    assert (terminate, text, metadata["attempts"]) == (True, "", 2) and user.stats.unparsable == 1
    mute = scripted_user(plain_chat, lambda prompt: " ", max_retries=2)
    instance = await mute.start_interaction(persona=PERSONA, goal=GOAL)
    with pytest.raises(ChatModelError, match=r"simulated user failed after 3 attempt\(s\): unparsable reply ''"):
        await mute.generate_response(instance, CONVERSATION)


async def test_an_engine_error_is_retried_then_raised(plain_chat):
    calls = iter([EngineError("busy"), "Fine."])
    user = scripted_user(plain_chat, lambda prompt: next(calls))
    instance = await user.start_interaction(persona=PERSONA, goal=GOAL)
    assert (await user.generate_response(instance, CONVERSATION))[3]["attempts"] == 2
    broken = scripted_user(plain_chat, lambda prompt: EngineError("down"), max_retries=1)
    instance = await broken.start_interaction(persona=PERSONA, goal=GOAL)
    with pytest.raises(ChatModelError, match=r"after 2 attempt\(s\): EngineError: down"):
        await broken.generate_response(instance, CONVERSATION)
    assert broken.stats.failures == 1 and broken.stats.retries == 1


# ----- mistakes --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"goal": GOAL}, "needs interaction_kwargs.persona \\(a non-empty string\\): it is missing"),
        ({"persona": PERSONA}, "needs interaction_kwargs.goal \\(a non-empty string\\): it is missing"),
        ({"persona": PERSONA, "goal": " "}, "interaction_kwargs.goal .*got ' '"),
        ({"persona": PERSONA, "goal": GOAL, "max_user_turns": 0}, "interaction_kwargs.max_user_turns must be"),
    ],
)
async def test_interaction_kwargs_mistakes_name_the_key(plain_chat, kwargs, message):
    user = scripted_user(plain_chat, lambda prompt: "hi")
    with pytest.raises(ValueError, match=f"simulated user 'user'.*{message}"):
        await user.start_interaction(**kwargs)
    assert user.live_instances == 0


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"url": "http://h:1/v1", "max_concurency": 4},
            "config.max_concurency: unknown field; did you mean 'max_concurrency'",
        ),
        ({"url": "http://h:1/v1", "max_tokens": "many"}, "config.max_tokens: must be an integer, got 'many'"),
        ({"url": "http://h:1/v1", "max_concurrency": 0}, "max_concurrency must be >= 1, got 0"),
        ({"url": "h:1"}, "simulated user URL 'h:1' must start with http:// or https://"),
        ({"url": "http://h:1/v1", "model": "gpt-x"}, "url and model are both given.*served_model"),
        ({"url": "http://h:1/v1", "system_template": "Be {persona}. [DONE]"}, "system_template must contain {goal}"),
        ({"url": "http://h:1/v1", "system_template": "Be {persona}; want {goal}."}, "must tell the simulator its done"),
        ({"max_tokens": 8}, "config needs url \\(an OpenAI-compatible server\\) or model"),
        ({"model": "/no/such/dir"}, "config.model: model /no/such/dir: no such directory"),
    ],
)
def test_config_mistakes_are_value_errors_naming_the_key(config, message):
    with pytest.raises(ValueError, match=message):
        SimulatedUser({"name": "user", **config})


def test_an_engine_and_a_url_are_not_both_given(plain_chat):
    engine = ScriptedEngine(plain_chat, lambda turn, prompt, rid: "hi")
    with pytest.raises(ValueError, match=r"an engine is given, so config.url and config.model must not be"):
        SimulatedUser({"url": "http://h:1/v1"}, engine=engine, tokenizer=plain_chat)
    with pytest.raises(ValueError, match="needs the engine's tokenizer"):
        SimulatedUser({}, engine=engine)


def test_a_config_mistake_in_the_interaction_yaml_names_the_file_and_the_entry(tmp_path):
    path = tmp_path / "interactions.yaml"
    path.write_text("interaction:\n  - name: user\n    class_name: rollout.users.simulated_user:SimulatedUser\n"
                    "    config: {url: 'http://127.0.0.1:1/v1', temperature: hot}\n")  # fmt: skip
    with pytest.raises(InteractionConfigError, match=r"interactions.yaml: interaction\[0\]: .*could not be created: "
                       r"simulated user 'user': config.temperature: must be a number, got 'hot'"):  # fmt: skip
        load_interactions(path)


# ----- the embedded tiny model as the simulator ---------------------------------------------------------


class CountingEngine:
    """A real engine, with the calls it is running at once measured."""

    def __init__(self, engine: LocalEngine):
        self.engine, self.in_flight, self.max_in_flight = engine, 0, 0

    async def generate(self, input_ids: list[int], sampling: SamplingParams, rid: str) -> Generation:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self.engine.generate(input_ids, sampling, rid)
        finally:
            self.in_flight -= 1

    async def abort(self, rid: str | None = None) -> None:
        await self.engine.abort(rid)


async def test_24_conversations_keep_at_most_4_simulator_calls_in_flight_on_the_embedded_model(tokenizer):
    local = LocalEngine.from_pretrained(EMBEDDED_MODEL, LocalEngineConfig(max_batch_size=16, device="cpu"))
    async with local:
        engine = CountingEngine(local)
        user = SimulatedUser({"max_concurrency": 4, "max_tokens": 4, "max_retries": 8, "temperature": 1.0, **FAST},
                             engine=engine, tokenizer=tokenizer)  # fmt: skip
        instances = [await user.start_interaction(persona=f"user {i}", goal=GOAL) for i in range(24)]
        replies = await asyncio.gather(*(user.generate_response(i, CONVERSATION) for i in instances))
    assert user.max_in_flight == 4 and engine.max_in_flight == 4  # measured: reached, never above
    assert user.in_flight == 0 and user.queued == 0
    assert user.stats.calls == 24 + user.stats.unparsable and user.stats.failures == 0
    for terminate, text, score, metadata in replies:
        assert isinstance(text, str) and score == 0.0 and metadata["attempts"] >= 1
        assert terminate == metadata["goal_met"] and (text or terminate)


async def test_model_embedded_opens_an_engine_of_its_own_and_closes_it():
    user = SimulatedUser({"name": "user", "model": "embedded", "device": "cpu", "max_tokens": 4, "max_retries": 8,
                          "temperature": 1.0, **FAST})  # fmt: skip
    assert user.model_dir == EMBEDDED_MODEL and user.chat_model is None
    instance = await user.start_interaction(persona=PERSONA, goal=GOAL)
    with pytest.raises(RuntimeError, match="simulated user 'user' is not open"):
        await user.generate_response(instance, CONVERSATION)
    async with user:
        engine = user.chat_model.engine
        assert isinstance(engine, LocalEngine) and engine._task is not None
        _, text, _, metadata = await user.generate_response(instance, CONVERSATION)
        assert isinstance(text, str) and metadata["user_turn"] == 1
    assert engine._task is None and user.chat_model is None
    with pytest.raises(RuntimeError, match="is not open"):
        await user.generate_response(instance, CONVERSATION)


# ----- a real rallyrl serve process, from an interaction YAML -------------------------------------------


@pytest.fixture(scope="module")
def server_url(tmp_path_factory) -> str:
    with serve_processes(EMBEDDED_MODEL, tmp_path_factory.mktemp("serve-logs")) as (server,):
        yield server.url


def interaction_yaml(tmp_path, config: str) -> Any:
    path = tmp_path / "interactions.yaml"
    path.write_text(f"interaction:\n  - name: user\n    class_name: rollout.users.simulated_user:SimulatedUser\n"
                    f"    config: {config}\n")  # fmt: skip
    return load_interactions(path)


@pytest.mark.slow
async def test_a_simulated_user_from_a_yaml_talks_to_a_real_rallyrl_serve(server_url, tmp_path):
    interactions = interaction_yaml(
        tmp_path, f"{{url: '{server_url}/v1', max_concurrency: 2, max_tokens: 8, temperature: 1.0, "
                  "max_retries: 8, backoff_s: 0.001, max_user_turns: 2}",
    )  # fmt: skip
    user = interactions["user"]
    assert isinstance(user, SimulatedUser) and user.name == "user" and user.settings.max_user_turns == 2
    async with user:
        instances = [await user.start_interaction(persona=f"user {i}", goal=GOAL) for i in range(6)]
        replies = await asyncio.gather(*(user.generate_response(i, CONVERSATION) for i in instances))
    assert user.max_in_flight == 2 and user.stats.calls == 6 + user.stats.unparsable and user.stats.failures == 0
    for terminate, text, _, metadata in replies:
        assert isinstance(text, str) and (text or terminate) and "[DONE]" not in text
        assert metadata["latency_s"] > 0 and metadata["attempts"] >= 1


@pytest.mark.slow
def test_rallyrl_rollout_plays_the_user_turns_with_a_simulator_behind_rallyrl_serve(server_url, tmp_path):
    """Three processes: this test, ``rallyrl rollout`` (the embedded policy) and ``rallyrl serve`` (the user)."""
    records = []
    for record in make_calc_records(4, seed=0):
        extra = {**record.extra, "interaction_kwargs": {"name": "user", "persona": PERSONA, "goal": "a checked sum"}}
        records.append({"prompt": record.prompt, "data_source": "calc", "ground_truth": record.ground_truth,
                        "tools_kwargs": record.tools_kwargs, "extra": extra})  # fmt: skip
    data, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    data.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    (tmp_path / "user.yaml").write_text(
        "interaction:\n  - name: user\n    class_name: rollout.users.simulated_user:SimulatedUser\n"
        f"    config: {{url: '{server_url}/v1', max_tokens: 8, temperature: 1.0, max_retries: 8, max_user_turns: 1}}\n"
    )
    result = run_cli("rollout", "--data", str(data), "--interactions", str(tmp_path / "user.yaml"), "--out", str(out),
                     "--device", "cpu", "--no-progress")  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    chat = ChatTokenizer(load_tokenizer(EMBEDDED_MODEL))
    trajectories = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert len(trajectories) == 4 and all(t["error"] is None for t in trajectories)
    played = [t for t in trajectories if t["interaction_turns"]]
    assert played, "the policy never stopped to let the user speak"
    for trajectory in played:
        said = [turn["text"] for turn in trajectory["interaction_turns"] if not turn["terminated"]]
        assert said == [m["content"] for m in trajectory["messages"][2:] if m["role"] == "user"]
        for turn in trajectory["interaction_turns"]:  # a simulator reply, or the limit's end without a call
            assert turn["metadata"]["attempts"] >= 1 if "stopped" not in turn["metadata"] else turn["terminated"]
        context = [t for t, m in zip(trajectory["response_ids"], trajectory["loss_mask"], strict=True) if m == 0]
        assert all(text in chat.decode(context) for text in said)  # user turns: loss mask 0
        assert trajectory["consistency_diff"] is None


async def test_a_wrong_path_on_the_server_fails_at_once(server_url):
    async with SimulatedUser({"url": f"{server_url}/nope/v1", "max_retries": 3, **FAST}) as user:
        instance = await user.start_interaction(persona=PERSONA, goal=GOAL)
        with pytest.raises(ChatModelError, match=r"the simulated user failed: .*answered HTTP 404"):
            await user.generate_response(instance, CONVERSATION)
    assert user.stats.calls == 1


# ----- a dead and a hanging backend -------------------------------------------------------------------------


async def test_a_server_that_is_down_raises_after_its_retries():
    async with SimulatedUser({"url": f"http://127.0.0.1:{free_port()}/v1", "max_retries": 2, **FAST}) as user:
        instance = await user.start_interaction(persona=PERSONA, goal=GOAL)
        with pytest.raises(ChatModelError, match=r"the simulated user failed after 3 attempt\(s\): Client.*Error"):
            await user.generate_response(instance, CONVERSATION)
    assert user.stats.calls == 3 and user.stats.failures == 1 and user.in_flight == 0


@contextlib.asynccontextmanager
async def hanging_server() -> AsyncIterator[str]:
    """An OpenAI-looking server on loopback that never answers (until it is stopped)."""
    stop = asyncio.Event()

    async def hang(request: web.Request) -> web.Response:
        await stop.wait()
        return web.Response(status=503)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", hang)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        stop.set()
        await runner.cleanup()


async def test_a_hanging_server_times_out_each_call_and_then_raises():
    async with hanging_server() as url, SimulatedUser({"url": url, "timeout_s": 0.2, "max_retries": 1, **FAST}) as user:
        instance = await user.start_interaction(persona=PERSONA, goal=GOAL)
        started = time.monotonic()
        with pytest.raises(ChatModelError, match=r"failed after 2 attempt\(s\): timed out"):
            await user.generate_response(instance, CONVERSATION)
        assert 0.4 <= time.monotonic() - started < 2.0
    assert user.stats.calls == 2 and user.in_flight == 0


async def test_a_hanging_engine_call_is_aborted_and_retried(plain_chat):
    aborted: list[str] = []
    calls = iter([10.0, 0.0])
    engine = ScriptedEngine(plain_chat, lambda turn, prompt, rid: "Go on.", delay=lambda rid: next(calls))
    engine.abort = lambda rid=None: asyncio.sleep(0, aborted.append(rid))  # type: ignore[method-assign]
    user = SimulatedUser({"timeout_s": 0.05, **FAST}, engine=engine, tokenizer=plain_chat)
    instance = await user.start_interaction(persona=PERSONA, goal=GOAL)
    assert (await user.generate_response(instance, CONVERSATION))[3]["attempts"] == 2
    assert len(aborted) == 1 and aborted[0].startswith("simulated-user-")


# ----- user turns in the rollout loop ---------------------------------------------------------------------


def conversation_request(rid: str, goal: str = GOAL) -> AsyncRolloutRequest:
    request = AsyncRolloutRequest(rid, 0, 0, [{"role": "user", "content": "Hello, I need help."}])
    request.extra["interaction_kwargs"] = {"name": "user", "persona": PERSONA, "goal": goal}
    return request


def simulator_script(prompt: str) -> str | Exception:
    """A simulator that wants two answers and says so; one whose goal is "fail" breaks."""
    if "Your goal: fail" in prompt:
        return EngineError("simulator down")
    return "Thanks, that is all. [DONE]" if "Answer 1" in prompt else "Can you say more?"


async def test_user_turns_join_the_conversation_with_loss_mask_0(chat, plain_chat):
    policy = ScriptedEngine(chat, lambda turn, prompt, rid: f"Answer {turn}")
    user = scripted_user(plain_chat, simulator_script, max_retries=0)
    request = await run_request(
        conversation_request("r0"), policy, chat, {}, RolloutConfig(), interactions={"user": user}
    )
    assert request.error is None and request.finish_reason == FinishReason.STOP
    assert [(m["role"], m["content"]) for m in request.messages] == [
        ("user", "Hello, I need help."), ("assistant", "Answer 0"), ("user", "Can you say more?"),
        ("assistant", "Answer 1"),
    ]  # fmt: skip  # the closing "[DONE]" reply ends it and is not appended
    trained = [t for t, m in zip(request.response_ids, request.loss_mask, strict=True) if m == 1]
    context = [t for t, m in zip(request.response_ids, request.loss_mask, strict=True) if m == 0]
    assert trained == policy.emitted["r0"]  # exactly the policy's tokens are trained on
    assert "Can you say more?" in chat.decode(context) and "Can you say more?" not in chat.decode(trained)
    assert request.consistency_diff is None
    assert [(t.text, t.terminated, t.metadata["goal_met"]) for t in request.interaction_turns] == [
        ("Can you say more?", False, False), ("Thanks, that is all.", True, True)
    ]  # fmt: skip
    assert request.rewards.interaction == 1.0 and request.rewards.turn_scores == [0.0, 0.0]
    assert user.live_instances == 0  # finalized


async def test_a_failing_simulator_ends_only_its_own_request(chat, plain_chat):
    policy = ScriptedEngine(chat, lambda turn, prompt, rid: f"Answer {turn}")
    user = scripted_user(plain_chat, simulator_script, max_retries=1)
    requests = [conversation_request("ok"), conversation_request("broken", goal="fail")]
    config = RolloutConfig()
    await asyncio.gather(*(run_request(r, policy, chat, {}, config, interactions={"user": user}) for r in requests))
    ok, broken = requests
    assert ok.finish_reason == FinishReason.STOP and ok.rewards.interaction == 1.0
    assert broken.finish_reason == FinishReason.ERROR
    assert "failed after 2 attempt(s): EngineError: simulator down" in broken.error
    assert user.live_instances == 0
