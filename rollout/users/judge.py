"""LLM-as-judge: a model grades each final answer against the reference, as a reward function.

    judge = Judge("http://127.0.0.1:30000", JudgeConfig(max_concurrency=16))   # OpenAI /v1/chat/completions
    judge = Judge(engine, tokenizer=tokenizer)                                 # any rallyrl Engine
    async with judge:
        runner = RolloutRunner(..., reward_fn=reward_for_records("judge", rewards={"judge": judge.reward}))

One judgment: the template is filled with the question (the prompt's last user message), the
reference answer (``ground_truth``) and the model's final answer; the judge model's reply is
parsed for ``score: X`` (``mode="score"``, X from 0 to ``score_max``, scaled to [0, 1]) or
YES / NO (``mode="yes_no"``, 1 or 0).

- Concurrency: at most ``max_concurrency`` judge calls are in flight; the others wait in the
  semaphore's queue without holding up anything else (a rollout request waiting for its judgment
  is one suspended coroutine). ``in_flight``, ``max_in_flight`` and ``queued`` are measured.
- Retries: an engine error, an HTTP error that may pass (connection, timeout, 408, 429, 5xx) or
  an unparsable reply is retried with exponential backoff and full jitter (``rollout/retry.py``),
  up to ``max_retries`` times; the slot is given back while waiting. Other HTTP errors (400,
  401, 404) fail at once. The bound, the timeout and the retries are ``rollout/users/chat_model.py``'s,
  shared with the simulated user.
- Cache: a successful score is kept under (template, question, reference, answer), in memory
  and, with ``cache_path``, in a JSON file (loaded at construction, written on exit and by
  ``save_cache``). Identical judgments asked for at the same time call the judge once.
- Failure: a judgment that still fails is recorded on the request (``rewards.judge = None``,
  ``rewards.judge_error`` and a note in ``error``) and its reward is missing (None), never 0:
  the trainer leaves it out of its group's statistics.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from data.files import atomic_write_bytes
from data.reward_fns import final_answer_text, question_text
from data.text import truncate_middle
from rollout.config import JudgeConfig
from rollout.engines.base import Engine
from rollout.request import AsyncRolloutRequest
from rollout.users.chat_model import ChatModel, ChatModelError, ChatModelStats, ChatSettings, chat_completions_url

__all__ = ["Judge", "JudgeConfig", "JudgeError", "JudgeStats", "chat_completions_url", "parse_score", "parse_verdict"]

SCORE_TEMPLATE = """You are grading an answer to a question against the reference answer.

Question:
{question}

Reference answer:
{reference}

Answer to grade:
{answer}

Is the answer to grade correct? Reply with one line "score: X", where X is a whole number from 0 (wrong) \
to {score_max} (fully correct)."""
YES_NO_TEMPLATE = """You are grading an answer to a question against the reference answer.

Question:
{question}

Reference answer:
{reference}

Answer to grade:
{answer}

