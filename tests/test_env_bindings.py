"""The hubs' step environments (textarena, GEM, SkyRL-Gym) played turn by turn by the embedded model through
``EnvironmentInteraction``: token-exact conversations, observations never trained on, the environment's own
rewards, every environment closed exactly once. The real installed packages, offline."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import pytest
from aiohttp import web
from conftest import ScriptedEngine
from env_checks import Recorder, check_conversation

from data.env_tasks import make_env_records
from data.schema import Record
from rollout.api import resolve_model
from rollout.config import RolloutConfig
from rollout.engines.local import LocalEngine
from rollout.envs.bindings import MissingExtraError
from rollout.envs.interaction import EnvironmentInteraction
from rollout.envs.textarena import first_listed_move
from rollout.loop import run_request
from rollout.request import AsyncRolloutRequest
from rollout.runner import request_from_record
from rollout.tokens import ChatTokenizer, load_tokenizer

CONFIG = RolloutConfig(max_new_tokens=64, max_turns=6, seed=7)
OPPONENT = "rollout.envs.textarena:first_listed_move"


@pytest.fixture(scope="module")
def model_dir():
    return resolve_model(None)


@pytest.fixture(scope="module")
def chat(model_dir) -> ChatTokenizer:
    return ChatTokenizer(load_tokenizer(model_dir), [])


def spy(monkeypatch, cls: type, method: str) -> list[tuple[Any, Any]]:
    """Every call of ``cls.method``, as (instance, result)."""
    calls: list[tuple[Any, Any]] = []
    real = getattr(cls, method)

    def recorded(self, *args: Any, **kwargs: Any) -> Any:
        result = real(self, *args, **kwargs)
        calls.append((self, result))
        return result

    monkeypatch.setattr(cls, method, recorded)
    return calls


async def play(records: list[Record], interaction: EnvironmentInteraction, model_dir, chat, engine=None,
               config: RolloutConfig = CONFIG) -> tuple[list[AsyncRolloutRequest], dict[str, list[int]]]:  # fmt: skip
    """Every record as one request through ``interaction`` (entered, so its start check runs), all at once."""
    async with LocalEngine.from_pretrained(model_dir) as local, interaction:
        recorder = Recorder(engine or local)
        runs = [run_request(request_from_record(r, i, 0, f"r{i}"), recorder, chat, {}, config,
                            interactions={"env": interaction}) for i, r in enumerate(records)]  # fmt: skip
        requests = await asyncio.gather(*runs)
    return list(requests), recorder.emitted


def check_closed_once(interaction: EnvironmentInteraction, real_closes: int | None = None) -> None:
    assert interaction.stats.opened == interaction.stats.closed
    if real_closes is not None:
        assert real_closes == interaction.stats.opened


def env(spec: str, **env_kwargs: Any) -> EnvironmentInteraction:
    return EnvironmentInteraction({"name": "env", "env": spec, "env_kwargs": env_kwargs})


@pytest.fixture
def textarena_closes(monkeypatch) -> list[tuple[Any, Any]]:
    """textarena's game-level close (under its wrappers): one per episode, with (rewards, game_info)."""
    import textarena

    return spy(monkeypatch, textarena.core.Env, "close")


def model_rewards(closes: list[tuple[Any, Any]], seat: int) -> list[float]:
    """The model's final reward in every game that ended (the start check's game did not)."""
    return sorted(float(rewards[seat]) for _, (rewards, _) in closes if rewards is not None)


# ----- textarena -----------------------------------------------------------------------------------


@pytest.mark.parametrize("game", ["GuessTheNumber-v0", "2048-v0-ultra-easy"])
async def test_a_textarena_single_player_game_is_played_turn_by_turn(game, model_dir, chat, textarena_closes):
    interaction = env(f"textarena:{game}")
    requests, emitted = await play(make_env_records(f"textarena:{game}", 3), interaction, model_dir, chat)

    for request in requests:
        check_conversation(request, emitted[request.request_id], chat)
        assert request.messages[1]["role"] == "user" and request.messages[1]["content"].startswith("[GAME] You ")
        assert request.interaction_turns[-1].terminated
    rewards = sorted(r.rewards.interaction for r in requests)
    assert rewards == model_rewards(textarena_closes, 0)  # the game's own, from its close
    assert [r.rewards.final for r in requests] == [r.rewards.interaction for r in requests]
    check_closed_once(interaction, len(textarena_closes))
    assert interaction.stats.opened == 4  # three episodes and the start check's


