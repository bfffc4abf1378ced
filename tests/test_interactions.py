"""Interactions: the user's turn (INTERACTING) of the request state machine, verl's
``BaseInteraction`` interface, the answer checker and the interaction config loader."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from conftest import ScriptedEngine, call, run_cli

from rollout.config import RolloutConfig
from rollout.loop import run_request
from rollout.request import AsyncRolloutRequest, FinishReason, RequestState, validate_trajectory
from rollout.runner import RolloutRunner
from rollout.users.interactions import AnswerChecker, BaseInteraction, InteractionConfigError, load_interactions
from trainer.batch import step_rewards

FAST = RolloutConfig(max_new_tokens=64, max_turns=8, interaction_timeout_s=2.0, tool_reward_timeout_s=2.0)


class Recording(BaseInteraction):
    """Counts every lifecycle call per instance; ``replies`` scripts the user's turns (a reply of
    None ends the conversation); ``fail``/``hang`` in the kwargs make generate_response raise / block."""

    def __init__(self, config: dict[str, Any] | None = None):
        super().__init__(config)
        self.started: list[str] = []
        self.finalized: list[str] = []
        self.seen: list[list[dict[str, Any]]] = []
        self.entered = asyncio.Event()

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        if kwargs.get("fail_start"):
            raise RuntimeError("no user today")
        instance_id = await super().start_interaction(instance_id, **kwargs)
        self.started.append(instance_id)
        return instance_id

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any):
        self.seen.append(messages)
        self.entered.set()
        if kwargs.get("fail"):
            raise RuntimeError("the user crashed")
        if kwargs.get("hang"):
            await asyncio.sleep(3600)
        if kwargs.get("bad_shape"):
            return "not a tuple"
        state = self._instances[instance_id]
        state["turn"] = state.get("turn", 0) + 1
        replies = kwargs.get("replies", [None])
        reply = replies[min(state["turn"], len(replies)) - 1]
        return reply is None, reply or "", 0.5 * state["turn"], {"turn": state["turn"]}

    async def calculate_score(self, instance_id: str, **kwargs: Any) -> float:
        return float(self._instances[instance_id].get("turn", 0))

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        self.finalized.append(instance_id)
        await super().finalize_interaction(instance_id, **kwargs)


def request_with(interaction_kwargs: dict[str, Any] | None, rid: str = "r0", ground_truth: str | None = None):
    extra = {"interaction_kwargs": interaction_kwargs} if interaction_kwargs is not None else {}
    messages = [{"role": "system", "content": "S."}, {"role": "user", "content": "What is 6*7?"}]
    return AsyncRolloutRequest(rid, 0, 0, messages, ground_truth=ground_truth, extra=extra)


def answers(*texts: str):
    return lambda turn, prompt, rid: texts[min(turn, len(texts) - 1)]


def states(request: AsyncRolloutRequest) -> list[str]:
    return [event.state.value for event in request.trace]


async def test_user_turns_are_context_tokens_and_the_conversation_checks_out(chat, tool):
    user = Recording({"name": "user"})
    engine = ScriptedEngine(chat, answers("\\boxed{41}", call("echo", text="6*7"), "\\boxed{42}"))
    request = request_with({"name": "user", "replies": ["Wrong, try again.", None]})
    await run_request(request, engine, chat, {"echo": tool}, FAST, interactions={"user": user})

    assert request.finish_reason is FinishReason.STOP and request.error is None
    assert states(request) == ["pending", "running", "interacting", "running", "tool_calling", "running",
                               "interacting", "completed"]  # fmt: skip
    assert [m["role"] for m in request.messages[2:]] == ["assistant", "user", "assistant", "tool", "assistant"]
    assert request.messages[3]["content"] == "Wrong, try again."
    # exactly the engine's tokens are trained on; the user turn is context
    trained = [t for t, m in zip(request.response_ids, request.loss_mask, strict=True) if m]
    assert trained == engine.emitted["r0"]
    user_ids = chat.encode("Wrong, try again.")
    start = next(i for i in range(len(request.response_ids)) if request.response_ids[i : i + len(user_ids)] == user_ids)
    assert request.loss_mask[start : start + len(user_ids)] == [0] * len(user_ids)
    assert all(lp is None for lp in request.logprobs[start : start + len(user_ids)])
    assert request.consistency_diff is None  # a full re-render gives the same tokens
    # the turns, their scores and the interaction's final score are kept
    assert [(t.turn, t.score, t.terminated) for t in request.interaction_turns] == [(1, 0.5, False), (3, 1.0, True)]
    assert request.rewards.turn_scores == [0.5, 1.0] and request.rewards.interaction == 2.0
    assert request.rewards.final == 2.0  # no ground truth: the default reward is the interaction's score
    assert request.metrics.user_turns == 2
    assert user.started == user.finalized and len(user.started) == 1 and user.live_instances == 0
    assert tool.created == tool.released == 1
    validate_trajectory(json.loads(json.dumps(request.to_record())))


async def test_the_interaction_sees_the_conversation_but_cannot_change_it(chat, tool):
    class Meddler(Recording):
        async def generate_response(self, instance_id, messages, **kwargs):
            messages.append({"role": "user", "content": "injected"})
            messages[0]["content"] = "rewritten"
            return True, "", 0.0, {}

    engine = ScriptedEngine(chat, answers("\\boxed{42}"))
    request = request_with({"name": "user"})
    await run_request(request, engine, chat, {"echo": tool}, FAST, interactions={"user": Meddler({"name": "user"})})
    assert request.messages[0]["content"] == "S." and len(request.messages) == 3
    assert request.consistency_diff is None


async def test_a_request_without_interaction_kwargs_has_no_user_turn(chat, tool):
    user = Recording({"name": "user"})
    engine = ScriptedEngine(chat, answers("\\boxed{42}"))
    request = request_with(None)
    await run_request(request, engine, chat, {"echo": tool}, FAST, interactions={"user": user})
    assert "interacting" not in states(request) and user.started == [] and request.rewards.interaction is None


async def test_records_name_their_interaction_and_an_unknown_name_ends_only_that_request(chat, tool):
    user = Recording({"name": "user"})
    engine = ScriptedEngine(chat, answers("\\boxed{42}"))
    records_kwargs = [{"name": "user"}, {"name": "nobody"}]
    requests = [request_with(kwargs, rid=f"r{i}") for i, kwargs in enumerate(records_kwargs)]
    await asyncio.gather(*(run_request(r, engine, chat, {"echo": tool}, FAST, interactions={"user": user})
                           for r in requests))  # fmt: skip
    assert requests[0].finish_reason is FinishReason.STOP and requests[0].metrics.user_turns == 1
    assert requests[1].finish_reason is FinishReason.ERROR
    assert "'nobody' names no interaction" in requests[1].error and "user" in requests[1].error
    assert tool.created == tool.released == 2


async def test_a_failing_interaction_ends_only_its_request_and_is_finalized(chat, tool):
    user = Recording({"name": "user"})
    engine = ScriptedEngine(chat, answers("\\boxed{42}"))
    ok, failing, shapeless = (request_with({"name": "user"}, "ok"), request_with({"name": "user", "fail": True}, "f"),
                              request_with({"name": "user", "bad_shape": True}, "s"))  # fmt: skip
    await asyncio.gather(*(run_request(r, engine, chat, {"echo": tool}, FAST, interactions={"user": user})
                           for r in (ok, failing, shapeless)))  # fmt: skip
    assert ok.finish_reason is FinishReason.STOP and ok.error is None
    assert failing.finish_reason is FinishReason.ERROR
    assert failing.error == "interaction user failed: RuntimeError: the user crashed"
    assert shapeless.finish_reason is FinishReason.ERROR and "must return (should_terminate" in shapeless.error
    assert sorted(user.started) == sorted(user.finalized) and len(user.started) == 3
    assert tool.created == tool.released == 3


async def test_a_hanging_interaction_times_out_and_ends_only_its_request(chat, tool):
    user = Recording({"name": "user"})
    engine = ScriptedEngine(chat, answers("\\boxed{42}"))
    config = RolloutConfig(max_new_tokens=64, interaction_timeout_s=0.2)
    hanging, ok = request_with({"name": "user", "hang": True}, "h"), request_with({"name": "user"}, "ok")
    runs = [run_request(r, engine, chat, {"echo": tool}, config, interactions={"user": user}) for r in (hanging, ok)]
    await asyncio.wait_for(asyncio.gather(*runs), 10)
    assert hanging.finish_reason is FinishReason.ERROR and hanging.error == "interaction user timed out after 0.2 s"
    assert ok.finish_reason is FinishReason.STOP
    assert len(user.finalized) == 2 and user.live_instances == 0


async def test_a_failed_start_ends_the_request_without_a_finalize(chat, tool):
    user = Recording({"name": "user"})
    request = request_with({"name": "user", "fail_start": True})
    await run_request(request, ScriptedEngine(chat, answers("x")), chat, {"echo": tool}, FAST,
                      interactions={"user": user})  # fmt: skip
    assert request.finish_reason is FinishReason.ERROR
    assert request.error == "start_interaction of interaction user failed: RuntimeError: no user today"
    assert user.finalized == [] and tool.created == tool.released == 1
    assert request.prompt_ids == []  # nothing was generated


async def test_cancelling_mid_interaction_finalizes_every_started_instance_exactly_once(chat, tool):
    user = Recording({"name": "user"})
    engine = ScriptedEngine(chat, answers("\\boxed{1}", "\\boxed{2}"), delay=lambda rid: 0.01)
    hanging = [request_with({"name": "user", "hang": True}, f"h{i}") for i in range(3)]
    talking = [request_with({"name": "user", "replies": ["again"] * 50}, f"t{i}") for i in range(3)]
    config = RolloutConfig(max_turns=50)
    runs = [
        run_request(r, engine, chat, {"echo": tool}, config, interactions={"user": user}) for r in hanging + talking
    ]
    tasks = [asyncio.create_task(run) for run in runs]
    await asyncio.wait_for(user.entered.wait(), 5)
    await asyncio.sleep(0.05)  # the talking ones between turns, the hanging ones in generate_response
    for task in tasks:
        task.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(result, asyncio.CancelledError) for result in results)
    assert sorted(user.started) == sorted(user.finalized) and len(user.finalized) == len(set(user.finalized)) == 6
    assert all(r.finish_reason is FinishReason.ABORT and r.state is RequestState.COMPLETED for r in hanging + talking)
    assert all(r.metrics.user_turns >= 1 for r in talking)
    assert tool.created == tool.released == 6


async def test_the_user_turn_budget_ends_a_conversation_the_user_would_go_on_with(chat, tool):
    user = Recording({"name": "user"})
    engine = ScriptedEngine(chat, answers("\\boxed{1}"))
    config = RolloutConfig(max_new_tokens=64, max_user_turns=2)
    request = request_with({"name": "user", "replies": ["again"] * 10})
    await run_request(request, engine, chat, {"echo": tool}, config, interactions={"user": user})
    assert request.finish_reason is FinishReason.MAX_TURNS
    assert [m["role"] for m in request.messages].count("user") == 1 + 2  # the question, then two user turns
    assert request.metrics.user_turns == 3 and request.metrics.turns == 3
    assert request.consistency_diff is None


async def test_the_assistant_turn_budget_also_bounds_user_turns(chat, tool):
    engine = ScriptedEngine(chat, answers("\\boxed{1}"))
    request = request_with({"name": "user", "replies": ["again"] * 10})
    await run_request(request, engine, chat, {"echo": tool}, RolloutConfig(max_new_tokens=64, max_turns=2),
                      interactions={"user": Recording({"name": "user"})})  # fmt: skip
    assert request.finish_reason is FinishReason.MAX_TURNS and request.metrics.turns == 2


# ----- the answer checker ---------------------------------------------------------------------------


async def test_the_checker_asks_again_until_the_answer_is_right(chat, tool):
    checker = AnswerChecker({"name": "checker", "max_attempts": 3, "retry_penalty": 0.25})
    engine = ScriptedEngine(chat, answers("\\boxed{41}", "\\boxed{42}"))
    request = request_with({"name": "checker", "ground_truth": "42"}, ground_truth="42")
    await run_request(request, engine, chat, {"echo": tool}, FAST, interactions={"checker": checker})
    assert request.finish_reason is FinishReason.STOP
    assert [m["role"] for m in request.messages[2:]] == ["assistant", "user", "assistant"]
    assert "incorrect" in request.messages[3]["content"]
    assert request.rewards.turn_scores == [0.0, 1.0] and request.rewards.interaction == 0.75
    assert request.rewards.answer == 1.0  # the answer after the last attempt
    assert [t.metadata for t in request.interaction_turns] == [
        {"attempt": 1, "correct": False},
        {"attempt": 2, "correct": True},
    ]
    assert checker.live_instances == 0


async def test_the_checker_gives_up_after_its_attempts(chat, tool):
    checker = AnswerChecker({"name": "checker", "max_attempts": 2})
    engine = ScriptedEngine(chat, answers("\\boxed{1}", "\\boxed{2}", "\\boxed{3}"))
    request = request_with({"name": "checker", "ground_truth": "42"}, ground_truth="42")
    await run_request(request, engine, chat, {"echo": tool}, FAST, interactions={"checker": checker})
    assert request.finish_reason is FinishReason.STOP and request.metrics.turns == 2
    assert request.rewards.interaction == 0.0 and request.rewards.answer == 0.0


async def test_the_checker_without_a_ground_truth_is_a_clear_error(chat, tool):
    request = request_with({"name": "checker"})
    await run_request(request, ScriptedEngine(chat, answers("x")), chat, {"echo": tool}, FAST,
                      interactions={"checker": AnswerChecker({"name": "checker"})})  # fmt: skip
    assert request.finish_reason is FinishReason.ERROR and "needs interaction_kwargs.ground_truth" in request.error


def test_user_turn_scores_are_step_rewards_of_the_turns_they_answer(chat, tool):
    checker = AnswerChecker({"name": "checker", "max_attempts": 3})
    engine = ScriptedEngine(chat, answers(call("echo", text="a"), "\\boxed{41}", "\\boxed{42}"))
    request = request_with({"name": "checker", "ground_truth": "42"}, ground_truth="42")
    asyncio.run(run_request(request, engine, chat, {"echo": tool}, FAST, interactions={"checker": checker}))
    # turn 1: a tool call (step reward 0.5); turn 2: wrong (0); turn 3: right (1) + the final reward (1)
    assert step_rewards(request) == [0.5, 0.0, 2.0]


async def test_interactions_run_through_the_runner_for_every_sample(chat, tool):
    from data.synthetic import make_calc_retry_records

    records = make_calc_retry_records(3, seed=0)
    checker = AnswerChecker({"name": "checker", "max_attempts": 2})
    engine = ScriptedEngine(chat, answers("\\boxed{0}", "\\boxed{1}"))
    runner = RolloutRunner(engine, chat, {"echo": tool}, FAST, progress=False, interactions={"checker": checker})
    result = await runner.run(records, samples_per_prompt=2)
    assert [r.metrics.user_turns for r in result.requests] == [2] * 6
    assert result.summary.to_dict().get("user_turns") == 2.0
    assert checker.live_instances == 0


# ----- the config loader ----------------------------------------------------------------------------


def write(tmp_path, text: str):
    path = tmp_path / "interaction_config.yaml"
    path.write_text(text)
    return path


def test_verl_interaction_config_loads_by_class_path(tmp_path):
    interactions = load_interactions(write(tmp_path, """
