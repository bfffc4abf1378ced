"""Admission of a request to ``rallyrl serve`` before anything is queued: every count and length
bounded (``ServeConfig.limits``, ``rollout/limits.py``), text prompts that cannot fit the context
refused before they are tokenized, long ones tokenized on a worker thread, and the generations of
the whole server counted so that a flood is answered "busy" instead of queued without end."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

from rollout.config import ServeConfig
from rollout.serve.http import BadRequest


class ServerState(Protocol):
    """What admission reads of the server (``state.ServerState``, which imports this module)."""

    config: ServeConfig
    context_length: int | None
    longest_token: int

    def check_vocabulary(self, ids: list[int], name: str) -> None: ...

    def encode(self, text: str) -> list[int]: ...

ENCODE_OFF_LOOP = 16 * 2**10
"""Texts at least this long (characters) are tokenized on a worker thread."""


class Busy(RuntimeError):
    """The server holds ``limits.max_pending`` generations: answered 503 with ``Retry-After``."""


def check_count(name: str, count: int, limit: int, setting: str) -> None:
    if count > limit:
        raise BadRequest(f"{name}: {count} is over this server's limit of {limit} (limits.{setting})")


def check_samples(server: ServerState, prompts: int, n: int, name: str = "n") -> None:
    """``n`` samples of each of ``prompts`` prompts: within ``max_prompts``, ``max_n`` and ``max_samples``."""
    limits = server.config.limits
    check_count("prompts", prompts, limits.max_prompts, "max_prompts")
    check_count(name, n, limits.max_n, "max_n")
    check_count(f"prompts x {name}", prompts * n, limits.max_samples, "max_samples")


def check_stops(server: ServerState, stop: Any, stop_token_ids: Any, prefix: str = "") -> None:
    """At most ``max_stop`` stop strings of at most ``max_stop_chars`` characters, and at most
    ``max_stop`` stop token ids, each in the vocabulary (their JSON types are checked elsewhere)."""
    limits = server.config.limits
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    check_count(f"{prefix}stop", len(stops), limits.max_stop, "max_stop")
    for i, text in enumerate(stops):
        if isinstance(text, str) and len(text) > limits.max_stop_chars:
            raise BadRequest(f"{prefix}stop[{i}]: {len(text)} characters, over this server's limit of "
                             f"{limits.max_stop_chars} (limits.max_stop_chars)")  # fmt: skip
    if isinstance(stop_token_ids, list):
        check_count(f"{prefix}stop_token_ids", len(stop_token_ids), limits.max_stop, "max_stop")
        ids = [t for t in stop_token_ids if type(t) is int]
        if ids:
            server.check_vocabulary(ids, f"{prefix}stop_token_ids")


def text_limit(server: ServerState) -> int:
    """The most characters a text prompt may have: ``max_prompt_chars``, and no more than the context
    could hold even if every token were the vocabulary's longest (a longer text cannot fit)."""
    limit = server.config.limits.max_prompt_chars
    if server.context_length is not None and server.longest_token:
        limit = min(limit, server.context_length * server.longest_token)
    return limit


def check_chars(server: ServerState, chars: int, name: str) -> None:
    """A 400 when ``chars`` characters of prompt text are over ``text_limit``."""
    limit = text_limit(server)
    if chars > limit:
        why = "limits.max_prompt_chars" if limit == server.config.limits.max_prompt_chars else (
            f"{server.context_length} tokens of context, at most {server.longest_token} characters a token")
        raise BadRequest(f"{name}: {chars} characters cannot be served (at most {limit}: {why})")


async def encode_text(server: ServerState, text: str, name: str) -> list[int]:
    """The token ids of a text prompt, checked against ``text_limit`` first; long texts are tokenized
    on a worker thread, so that ``/health`` keeps answering."""
    check_chars(server, len(text), name)
    if len(text) < ENCODE_OFF_LOOP:
        return server.encode(text)
    return await asyncio.to_thread(server.encode, text)


def check_prompt_length(server: ServerState, length: int, name: str) -> None:
    """A prompt of ``length`` tokens is shorter than the context (checked before its ids are read one by one)."""
    context = server.context_length
    if context is not None and length >= context:
        raise BadRequest(f"{name}: the prompt has {length} tokens, the context holds {context}")


def check_prompt_ids(server: ServerState, ids: list[int], name: str) -> None:
    """A prompt of token ids: shorter than the context, in the vocabulary."""
    check_prompt_length(server, len(ids), name)
    server.check_vocabulary(ids, name)


class PendingCount:
    """Generations admitted and not yet answered, server-wide, against ``limits.max_pending``."""

    def __init__(self, limit: int):
        self.limit = limit
        self.count = 0

    @contextlib.contextmanager
    def hold(self, generations: int) -> Iterator[None]:
        if self.count + generations > self.limit:
            raise Busy(f"the server holds {self.count} generations, and {generations} more would pass its limit "
                       f"of {self.limit} (limits.max_pending): retry later")  # fmt: skip
        self.count += generations
        try:
            yield
        finally:
            self.count -= generations
