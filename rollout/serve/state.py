"""The state of ``rallyrl serve`` that its routes share (``native_routes.py``, ``openai_routes.py``):
the engine and its tokenizer, the weight version served, and the admission of requests (held while
generation is paused or weights load, counted while in flight). No route lives here; the
application that wires them is ``app.py``."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from rollout.config import ServeConfig
from rollout.engines.base import Engine, EngineError, Generation, PartialGeneration, SamplingParams
from rollout.engines.sglang_protocol import parse_weight_version
from rollout.serve.admission import PendingCount
from rollout.serve.generation import GenerateItem, eos_token_ids, generate_chunks
from rollout.serve.http import BadRequest, model_config
from rollout.serve.weight_files import load_weights, weight_roots
from rollout.tokens import longest_token_chars


class ServerState:
    """One engine served: what every route reads (model, tokenizer, weight version) and the admission
    of its requests. ``tokenizer`` decodes text fields and renders chat messages; the engine itself
    sees token ids only."""

    def __init__(self, engine: Engine, tokenizer: Any, config: ServeConfig):
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = config
        self.model_name = config.served_model_name or Path(config.model).name
        self.vocab_size: int | None = model_config(config.model).get("vocab_size")
        self.context_length: int | None = config.engine.max_model_len or model_config(config.model).get(
            "max_position_embeddings")  # fmt: skip
        """Prompt and new tokens together; longer requests are refused, as SGLang refuses them."""
        self.eos_token_ids = eos_token_ids(config.model, tokenizer)
        """Where a generation ends unless ``ignore_eos`` (besides the request's ``stop_token_ids``)."""
        self.weight_version: int | None = None  # None until the first update ("default" in SGLang)
        self._version_names: dict[int, str] = {}
        """The name each update gave its version (``weight_version`` of the request, as SGLang keeps it)."""
        self.started = time.time()
        self._open = asyncio.Event()  # set while new requests may start
        self._open.set()
        self._paused = False
        self._in_flight = 0
        self._idle = asyncio.Condition()
        self._update_lock = asyncio.Lock()
        self.weights_half_updated = False
        """A weight-update session has loaded part of its weights (``weight_routes.py``): nothing generates."""
        self.weight_session_open = False
        """Between ``/begin_weight_update`` (once it holds the update lock) and ``/end_weight_update``."""
        self.weight_session_beginning = False
        """A ``/begin_weight_update`` waits for the update lock (a load from disk holds it)."""
        self.counters = {"requests": 0, "generated_tokens": 0, "aborted": 0}
        self.pending = PendingCount(config.limits.max_pending)
        """Generations admitted and not answered yet, server-wide (``limits.max_pending``)."""
        self.longest_token = longest_token_chars(tokenizer) or 0
        """Characters of the vocabulary's longest token: a text longer than the context times this cannot fit."""
        self.weight_roots = weight_roots(config.weights_dirs, config.model)
        """Where ``/update_weights_from_disk`` may read (``weight_files.py``)."""

    # ----- generation ----------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _admitted(self) -> AsyncIterator[None]:
        """Wait while generation is paused or weights are loading; count the request in flight."""
        await self._open.wait()
        self._in_flight += 1
        try:
            yield
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                async with self._idle:
                    self._idle.notify_all()

    async def generate_tokens(
        self, input_ids: list[int], sampling: SamplingParams, rid: str, stop: Sequence[str] = ()
    ) -> Generation:
        """The engine's generation, ended where SGLang ends it (at a stop string too)."""
        chunks = generate_chunks(self.engine, self.tokenizer, input_ids, sampling, rid, stop)
        async with self._admitted(), contextlib.aclosing(chunks):
            async for chunk in chunks:
                generation = chunk
        assert isinstance(generation, Generation)
        self._count(generation)
        return generation

    def _count(self, generation: Generation) -> None:
        self.counters["requests"] += 1
        self.counters["generated_tokens"] += len(generation.output_ids)
        self.counters["aborted"] += generation.finish_reason == "abort"

    async def generate_item(self, item: GenerateItem) -> Generation:
        """One item's generation, ended where SGLang ends it."""
        if item.no_tokens:  # max_new_tokens 0: SGLang answers "length" with no tokens
            return Generation([], [], "length", self.weight_version or 0)
        return await self.generate_tokens(item.input_ids, item.sampling, item.rid, item.options.stop)

    def check_vocabulary(self, ids: list[int], name: str) -> None:
        low, high = min(ids), max(ids)
        if low < 0 or (self.vocab_size is not None and high >= self.vocab_size):
            bad = low if low < 0 else high
            raise BadRequest(f"{name}: token id {bad} is outside the vocabulary (0..{(self.vocab_size or 0) - 1})")

    async def stream_generations(
        self, items: Sequence[GenerateItem]
    ) -> AsyncIterator[tuple[int, Generation | PartialGeneration]]:
        """The generations of ``items`` made together, as SGLang ends and streams them (``stream_interval``
        1): the tokens so far after each new token, the last step being the final ``Generation``, each
        with its item's index, in the order they come. The items are admitted together (held while
        paused)."""
        chunks: asyncio.Queue[tuple[int, Generation | PartialGeneration | BaseException | None]] = asyncio.Queue()

        async def stream(index: int, item: GenerateItem) -> None:
            try:
                if item.no_tokens:
                    await chunks.put((index, await self.generate_item(item)))
                    return
                parts = generate_chunks(self.engine, self.tokenizer, item.input_ids, item.sampling, item.rid,
                                        item.options.stop, True)  # fmt: skip
                async with contextlib.aclosing(parts):
                    async for part in parts:
                        await chunks.put((index, part))
            except Exception as exc:  # raised where the chunks are read
                await chunks.put((index, exc))
            finally:
                await chunks.put((index, None))

        async with self._admitted():
            tasks = [asyncio.create_task(stream(index, item)) for index, item in enumerate(items)]
            shown = [0] * len(items)  # tokens sent per item; the newest waits: the final may be next
            try:
                running = len(tasks)
                while running:
                    index, chunk = await chunks.get()
                    if chunk is None:
                        running -= 1
                        continue
                    if isinstance(chunk, BaseException):
                        raise chunk
                    for count in range(shown[index] + 1, len(chunk.output_ids)):
                        yield index, PartialGeneration(chunk.output_ids[:count], chunk.output_logprobs[:count])
                    shown[index] = max(shown[index], len(chunk.output_ids) - 1)
                    if isinstance(chunk, Generation):
                        self._count(chunk)
                        yield index, chunk
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    # ----- weight versions ---------------------------------------------------------------------

    def version_text(self) -> str:
        """The name of the weights served now: "default" until the first update, then the
        ``weight_version`` that update was given (its number when it was given none)."""
        return "default" if self.weight_version is None else self.version_name(self.weight_version)

    def version_name(self, version: int) -> str:
        """The name of the engine's weight ``version`` (versions older than every update: "default")."""
        if version in self._version_names:
            return self._version_names[version]
        return "default" if not self._version_names or version < min(self._version_names) else str(version)

    # ----- control -----------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Requests being generated now."""
        return self._in_flight

    @property
    def paused(self) -> bool:
        """Whether generation is paused (``/pause_generation`` until ``/continue_generation``)."""
        return self._paused

    async def pause(self) -> None:
        """Hold new requests; abort the ones in flight (their clients resume them)."""
        self._paused = True
        self._open.clear()
        await self.engine.abort(None)

    def resume(self) -> None:
        """Let requests start again (once a weight update in progress is done)."""
        self._paused = False
        if not self._update_lock.locked() and not self.weights_half_updated:
            self._open.set()

    async def hold_for_weights(self) -> None:
        """Hold new requests and wait for the ones in flight: a session of weight updates begins (one at
        a time, nor beside a load from disk) and lasts until ``release_after_weights``."""
        await self._update_lock.acquire()
        self._open.clear()
        try:
            async with self._idle:
                await self._idle.wait_for(lambda: self._in_flight == 0)
        except BaseException:  # cancelled: the lock is not left held by nobody
            self.release_after_weights()
            raise

    def release_after_weights(self) -> None:
        """The session of weight updates is over: requests start again unless generation is paused or
        the weights are half updated (a bucket that failed to load)."""
        self._update_lock.release()
        if not self._paused and not self.weights_half_updated:
            self._open.set()

    def next_version(self, requested: Any) -> int:
        """The weight version an update that names ``requested`` makes: its number ("7", "step_7"), else the next."""
        return _version_number(requested, self.weight_version)

    def name_version(self, new: int, requested: Any) -> None:
        """Record ``new`` as the version served, under the name the update gave it (None: its number)."""
        self.weight_version = new
        self._version_names[new] = str(new if requested is None else requested)

    async def update_weights(self, model_path: str, version: Any, abort_all: bool) -> str | None:
        """Load the safetensors weights of a model directory between requests: new requests wait, the
        ones in flight finish (or are aborted with ``abort_all``). The failure's message, or None: at once
        while a weight-update session is open (it holds the update lock until ``/end_weight_update``)."""
        if self.weight_session_open or self.weight_session_beginning:
            return (f"{model_path}: a weight-update session is open (/begin_weight_update): call /end_weight_update "
                    "first, then load from disk")  # fmt: skip
        async with self._update_lock:
            self._open.clear()
            try:
                if abort_all:
                    await self.engine.abort(None)
                async with self._idle:
                    await self._idle.wait_for(lambda: self._in_flight == 0)
                try:
                    state_dict = await load_weights(model_path, self.weight_roots, self.config.weight_load_timeout_s)
                    new = self.next_version(version)
                    await self.engine.update_weights(state_dict, weight_version=new)
                    self.name_version(new, version)
                    self.weights_half_updated = False  # whole weights again
                except (OSError, ValueError, EngineError) as exc:
                    return f"{model_path}: {exc}"
            finally:
                if not self._paused:
                    self._open.set()
        return None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _version_number(requested: Any, current: int | None) -> int:
    """The new weight version: the requested one when it names a number ("7", "step_7"), else the next."""
    number = parse_weight_version(requested)
    return (current or 0) + 1 if number is None else number
