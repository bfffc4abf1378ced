"""textarena games as step environments: ``textarena:GuessTheNumber-v0``, ``textarena:TicTacToe-v0``.

Single-player games (GuessTheNumber, TowerOfHanoi, FrozenLake, Sudoku, ...): the model is player 0; its
reward is its entry in the rewards textarena gives when the game ends (``env.close()``: ``{player:
reward}``), on the final step (0 before); a request that ends before the game does (its ``max_turns``) gets
none. The binding closes the game itself at its end; its own ``close`` is idempotent.

Games of two or more players: the model plays seat ``seat`` (env_kwargs, default 0) and a FIXED opponent
policy, named by the user, plays every other seat:

    opponent: "pkg.module:function"          called with that player's observation text, returns its
                                             action; sync, or async (run in its own event loop)
    opponent_url: "http://127.0.0.1:8000/v1" an OpenAI-compatible chat completions endpoint (with
                                             opponent_model, opponent_timeout_s, opponent_api_key)
    opponent: "rollout.envs.textarena:first_listed_move"   built in: the first move textarena lists

After the model's action the opponents move until it is the model's turn again or the game ends; the
model sees what textarena gives its player. Self-play (the model in every seat, all seats trained) is not
built: one game would be several requests whose turns interleave, which the one-request-one-conversation
state machine does not have, and the group-relative advantage of two seats of one game is not defined; a
fixed opponent keeps one request per episode.

Observations: textarena's default wrappers give a player the whole game so far at every turn; a chat
already holds it, so each user turn is what is new since the model's last move (``observations: full``
sends it whole). Actions: the default wrappers put a move without brackets in them (``4`` -> ``[4]``).

Offline: the word games (Wordle, Hangman, WordSearch, ...) call ``nltk.download`` when they load. Here that
only looks on disk (no network), and a corpus that is missing is an EnvError that names it and the command
that installs it, so the rollout's start check (one reset) fails at startup, never mid-run.

Randomness and offline NLTK: each episode runs with its own copy of the global generators textarena
seeds, and NLTK stays on disk (``rollout/envs/episode.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any, Literal

from rollout.envs.bindings import require
from rollout.envs.episode import EpisodeRandom, inside
from rollout.envs.step import EnvError, Step

OPPONENT_SYSTEM_PROMPT = (
    "You are a competitive game player. Make sure you read the game instructions carefully, "
    "and always follow the required format."
)  # textarena's STANDARD_GAME_PROMPT
MAX_OPPONENT_MOVES = 1000
"""Most opponent moves between two of the model's: a game that never gives the turn back is an error."""
_MOVES_LINE = re.compile(r"(?:available|valid|legal) (?:moves|actions|columns)[^:\n]*:([^\n]*)", re.IGNORECASE)


def first_listed_move(observation: str) -> str:
    """A fixed opponent: the first move of the last list of available / valid moves in the observation
    (``Available Moves: '[0]', '[1]'`` -> ``[0]``); ``[0]`` when it lists none."""
    for tail in reversed(_MOVES_LINE.findall(observation)):
        move = re.search(r"\[[^\[\]\n]+\]", tail)
        if move:
            return move.group(0)
    return "[0]"


