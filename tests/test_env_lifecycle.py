"""Step environments' lifecycles and edges: an environment that fails or is cancelled mid-step is still closed
once, a word game without its NLTK data fails at startup without a download, seeds give the same game under
concurrency, the opponents of two-player textarena games, and ``rallyrl rollout --task textarena:...``."""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from test_env_bindings import CONFIG, OPPONENT, env, spy

from data.env_tasks import make_env_records
from rollout.engines.local import LocalEngine
from rollout.envs.step import EnvError
from rollout.envs.textarena import TextArenaBinding, first_listed_move
from rollout.loop import run_request
from rollout.request import FinishReason
from rollout.runner import request_from_record

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir():
    from rollout.api import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="module")
def chat(model_dir):
    from rollout.tokens import ChatTokenizer, load_tokenizer

    return ChatTokenizer(load_tokenizer(model_dir), [])


@pytest.fixture
def textarena_closes(monkeypatch) -> list[tuple[Any, Any]]:
    import textarena

    return spy(monkeypatch, textarena.core.Env, "close")


# ----- closed once, whatever happens ---------------------------------------------------------------


async def test_an_env_that_raises_in_step_ends_only_its_request_and_is_closed_once(model_dir, chat, textarena_closes):
    # textarena's Countdown-v0 raises a ValueError on a move it cannot parse (its own bug): a real failing step
    records = make_env_records("textarena:GuessTheNumber-v0", 3)
    records[1].extra["interaction_kwargs"]["env"] = "textarena:Countdown-v0"
    interaction = env("textarena:GuessTheNumber-v0")
    async with LocalEngine.from_pretrained(model_dir) as engine, interaction:
        runs = [run_request(request_from_record(r, i, 0, f"r{i}"), engine, chat, {}, CONFIG,
                            interactions={"env": interaction}) for i, r in enumerate(records)]  # fmt: skip
        requests = await asyncio.gather(*runs)

    failed = requests[1]
    assert failed.finish_reason is FinishReason.ERROR
    assert "textarena:Countdown-v0: step failed: ValueError" in failed.error
    assert [r.finish_reason for r in (requests[0], requests[2])] == [FinishReason.STOP] * 2
    assert interaction.stats.errors == 1
    assert interaction.stats.opened == interaction.stats.closed == len(textarena_closes) == 4


async def test_a_request_cancelled_mid_step_closes_its_env_once_the_step_returns(
    model_dir, chat, textarena_closes, monkeypatch
):
    from textarena.envs.GuessTheNumber.env import GuessTheNumberEnv

    entered, release = threading.Event(), threading.Event()
    real_step = GuessTheNumberEnv.step

    def slow_step(self, action: str) -> Any:
        entered.set()
        release.wait(10)
        return real_step(self, action)

    monkeypatch.setattr(GuessTheNumberEnv, "step", slow_step)
    interaction = env("textarena:GuessTheNumber-v0")
    [record] = make_env_records("textarena:GuessTheNumber-v0", 1)
    async with LocalEngine.from_pretrained(model_dir) as engine, interaction:
        task = asyncio.create_task(run_request(request_from_record(record, 0, 0, "r0"), engine, chat, {}, CONFIG,
                                               interactions={"env": interaction}))  # fmt: skip
        assert await asyncio.to_thread(entered.wait, 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert (interaction.stats.opened, interaction.stats.closed) == (2, 1)  # the step still runs: not yet
        release.set()
        for _ in range(100):
            if interaction.stats.closed == 2:
                break
            await asyncio.sleep(0.02)
    assert interaction.stats.opened == interaction.stats.closed == len(textarena_closes) == 2


# ----- offline ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "data"),
    [("textarena:Hangman-v0", "words"), ("textarena:Wordle-v0", "averaged_perceptron_tagger_eng"),
     ("gem:game:Hangman-v0-easy", "words")],
)  # fmt: skip
async def test_a_word_game_without_its_nltk_data_fails_at_startup_naming_it(spec, data, monkeypatch, tmp_path):
    import nltk
    import nltk.downloader

    fetched: list[Any] = []

    def offline(*args: Any, **kwargs: Any) -> Any:
        fetched.append(args)
        raise OSError("no network in this test")

    monkeypatch.setattr(nltk.data, "path", [str(tmp_path)])  # no NLTK data anywhere
    monkeypatch.setattr(nltk.downloader, "urlopen", offline)
    started = time.monotonic()
    with pytest.raises(EnvError, match=rf"{spec} needs the NLTK data '{data}'.*nltk\.download\('{data}'\)"):
        async with env(spec):
            pass
    assert fetched == [] and time.monotonic() - started < 5  # nothing was fetched, nothing waited on


async def test_a_word_game_loaded_outside_the_binding_still_fails_naming_its_data(monkeypatch, tmp_path):
    import importlib

    import nltk

    monkeypatch.setattr(nltk.data, "path", [str(tmp_path)])
    with monkeypatch.context() as offline:
        offline.setattr(nltk, "download", lambda *args, **kwargs: False)  # what nltk.download gives offline
        importlib.import_module("textarena.envs.Hangman.env")  # its download "ran" before any binding
    with pytest.raises(EnvError, match=r"textarena:Hangman-v0 needs the NLTK data 'words'"):
        async with env("textarena:Hangman-v0"):
            pass


