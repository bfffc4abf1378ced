"""The embedded engine's running batch on the model (``local.py`` schedules it): the KV rows of the
running sequences, the prefix cache, and one scheduling step (weights, aborts, prefill of the admitted,
recompute after a weight update, one decode step). Everything here runs on the engine's worker thread."""

from __future__ import annotations

import asyncio
from typing import Any

import torch
from transformers import PreTrainedModel

from rollout.engines.config import LocalEngineConfig
from rollout.engines.heap import give_back_memory, trim_heap
from rollout.engines.kv_cache import KVBuffer, PrefixCache
from rollout.engines.sampling import sample_tokens
from rollout.engines.sequence import EngineStats, Sequence
from rollout.engines.shared_prefix import NAME as SHARED_PREFIX_ATTENTION
from rollout.engines.shared_prefix import shared_prefix_length


class ModelBatch:
    """The running sequences on a causal LM, one KV row each (``running[i].row == i``)."""

    def __init__(self, model: PreTrainedModel, config: LocalEngineConfig, device: Any, dtype: torch.dtype,
                 max_model_len: int):  # fmt: skip
        self.model, self.config, self.max_model_len = model, config, max_model_len
        self.device, self.dtype = device, dtype
        self._cascade = model.config._attn_implementation in ("sdpa", SHARED_PREFIX_ATTENTION)
        if self._cascade:  # SDPA, with one read of a prompt prefix all rows share
            model.set_attn_implementation(SHARED_PREFIX_ATTENTION)
        self._decoder = model.get_decoder()
        self._lm_head = model.get_output_embeddings()
        model_config = model.config
        head_dim = getattr(model_config, "head_dim", None) or (
            model_config.hidden_size // model_config.num_attention_heads
        )
        self.kv = KVBuffer(
            model_config.num_hidden_layers, model_config.num_key_value_heads, head_dim, self.dtype, self.device
        )
        self.prefix_cache = PrefixCache(config.prefix_cache_mb * 2**20)
        self.flush_requested = False
        self._generator = torch.Generator(device=self.device).manual_seed(config.seed or 0)
        self.running: list[Sequence] = []  # index == KV row
        self.weight_version = 0
        self.stats = EngineStats()
        self._shared_length: int | None = None  # None: the batch changed, recompute
        self.shapes: dict[str, torch.Size] = {}  # each state-dict entry's, while the memory is released (colocation)

    @torch.inference_mode()
    def step(
        self,
        admitted: list[Sequence],
        aborts: set[str | None],
        weights: list[tuple[dict[str, Any], int, asyncio.Future[int]]],
    ) -> list[Sequence]:
        """One scheduling step: weights, aborts, prefill of the admitted, one decode step."""
        for state_dict, version, _ in weights:
            self.load_weights(state_dict, version)
        if self.flush_requested:
            self.flush_requested = False
            self.prefix_cache.clear()
            trim_heap()
        finished: list[Sequence] = []
        if aborts:
            for seq in list(self.running):
                if None in aborts or seq.rid in aborts:
                    seq.finish = "abort"
            finished += self.retire()
        if self.config.recompute_on_update and any(seq.stale_kv for seq in self.running):
            self.recompute()
            finished += self.retire()
        if admitted:
            self.prefill(admitted)
            finished += self.retire()
        if self.running:
            self.decode()
            finished += self.retire()
        return finished

    def release_idle_memory(self) -> None:
        """The engine has been idle a while: give back the buffers a burst grew, and the freed heap."""
        if not self.running:
            self.kv.shrink()
            trim_heap()

    def release_memory(self) -> int:
        """Colocation: give back the KV buffers, the prefix cache and the weights' storage (their shapes
        are kept); the bytes let go. Nothing may be running."""
        if self.running:
            raise RuntimeError("the engine's memory can be released only while nothing runs")
        parameters = dict(self.model.named_parameters())
        weights = sum(p.numel() * p.element_size() for p in parameters.values())
        freed = self.kv.nbytes + self.prefix_cache.nbytes + weights
        self.kv.release()
        self.prefix_cache.clear()
        self.shapes = {name: tensor.shape for name, tensor in self.model.state_dict(keep_vars=True).items()}
        for parameter in parameters.values():
            parameter.data = torch.empty(0, dtype=parameter.dtype, device=parameter.device)
        self._shared_length = None
        give_back_memory(self.device)
        return freed

    def resume_memory(self, state_dict: dict[str, Any], version: int) -> int:
        """After ``release_memory``: the weights' storage again, filled from ``state_dict`` (which must
        hold every parameter), and the KV buffers; the bytes taken."""
        parameters = dict(self.model.named_parameters())
        missing = sorted(name for name in parameters if name not in state_dict)
        if missing:
            raise ValueError(f"the engine's weights were released and {missing[:3]} are not in the update")
        unknown = sorted(name for name in state_dict if name not in self.shapes)
        if unknown:
            raise ValueError(f"unknown parameters {unknown[:3]}")
        wrong = [name for name in state_dict if tuple(state_dict[name].shape) != tuple(self.shapes[name])]
        if wrong:
            raise ValueError(f"{wrong[0]} has shape {tuple(state_dict[wrong[0]].shape)}, the engine's is "
                             f"{tuple(self.shapes[wrong[0]])}")  # fmt: skip
        for name, parameter in parameters.items():
            parameter.data = torch.empty(self.shapes[name], dtype=parameter.dtype, device=parameter.device)
        self.shapes = {}
        self.load_weights(state_dict, version)
        self.kv.reallocate()
        return self.kv.nbytes + sum(p.numel() * p.element_size() for p in parameters.values())

    def load_weights(self, state_dict: dict[str, Any], version: int) -> None:
        self.model.load_state_dict(state_dict, strict=False)
        self.prefix_cache.clear()  # cached keys and values came from the old weights
        for seq in self.running:  # and so did those of the running sequences
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
        running = self.running
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
        kv, device = self.kv, self.device
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

    def prefill(self, admitted: list[Sequence]) -> None:
        """Compute the admitted prompts (less what the prefix cache has) into new rows, and
        sample each one's first token."""
        kv, device = self.kv, self.device
        count, first = len(admitted), kv.num_rows
        cached = [self.prefix_cache.lookup(seq.prompt_ids) for seq in admitted]
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
                if lengths[i] - starts[i] >= self.prefix_cache.block:
                    self.prefix_cache.insert(seq.prompt_ids, *kv.row_kv(first + i, lengths[i]))
        for seq in admitted:
            if seq.sampling.seed is not None:
                seq.generator = torch.Generator(device=device).manual_seed(seq.sampling.seed)
        tokens, logprobs = self._sample(logits, admitted)
        self._shared_length = None
        for seq, token, logprob in zip(admitted, tokens, logprobs, strict=True):
            seq.row = len(self.running)
            seq.length = len(seq.prompt_ids)
            self.running.append(seq)
            if token is not None:
                seq.emit(token, logprob, self.weight_version, self.max_model_len)
        self.stats.prefills += 1
        self.stats.prefill_tokens += sum(lengths) - sum(starts)
        self.stats.cached_tokens += sum(starts)
        self.stats.generated_tokens += count

    def recompute(self) -> None:
        """After a weight update: compute every running sequence again from all its tokens (the
        last sampled one too, whose keys and values were not computed yet) on the new weights,
        into fresh rows, and sample each one's next token at its last position, as a request
        resumed on new weights is. Rows are filled in groups of at most ``max_prefill_tokens``
        (padded); a sequence longer than that alone goes in chunks of it."""
        kv, budget = self.kv, self.config.max_prefill_tokens
        resumed = sorted(self.running, key=lambda seq: seq.length)  # like lengths together: little padding
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
        sampled, logprobs = self._sample(logits, resumed)
        self.running, self._shared_length = [], None
        for row, (seq, ids, token, logprob) in enumerate(zip(resumed, tokens, sampled, logprobs, strict=True)):
            kv.mask[row, : len(ids)] = True
            seq.row, seq.length, seq.stale_kv = row, len(ids), False
            self.running.append(seq)
            if token is not None:
                seq.emit(token, logprob, self.weight_version, self.max_model_len)
        kv.num_rows = len(resumed)
        self.stats.resumed_sequences += len(resumed)
        self.stats.recomputed_tokens += sum(map(len, tokens))
        self.stats.generated_tokens += len(resumed)

    def decode(self) -> None:
        kv, running, device = self.kv, self.running, self.device
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
        tokens, logprobs = self._sample(logits, running)
        for seq, token, logprob in zip(running, tokens, logprobs, strict=True):
            seq.length += 1
            if token is not None:
                seq.emit(token, logprob, self.weight_version, self.max_model_len)
        self.stats.steps += 1
        self.stats.generated_tokens += rows
        self.stats.peak_batch = max(self.stats.peak_batch, rows)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int | None], list[float | None]]:
        """One token and its logprob per row. Sampling is the one part of a step that depends on each
        request's own parameters: when it fails for the batch, each row is sampled alone, and a row that
        fails again ends its own request with the error (token None) while the others go on."""
        try:
            tokens, logprobs = sample_tokens(
                logits, [s.sampling for s in seqs], self._generator, [s.generator for s in seqs]
            )
            return tokens.tolist(), logprobs.tolist()
        except Exception:
            pass
        rows: tuple[list[int | None], list[float | None]] = ([], [])
        for row, seq in enumerate(seqs):
            try:
                token, logprob = sample_tokens(logits[row : row + 1], [seq.sampling], self._generator, [seq.generator])
                rows[0].append(int(token[0]))
                rows[1].append(float(logprob[0]))
            except Exception as exc:  # this request's own failure: it ends with it, alone
                seq.error, seq.finish = exc, "abort"
                rows[0].append(None)
                rows[1].append(None)
        return rows

    def retire(self) -> list[Sequence]:
        """Remove finished sequences from the batch (and their KV rows)."""
        done = [s for s in self.running if s.finish is not None]
        if done:
            self._shared_length = None
        for seq in done:
            if self.config.prefix_cache_mb > 0 and not seq.stale_kv:  # keep its keys and values for the next turn
                tokens = (seq.prompt_ids + seq.output_ids)[: seq.length]
                self.prefix_cache.insert(tokens, *self.kv.row_kv(seq.row, seq.length))
            moved = self.kv.remove_row(seq.row)
            last = self.running.pop()
            if moved is not None:
                last.row = seq.row
                self.running[seq.row] = last
        return done
