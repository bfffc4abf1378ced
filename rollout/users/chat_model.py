"""One chat completion from a helper model: a rallyrl Engine (with its tokenizer) or an
OpenAI-compatible URL, bounded, timed and retried. The judge and the simulated user both ask
their model through it.

    model = ChatModel("http://127.0.0.1:30000/v1", ChatSettings(max_concurrency=16), label="judge")
    async with model:                                # one ClientSession for a URL, closed on exit
        reply = await model.complete([{"role": "user", "content": "..."}], parse=parse_score)
    reply.value, reply.text, reply.attempts, reply.latency_s

- Concurrency: at most ``max_concurrency`` calls are in flight; the others wait in the
  semaphore's queue (``in_flight``, ``max_in_flight`` and ``queued`` are measured).
- Timeouts: each call has ``timeout_s`` of wall-clock time; a timed-out engine call is aborted.
- Retries: an engine error, a timeout, an HTTP error that may pass (connection, 408, 429, 5xx)
  or a reply that ``parse`` rejects (returns None) is retried with exponential backoff and full
  jitter (``rollout/retry.py``), up to ``max_retries`` times; the slot is given back while
  waiting. Other HTTP errors (400, 401, 404) fail at once. What still fails raises ChatModelError.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import aiohttp
import orjson

from data.text import truncate_middle
from rollout.engines.base import Engine, SamplingParams
from rollout.retry import RETRY_STATUSES, Backoff, call_with_retries
from rollout.tokens import ChatTokenizer

T = TypeVar("T")


@dataclass(frozen=True)
class ChatSettings:
    """How a helper model is called."""

    max_concurrency: int = 16
    """Most calls in flight at once; the others wait in a queue."""
    max_tokens: int = 256
    """Most tokens of one reply."""
    temperature: float = 0.0
    """Sampling temperature (0: greedy)."""
    timeout_s: float = 120.0
    """Wall-clock limit of one call."""
    max_retries: int = 3
    """Retries of a failed call before the completion fails."""
    backoff_s: float = 0.5
    """First retry delay; doubles each retry, with jitter."""
    backoff_max_s: float = 8.0
    """Longest retry delay."""
    model: str = "default"
    """The ``model`` field of OpenAI requests (servers that host several models pick by it)."""
    api_key: str | None = None
    """Sent as ``Authorization: Bearer`` to an OpenAI-compatible URL."""
    connect_timeout_s: float = 10.0
    """Limit on opening a connection to an OpenAI-compatible URL."""


@dataclass
class ChatModelStats:
    """Counts of what a chat model did."""

    calls: int = 0
    """Calls to the model (retries included)."""
    retries: int = 0
    unparsable: int = 0
    """Replies that ``parse`` rejected."""
    failures: int = 0
    """Completions that failed after every retry."""


@dataclass(frozen=True)
class ChatReply(Generic[T]):
    """A completion: the parsed value, the reply's text, the calls it took and its wall time
    (queueing and retries included)."""

    value: T
    text: str
    attempts: int
    latency_s: float


class ChatModelError(RuntimeError):
    """A completion failed (after its retries): the message says why."""


class FatalCallError(ChatModelError):
    """A call failed in a way no retry can mend (a 400, a 401, a 404, a model that is not open)."""


class RetryableCallError(ChatModelError):
    """A call failed in a way another call may not (an engine or connection error, a timeout, an
    HTTP 5xx, a reply that does not parse)."""


def chat_completions_url(url: str, label: str = "judge") -> str:
    """``http://host:port`` or ``.../v1`` -> ``.../v1/chat/completions`` (a full one is kept)."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"{label} URL {url!r} must start with http:// or https://")
    url = url.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    return url + ("/chat/completions" if url.endswith("/v1") else "/v1/chat/completions")


