"""SFT examples: conversations and rollout trajectories -> token ids with a loss mask, in the
exact layout of rollouts, and the batches they are trained in.

A conversation is tokenised the way a rollout builds it, so SFT trains exactly the tokens the
engine will later generate: the prompt rendered once with the tool schemas, each assistant
message as its text's tokens plus the turn-close stop token (loss mask 1), and the template
glue and tool messages by delta rendering (loss mask 0). Rollout trajectories (``rallyrl
rollout`` JSONL) are used as they are: ``prompt_ids + response_ids`` with their ``loss_mask``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import torch
from transformers import PreTrainedTokenizerBase

from data.schema import RecordError, load_records
from data.synthetic import make_calc_sft_records
from rollout.api import setup_tools
from rollout.request import validate_trajectory
from rollout.tokens import ChatTokenizer
from tools.base import BaseTool
from trainer.batch import shared_prefix_length
from trainer.config import SFTConfig


@dataclass
class Example:
    """One training sequence: token ids and a mask that is 1 on the tokens trained on."""

    input_ids: list[int]
    loss_mask: list[int]


def calc_chat(tokenizer: PreTrainedTokenizerBase) -> tuple[ChatTokenizer, dict[str, BaseTool]]:
    """The chat tokenizer and tools of a default rollout (the calculator), so SFT sees the same prompt."""
    tools, chat = setup_tools(None, tokenizer)
    return chat, tools


def tokenize_conversation(chat: ChatTokenizer, messages: list[dict[str, Any]]) -> Example:
    """A conversation in the rollout layout: assistant text + stop token trained, the rest context.

    Messages after the last assistant message are dropped (nothing would be trained on them).
    """
    roles = [message["role"] for message in messages]
    if "assistant" not in roles:
        raise ValueError("the conversation has no assistant message to train on")
    first = roles.index("assistant")
    last = len(roles) - 1 - roles[::-1].index("assistant")
    ids = chat.prompt_ids(messages[:first])
    mask = [0] * len(ids)
    i = first
    while i <= last:
        output = [*chat.encode(messages[i]["content"]), chat.turn_close_ids[0]]
        ids += output
        mask += [1] * len(output)
        following = i + 1
        while following <= last and roles[following] != "assistant":
            following += 1
        if following <= last:  # glue, then the tool / user turns, then the next generation prompt
            context = chat.assistant_close_ids(output)
            context += chat.delta_ids(messages[i + 1 : following])  # [] -> just the generation prompt
            ids += context
            mask += [0] * len(context)
        i = following
    return Example(ids, mask)


def load_examples(config: SFTConfig, chat: ChatTokenizer) -> list[Example]:
    """The training examples: generated calc traces, or ``config.data`` (conversations or trajectories)."""
    if config.data is None:
        conversations = [
            record.prompt
            for record in make_calc_sft_records(
                config.num_examples, config.seed, tool_call_share=config.tool_call_share
            )
        ]
        examples = [tokenize_conversation(chat, messages) for messages in conversations]
    elif _is_trajectory_file(Path(config.data)):
        examples = _trajectory_examples(Path(config.data), config.min_reward)
    else:
        records = load_records(config.data)
        examples = []
        for record in records:
            try:
                examples.append(tokenize_conversation(chat, record.prompt))
            except ValueError as exc:
                raise RecordError(str(exc), path=config.data, index=record.index, field="prompt") from None
    if config.data is not None and config.num_examples:
        examples = examples[: config.num_examples]
    examples = [Example(e.input_ids[: config.max_length], e.loss_mask[: config.max_length]) for e in examples]
    examples = [e for e in examples if any(e.loss_mask[1:])]
    if not examples:
        raise ValueError(f"{config.data or 'calc traces'}: no example has a token to train on")
    return examples


def _is_trajectory_file(path: Path) -> bool:
    """A rollout JSONL (its lines carry ``response_ids``) rather than a file of dataset records."""
    if path.suffix.lower() != ".jsonl" or not path.is_file():
        return False
    with path.open("rb") as f:
        for line in f:
            if line.strip():
                try:
                    first = orjson.loads(line)
                except orjson.JSONDecodeError:
                    return False
                return isinstance(first, dict) and "response_ids" in first and "loss_mask" in first
    return False


def _trajectory_examples(path: Path, min_reward: float | None) -> list[Example]:
    examples = []
    for number, line in enumerate(path.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            trajectory = orjson.loads(line)
            validate_trajectory(trajectory)
        except (orjson.JSONDecodeError, ValueError) as exc:
            raise RecordError(f"not a valid trajectory: {exc}", path=path, line=number) from None
        if min_reward is not None and (trajectory["reward"] is None or trajectory["reward"] < min_reward):
            continue
        for piece in [*trajectory.get("segments", []), trajectory]:  # a split gateway session: every sample
            prompt = piece["prompt_ids"]
            examples.append(Example(prompt + piece["response_ids"], [0] * len(prompt) + piece["loss_mask"]))
    return examples


# ---------------------------------------------------------------------------------------------
# Batches and the loss


@dataclass
class Batch:
    """Right-padded token ids and loss masks of several examples."""

    input_ids: torch.Tensor
    """[batch, length], padded on the right."""
    loss_mask: torch.Tensor
    """[batch, length], 1 on tokens trained on (0 on padding)."""
    shared_prefix: int = 0
    """Leading tokens every row shares and that are not trained on: computed once, not per row."""

    def to(self, device: torch.device) -> Batch:
        return Batch(self.input_ids.to(device), self.loss_mask.to(device), self.shared_prefix)


def collate(examples: list[Example], pad_token_id: int) -> Batch:
    """Pad on the right; find the prefix all rows share (the system prompt, for calc traces), as the
    GRPO update does (``trainer.batch.shared_prefix_length``)."""
    length = max(len(e.input_ids) for e in examples)
    input_ids = torch.full((len(examples), length), pad_token_id, dtype=torch.long)
    loss_mask = torch.zeros((len(examples), length), dtype=torch.long)
    for row, example in enumerate(examples):
        input_ids[row, : len(example.input_ids)] = torch.tensor(example.input_ids)
        loss_mask[row, : len(example.loss_mask)] = torch.tensor(example.loss_mask)
    return Batch(input_ids, loss_mask, shared_prefix_length(examples))




def batches(examples: list[Example], batch_size: int, seed: int):
    """Endless batches: each pass over the examples in a fresh seeded order."""
    rng = random.Random(seed)
    order: list[int] = []
    while True:
        if len(order) < batch_size:
            fresh = list(range(len(examples)))
            rng.shuffle(fresh)
            order += fresh
        chosen, order = order[:batch_size], order[batch_size:]
        yield [examples[i] for i in chosen]