class ChatOpponent:
    """An opponent served by an OpenAI-compatible chat completions endpoint (``{url}/chat/completions``):
    a system prompt and the observation as one user message; its reply is the move. Blocking, with a
    timeout: it runs in the binding's worker thread."""

    def __init__(self, url: str, model: str = "default", timeout_s: float = 60.0, api_key: str | None = None,
                 system_prompt: str = OPPONENT_SYSTEM_PROMPT, max_tokens: int | None = None):  # fmt: skip
        self.endpoint = url.rstrip("/") + "/chat/completions"
        self.model, self.timeout_s, self.api_key = model, float(timeout_s), api_key
        self.system_prompt, self.max_tokens = system_prompt, max_tokens
        host = urllib.parse.urlsplit(self.endpoint).hostname
        handlers = [urllib.request.ProxyHandler({})] if host in ("127.0.0.1", "localhost", "::1") else []
        self._opener = urllib.request.build_opener(*handlers)

    def __call__(self, observation: str) -> str:
        body: dict[str, Any] = {"model": self.model, "messages": [
            {"role": "system", "content": self.system_prompt}, {"role": "user", "content": observation}]}  # fmt: skip
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.endpoint, json.dumps(body).encode(), headers, method="POST")
        try:
            with self._opener.open(request, timeout=self.timeout_s) as response:
                payload = json.loads(response.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:300].decode("utf-8", "replace")
            raise EnvError(f"opponent at {self.endpoint} answered HTTP {exc.code}: {detail}") from None
        except (urllib.error.URLError, TimeoutError, OSError) as exc:
            raise EnvError(f"opponent at {self.endpoint} did not answer: {exc}") from None
        except ValueError as exc:
            raise EnvError(f"opponent at {self.endpoint} answered with no JSON: {exc}") from None
        try:
            return str(payload["choices"][0]["message"]["content"] or "")
        except (KeyError, IndexError, TypeError):
            raise EnvError(f"opponent at {self.endpoint}: no choices[0].message.content in {payload!r:.99}") from None


def load_opponent(opponent: str | Callable[[str], Any] | None, url: str | None, **chat: Any) -> Callable | None:
    """The opponent policy env_kwargs name: a function by import path (or a callable), or a chat endpoint."""
    if opponent is not None and url is not None:
        raise ValueError("textarena: give the opponent as 'opponent' (a function) or 'opponent_url', not both")
    if url is not None:
        return ChatOpponent(url, **chat)
    if isinstance(opponent, str):
        from tools.loading import import_class

        opponent = import_class(opponent)
    if opponent is not None and not callable(opponent):
        raise TypeError(f"textarena: opponent {opponent!r} is not callable: name a function 'pkg.module:function'")
    return opponent


def _call_policy(policy: Callable[[str], Any], observation: str) -> str:
    result = policy(observation)
    if inspect.isawaitable(result):
        result = asyncio.run(_wait(result))  # in a worker thread: no loop runs here
    return str(result)


async def _wait(awaitable: Any) -> Any:
    return await awaitable


