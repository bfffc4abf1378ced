"""The embedded engine: a transformers causal LM served in-process with continuous batching.

One background task owns the batch. Between decode steps it admits waiting requests
(prefilled together into free rows of the KV buffer), drops finished and aborted ones,
and applies pending weight updates; each step then decodes one token for every running
request. After a weight update every running request is computed again from its tokens so
far on the new weights (``recompute_on_update``), as a request that SGLang aborts and resumes
is, so that each later token comes from the new policy alone. Model steps run on a single
worker thread, so the event loop stays free for tools and I/O. The batch on the model is in
``batch.py``, sampling in ``sampling.py``, a request's state in ``sequence.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel

from rollout.engines.base import EngineError, Generation, PartialGeneration, SamplingParams
from rollout.engines.batch import ModelBatch
from rollout.engines.config import LocalEngineConfig
from rollout.engines.local_model import check_state_dict, load_model, resolve_device, resolve_dtype
from rollout.engines.sampling import sample_tokens
from rollout.engines.sequence import EngineStats, Sequence
from rollout.engines.shared_prefix import MIN_SHARED_PREFIX, shared_prefix_length

IDLE_RELEASE_S = 1.0
"""After this long with nothing to do, the engine gives back the KV buffers a burst grew and the
memory freed since (``ModelBatch.release_idle_memory``): a burst does not pin its high-water mark."""

__all__ = ["EngineStats", "LocalEngine", "LocalEngineConfig", "sample_tokens", "shared_prefix_length"]


class LocalEngine:
    """An in-process engine over a Hugging Face causal LM; use ``async with`` to run it."""

    def __init__(self, model: PreTrainedModel, config: LocalEngineConfig | None = None):
        self.config = config or LocalEngineConfig()
        self.device = resolve_device(self.config.device)
        self.dtype = resolve_dtype(self.config.dtype, self.device)
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        self.max_model_len = self.config.max_model_len or model.config.max_position_embeddings
        self._batch = ModelBatch(self.model, self.config, self.device, self.dtype, self.max_model_len)
        self._waiting: deque[Sequence] = deque()
        self._aborts: set[str | None] = set()
        self._pending_weights: list[tuple[dict[str, Any], int, asyncio.Future[int]]] = []
        self._wake = asyncio.Event()
        self._executor: ThreadPoolExecutor | None = None
        self._task: asyncio.Task[None] | None = None
        self.released = False  # colocation: the KV cache and the weights' storage are given back

    @property
    def weight_version(self) -> int:
        """The version of the weights the next token comes from."""
        return self._batch.weight_version

    @property
    def stats(self) -> EngineStats:
        return self._batch.stats

    @classmethod
    def from_pretrained(cls, path: str | Path, config: LocalEngineConfig | None = None) -> LocalEngine:
        """Load a local Hugging Face model directory (nothing is downloaded)."""
        return cls(load_model(path), config)

    async def __aenter__(self) -> LocalEngine:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="local-engine")
        self._task = asyncio.create_task(self._serve(), name="local-engine")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._executor is not None:  # let a step still running on the worker finish first
            await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown, True)
            self._executor = None
        for seq in [*self._waiting, *self._batch.running]:
            self._resolve(seq, "abort")
        self._waiting.clear()
        self._batch.running.clear()
        self._batch.kv.clear()

    # ----- the Engine protocol -------------------------------------------------------------

    async def generate(self, input_ids: list[int], sampling: SamplingParams, rid: str) -> Generation:
        if self._task is None:
            raise EngineError("LocalEngine is not running: use it inside 'async with engine:'")
        self.check_resident(rid)
        if not input_ids:
            raise EngineError(f"request {rid}: empty input_ids")
        self.check_token_ids(input_ids, rid)
        if len(input_ids) >= self.max_model_len:
            return Generation([], [], "length", self.weight_version)
        future: asyncio.Future[Generation] = asyncio.get_running_loop().create_future()
        self._waiting.append(Sequence(rid, list(input_ids), sampling, future))
        self._wake.set()
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            self._aborts.add(rid)  # stop spending compute on it
            self._wake.set()
            raise

    def check_resident(self, rid: str) -> None:
        if self.released:
            raise EngineError(f"request {rid}: the engine's memory is released for the update (colocation); "
                              "it takes it back with the next weights")  # fmt: skip

    def check_token_ids(self, input_ids: list[int], rid: str) -> None:
        """A token id outside the vocabulary would fail the whole batch's step: refuse it here."""
        vocab = self.model.get_input_embeddings().num_embeddings
        low, high = min(input_ids), max(input_ids)
        if low < 0 or high >= vocab:
            bad = low if low < 0 else high
            raise EngineError(f"request {rid}: token id {bad} is outside the vocabulary (0..{vocab - 1})")

    async def generate_stream(
        self, input_ids: list[int], sampling: SamplingParams, rid: str
    ) -> AsyncIterator[PartialGeneration | Generation]:
        """Like ``generate``, yielding the tokens so far after each decode step and the final
        ``Generation`` last."""
        if self._task is None:
            raise EngineError("LocalEngine is not running: use it inside 'async with engine:'")
        if not input_ids or len(input_ids) >= self.max_model_len:
            yield await self.generate(input_ids, sampling, rid)
            return
        self.check_resident(rid)
        self.check_token_ids(input_ids, rid)
        future: asyncio.Future[Generation] = asyncio.get_running_loop().create_future()
        seq = Sequence(rid, list(input_ids), sampling, future, progress=asyncio.Queue())
        future.add_done_callback(lambda _: seq.progress.put_nowait(None))  # type: ignore[union-attr]
        self._waiting.append(seq)
        self._wake.set()
        sent = 0
        try:
            while (count := await seq.progress.get()) is not None:  # type: ignore[union-attr]
                if count > sent:
                    sent = count
                    yield PartialGeneration(seq.output_ids[:count], seq.output_logprobs[:count])
            yield future.result()
        finally:
            if not future.done():  # the consumer went away: stop spending compute on it
                self._aborts.add(rid)
                self._wake.set()

    async def flush_cache(self) -> None:
        """Forget the cached KV of finished prompts (at the next scheduling step)."""
        self._batch.flush_requested = True
        self._wake.set()

    async def update_weights(self, state_dict: dict[str, Any], weight_version: int | None = None) -> int:
        if self.released:  # (the weights' storage is empty: the update is ``resume_memory``)
            await self.resume_memory(state_dict, weight_version)
            return self.weight_version
        check_state_dict(self.model, state_dict)  # a bad update must not reach the batch (and fail its requests)
        version = self.weight_version + 1 if weight_version is None else weight_version
        if self._task is None:
            self._batch.load_weights(state_dict, version)
            return version
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._pending_weights.append((state_dict, version, future))
        self._wake.set()
        return await future

    async def release_memory(self) -> int:
        """Colocation: give back the KV cache, the prefix cache and the weights' storage while the trainer
        updates (nothing may be in flight); the bytes let go. ``resume_memory`` takes them back."""
        if self._waiting or self._batch.running or self._pending_weights:
            raise EngineError("LocalEngine.release_memory: requests are in flight; release it between rollouts")
        if self.released:
            return 0
        self.released = True  # (new requests are refused from now on, while the worker lets go)
        try:
            return await self._on_worker(self._batch.release_memory)
        except BaseException:
            self.released = False
            raise

    async def resume_memory(self, state_dict: dict[str, Any], weight_version: int | None = None) -> int:
        """After ``release_memory``: the weights rebuilt from ``state_dict`` (every parameter) as
        ``weight_version``, and the KV cache; the bytes taken (0 where nothing was released: a plain update)."""
        if not self.released:
            await self.update_weights(state_dict, weight_version)
            return 0
        version = self.weight_version + 1 if weight_version is None else weight_version
        try:
            taken = await self._on_worker(self._batch.resume_memory, state_dict, version)
        except (ValueError, RuntimeError) as exc:  # a parameter missing, or of another shape
            raise EngineError(f"LocalEngine.resume_memory: {exc}") from exc
        self.released = False
        return taken

    async def _on_worker(self, function: Any, *args: Any) -> Any:
        """``function`` on the model's worker thread (after any step running there), or here when stopped."""
        if self._executor is None:
            return function(*args)
        return await asyncio.get_running_loop().run_in_executor(self._executor, function, *args)

    async def abort(self, rid: str | None = None) -> None:
        self._aborts.add(rid)
        self._wake.set()

    async def health(self) -> bool:
        return self._task is not None and not self._task.done()

    # ----- the batch owner --------------------------------------------------------------------

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = self._batch
            if not (self._waiting or batch.running or self._pending_weights or self._aborts or batch.flush_requested):
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), IDLE_RELEASE_S)
                except TimeoutError:  # idle: give back what the last burst took, then wait
                    await loop.run_in_executor(self._executor, batch.release_idle_memory)
                    await self._wake.wait()
            aborts, self._aborts = self._aborts, set()
            self._drop_waiting(aborts)
            weights, self._pending_weights = self._pending_weights, []
            admitted = self._admit()
            started = time.perf_counter()
            try:
                finished = await loop.run_in_executor(self._executor, self._batch.step, admitted, aborts, weights)
            except Exception as exc:  # a forward pass (shared by all) failed, e.g. out of memory: fail the batch
                for seq in [*admitted, *self._batch.running]:
                    if not seq.future.done():
                        seq.future.set_exception(EngineError(f"local engine step failed: {exc!r}"))
                self._batch.running.clear()
                self._batch.kv.clear()
                for _, _, future in weights:
                    if not future.done():
                        future.set_exception(EngineError(f"weight update failed: {exc!r}"))
                continue
            self.stats.busy_s += time.perf_counter() - started
            for _, version, future in weights:
                if not future.done():
                    future.set_result(version)
            weights = []  # loaded: let go of the tensors (another process's memory, with CUDA IPC)
            for seq in finished:
                self._resolve(seq, seq.finish or "abort")
            for seq in self._batch.running:
                if seq.progress is not None:
                    seq.progress.put_nowait(len(seq.output_ids))
            # yield once so that coroutines woken by these results can submit their next turn
            await asyncio.sleep(0)

    def _drop_waiting(self, aborts: set[str | None]) -> None:
        if not aborts:
            return
        kept: deque[Sequence] = deque()
        for seq in self._waiting:
            if None in aborts or seq.rid in aborts or seq.future.done():
                self._resolve(seq, "abort")
            else:
                kept.append(seq)
        self._waiting = kept

    def _admit(self) -> list[Sequence]:
        admitted: list[Sequence] = []
        free = self.config.max_batch_size - len(self._batch.running)
        longest = 0
        while self._waiting and len(admitted) < free:
            seq = self._waiting[0]
            longest_if = max(longest, len(seq.prompt_ids))
            if admitted and longest_if * (len(admitted) + 1) > self.config.max_prefill_tokens:
                break
            longest = longest_if
            admitted.append(self._waiting.popleft())
        if len(admitted) > 1 and self.config.prefix_cache_mb > 0:
            # prompts sharing a long prefix that is not cached yet: prefill the first alone, so
            # that the others (next step) find its keys and values in the prefix cache
            _, cached = self._batch.prefix_cache.lookup(admitted[0].prompt_ids)
            if shared_prefix_length([s.prompt_ids for s in admitted]) - cached >= MIN_SHARED_PREFIX:
                self._waiting.extendleft(reversed(admitted[1:]))
                admitted = admitted[:1]
        return admitted

    def _resolve(self, seq: Sequence, finish: str) -> None:
        if seq.error is not None and not seq.future.done():
            seq.future.set_exception(EngineError(f"request {seq.rid}: its step failed: {seq.error!r}"))
        if not seq.future.done():
            generation = Generation(seq.output_ids, seq.output_logprobs, finish, self.weight_version)  # type: ignore[arg-type]
            generation.output_weight_versions = seq.output_weight_versions
            seq.future.set_result(generation)