interaction:
  - name: "gsm8k"
    class_name: "verl.interactions.gsm8k_interaction.Gsm8kInteraction"
    config: {}
  - class_name: "rollout.users.interactions.AnswerChecker"
    config: {max_attempts: 5}
"""))  # fmt: skip
    assert set(interactions) == {"gsm8k", "answerchecker"}
    assert isinstance(interactions["gsm8k"], AnswerChecker)  # verl's GSM8K checker, where verl has none
    assert interactions["answerchecker"].max_attempts == 5 and interactions["gsm8k"].name == "gsm8k"


def test_a_verl_style_interaction_class_that_does_not_subclass_ours_runs(tmp_path, chat, tool):
    (tmp_path / "my_interactions.py").write_text("""
class EchoInteraction:
    def __init__(self, config):
        self.config = config
        self.name = config.get("name", "interaction_agent")
        self.done = []

    async def start_interaction(self, instance_id=None, **kwargs):
        return instance_id or "the-one"

    async def generate_response(self, instance_id, messages, **kwargs):
        return True, "ok", 1.0, {}

    async def calculate_score(self, instance_id, **kwargs):
        return 0.5

    async def finalize_interaction(self, instance_id, **kwargs):
        self.done.append(instance_id)
""")
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        interactions = load_interactions(
            write(tmp_path, "interaction:\n  - class_name: my_interactions.EchoInteraction\n")
        )
        assert set(interactions) == {"echo"}
        request = request_with({"name": "echo"})
        asyncio.run(run_request(request, ScriptedEngine(chat, answers("x")), chat, {"echo": tool}, FAST,
                                interactions=interactions))  # fmt: skip
        assert request.rewards.interaction == 0.5 and interactions["echo"].done == ["the-one"]
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("my_interactions", None)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tools: []\n", "expected a top-level 'interaction:' list"),
        ("interaction:\n  - name: x\n", "interaction[0].class_name: expected an import path"),
        ("interaction:\n  - class_name: nowhere.Thing\n", "interaction[0].class_name: cannot import 'nowhere.Thing'"),
        ("interaction:\n  - class_name: rollout.users.interactions:AnswerChecker\n    extra: 1\n",
         "unknown field(s) extra"),
        ("interaction:\n  - class_name: rollout.users.interactions:AnswerChecker\n    config: {max_attempts: 0}\n",
         "could not be created: AnswerChecker: max_attempts must be >= 1"),
        ("interaction:\n  - class_name: json:dumps\n", "has no start_interaction"),
        ("interaction:\n  - {name: a, class_name: rollout.users.interactions:AnswerChecker}\n"
         "  - {name: a, class_name: rollout.users.interactions:AnswerChecker}\n", "interaction[1].name: a second"),
        ("interaction: [\n", "not valid YAML"),
    ],
)  # fmt: skip
def test_a_bad_interaction_config_names_the_file_entry_and_field(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(InteractionConfigError) as excinfo:
        load_interactions(path)
    assert str(path) in str(excinfo.value) and message in str(excinfo.value)


# ----- the CLI --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_rollout_and_show_on_the_calc_retry_task(tmp_path):
    out = tmp_path / "retry.jsonl"
    done = run_cli("rollout", "--task", "calc-retry", "--interactions", "data/configs/interactions_checker.yaml",
                   "--num-prompts", "8", "-n", "2", "--out", str(out), "--no-progress")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "user_turns" in done.stdout + done.stderr
    assert run_cli("check", str(out)).returncode == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 16 and all(r["consistency_diff"] is None for r in records)
    assert all(r["interaction_turns"] and r["interaction_turns"][-1]["terminated"] for r in records
               if r["finish_reason"] == "stop")  # fmt: skip
    retried = next((i for i, r in enumerate(records) if len(r["interaction_turns"]) > 1), None)
    assert retried is not None, "the tiny model is never right every time: some request was told to retry"
    shown = run_cli("show", str(out), "--index", str(retried))
    assert shown.returncode == 0, shown.stderr
    assert "user turn (interaction), answering turn" in shown.stdout and "user turns" in shown.stdout


@pytest.mark.slow
def test_records_with_interaction_kwargs_and_no_interaction_config_stay_single_agent(tmp_path):
    out = tmp_path / "plain.jsonl"
    done = run_cli("rollout", "--task", "calc-retry", "--num-prompts", "4", "--out", str(out), "--no-progress")
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(r["interaction_turns"] == [] for r in records)


@pytest.mark.slow
def test_training_on_calc_retry_takes_fewer_attempts_and_ends_right_more_often(tmp_path):
    """Two GRPO steps of the shipped calc-retry config, 4 samples per prompt (the embedded model,
    the answer checker):
    the mean attempts per request fall and the accuracy after the last attempt rises (the whole
    run's curves are in README)."""
    out = tmp_path / "run"
    done = run_cli("train", "--config", "data/configs/grpo_calc_retry.yaml", "--steps", "2", "-n", "4",
                   "--out", str(out), "--no-progress", timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first, last = history[0], history[-1]
    assert 1.0 < last["rollout/user_turns"] < first["rollout/user_turns"] <= 3.0
    assert first["rollout/accuracy"] < last["rollout/accuracy"]


VERL_RECORD = {
    "data_source": "openai/gsm8k",
    "prompt": [{"role": "user", "content": "Natalia sold 48 clips in April and half as many in May. How many in all?"}],
    "ability": "math",
    "reward_model": {"style": "rule", "ground_truth": "72"},
    "extra_info": {"split": "train", "index": 0,
                   "interaction_kwargs": {"name": "gsm8k", "query": "Natalia sold ...", "ground_truth": "72"}},
}  # fmt: skip
VERL_INTERACTION_CONFIG = """interaction:
  - name: "gsm8k"
    class_name: "verl.interactions.gsm8k_interaction.Gsm8kInteraction"
    config: {}
"""


@pytest.mark.slow
def test_a_verl_record_and_interaction_config_run_in_rollout_and_train_unchanged(tmp_path):
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("\n".join(json.dumps({**VERL_RECORD, "extra_info": {**VERL_RECORD["extra_info"], "index": i}})
                              for i in range(2)))  # fmt: skip
    config = write(tmp_path, VERL_INTERACTION_CONFIG)
    out = tmp_path / "rollouts.jsonl"
    done = run_cli("rollout", "--data", str(data), "--interactions", str(config), "-n", "4", "--out", str(out),
                   "--max-new-tokens", "128", "--no-progress")  # fmt: skip
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 8 and all(r["consistency_diff"] is None for r in records)
    assert any(r["interaction_turns"] for r in records)
    assert all(r["interaction_turns"] for r in records if r["finish_reason"] == "stop")  # the checker had its turn
    run = tmp_path / "run"
    done = run_cli("train", "--data", str(data), "--set", f"interactions={config}", "--steps", "1",
                   "--prompts-per-step", "2", "-n", "4", "--set", "rollout.max_new_tokens=128", "--out", str(run),
                   "--no-progress")  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    step = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert step["rollout/user_turns"] > 0
