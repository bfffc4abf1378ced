"""Trajectories -> training samples -> padded tensors.

A trajectory is ``prompt_ids + response_ids`` with ``loss_mask`` over the response: 1 on the
tokens the engine generated. Each contiguous run of 1s is one assistant turn (a *step*).

- ``trajectory`` mode: one sample per trajectory, every step trained.
- stepwise modes (``broadcast``, ``per_step``): one sample per step — the conversation up to
  the end of that step, with only that step's tokens masked in.

A gateway session whose history the agent rewrote is split (``request.segments``): its *pieces*
are each segment, then the request's own tokens. Every piece is trained, each as above, and its
steps are numbered across the pieces in order, as its tool calls' turns are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from rollout.request import AsyncRolloutRequest, Segment


@dataclass
class Sample:
    """One training sequence. ``loss_mask[i]`` says whether token ``i`` is trained on (predicted
    from the tokens before it); ``engine_logprobs[i]`` is the engine's logprob for it (0.0 where
    masked out)."""

    input_ids: list[int]
    loss_mask: list[int]
    engine_logprobs: list[float]
    advantage: float = 0.0
    group_id: int = 0
    """The request's ``prompt_index``: the GRPO group it was sampled in."""


def step_spans(loss_mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each contiguous run of 1s (each assistant turn) in a response mask."""
    spans, start = [], None
    for i, m in enumerate(loss_mask):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    if start is not None:
        spans.append((start, len(loss_mask)))
    return spans


def pieces(request: AsyncRolloutRequest) -> list[Segment | AsyncRolloutRequest]:
    """The token sequences of a request in session order: each segment of a split session, then the
    request's own tokens (for every other request, just itself). Each has ``prompt_ids``,
    ``response_ids``, ``loss_mask`` and ``logprobs``."""
    return [*request.segments, request]


def step_rewards(request: AsyncRolloutRequest) -> list[float]:
    """r_t per assistant turn, over all pieces in order: the step rewards of the tool calls made in
    that turn and the interaction's score of the user turn answering it, plus the final reward on
    the session's last turn. A segment's turns are numbered from its recorded ``turns`` count."""
    turn_rewards = [(call.turn, call.reward) for call in request.tool_calls]
    turn_rewards += [(user_turn.turn, user_turn.score) for user_turn in request.interaction_turns]
    rewards: list[float] = []
    first = 0  # the session's turns before this piece
    for piece in pieces(request):
        steps = len(step_spans(piece.loss_mask))
        turns = piece.turns if isinstance(piece, Segment) else steps
        piece_rewards = [0.0] * steps
        for turn, reward in turn_rewards:
            if 1 <= turn - first <= min(turns, steps):
                piece_rewards[turn - first - 1] += reward
        rewards += piece_rewards
        first += turns
    if rewards:
        rewards[-1] += request.rewards.final
    return rewards


def _engine_logprobs(piece: Segment | AsyncRolloutRequest) -> list[float]:
    return [0.0] * len(piece.prompt_ids) + [lp if lp is not None else 0.0 for lp in piece.logprobs]


def _piece_sample(piece: Segment | AsyncRolloutRequest, advantage: float, group_id: int) -> Sample:
    return Sample(
        input_ids=piece.prompt_ids + piece.response_ids,
        loss_mask=[0] * len(piece.prompt_ids) + list(piece.loss_mask),
        engine_logprobs=_engine_logprobs(piece),
        advantage=advantage,
        group_id=group_id,
    )


def trajectory_samples(request: AsyncRolloutRequest, advantage: float) -> list[Sample]:
    """One sample per piece (one for an unsplit request), all of its steps trained, each with the
    request's ``advantage``."""
    return [_piece_sample(piece, advantage, request.prompt_index) for piece in pieces(request)]


def trajectory_sample(request: AsyncRolloutRequest, advantage: float) -> Sample:
    """The request's own tokens as one sample, all of its steps trained: the whole trajectory, or
    a split session's last sample only (``trajectory_samples`` gives every piece)."""
    return _piece_sample(request, advantage, request.prompt_index)


def step_samples(request: AsyncRolloutRequest, advantages: list[float]) -> list[Sample]:
    """One sample per assistant turn, over all pieces in order: the piece's conversation up to the
    end of that turn, only that turn's tokens masked in. ``advantages[t]`` goes with turn ``t``."""
    samples = []
    for piece in pieces(request):
        offset = len(piece.prompt_ids)
        ids = piece.prompt_ids + piece.response_ids
        logprobs = _engine_logprobs(piece)
        for start, end in step_spans(piece.loss_mask):
            mask = [0] * (offset + start) + [1] * (end - start)
            samples.append(
                Sample(
                    input_ids=ids[: offset + end],
                    loss_mask=mask,
                    engine_logprobs=logprobs[: offset + end],
                    advantage=advantages[len(samples)],
                    group_id=request.prompt_index,
                )
            )
    return samples


@dataclass
class TrainBatch:
    """A micro-batch of samples as the model reads it and as the loss reads it.

    The model's input is ``input_ids``/``position_ids`` ``[R, N]``: either the samples right-padded
    (R = B, with ``attention_mask``) or packed into one row without padding (R = 1, no attention
    mask: position ids restart at 0 for each sample, which tells the attention implementation
    where each one starts). The loss's view is per sample, ``[B, T]`` (T the longest sample):
    ``loss_mask``, ``engine_logprobs``, and ``advantages [B]``. ``positions`` are the flat indices
    (into ``input_ids.view(-1)``) of the ``M`` tokens whose next token is trained, ``targets`` those
    next tokens, and ``slots`` where their logprobs go in a ``[B, T - 1]`` tensor (row t predicts
    token t + 1): only trained tokens go through the LM head.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    engine_logprobs: torch.Tensor
    advantages: torch.Tensor
    positions: torch.Tensor
    targets: torch.Tensor
    slots: torch.Tensor
    shared_prefix: int = 0
    """Leading tokens every row holds and no row trains on (padded rows only): the model runs them once
    and every row reads their keys and values; ``positions`` then index ``[R, N - shared_prefix]``."""

    def __len__(self) -> int:
        return self.loss_mask.shape[0]

    @property
    def packed(self) -> bool:
        return self.attention_mask is None

    def to(self, device: torch.device | str) -> TrainBatch:
        moved = {name: getattr(self, name) for name in self.__dataclass_fields__ if name != "shared_prefix"}
        tensors = {name: None if t is None else t.to(device) for name, t in moved.items()}
        return TrainBatch(**tensors, shared_prefix=self.shared_prefix)

    def unflatten(self, values: torch.Tensor) -> torch.Tensor:
        """Per-token ``values [M]`` (of the trained tokens) as ``[B, T - 1]``, 0 elsewhere."""
        rows, length = self.loss_mask.shape
        out = values.new_zeros(rows * max(length - 1, 0))
        return out.index_put((self.slots,), values).view(rows, max(length - 1, 0))


def collate(samples: list[Sample], pad_id: int = 0, packed: bool = False, share_prefix: bool = False) -> TrainBatch:
    """``samples`` as a TrainBatch: right-padded rows, or with ``packed`` one row without padding.
    ``share_prefix`` (padded rows): the leading tokens all rows hold and none trains on, when at least
    ``MIN_SHARED_PREFIX``, become the batch's ``shared_prefix``."""
    length = max(len(s.input_ids) for s in samples)
    count = len(samples)
    shared = shared_prefix_length(samples) if share_prefix and not packed else 0
    loss_mask = torch.zeros(count, length, dtype=torch.float32)
    engine_logprobs = torch.zeros(count, length, dtype=torch.float32)
    positions, targets, slots = [], [], []
    offset = 0
    for i, sample in enumerate(samples):
        n = len(sample.input_ids)
        loss_mask[i, :n] = torch.tensor(sample.loss_mask, dtype=torch.float32)
        engine_logprobs[i, :n] = torch.tensor(sample.engine_logprobs)
        trained = [t for t in range(n - 1) if sample.loss_mask[t + 1]]  # t predicts t + 1
        start = offset if packed else i * (length - shared) - shared  # (trained t >= shared: see below)
        positions += [start + t for t in trained]
        targets += [sample.input_ids[t + 1] for t in trained]
        slots += [i * (length - 1) + t for t in trained]
        offset += n
    if packed:
        input_ids = torch.tensor([[token for s in samples for token in s.input_ids]], dtype=torch.long)
        position_ids = torch.tensor([[p for s in samples for p in range(len(s.input_ids))]], dtype=torch.long)
        attention_mask = None
    else:
        input_ids = torch.full((count, length), pad_id, dtype=torch.long)
        attention_mask = torch.zeros(count, length, dtype=torch.long)
        for i, sample in enumerate(samples):
            input_ids[i, : len(sample.input_ids)] = torch.tensor(sample.input_ids)
            attention_mask[i, : len(sample.input_ids)] = 1
        position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    advantages = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    positions, targets, slots = (torch.tensor(index, dtype=torch.long) for index in (positions, targets, slots))
    return TrainBatch(input_ids, attention_mask, position_ids, loss_mask, engine_logprobs, advantages,
                      positions, targets, slots, shared)  # fmt: skip


MIN_SHARED_PREFIX = 32
"""A micro-batch's rows share their leading tokens in the update when they are at least this many."""


class Masked(Protocol):
    """A training sequence: a ``Sample``, or an SFT example (``trainer/sft_data.py``)."""

    input_ids: list[int]
    loss_mask: list[int]


def shared_prefix_length(samples: Sequence[Masked]) -> int:
    """Tokens ``0..p-1`` every sample holds, none trained on and none predicting a trained token (the
    model computes no hidden state for them, and token ``t`` predicts ``t + 1``): the prompt, or its
    system part where the prompts differ; 0 when shorter than ``MIN_SHARED_PREFIX`` or one sample."""
    if len(samples) < 2:
        return 0
    limit = min(len(s.input_ids) for s in samples) - 1
    for sample in samples:
        first_trained = next((t for t, m in enumerate(sample.loss_mask) if m), len(sample.loss_mask))
        limit = min(limit, first_trained - 1)
    first = samples[0].input_ids
    p = 0
    while p < limit and all(s.input_ids[p] == first[p] for s in samples):
        p += 1
    return p if p >= MIN_SHARED_PREFIX else 0


def micro_batches(samples: list[Sample], size: int | None, max_tokens: int | None = None,
                  packed: bool = False) -> list[list[Sample]]:  # fmt: skip
    """Consecutive chunks of at most ``size`` samples (None: any number), sorted by length so padding stays small, and
    of at most ``max_tokens`` tokens (padded: rows x the longest; ``packed``: the sum of lengths; a
    longer sample goes alone), so a few long conversations cannot blow up a forward pass."""
    chunks: list[list[Sample]] = []
    used = 0
    for sample in sorted(samples, key=lambda s: len(s.input_ids)):
        chunk = chunks[-1] if chunks else None
        n = len(sample.input_ids)
        tokens = used + n if packed else (len(chunk or ()) + 1) * n
        fits = max_tokens is None or tokens <= max_tokens
        if chunk is None or (size is not None and len(chunk) >= size) or not fits:
            chunks.append([sample])
            used = n
        else:
            chunk.append(sample)
            used += n
    return chunks