class ChatModel:
    """A helper model behind a bound, a timeout and retries: an Engine (used as it is; its owner
    opens and closes it) or an OpenAI URL (``async with`` opens its ClientSession).

    ``label`` names the model in errors ("the judge failed after 3 attempt(s): ..."); ``stats``
    may be an owner's own ChatModelStats (or a subclass of it) to count into.
    """

    def __init__(
        self,
        backend: Engine | str,
        settings: ChatSettings | None = None,
        *,
        tokenizer: Any = None,
        label: str = "chat model",
        stats: ChatModelStats | None = None,
    ):
        self.settings = settings or ChatSettings()
        self.label = label
        self.url: str | None = None
        self.engine: Engine | None = None
        self.chat: ChatTokenizer | None = None
        if isinstance(backend, str):
            self.url = chat_completions_url(backend, label)
        else:
            if tokenizer is None:
                raise ValueError(f"a {label} on an engine needs the engine's tokenizer: pass tokenizer=...")
            self.engine = backend
            self.chat = tokenizer if isinstance(tokenizer, ChatTokenizer) else ChatTokenizer(tokenizer)
        self.stats = stats if stats is not None else ChatModelStats()
        self.in_flight = 0
        """Calls running now."""
        self.max_in_flight = 0
        """The most calls that ran at once."""
        self.queued = 0
        """Calls waiting for a slot now."""
        self._semaphore = asyncio.Semaphore(self.settings.max_concurrency)
        self._backoff = Backoff(self.settings.backoff_s, self.settings.backoff_max_s)
        self._session: aiohttp.ClientSession | None = None

    def __repr__(self) -> str:
        return f"ChatModel({self.label!r}, {self.url or self.engine!r})"

    async def __aenter__(self) -> ChatModel:
        if self.url is not None and self._session is None:
            headers = {"Authorization": f"Bearer {self.settings.api_key}"} if self.settings.api_key else None
            self._session = aiohttp.ClientSession(
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=None, connect=self.settings.connect_timeout_s),
                connector=aiohttp.TCPConnector(limit=0),  # the semaphore is the limit
            )
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def complete(
        self, messages: list[dict[str, Any]], parse: Callable[[str], T | None] | None = None
    ) -> ChatReply[T]:
        """The model's reply to ``messages``, called until ``parse`` accepts it (returns a value,
        not None; no ``parse``: any reply); ChatModelError when no attempt does."""
        started = time.monotonic()
        try:
            request = self._request_for(messages)
        except Exception as exc:  # a conversation the tokenizer cannot render: no call can pass
            self.stats.failures += 1
            problem = f"{type(exc).__name__}: {exc}"
            raise ChatModelError(f"the {self.label} prompt could not be rendered: {problem}") from None
        attempts = 0

        async def attempt() -> tuple[Any, str]:
            nonlocal attempts
            attempts += 1
            return await self._attempt(request, parse)

        try:  # the slot is free while waiting to retry
            value, text = await call_with_retries(
                attempt, retries=self.settings.max_retries, backoff=self._backoff,
                retry_on=(RetryableCallError,), on_retry=self._count_retry,
            )  # fmt: skip
        except RetryableCallError as exc:
            self.stats.failures += 1
            raise ChatModelError(f"the {self.label} failed after {attempts} attempt(s): {exc}") from None
        except FatalCallError as exc:
            self.stats.failures += 1
            raise ChatModelError(f"the {self.label} failed: {exc}") from None
        return ChatReply(value, text, attempts, time.monotonic() - started)

    async def _attempt(self, request: Any, parse: Callable[[str], Any] | None) -> tuple[Any, str]:
        """One call and the value in its reply; RetryableCallError when another call may pass."""
        try:
            text = await self._call_limited(request)
        except FatalCallError:
            raise
        except Exception as exc:  # engine errors, connection errors, timeouts: another try may pass
            problem = "timed out" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
            raise RetryableCallError(problem) from exc
        if parse is None:
            return text, text
        value = parse(text)
        if value is None:
            self.stats.unparsable += 1
            raise RetryableCallError(f"unparsable reply {truncate_middle(text.strip(), 200)!r}")
        return value, text

    def _count_retry(self, _: BaseException) -> None:
        self.stats.retries += 1

    def _request_for(self, messages: list[dict[str, Any]]) -> Any:
        """What each attempt sends: prompt token ids for an engine, the JSON body for a URL."""
        if self.chat is not None:
            return self.chat.prompt_ids(messages)
        return orjson.dumps(
            {"model": self.settings.model, "messages": messages, "max_tokens": self.settings.max_tokens,
             "temperature": self.settings.temperature}
        )  # fmt: skip

    async def _call_limited(self, request: Any) -> str:
        """One call, when a slot is free (at most ``max_concurrency`` at once)."""
        self.queued += 1
        try:
            await self._semaphore.acquire()
        finally:
            self.queued -= 1
        rid = f"{self.label.replace(' ', '-')}-{uuid.uuid4().hex[:16]}"
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.stats.calls += 1
        try:
            async with asyncio.timeout(self.settings.timeout_s):
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
            max_new_tokens=self.settings.max_tokens,
            temperature=self.settings.temperature,
            stop_token_ids=self.chat.stop_token_ids,
        )
        generation = await self.engine.generate(prompt_ids, sampling, rid)
        if generation.finish_reason == "abort":
            raise RuntimeError(f"the {self.label} engine aborted the request")
        return self.chat.assistant_text(generation.output_ids)

    async def _call_url(self, body: bytes) -> str:
        if self._session is None:
            opener = self.label.replace(" ", "_")
            raise FatalCallError(f"the {self.label} at {self.url} is not open: use it inside 'async with {opener}:'")
        async with self._session.post(self.url, data=body, headers={"Content-Type": "application/json"}) as response:
            text = await response.text()
            if response.status != 200:
                message = f"{self.url} answered HTTP {response.status}: {truncate_middle(text.strip(), 300)}"
                raise (RuntimeError if response.status in RETRY_STATUSES else FatalCallError)(message)
        try:
            content = orjson.loads(text)["choices"][0]["message"]["content"]
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
            raise RuntimeError(f"{self.url} answered with no choices[0].message.content") from None
        return content if isinstance(content, str) else ""