async def test_a_two_player_game_is_played_against_an_opponent_function(model_dir, chat, textarena_closes):
    interaction = env("textarena:TicTacToe-v0", seat=1, opponent=OPPONENT)
    requests, emitted = await play(make_env_records("textarena:TicTacToe-v0", 2), interaction, model_dir, chat)

    for request in requests:
        check_conversation(request, emitted[request.request_id], chat)
        first = request.messages[1]["content"]
        assert "You are Player 1" in first and "[Player 0] [0]" in first  # the opponent opened in cell 0
    assert sorted(r.rewards.interaction for r in requests) == model_rewards(textarena_closes, 1)
    check_closed_once(interaction, len(textarena_closes))


@pytest.fixture
async def opponent_server() -> Any:
    """An OpenAI-compatible chat endpoint on 127.0.0.1 whose model plays ``first_listed_move``."""
    seen: list[list[dict[str, Any]]] = []

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body["messages"])
        move = first_listed_move(body["messages"][-1]["content"])
        return web.json_response({"choices": [{"index": 0, "message": {"role": "assistant", "content": move}}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/v1", seen
    finally:
        await runner.cleanup()


async def test_a_two_player_game_is_played_against_an_opponent_served_over_http(
    model_dir, chat, textarena_closes, opponent_server
):
    url, seen = opponent_server
    interaction = env("textarena:TicTacToe-v0", seat=1, opponent_url=url, opponent_model="fixed")
    requests, emitted = await play(make_env_records("textarena:TicTacToe-v0", 2), interaction, model_dir, chat)

    for request in requests:
        check_conversation(request, emitted[request.request_id], chat)
        assert "[Player 0] [0]" in request.messages[1]["content"]
    assert len(seen) == 3  # one opening move per game, the start check's included
    assert all("You are Player 0" in messages[-1]["content"] for messages in seen)  # the opponent's own view
    assert sorted(r.rewards.interaction for r in requests) == model_rewards(textarena_closes, 1)
    check_closed_once(interaction, len(textarena_closes))


# ----- GEM -----------------------------------------------------------------------------------------


def gem_game(monkeypatch) -> tuple[list[tuple[Any, Any]], list[Any]]:
    from gem.envs.game_env.guess_the_number import GuessTheNumberEnv

    from rollout.envs.gem import GEMBinding

    return spy(monkeypatch, GuessTheNumberEnv, "step"), spy(monkeypatch, GEMBinding, "close")


async def test_a_gem_game_is_played_by_the_embedded_model(model_dir, chat, monkeypatch):
    steps, closes = gem_game(monkeypatch)
    interaction = env("gem:game:GuessTheNumber-v0-hard")
    requests, emitted = await play(make_env_records("gem:game:GuessTheNumber-v0-hard", 3), interaction, model_dir, chat)

    for request in requests:  # its replies are rarely a well-formed \boxed{N}: GEM ends the game on the first
        check_conversation(request, emitted[request.request_id], chat, min_turns=1)
    assert sum(r.rewards.interaction for r in requests) == pytest.approx(sum(float(s[1]) for _, s in steps))
    check_closed_once(interaction, len(closes))


async def test_a_gem_game_over_several_turns_gives_the_games_rewards(chat, model_dir, monkeypatch):
    from rollout.envs.gem import GEMBinding

    target = GEMBinding("game:GuessTheNumber-v0-hard")
    target.reset(seed=11, messages=[])
    number = target.env.game_number  # the seed's game, whoever else plays at the same time
    target.close()
    steps, closes = gem_game(monkeypatch)
    moves = ["\\boxed{99}", f"It is \\boxed{{{number + 1 if number < 50 else number - 1}}}", f"\\boxed{{{number}}}"]
    engine = ScriptedEngine(chat, lambda turn, prompt, rid: moves[turn])
    interaction = env("gem:game:GuessTheNumber-v0-hard")
    records = make_env_records("gem:game:GuessTheNumber-v0-hard", 1, seed=11)
    [request], emitted = await play(records, interaction, model_dir, chat, engine=engine)

    check_conversation(request, emitted["r0"], chat, min_turns=3)
    assert "outside the range" in request.messages[3]["content"]
    assert [t.score for t in request.interaction_turns] == [0.0, 0.0, 1.0]  # out of range, a hint, the number
    assert [float(s[1]) for _, s in steps] == [0.0, 0.0, 1.0]
    assert request.rewards.interaction == request.rewards.final == 1.0
    check_closed_once(interaction, len(closes))


# ----- SkyRL-Gym -----------------------------------------------------------------------------------


def gsm8k_records(n: int, max_turns: int = 3) -> list[Record]:
    extras = {"reward_spec": {"ground_truth": "72"}, "max_turns": max_turns}
    kwargs = {"name": "env", "env": "skyrl_gym:gsm8k_multi_turn", "env_kwargs": {"extras": extras}}
    prompt = [{"role": "system", "content": "Answer as #### N."}, {"role": "user", "content": "What is 8*9?"}]
    return [Record(prompt=prompt, data_source="gsm8k", extra={"interaction_kwargs": kwargs}, index=i) for i in range(n)]


@pytest.mark.parametrize("scripted", [False, True], ids=["embedded", "scripted"])
async def test_a_skyrl_gym_multi_turn_env_is_played_to_its_turn_limit(scripted, model_dir, chat, monkeypatch):
    from skyrl_gym.envs.gsm8k.multi_turn_env import GSM8kMultiTurnEnv

    steps, closes = spy(monkeypatch, GSM8kMultiTurnEnv, "step"), spy(monkeypatch, GSM8kMultiTurnEnv, "close")
    moves = ["Let me think.", "#### 71", "#### 72"]
    engine = ScriptedEngine(chat, lambda turn, prompt, rid: moves[turn]) if scripted else None
    # the config's extras make the start check's episode; each record's own extras replace them
    interaction = env("skyrl_gym:gsm8k_multi_turn", extras={"reward_spec": {"ground_truth": "0"}, "max_turns": 1})
    requests, emitted = await play(gsm8k_records(1 if scripted else 2), interaction, model_dir, chat, engine=engine)

    for request in requests:
        check_conversation(request, emitted[request.request_id], chat, min_turns=3)
        assert request.messages[:2] == gsm8k_records(1)[0].prompt  # init's conversation is the start
        assert "#### ANSWER" in [m["content"] for m in request.messages if m["role"] == "user"][1]
    assert sum(r.rewards.interaction for r in requests) == pytest.approx(sum(s["reward"] for _, s in steps))
    if scripted:  # a format score for a wrong answer, then the right one ends it
        assert [t.score for t in requests[0].interaction_turns] == pytest.approx([0.0, 0.2 / 3, 1.0])
    check_closed_once(interaction, len(closes))


# ----- a family whose package is not installed -----------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "module", "extra", "binding"),
    [("textarena:GuessTheNumber-v0", "textarena", "textarena", "rollout.envs.textarena:TextArenaBinding"),
     ("gem:game:GuessTheNumber-v0-easy", "gem", "gem", "rollout.envs.gem:GEMBinding"),
     ("skyrl_gym:gsm8k_multi_turn", "skyrl_gym", "skyrl-gym", "rollout.envs.skyrl_gym:SkyRLGymBinding")],
)  # fmt: skip
def test_a_family_whose_package_is_missing_names_the_pip_command(spec, module, extra, binding, monkeypatch):
    from tools.loading import import_class

    monkeypatch.setitem(sys.modules, module, None)  # import module -> ImportError, as when it is not installed
    with pytest.raises(MissingExtraError, match=rf"pip install 'rallyrl\[{extra}\]'"):
        EnvironmentInteraction({"name": "env", "env": spec})
    with pytest.raises(MissingExtraError, match=rf"pip install 'rallyrl\[{extra}\]'"):
        import_class(binding)("x")