class TextArenaBinding:
    """One textarena game; the model plays ``seat``, a fixed opponent policy the others (see the module doc)."""

    def __init__(self, env_id: str, *, seat: int = 0, num_players: int | None = None,
                 opponent: str | Callable[[str], Any] | None = None, opponent_url: str | None = None,
                 opponent_model: str = "default", opponent_timeout_s: float = 60.0,
                 opponent_api_key: str | None = None, observations: Literal["new", "full"] = "new",
                 **make_kwargs: Any):  # fmt: skip
        textarena = require("textarena", "textarena")
        self.env_id = env_id
        self.opponent = load_opponent(opponent, opponent_url, model=opponent_model, timeout_s=opponent_timeout_s,
                                      api_key=opponent_api_key)  # fmt: skip
        self.num_players = int(num_players or (2 if self.opponent is not None else 1))
        self.seat = int(seat)
        if not 0 <= self.seat < self.num_players:
            raise ValueError(f"textarena {env_id}: seat {seat} is not one of the {self.num_players} players' seats")
        if observations not in ("new", "full"):
            raise ValueError(f"textarena {env_id}: observations must be 'new' or 'full', not {observations!r}")
        self.observations = observations
        self.random = EpisodeRandom()
        with self._inside():
            self.env = textarena.make(env_id, **make_kwargs)
        self.rewards: dict[int, float] | None = None  # the game's final rewards, once it is over
        self.game_info: dict[Any, Any] = {}
        self._seen = ""  # the model's cumulative observation so far (for the "new" part)
        self._started = self._over = self._closed = False

    def _inside(self) -> contextlib.AbstractContextManager[None]:
        return inside(self.random, f"textarena:{self.env_id}")

    def reset(self, seed: int | None, messages: list[dict[str, Any]]) -> str:
        """Start the game (opponents seated before the model move first); the model's first observation."""
        try:
            with self._inside():
                self.env.reset(num_players=self.num_players, seed=seed)
        except AssertionError as exc:
            hint = (
                "a game of several players needs an opponent: env_kwargs opponent ('pkg.module:function', e.g. "
                "rollout.envs.textarena:first_listed_move) or opponent_url, and num_players when not 2"
                if self.opponent is None
                else "give num_players, or drop the opponent for a one-player game"
            )
            raise EnvError(f"textarena {self.env_id} with {self.num_players} player(s): {exc}; {hint}") from None
        self._started = True
        over, observation = self._advance()
        if over:
            raise EnvError(f"textarena {self.env_id}: the game ended before the model's first move")
        return self._text(observation)

    def step(self, action: str) -> Step:
        """The model's move, then the opponents' until the model is to move again or the game ends."""
        if self._over or not self._started:
            raise EnvError(f"textarena {self.env_id}: step on a game that is {'over' if self._over else 'not reset'}")
        with self._inside():
            done, info = self.env.step(action)
        over, observation = (True, None) if done else self._advance()
        if not over:
            return Step(self._text(observation), 0.0, False, False, dict(info or {}))
        self._finish()
        reward = float((self.rewards or {}).get(self.seat, 0.0))
        outcome = self.game_info.get(self.seat, {}) if isinstance(self.game_info, dict) else {}
        return Step("", reward, True, False, {**dict(info or {}), "rewards": self.rewards, "outcome": outcome})

    def close(self) -> None:
        """Close the game once (it closed itself at its end already)."""
        if self._closed:
            return
        self._closed = True
        if self._started:
            self._finish()

    def _advance(self) -> tuple[bool, Any]:
        """Opponents move until the model's seat is to move (False, its observation) or the game ends (True)."""
        for _ in range(MAX_OPPONENT_MOVES):
            with self._inside():
                player, observation = self.env.get_observation()
            if player == self.seat:
                return False, observation
            if self.opponent is None:
                raise EnvError(f"textarena {self.env_id}: player {player} is to move and no opponent plays it: "
                               "give env_kwargs opponent ('pkg.module:function') or opponent_url")  # fmt: skip
            try:
                action = _call_policy(self.opponent, self._plain(observation))
            except EnvError:
                raise
            except Exception as exc:
                raise EnvError(f"textarena {self.env_id}: the opponent failed on player {player}'s turn: "
                               f"{type(exc).__name__}: {exc}") from exc  # fmt: skip
            with self._inside():
                done, _ = self.env.step(action)
            if done:
                return True, None
        raise EnvError(f"textarena {self.env_id}: {MAX_OPPONENT_MOVES} opponent moves without the model's turn")

    def _finish(self) -> None:
        """textarena's close: the final rewards and game info, taken once."""
        if self._over:
            return
        self._over = True
        with self._inside():
            result = self.env.close()
        rewards, self.game_info = result if isinstance(result, tuple) and len(result) == 2 else (result, {})
        self.rewards = {int(k): float(v) for k, v in (rewards or {}).items()}

    def _plain(self, observation: Any) -> str:
        """An observation as text: a wrapped game's string as it is; a raw game's messages as ``[who] text``."""
        if isinstance(observation, str):
            return observation
        names = getattr(getattr(self.env, "state", None), "role_mapping", {}) or {}
        return "\n".join(f"[{'GAME' if who == -1 else names.get(who, f'Player {who}')}] {text}"
                         for who, text, *_ in observation or [])  # fmt: skip

    def _text(self, observation: Any) -> str:
        """What the model is shown: the part of its observation that is new since its last move (or all of it)."""
        text = self._plain(observation)
        if self.observations == "full" or not isinstance(observation, str):
            return text.strip()
        new = text[len(self._seen) :] if text.startswith(self._seen) else text
        self._seen = text
        return new.strip()