def test_a_word_game_with_its_nltk_data_on_disk_runs_without_the_network(tmp_path):
    words = tmp_path / "corpora" / "words"
    words.mkdir(parents=True)
    (words / "en").write_text("apple\nbanana\ncherry\n")
    (words / "en-basic").write_text("apple\nbanana\ncherry\n")
    script = textwrap.dedent("""
        import json, nltk.downloader
        def offline(*args, **kwargs):
            raise SystemExit("the network was used")
        nltk.downloader.urlopen = offline
        from rollout.envs.textarena import TextArenaBinding
        game = TextArenaBinding("Hangman-v0")
        first = game.reset(3, [])
        step = game.step("[A]")
        game.close()
        print(json.dumps({"first": first, "observation": step.observation, "done": step.done}))
    """)
    env_vars = {**os.environ, "NLTK_DATA": str(tmp_path), "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env_vars, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert "Hangman" in result["first"] and not result["done"]
    assert "[Player] [A]" in result["observation"]


# ----- randomness ---------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["textarena", "gem"])
def test_a_seed_is_the_same_game_however_many_episodes_run_at_once(family):
    from rollout.envs.gem import GEMBinding

    def number(seed: int | None) -> int:
        game = (
            TextArenaBinding("GuessTheNumber-v0")
            if family == "textarena"
            else GEMBinding("game:GuessTheNumber-v0-hard")
        )
        game.reset(seed, [])
        found = game.env.game_number if family == "gem" else game.env.state.game_state["game_number"]
        game.close()
        return found

    before = random.getstate()
    alone = {seed: number(seed) for seed in range(4)}
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(number, [i % 4 for i in range(64)]))
        unseeded = list(pool.map(number, [None] * 8))
    assert together == [alone[i % 4] for i in range(64)]
    assert len(set(unseeded)) > 1  # an episode without a seed draws its own game
    assert random.getstate() == before  # the process's own generator is left as it was


# ----- opponents ----------------------------------------------------------------------------------


def test_the_opponent_moves_after_each_model_move_until_the_game_ends(textarena_closes):
    game = TextArenaBinding("TicTacToe-v0", seat=0, opponent=OPPONENT)
    assert "You are Player 0" in game.reset(1, [])
    step = game.step("[4]")
    assert "Player 1 placed their symbol (X) in cell 0" in step.observation and not step.done
    game.step("[3]")  # the opponent takes cell 1
    final = game.step("[5]")  # 3-4-5: the model wins
    assert (final.done, final.reward, final.info["rewards"]) == (True, 1.0, {0: 1.0, 1: -1.0})
    game.close()
    game.close()
    assert len(textarena_closes) == 1


def test_an_async_opponent_runs_in_its_own_event_loop():
    moves: list[str] = []

    async def opponent(observation: str) -> str:
        await asyncio.sleep(0)
        moves.append(first_listed_move(observation))
        return moves[-1]

    game = TextArenaBinding("TicTacToe-v0", seat=1, opponent=opponent)
    assert "[Player 0] [0]" in game.reset(1, [])
    assert "[Player 0] [1]" in game.step("[4]").observation
    assert moves == ["[0]", "[1]"]
    game.close()


def test_the_built_in_opponent_plays_the_first_move_listed_last():
    assert first_listed_move("Available Moves: '[0]', '[1]'\n...\nAvailable Moves: '[5]', '[7]'") == "[5]"
    assert first_listed_move("Valid moves: [2], [3]") == "[2]"
    assert first_listed_move("no list here") == "[0]"


async def test_a_two_player_game_without_an_opponent_fails_at_startup_saying_what_to_give():
    with pytest.raises(EnvError, match=r"TicTacToe-v0 with 1 player.*needs an opponent: env_kwargs opponent"):
        async with env("textarena:TicTacToe-v0"):
            pass


async def test_an_opponent_url_that_does_not_answer_fails_at_startup_naming_it():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens there
    url = f"http://127.0.0.1:{port}/v1"
    with pytest.raises(EnvError, match=rf"opponent at {url}/chat/completions did not answer"):
        async with env("textarena:TicTacToe-v0", seat=1, opponent_url=url, opponent_timeout_s=5):
            pass


# ----- the command line ---------------------------------------------------------------------------


def test_rollout_of_a_textarena_task_from_the_command_line(tmp_path):
    out = tmp_path / "f.jsonl"
    command = [shutil.which("rallyrl") or "rallyrl", "rollout", "--task", "textarena:GuessTheNumber-v0",
               "--num-prompts", "2", "--out", str(out)]  # fmt: skip
    env_vars = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, capture_output=True, text=True, env=env_vars, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]

    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2 and {row["data_source"] for row in rows} == {"textarena:GuessTheNumber-v0"}
    for row in rows:
        assert row["finish_reason"] == "stop" and row["error"] is None and row["consistency_diff"] is None
        assert [m["role"] for m in row["messages"][:3]] == ["system", "user", "assistant"]
        assert "Guess The Number" in row["messages"][1]["content"]
        assert len(row["interaction_turns"]) >= 2 and row["interaction_turns"][-1]["terminated"]
        assert row["reward"] == row["rewards"]["interaction"] == sum(t["score"] for t in row["interaction_turns"])