Is the answer to grade correct? Reply with YES or NO only."""
NO_REFERENCE = "(none given)"
_PLACEHOLDER_RE = re.compile(r"\{(question|reference|answer|score_max)\}")
_SCORE_RE = re.compile(
    r"\bscore\b\s*(?:is|of|=|:)?\s*\**\s*([-+]?\d+(?:\.\d+)?)(?:\s*(?:/|out\s+of)\s*(\d+(?:\.\d+)?))?", re.IGNORECASE
)
_LABELLED_VERDICT_RE = re.compile(r"\b(?:verdict|judge?ment|correct)\b\s*[:=]\s*\**\s*(yes|no)\b", re.IGNORECASE)
_CAPS_VERDICT_RE = re.compile(r"\b(YES|NO)\b")


@dataclass
class JudgeStats(ChatModelStats):
    """Counts of what a judge did: its model's calls, retries, unparsable replies (no score or
    verdict in them) and failed judgments, and these."""

    judgments: int = 0
    """Scores asked for (cache hits included)."""
    cache_hits: int = 0


class JudgeError(RuntimeError):
    """A judgment failed (after its retries): the message says why."""


@dataclass
class _KeyLock:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0


def parse_score(text: str, score_max: float = 10.0) -> float | None:
    """The last ``score: X`` (also ``Score = X/10``, ``**Score:** X``, ``score of X out of 10``) of a
    reply, scaled to [0, 1]; None when there is none or it lies outside the scale."""
    matches = _SCORE_RE.findall(text)
    if not matches:
        return None
    number, scale = matches[-1]
    top = float(scale) if scale else score_max
    if top <= 0:
        return None
    value = float(number) / top
    return value if 0.0 <= value <= 1.0 and math.isfinite(value) else None


def parse_verdict(text: str) -> float | None:
    """1.0 for YES, 0.0 for NO: a reply that is only the word (any case), else the last
    ``verdict: X``, else YES / NO in capitals when only one of them appears; None otherwise."""
    bare = text.strip().strip(".!*`'\" \n").lower()
    if bare in ("yes", "no"):
        return 1.0 if bare == "yes" else 0.0
    labelled = _LABELLED_VERDICT_RE.findall(text)
    if labelled:
        return 1.0 if labelled[-1].lower() == "yes" else 0.0
    verdicts = set(_CAPS_VERDICT_RE.findall(text))
    if len(verdicts) == 1:
        return 1.0 if verdicts == {"YES"} else 0.0
    return None


class Judge:
    """Grades final answers with a judge model: an Engine (with its tokenizer) or an OpenAI URL.

    The engine is used as it is (its owner opens and closes it); an OpenAI URL needs
    ``async with judge:`` (one ClientSession, closed on exit). The cache file is written on exit.
    """

    def __init__(self, backend: Engine | str, config: JudgeConfig | None = None, *, tokenizer: Any = None):
        self.config = config or JudgeConfig()
        self.stats = JudgeStats()
        c = self.config
        settings = ChatSettings(
            max_concurrency=c.max_concurrency, max_tokens=c.max_new_tokens, temperature=c.temperature,
            timeout_s=c.timeout_s, max_retries=c.max_retries, backoff_s=c.backoff_s, backoff_max_s=c.backoff_max_s,
            model=c.model, api_key=c.api_key, connect_timeout_s=c.connect_timeout_s,
        )  # fmt: skip
        self.model = ChatModel(backend, settings, tokenizer=tokenizer, label="judge", stats=self.stats)
        """The judge model behind its bound, timeout and retries."""
        self.url, self.engine, self.chat = self.model.url, self.model.engine, self.model.chat
        self.template = self.config.template or (SCORE_TEMPLATE if self.config.mode == "score" else YES_NO_TEMPLATE)
        self.cache: dict[str, float] = {}
        self._cache_dirty = False
        self._key_locks: dict[str, _KeyLock] = {}
        self._fingerprint = [self.config.mode, self.template, self.config.score_max]
        if self.config.cache_path and Path(self.config.cache_path).exists():
            self.cache = _read_cache(Path(self.config.cache_path))

    def __repr__(self) -> str:
        return f"Judge({self.url or self.engine!r})"

    @property
    def in_flight(self) -> int:
        """Judge calls running now."""
        return self.model.in_flight

    @property
    def max_in_flight(self) -> int:
        """The most judge calls that ran at once."""
        return self.model.max_in_flight

    @property
    def queued(self) -> int:
        """Judge calls waiting for a slot now."""
        return self.model.queued

    async def __aenter__(self) -> Judge:
        await self.model.__aenter__()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.model.__aexit__(*exc_info)
        self.save_cache()

    # ----- the reward function ------------------------------------------------------------------

    async def reward(self, request: AsyncRolloutRequest) -> float | None:
        """The judge's score of ``request``'s final answer in [0, 1] (also in ``rewards.judge``); None
        when the judgment failed, which is recorded in ``rewards.judge_error`` and ``error``."""
        try:
            value = await self.score(question_text(request), final_answer_text(request), request.ground_truth)
        except Exception as exc:
            message = str(exc) if isinstance(exc, JudgeError) else f"the judge failed: {type(exc).__name__}: {exc}"
            request.rewards.judge = None
            request.rewards.judge_error = message
            request.error = message if request.error is None else f"{request.error}; {message}"
            return None
        request.rewards.judge = value
        return value

    async def score(self, question: str, answer: str, reference: str | None = None) -> float:
        """The judge's score in [0, 1]; cached. Raises JudgeError when the judgment fails."""
        self.stats.judgments += 1
        key = self.cache_key(question, answer, reference)
        if key in self.cache:
            self.stats.cache_hits += 1
            return self.cache[key]
        async with self._one_judgment_per_key(key):
            if key in self.cache:  # judged while this one waited for the same key
                self.stats.cache_hits += 1
                return self.cache[key]
            value = await self._judge(self.prompt(question, answer, reference))
            self.cache[key] = value
            self._cache_dirty = True
            return value

    def prompt(self, question: str, answer: str, reference: str | None = None) -> str:
        """The template filled in (each text cut to ``max_answer_chars``; braces in them are kept as they are)."""
        limit = self.config.max_answer_chars
        values = {
            "question": truncate_middle(question, limit),
            "reference": truncate_middle(reference, limit) if reference is not None else NO_REFERENCE,
            "answer": truncate_middle(answer, limit),
            "score_max": f"{self.config.score_max:g}",
        }
        return _PLACEHOLDER_RE.sub(lambda match: values[match[1]], self.template)

    def parse(self, reply: str) -> float | None:
        """The score in [0, 1] in a judge's reply, or None when it has none."""
        if self.config.mode == "score":
            return parse_score(reply, self.config.score_max)
        return parse_verdict(reply)

    def cache_key(self, question: str, answer: str, reference: str | None = None) -> str:
        payload = orjson.dumps([self._fingerprint, question, reference, answer])
        return hashlib.sha256(payload).hexdigest()

    def save_cache(self) -> None:
        """Write the cache file (atomically) when there is one and something new to write."""
        if not self.config.cache_path or not self._cache_dirty:
            return
        atomic_write_bytes(self.config.cache_path, orjson.dumps({"scores": self.cache}))
        self._cache_dirty = False

    # ----- one judgment ---------------------------------------------------------------------------

    async def _judge(self, prompt: str) -> float:
        """Call the judge model until a reply parses (``rollout/users/chat_model.py``: bounded, timed,
        retried with backoff); JudgeError when none does."""
        try:
            reply = await self.model.complete([{"role": "user", "content": prompt}], parse=self.parse)
        except ChatModelError as exc:
            raise JudgeError(str(exc)) from None
        return reply.value

    @contextlib.asynccontextmanager
    async def _one_judgment_per_key(self, key: str) -> AsyncIterator[None]:
        """Judgments of the same key take turns, so a second one finds the first one's score cached."""
        entry = self._key_locks.setdefault(key, _KeyLock())
        entry.users += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.users -= 1
            if entry.users == 0:
                del self._key_locks[key]


def _read_cache(path: Path) -> dict[str, float]:
    try:
        scores = orjson.loads(path.read_bytes())["scores"]
        if not isinstance(scores, dict) or not all(isinstance(v, (int, float)) for v in scores.values()):
            raise TypeError
    except (OSError, orjson.JSONDecodeError, KeyError, TypeError):
        raise ValueError(f"{path}: not a judge cache file (expected {{'scores': {{key: score}}}}); remove it") from None
    return {str(key): float(value) for key, value in scores.items()}
