"""The embedded engine: a transformers causal LM served in-process with continuous batching.

One background task owns the batch. Between decode steps it admits waiting requests
(prefilled together into free rows of the KV buffer), drops finished and aborted ones,
and applies pending weight updates; each step then decodes one token for every running
request. After a weight update every running request is computed again from its tokens so
far on the new weights (``recompute_on_update``), as a request that SGLang aborts and resumes
is, so that each later token comes from the new policy alone. Model steps run on a single
worker thread, so the event loop stays free for tools and I/O. Sampling is in
``sampling.py``, a request's state in ``sequence.py``.
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

import torch
from transformers import PreTrainedModel

from rollout.engines.base import EngineError, Generation, PartialGeneration, SamplingParams
from rollout.engines.config import LocalEngineConfig
from rollout.engines.kv_cache import KVBuffer, PrefixCache
from rollout.engines.local_model import check_state_dict, load_model, resolve_device, resolve_dtype
from rollout.engines.sampling import sample_tokens
from rollout.engines.sequence import EngineStats, Sequence
from rollout.engines.shared_prefix import MIN_SHARED_PREFIX, shared_prefix_length
from rollout.engines.shared_prefix import NAME as SHARED_PREFIX_ATTENTION

__all__ = ["EngineStats", "LocalEngine", "LocalEngineConfig", "sample_tokens", "shared_prefix_length"]


class LocalEngine:
    """An in-process engine over a Hugging Face causal LM; use ``async with`` to run it."""

    def __init__(self, model: PreTrainedModel, config: LocalEngineConfig | None = None):
        self.config = config or LocalEngineConfig()
        self.device = resolve_device(self.config.device)
        self.dtype = resolve_dtype(self.config.dtype, self.device)
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        self._cascade = self.model.config._attn_implementation in ("sdpa", SHARED_PREFIX_ATTENTION)
        if self._cascade:  # SDPA, with one read of a prompt prefix all rows share
            self.model.set_attn_implementation(SHARED_PREFIX_ATTENTION)
        self._decoder = model.get_decoder()
        self._lm_head = model.get_output_embeddings()
        model_config = model.config
        self.max_model_len = self.config.max_model_len or model_config.max_position_embeddings
        head_dim = getattr(model_config, "head_dim", None) or (
            model_config.hidden_size // model_config.num_attention_heads
        )
        self._kv = KVBuffer(
            model_config.num_hidden_layers, model_config.num_key_value_heads, head_dim, self.dtype, self.device
        )
        self._prefix_cache = PrefixCache(self.config.prefix_cache_mb * 2**20)
        self._flush_requested = False
        self._generator = torch.Generator(device=self.device).manual_seed(self.config.seed or 0)
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []  # index == KV row
        self._aborts: set[str | None] = set()
        self._pending_weights: list[tuple[dict[str, Any], int, asyncio.Future[int]]] = []
        self._wake = asyncio.Event()
        self._executor: ThreadPoolExecutor | None = None
        self._task: asyncio.Task[None] | None = None
        self.weight_version = 0
        self.stats = EngineStats()
        self._shared_length: int | None = None  # None: the batch changed, recompute

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
        for seq in [*self._waiting, *self._running]:
            self._resolve(seq, "abort")
        self._waiting.clear()
        self._running.clear()
        self._kv.clear()

    # ----- the Engine protocol -------------------------------------------------------------

    async def generate(self, input_ids: list[int], sampling: SamplingParams, rid: str) -> Generation:
        if self._task is None:
            raise EngineError("LocalEngine is not running: use it inside 'async with engine:'")
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
        self._flush_requested = True
        self._wake.set()

    async def update_weights(self, state_dict: dict[str, Any], weight_version: int | None = None) -> int:
        check_state_dict(self.model, state_dict)  # a bad update must not reach the batch (and fail its requests)
        version = self.weight_version + 1 if weight_version is None else weight_version
        if self._task is None:
            self._load_weights(state_dict, version)
            return version
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._pending_weights.append((state_dict, version, future))
        self._wake.set()
        return await future

    async def abort(self, rid: str | None = None) -> None:
        self._aborts.add(rid)
        self._wake.set()

    async def health(self) -> bool:
        return self._task is not None and not self._task.done()

    # ----- the batch owner --------------------------------------------------------------------

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not (self._waiting or self._running or self._pending_weights or self._aborts or self._flush_requested):
                self._wake.clear()
                await self._wake.wait()
            aborts, self._aborts = self._aborts, set()
            self._drop_waiting(aborts)
            weights, self._pending_weights = self._pending_weights, []
            admitted = self._admit()
            started = time.perf_counter()
            try:
                finished = await loop.run_in_executor(self._executor, self._step, admitted, aborts, weights)
            except Exception as exc:  # a bug or an out-of-memory: fail the batch, keep serving
                for seq in [*admitted, *self._running]:
                    if not seq.future.done():
                        seq.future.set_exception(EngineError(f"local engine step failed: {exc!r}"))
                self._running.clear()
                self._kv.clear()
                for _, _, future in weights:
                    if not future.done():
                        future.set_exception(EngineError(f"weight update failed: {exc!r}"))
                continue
            self.stats.busy_s += time.perf_counter() - started
            for _, version, future in weights:
                if not future.done():
                    future.set_result(version)
            for seq in finished:
                self._resolve(seq, seq.finish or "abort")
            for seq in self._running:
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
        free = self.config.max_batch_size - len(self._running)
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
            _, cached = self._prefix_cache.lookup(admitted[0].prompt_ids)
            if shared_prefix_length([s.prompt_ids for s in admitted]) - cached >= MIN_SHARED_PREFIX:
                self._waiting.extendleft(reversed(admitted[1:]))
                admitted = admitted[:1]
        return admitted

    def _resolve(self, seq: Sequence, finish: str) -> None:
        if not seq.future.done():
            generation = Generation(seq.output_ids, seq.output_logprobs, finish, self.weight_version)  # type: ignore[arg-type]
            generation.output_weight_versions = seq.output_weight_versions
            seq.future.set_result(generation)

    # ----- the worker thread -------------------------------------------------------------------

    @torch.inference_mode()
    def _step(
        self,
        admitted: list[Sequence],
        aborts: set[str | None],
        weights: list[tuple[dict[str, Any], int, asyncio.Future[int]]],
    ) -> list[Sequence]:
        """One scheduling step: weights, aborts, prefill of the admitted, one decode step."""
        for state_dict, version, _ in weights:
            self._load_weights(state_dict, version)
        if self._flush_requested:
            self._flush_requested = False
            self._prefix_cache.clear()
        finished: list[Sequence] = []
        if aborts:
            for seq in list(self._running):
                if None in aborts or seq.rid in aborts:
                    seq.finish = "abort"
            finished += self._retire()
        if self.config.recompute_on_update and any(seq.stale_kv for seq in self._running):
            self._recompute()
            finished += self._retire()
        if admitted:
            self._prefill(admitted)
            finished += self._retire()
        if self._running:
            self._decode()
            finished += self._retire()
        return finished

    def _load_weights(self, state_dict: dict[str, Any], version: int) -> None:
        self.model.load_state_dict(state_dict, strict=False)
        self._prefix_cache.clear()  # cached keys and values came from the old weights
        for seq in self._running:  # and so did those of the running sequences
            seq.stale_kv = True
        self._shared_length = None
        self.weight_version = version

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache, shared_prefix: int = 0
    ) -> torch.Tensor:
        """Hidden states of the decoder (logits are taken only where a token is sampled)."""
        additive = torch.zeros(mask.shape, dtype=self.dtype, device=self.device)
        additive.masked_fill_(~mask, torch.finfo(self.dtype).min)
        extra = {"shared_prefix": shared_prefix} if shared_prefix else {}
        hidden = self._decoder(
            input_ids=input_ids,
            position_ids=positions,
            attention_mask=additive[:, None],
            past_key_values=cache,
            use_cache=True,
            **extra,
        ).last_hidden_state
        return hidden

    def _shared_prefix(self) -> int:
        """The prompt prefix every running sequence shares, read once per decode step; recomputed
        only when the batch changes."""
        running = self._running
        if len(running) < 2 or not self._cascade:
            return 0
        if self._shared_length is None:  # rows from different weights hold different keys for one prefix
            stale = any(s.stale_kv for s in running)
            self._shared_length = 0 if stale else shared_prefix_length([s.prompt_ids for s in running])
        return self._shared_length

    def _compute_rows(
        self, first: int, tokens: list[list[int]], starts: list[int], cached: list[Any] | None = None
    ) -> torch.Tensor:
        """Compute ``tokens[i][starts[i]:]`` into KV row ``first + i`` from column ``starts[i]``
        (columns ``0 .. starts[i]`` hold the rest already, or get ``cached[i]``, a prefix cache
        entry); returns the hidden state at each row's last token, [rows, hidden]. Marks no
        column valid."""
        kv, device = self._kv, self.device
        count = len(tokens)
        lengths = [len(ids) for ids in tokens]
        query = max(n - start for n, start in zip(lengths, starts, strict=True))
        kv.reserve(first + count, max(kv.width, max(lengths), max(starts) + query) + 1)
        input_ids = torch.zeros(count, query, dtype=torch.long, device=device)
        for i, (ids, start) in enumerate(zip(tokens, starts, strict=True)):
            input_ids[i, : lengths[i] - start] = torch.tensor(ids[start:], device=device)
            if cached is not None and cached[i] is not None:
                kv.load_row(first + i, cached[i].keys, cached[i].values, start)
        start_t = torch.tensor(starts, device=device)
        positions = start_t[:, None] + torch.arange(query, device=device)[None, :]  # [count, query]
        end = int(positions.max()) + 1
        mask = torch.arange(end, device=device)[None, None, :] <= positions[:, :, None]  # [count, query, end]
        rows = slice(first, first + count)
        start: int | torch.Tensor = starts[0] if len(set(starts)) == 1 else start_t
        hidden = self._forward(input_ids, positions, mask, kv.view(rows, start))
        last = torch.tensor([n - s - 1 for n, s in zip(lengths, starts, strict=True)], device=device)
        return hidden[torch.arange(count, device=device), last]

    def _prefill(self, admitted: list[Sequence]) -> None:
        """Compute the admitted prompts (less what the prefix cache has) into new rows, and
        sample each one's first token."""
        kv, device = self._kv, self.device
        count, first = len(admitted), kv.num_rows
        cached = [self._prefix_cache.lookup(seq.prompt_ids) for seq in admitted]
        starts = [length for _, length in cached]
        lengths = [len(seq.prompt_ids) for seq in admitted]
        entries = [entry for entry, _ in cached]
        logits = self._lm_head(self._compute_rows(first, [seq.prompt_ids for seq in admitted], starts, entries))
        for i, n in enumerate(lengths):
            kv.mask[first + i, :n] = True
        kv.num_rows += count
        kv.width = max(kv.width, max(lengths))
        if self.config.prefix_cache_mb > 0:  # later prompts of the same wave share the system prompt
            for i, seq in enumerate(admitted):
                if lengths[i] - starts[i] >= self._prefix_cache.block:
                    self._prefix_cache.insert(seq.prompt_ids, *kv.row_kv(first + i, lengths[i]))
        for seq in admitted:
            if seq.sampling.seed is not None:
                seq.generator = torch.Generator(device=device).manual_seed(seq.sampling.seed)
        tokens, logprobs = sample_tokens(
            logits, [s.sampling for s in admitted], self._generator, [s.generator for s in admitted]
        )
        self._shared_length = None
        for seq, token, logprob in zip(admitted, tokens.tolist(), logprobs.tolist(), strict=True):
            seq.row = len(self._running)
            seq.length = len(seq.prompt_ids)
            self._running.append(seq)
            seq.emit(token, logprob, self.weight_version, self.max_model_len)
        self.stats.prefills += 1
        self.stats.prefill_tokens += sum(lengths) - sum(starts)
        self.stats.cached_tokens += sum(starts)
        self.stats.generated_tokens += count

    def _recompute(self) -> None:
        """After a weight update: compute every running sequence again from all its tokens (the
        last sampled one too, whose keys and values were not computed yet) on the new weights,
        into fresh rows, and sample each one's next token at its last position, as a request
        resumed on new weights is. Rows are filled in groups of at most ``max_prefill_tokens``
        (padded); a sequence longer than that alone goes in chunks of it."""
        kv, budget = self._kv, self.config.max_prefill_tokens
        resumed = sorted(self._running, key=lambda seq: seq.length)  # like lengths together: little padding
        tokens = [seq.prompt_ids + seq.output_ids for seq in resumed]  # seq.length + 1 each
        groups: list[list[int]] = []  # the rows of each forward pass
        for row, ids in enumerate(tokens):
            if groups and len(ids) * (len(groups[-1]) + 1) <= budget:
                groups[-1].append(row)
            else:
                groups.append([row])
        kv.clear()  # every row is written again, from column 0
        hidden: list[torch.Tensor] = []
        for rows in groups:
            group = [tokens[row] for row in rows]
            longest = len(group[-1])
            chunk = budget if len(rows) == 1 else longest
            for start in range(0, longest, chunk):  # the last chunk's hidden states are kept
                last = self._compute_rows(rows[0], [ids[: start + chunk] for ids in group], [start] * len(rows))
            hidden.append(last)
            kv.width = max(kv.width, longest)
        logits = self._lm_head(torch.cat(hidden))
        sampled, logprobs = sample_tokens(
            logits, [s.sampling for s in resumed], self._generator, [s.generator for s in resumed]
        )
        self._running, self._shared_length = [], None
        for row, (seq, ids, token, logprob) in enumerate(
            zip(resumed, tokens, sampled.tolist(), logprobs.tolist(), strict=True)
        ):
            kv.mask[row, : len(ids)] = True
            seq.row, seq.length, seq.stale_kv = row, len(ids), False
            self._running.append(seq)
            seq.emit(token, logprob, self.weight_version, self.max_model_len)
        kv.num_rows = len(resumed)
        self.stats.resumed_sequences += len(resumed)
        self.stats.recomputed_tokens += sum(map(len, tokens))
        self.stats.generated_tokens += len(resumed)

    def _decode(self) -> None:
        kv, running, device = self._kv, self._running, self.device
        rows = len(running)
        longest = max(s.length for s in running)
        # compact when the shared columns are mostly gaps, or before growing the buffer for them
        if kv.width > 4 * longest + 64 or (kv.width + 1 > kv.col_capacity and kv.width > 2 * longest):
            kv.compact()
        kv.reserve(rows, kv.width + 1)
        column = kv.width
        input_ids = torch.tensor([s.output_ids[-1] for s in running], device=device)[:, None]
        positions = torch.tensor([s.length for s in running], device=device)[:, None]
        kv.mask[:rows, column] = True
        mask = kv.mask[:rows, None, : column + 1]
        shared = self._shared_prefix()
        hidden = self._forward(input_ids, positions, mask, kv.view(slice(0, rows), column), shared)
        self.stats.shared_prefix_steps += bool(shared)
        kv.width = column + 1
        logits = self._lm_head(hidden[:, -1])
        tokens, logprobs = sample_tokens(
            logits, [s.sampling for s in running], self._generator, [s.generator for s in running]
        )
        for seq, token, logprob in zip(running, tokens.tolist(), logprobs.tolist(), strict=True):
            seq.length += 1
            seq.emit(token, logprob, self.weight_version, self.max_model_len)
        self.stats.steps += 1
        self.stats.generated_tokens += rows
        self.stats.peak_batch = max(self.stats.peak_batch, rows)

    def _retire(self) -> list[Sequence]:
        """Remove finished sequences from the batch (and their KV rows)."""
        done = [s for s in self._running if s.finish is not None]
        if done:
            self._shared_length = None
        for seq in done:
            if self.config.prefix_cache_mb > 0 and not seq.stale_kv:  # keep its keys and values for the next turn
                tokens = (seq.prompt_ids + seq.output_ids)[: seq.length]
                self._prefix_cache.insert(tokens, *self._kv.row_kv(seq.row, seq.length))
            moved = self._kv.remove_row(seq.row)
            last = self._running.pop()
            if moved is not None:
                last.row = seq.row
                self._running[seq.row] = last
        return done
