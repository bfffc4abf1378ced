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
  401, 404) fail at once.
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
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from data.files import atomic_write_bytes
from data.reward_fns import final_answer_text, question_text
from data.text import truncate_middle
from rollout.config import JudgeConfig
from rollout.engines.base import Engine, SamplingParams
from rollout.request import AsyncRolloutRequest
from rollout.retry import RETRY_STATUSES, Backoff, call_with_retries
from rollout.tokens import ChatTokenizer

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
class JudgeStats:
    """Counts of what a judge did."""

    judgments: int = 0
    """Scores asked for (cache hits included)."""
    cache_hits: int = 0
    calls: int = 0
    """Calls to the judge model (retries included)."""
    retries: int = 0
    unparsable: int = 0
    """Replies with no score or verdict in them."""
    failures: int = 0
    """Judgments that failed after every retry."""


class JudgeError(RuntimeError):
    """A judgment failed (after its retries): the message says why."""


class _FatalCallError(JudgeError):
    """A call failed in a way no retry can mend (a 400, a 401, a 404)."""


class _RetryableCallError(JudgeError):
    """A call failed in a way another call may not (an engine or connection error, a timeout, an
    unparsable reply); the message says how."""


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


def chat_completions_url(url: str) -> str:
    """``http://host:port`` or ``.../v1`` -> ``.../v1/chat/completions`` (a full one is kept)."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"judge URL {url!r} must start with http:// or https://")
    url = url.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    return url + ("/chat/completions" if url.endswith("/v1") else "/v1/chat/completions")


class Judge:
    """Grades final answers with a judge model: an Engine (with its tokenizer) or an OpenAI URL.

    The engine is used as it is (its owner opens and closes it); an OpenAI URL needs
    ``async with judge:`` (one ClientSession, closed on exit). The cache file is written on exit.
    """

    def __init__(self, backend: Engine | str, config: JudgeConfig | None = None, *, tokenizer: Any = None):
        self.config = config or JudgeConfig()
        self.url: str | None = None
        self.engine: Engine | None = None
        self.chat: ChatTokenizer | None = None
        if isinstance(backend, str):
            self.url = chat_completions_url(backend)
        else:
            if tokenizer is None:
                raise ValueError("a judge on an engine needs the engine's tokenizer: Judge(engine, tokenizer=...)")
            self.engine = backend
            self.chat = tokenizer if isinstance(tokenizer, ChatTokenizer) else ChatTokenizer(tokenizer)
        self.template = self.config.template or (SCORE_TEMPLATE if self.config.mode == "score" else YES_NO_TEMPLATE)
        self.stats = JudgeStats()
        self.in_flight = 0
        """Judge calls running now."""
        self.max_in_flight = 0
        """The most judge calls that ran at once."""
        self.queued = 0
        """Judge calls waiting for a slot now."""
        self.cache: dict[str, float] = {}
        self._cache_dirty = False
        self._semaphore = asyncio.Semaphore(self.config.max_concurrency)
        self._key_locks: dict[str, _KeyLock] = {}
        self._session: aiohttp.ClientSession | None = None
        self._fingerprint = [self.config.mode, self.template, self.config.score_max]
        self._backoff = Backoff(self.config.backoff_s, self.config.backoff_max_s)
        if self.config.cache_path and Path(self.config.cache_path).exists():
            self.cache = _read_cache(Path(self.config.cache_path))

    def __repr__(self) -> str:
        return f"Judge({self.url or self.engine!r})"

    async def __aenter__(self) -> Judge:
        if self.url is not None and self._session is None:
            headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else None
            self._session = aiohttp.ClientSession(
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=None, connect=self.config.connect_timeout_s),
                connector=aiohttp.TCPConnector(limit=0),  # the semaphore is the limit
            )
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
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

    # ----- one judgment: attempts, the queue, the two backends ------------------------------------

    async def _judge(self, prompt: str) -> float:
        """Call the judge until a reply parses, retrying with backoff; JudgeError when none does."""
        try:
            request = self._request_for(prompt)
        except Exception as exc:  # a template the tokenizer cannot render: no call can pass
            self.stats.failures += 1
            raise JudgeError(f"the judge prompt could not be rendered: {type(exc).__name__}: {exc}") from None
        attempts = self.config.max_retries + 1
        try:  # the slot is free while waiting to retry
            return await call_with_retries(
                lambda: self._attempt(request), retries=self.config.max_retries, backoff=self._backoff,
                retry_on=(_RetryableCallError,), on_retry=self._count_retry,
            )  # fmt: skip
        except _RetryableCallError as exc:
            self.stats.failures += 1
            raise JudgeError(f"the judge failed after {attempts} attempt(s): {exc}") from None
        except _FatalCallError as exc:
            self.stats.failures += 1
            raise JudgeError(f"the judge failed: {exc}") from None

    async def _attempt(self, request: Any) -> float:
        """One call and the score in its reply; _RetryableCallError when another call may pass."""
        try:
            reply = await self._call_limited(request)
        except _FatalCallError:
            raise
        except Exception as exc:  # engine errors, connection errors, timeouts: another try may pass
            problem = "timed out" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
            raise _RetryableCallError(problem) from exc
        value = self.parse(reply)
        if value is None:
            self.stats.unparsable += 1
            raise _RetryableCallError(f"unparsable reply {truncate_middle(reply.strip(), 200)!r}")
        return value

    def _count_retry(self, _: BaseException) -> None:
        self.stats.retries += 1

    def _request_for(self, prompt: str) -> Any:
        """What each attempt sends: prompt token ids for an engine, the JSON body for a URL."""
        messages = [{"role": "user", "content": prompt}]
        if self.chat is not None:
            return self.chat.prompt_ids(messages)
        return orjson.dumps(
            {"model": self.config.model, "messages": messages, "max_tokens": self.config.max_new_tokens,
             "temperature": self.config.temperature}
        )  # fmt: skip

    async def _call_limited(self, request: Any) -> str:
        """One call, when a slot is free (at most ``max_concurrency`` at once)."""
        self.queued += 1
        try:
            await self._semaphore.acquire()
        finally:
            self.queued -= 1
        rid = f"judge-{uuid.uuid4().hex[:16]}"
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.stats.calls += 1
        try:
            async with asyncio.timeout(self.config.timeout_s):
                if self.engine is not None:
                    return await self._call_engine(request, rid)
                return await self._call_url(request)
        except TimeoutError:
            if self.engine is not None:
                with contextlib.suppress(Exception):
                    await self.engine.abort(rid)
            raise
        finally:
            self.in_flight -= 1
            self._semaphore.release()

    async def _call_engine(self, prompt_ids: list[int], rid: str) -> str:
        assert self.engine is not None and self.chat is not None
        sampling = SamplingParams(
            max_new_tokens=self.config.max_new_tokens,
            temperature=self.config.temperature,
            stop_token_ids=self.chat.stop_token_ids,
        )
        generation = await self.engine.generate(prompt_ids, sampling, rid)
        if generation.finish_reason == "abort":
            raise RuntimeError("the judge engine aborted the request")
        return self.chat.assistant_text(generation.output_ids)

    async def _call_url(self, body: bytes) -> str:
        if self._session is None:
            raise _FatalCallError(f"{self!r} is not open: use it inside 'async with judge:'")
        async with self._session.post(self.url, data=body, headers={"Content-Type": "application/json"}) as response:
            text = await response.text()
            if response.status != 200:
                message = f"{self.url} answered HTTP {response.status}: {truncate_middle(text.strip(), 300)}"
                raise (RuntimeError if response.status in RETRY_STATUSES else _FatalCallError)(message)
        try:
            content = orjson.loads(text)["choices"][0]["message"]["content"]
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
            raise RuntimeError(f"{self.url} answered with no choices[0].message.content") from None
        return content if isinstance(content, str) else ""

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
