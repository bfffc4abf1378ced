"""The step-environment adapter (``rollout/envs/interaction.py``) with a user's own class by import path:
the first observation opens the conversation, each assistant turn is a step, observations are context
(loss mask 0), the reward is the environment's, and every environment is closed exactly once, also
when a step fails, hangs past its deadline or the request is cancelled."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
from conftest import ScriptedEngine

from data.env_tasks import is_env_task, make_env_records
from rollout.api import SetupError, setup_interactions
from rollout.config import RolloutConfig
from rollout.envs.bindings import MissingExtraError, binding_class, require, split_spec
from rollout.envs.interaction import EnvironmentInteraction
from rollout.envs.step import EnvError, Step, as_step, first_messages
from rollout.loop import run_request
from rollout.request import FinishReason
from rollout.runner import RolloutRunner, request_from_record

FAST = RolloutConfig(max_new_tokens=64, max_turns=8, interaction_timeout_s=5.0, tool_reward_timeout_s=5.0)
SPEC = f"{__name__}:CountingGame"
LOG: list[tuple[str, Any]] = []  # every call into a CountingGame, across instances
LOG_LOCK = threading.Lock()


class CountingGame:
    """A gymnasium-style game: ``turns`` steps, reward 1 on the last one when every move was "go".
    ``fail_at`` raises on that step, ``sleep_at`` blocks that step for ``sleep_s`` (a sync env)."""

    def __init__(
        self, turns: int = 3, fail_at: int = 0, sleep_at: int = 0, sleep_s: float = 0.0, bad_reset: bool = False
    ):
        self.turns, self.fail_at, self.sleep_at, self.sleep_s, self.bad_reset = (
            turns,
            fail_at,
            sleep_at,
            sleep_s,
            bad_reset,
        )
        self.n, self.good = 0, True

    def _log(self, what: str, value: Any = None) -> None:
        with LOG_LOCK:
            LOG.append((what, value))

    def reset(self, seed: int | None = None):
        self._log("reset", seed)
        if self.bad_reset:
            raise LookupError("Resource 'words' not found: nltk.download('words')")
        self.n = 0
        return f"Game {seed}: say go {self.turns} times.", {"seed": seed}

    def step(self, action: str):
        self.n += 1
        self._log("step", action)
        if self.n == self.fail_at:
            raise RuntimeError("the board caught fire")
        if self.n == self.sleep_at:
            time.sleep(self.sleep_s)
        self.good &= action.strip() == "go"
        done = self.n >= self.turns
        reward = (1.0 if self.good else 0.25) if done else 0.0
        return f"Move {self.n} taken.", reward, done, False, {"move": self.n}

    def close(self) -> None:
        self._log("close", self.n)


def closes() -> int:
    return sum(1 for what, _ in LOG if what == "close")


@pytest.fixture(autouse=True)
def clear_log():
    LOG.clear()


def env_request(rid: str = "r0", seed: int = 7, **env_kwargs: Any):
    record = make_env_records(SPEC, 1, seed, env_kwargs=env_kwargs)[0]
    return request_from_record(record, 0, 0, rid)


def moves(*texts: str):
    return lambda turn, prompt, rid: texts[min(turn, len(texts) - 1)]


async def test_an_episode_is_a_conversation_with_the_environment(chat):
    env = EnvironmentInteraction({"name": "env", "env": SPEC})
    engine = ScriptedEngine(chat, moves("go"))
    request = await run_request(env_request(seed=7), engine, chat, {}, FAST, interactions={"env": env})

    assert request.finish_reason is FinishReason.STOP and request.error is None
    assert request.messages[1] == {"role": "user", "content": "Game 7: say go 3 times."}  # reset's observation
    assert [m["role"] for m in request.messages[2:]] == ["assistant", "user", "assistant", "user", "assistant"]
    assert [m["content"] for m in request.messages if m["role"] == "user"][1:] == ["Move 1 taken.", "Move 2 taken."]
    trained = [t for t, m in zip(request.response_ids, request.loss_mask, strict=True) if m]
    assert trained == engine.emitted["r0"]  # only the model's moves are trained on: observations are context
    observation = chat.encode("Move 1 taken.")
    start = next(i for i in range(len(request.response_ids))
                 if request.response_ids[i : i + len(observation)] == observation)  # fmt: skip
    assert request.loss_mask[start : start + len(observation)] == [0] * len(observation)
    assert request.consistency_diff is None
    assert request.rewards.turn_scores == [0.0, 0.0, 1.0] and request.rewards.interaction == 1.0
    assert request.rewards.final == 1.0  # no ground truth: the environment's return
    assert [t.metadata["info"] for t in request.interaction_turns] == [{"move": 1}, {"move": 2}, {"move": 3}]
    assert [what for what, _ in LOG] == ["reset", "step", "step", "step", "close"] and LOG[0][1] == 7
    assert env.stats.opened == env.stats.closed == 1 and env.stats.steps == 3


async def test_a_failing_step_ends_only_its_request_and_closes_its_environment(chat):
    env = EnvironmentInteraction({"name": "env", "env": SPEC})
    engine = ScriptedEngine(chat, moves("go"))
    records = [make_env_records(SPEC, 1, i, env_kwargs={"fail_at": 2} if i == 1 else {})[0] for i in range(3)]
    result = await RolloutRunner(engine, chat, {}, FAST, interactions={"env": env}).run(records, 1)

    by_seed = {r.extra["interaction_kwargs"]["seed"]: r for r in result.requests}
    assert by_seed[1].finish_reason is FinishReason.ERROR
    assert f"environment {SPEC}: step failed: RuntimeError: the board caught fire" in by_seed[1].error
    assert [by_seed[s].finish_reason for s in (0, 2)] == [FinishReason.STOP, FinishReason.STOP]
    assert env.stats.opened == env.stats.closed == 3 == closes()


async def test_a_step_past_its_deadline_ends_the_request_and_the_env_closes_when_the_step_returns(chat):
    env = EnvironmentInteraction({"name": "env", "env": SPEC, "step_timeout_s": 0.2})
    engine = ScriptedEngine(chat, moves("go"))
    started = time.monotonic()
    request = await run_request(env_request(sleep_at=1, sleep_s=1.0), engine, chat, {}, FAST,
                                interactions={"env": env})  # fmt: skip
    assert time.monotonic() - started < 0.9  # the deadline, not the sleeping step, ended it
    assert request.finish_reason is FinishReason.ERROR and "step timed out after 0.2 s" in request.error
    assert closes() == 0  # not closed under the running step ...
    for _ in range(100):
        if closes():
            break
        await asyncio.sleep(0.05)
    assert closes() == 1 and env.stats.closed == env.stats.opened == 1  # ... but once it returned


async def test_a_slow_sync_step_does_not_stall_the_event_loop(chat):
    env = EnvironmentInteraction({"name": "env", "env": SPEC})
    engine = ScriptedEngine(chat, moves("go"))
    lags: list[float] = []

    async def ticker() -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(0.01)
            lags.append(time.monotonic() - before - 0.01)

    ticking = asyncio.create_task(ticker())
    records = make_env_records(SPEC, 8, 0, env_kwargs={"sleep_at": 1, "sleep_s": 0.3})
    started = time.monotonic()
    result = await RolloutRunner(engine, chat, {}, FAST, interactions={"env": env}).run(records, 1)
    ticking.cancel()
    assert all(r.finish_reason is FinishReason.STOP for r in result.requests)
    assert time.monotonic() - started < 8 * 0.3  # the eight sleeping steps overlapped in worker threads
    assert max(lags) < 0.2  # and the loop kept ticking


async def test_cancelling_mid_step_closes_every_environment_once(chat):
    env = EnvironmentInteraction({"name": "env", "env": SPEC})
    engine = ScriptedEngine(chat, moves("go"))
    tasks = [asyncio.create_task(run_request(env_request(f"r{i}", i, sleep_at=1, sleep_s=0.3), engine, chat, {},
                                             FAST, interactions={"env": env})) for i in range(4)]  # fmt: skip
    while sum(1 for what, _ in LOG if what == "step") < 4:
        await asyncio.sleep(0.01)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for _ in range(100):
        if closes() == 4:
            break
        await asyncio.sleep(0.05)
    assert closes() == 4 and env.stats.opened == env.stats.closed == 4


async def test_the_start_check_fails_at_startup_naming_what_the_environment_wanted():
    env = EnvironmentInteraction({"name": "env", "env": SPEC, "env_kwargs": {"bad_reset": True}})
    with pytest.raises(EnvError, match=r"failed its start check.*nltk.download\('words'\)"):
        async with env:
            pass
    assert env.stats.opened == env.stats.closed == 1


async def test_a_failing_reset_ends_the_request_with_an_error_naming_the_environment(chat):
    env = EnvironmentInteraction({"name": "env", "env": SPEC})
    request = await run_request(env_request(bad_reset=True), ScriptedEngine(chat, moves("go")), chat, {}, FAST,
                                interactions={"env": env})  # fmt: skip
    assert request.finish_reason is FinishReason.ERROR
    assert f"opening the conversation: EnvError: environment {SPEC}: reset failed: LookupError" in request.error
    assert env.stats.opened == env.stats.closed == 1


def test_step_results_of_every_shape_are_read():
    assert as_step(("obs", 1, True, False, {"a": 1}), "e") == Step("obs", 1.0, True, False, {"a": 1})
    assert as_step(("obs", 0.5, False, {}), "e") == Step("obs", 0.5, False, False, {})
    assert (
        as_step({"observations": [{"role": "user", "content": "hi"}], "reward": 2, "done": True}, "e").observation
        == "hi"
    )
    truncated = as_step(("o", 0, False, True, {}), "e")
    assert truncated.done and truncated.truncated
    with pytest.raises(TypeError, match="environment e: step returned str"):
        as_step("obs", "e")
    with pytest.raises(ValueError, match="not a finite number"):
        as_step(("o", float("nan"), False, False, {}), "e")
    prompt = [{"role": "system", "content": "S"}]
    assert first_messages(("hello", {}), prompt, "e") == [*prompt, {"role": "user", "content": "hello"}]
    assert first_messages([{"role": "user", "content": "q"}], prompt, "e") == [{"role": "user", "content": "q"}]
    with pytest.raises(TypeError, match="no first observation"):
        first_messages("", prompt, "e")


def test_specs_name_a_family_or_a_class_and_a_missing_extra_names_its_pip_command(monkeypatch):
    assert split_spec("textarena:Wordle-v0") == ("textarena", "Wordle-v0")
    assert split_spec("skyrl-gym:gsm8k") == ("skyrl_gym", "gsm8k")
    assert split_spec("my_pkg.envs:MyEnv") == (None, "my_pkg.envs:MyEnv")
    assert is_env_task("textarena:Wordle-v0") and is_env_task("skyrl-gym:x") and not is_env_task("calc")
    assert binding_class(SPEC)[1] == SPEC
    monkeypatch.setitem(__import__("sys").modules, "textarena", None)  # as if it were not installed
    with pytest.raises(MissingExtraError, match=r"pip install 'rallyrl\[textarena\]'"):
        require("textarena", "textarena")
    with pytest.raises(SetupError, match=r"task textarena:GuessTheNumber-v0: .*pip install 'rallyrl\[textarena\]'"):
        setup_interactions(None, "textarena:GuessTheNumber-v0")


def test_an_env_task_adds_the_environment_interaction_its_records_name():
    interactions = setup_interactions(None, SPEC.replace(__name__, "x"))  # not a family: no interaction
    assert interactions == {}
    record = make_env_records("textarena:GuessTheNumber-v0", 2, 5)[1]
    assert record.extra["interaction_kwargs"] == {"name": "env", "env": "textarena:GuessTheNumber-v0", "seed": 6}
    assert record.data_source == "textarena:GuessTheNumber-v0"
