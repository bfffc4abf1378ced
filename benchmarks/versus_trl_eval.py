"""The held-out evaluator of ``benchmarks/versus_trl.py``: one judge for both trainers.

It imports neither trainer (no ``trainer.*``, no ``trl``, not even rallyrl's rollout engine): plain
transformers greedy decoding of a model directory, the calculator executed on the model's
``<tool_call>{json}</tool_call>`` blocks, and the calc task's answer check. What it shares with
rallyrl is only the task's data (``data.synthetic``), the calculator's arithmetic
(``tools.calculator.evaluate``) and the grader (``data.rewards.score_answer``), which are the task
itself and what both trainers are rewarded with.

A conversation: the prompt rendered by the model directory's chat template with the calculator's
schema; each assistant turn greedy, at most ``max_new_tokens`` tokens, ending at the template's end
of turn; every tool call in it executed (a malformed one answered with an ``Error: ...`` text, as
rallyrl's loop and TRL's do), the tool messages appended by the template's own tokens (the
difference of two renderings), and the next turn generated; at most ``max_turns`` assistant turns.
A turn without a call, or cut at ``max_new_tokens``, ends it. The grade is ``score_answer`` of the
last assistant turn's text before any tool call against the record's ground truth.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.cache_utils import DynamicLayer

from data.rewards import score_answer
from data.schema import Record
from data.synthetic import make_calc_records
from tools.calculator import CalculatorError, CalculatorTool, evaluate, format_number

HELD_OUT_SEED = 12345
"""The seed of ``rallyrl eval``'s held-out calc prompts (``EvalConfig.seed``), apart from training seeds."""
CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def held_out_records(num: int) -> list[Record]:
    """The first ``num`` of the prompts ``rallyrl eval`` scores by default (300 of seed 12345)."""
    return make_calc_records(num, HELD_OUT_SEED)


@dataclass
class EvalSettings:
    """The limits of each held-out conversation: those of ``rallyrl eval`` on the calc task."""

    max_turns: int = 3
    max_new_tokens: int = 96
    max_model_len: int = 2048
    batch_size: int = 100
    """Conversations decoded together (left-padded)."""


@dataclass
class Conversation:
    """One held-out prompt's token ids as they grow, and what the evaluator saw."""

    record: Record
    ids: list[int]
    turns: list[str] = field(default_factory=list)
    calls: int = 0
    malformed: int = 0
    done: bool = False


@dataclass
class EvalResult:
    """Greedy held-out accuracy of one model directory, and how its conversations went."""

    accuracy: float
    correct: int
    prompts: int
    tool_calls_per_prompt: float
    malformed_call_share: float

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def calculator_reply(call_body: str) -> tuple[str, bool]:
    """The tool message for one ``<tool_call>`` body, and whether the call was malformed."""
    try:
        call = json.loads(call_body)
    except ValueError:
        return "Error: the tool call is not valid JSON", True
    if not isinstance(call, dict) or call.get("name") != "calculator" or not isinstance(call.get("arguments"), dict):
        return 'Error: call the calculator as {"name": "calculator", "arguments": {"expression": ...}}', True
    expression = call["arguments"].get("expression")
    if not isinstance(expression, str):
        return "Error: calculator needs 'expression', a string such as '12*(3+4)'", True
    try:
        return format_number(evaluate(expression)), False
    except CalculatorError as exc:
        return f"Error: {exc}", False


def split_turn(text: str) -> tuple[str, list[str]]:
    """A turn's content (the text before its first ``<tool_call>``) and its call bodies; an unclosed
    call is one malformed body."""
    start = text.find("<tool_call>")
    if start < 0:
        return text.strip(), []
    bodies = CALL_RE.findall(text)
    if text.rfind("<tool_call>") > text.rfind("</tool_call>"):
        bodies.append("<unclosed>")
    return text[:start].strip(), bodies


class HeldOutEvaluator:
    """Greedy accuracy of model directories on the held-out calc prompts (``evaluate(model_dir)``).

    Decoding is a plain loop over the model's forward pass with a key-value cache: the prompts'
    common prefix (system turn and tool schema) is computed once and shared, each row's tokens are
    appended with padding masked out, and rows whose conversation ended leave the batch.
    """

    def __init__(self, records: list[Record], settings: EvalSettings | None = None):
        self.records = records
        self.settings = settings or EvalSettings()
        self.schema = CalculatorTool().schema

    def evaluate(self, model_dir: str | Path) -> EvalResult:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        decoder = Decoder(model, tokenizer, self.settings)
        conversations = [Conversation(record, self.render_prompt(tokenizer, record)) for record in self.records]
        for start in range(0, len(conversations), self.settings.batch_size):
            decoder.run(conversations[start : start + self.settings.batch_size])
        correct = sum(
            score_answer(split_turn(c.turns[-1])[0] if c.turns else "", c.record.ground_truth or "")
            for c in conversations
        )
        calls = sum(c.calls for c in conversations)
        return EvalResult(
            accuracy=correct / len(conversations),
            correct=int(correct),
            prompts=len(conversations),
            tool_calls_per_prompt=calls / len(conversations),
            malformed_call_share=sum(c.malformed for c in conversations) / calls if calls else 0.0,
        )

    def render_prompt(self, tokenizer: Any, record: Record) -> list[int]:
        return list(
            tokenizer.apply_chat_template(
                record.prompt, tools=[self.schema], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )


class Decoder:
    """Greedy multi-turn decoding of a batch of conversations with tool execution between turns."""

    def __init__(self, model: Any, tokenizer: Any, settings: EvalSettings):
        self.model, self.tokenizer, self.settings = model, tokenizer, settings
        self.eos, self.pad = tokenizer.eos_token_id, tokenizer.pad_token_id
        self.glue = ToolGlue(tokenizer)

    @torch.inference_mode()
    def run(self, batch: list[Conversation]) -> None:
        prefix = common_prefix([c.ids for c in batch])[:-1]  # at least one token of each row left to feed
        self.cache = growing_cache(self.model.config)
        self.model(input_ids=torch.tensor([prefix]), cache=self.cache, use_cache=True)
        self.cache.batch_repeat_interleave(len(batch))
        self.mask = torch.ones(len(batch), len(prefix), dtype=torch.long)
        rows = list(batch)  # the conversations still in the cache, in its row order
        logits = self.feed([c.ids[len(prefix) :] for c in rows])
        for _ in range(self.settings.max_turns):
            turn: list[list[int]] = [[] for _ in rows]
            going = [True] * len(rows)
            for _ in range(self.settings.max_new_tokens):
                tokens = logits.argmax(-1).tolist()
                for i, token in enumerate(tokens):
                    if going[i]:
                        turn[i].append(token)
                        going[i] = token != self.eos
                if not any(going):
                    break
                logits = self.feed([[t] if g else [] for t, g in zip(tokens, going, strict=True)])
            glue = [self.finish_turn(c, ids) for c, ids in zip(rows, turn, strict=True)]
            keep = [i for i, c in enumerate(rows) if not c.done]
            if not keep or len(rows[0].ids) >= self.settings.max_model_len:
                break
            if len(keep) < len(rows):
                self.cache.batch_select_indices(torch.tensor(keep))
                self.mask = self.mask[keep]
                rows, glue = [rows[i] for i in keep], [glue[i] for i in keep]
            logits = self.feed(glue)
        for conversation in rows:
            conversation.done = True

    def finish_turn(self, conversation: Conversation, ids: list[int]) -> list[int]:
        """Record one turn; execute its calls; the tokens to feed before the next turn (none: done)."""
        ended = bool(ids) and ids[-1] == self.eos
        conversation.ids += ids
        text = self.tokenizer.decode(ids[:-1] if ended else ids, skip_special_tokens=False)
        conversation.turns.append(text)
        _, bodies = split_turn(text)
        if not ended or not bodies:
            conversation.done = True
            return []
        replies = []
        for body in bodies:
            reply, malformed = calculator_reply(body)
            conversation.calls += 1
            conversation.malformed += malformed
            replies.append(reply)
        glue = self.glue.tool_ids(replies)
        conversation.ids += glue
        return [ids[-1], *glue]  # the end of turn was sampled but not fed yet

    def feed(self, chunks: list[list[int]]) -> torch.Tensor:
        """Append each row's tokens (left-padded to one width, the padding masked out); the logits
        after each row's last token (meaningless for a row given none)."""
        width = max(1, max(len(chunk) for chunk in chunks))
        ids = torch.tensor([[self.pad] * (width - len(chunk)) + chunk for chunk in chunks])
        new_mask = torch.tensor([[0] * (width - len(chunk)) + [1] * len(chunk) for chunk in chunks])
        self.mask = torch.cat([self.mask, new_mask], dim=1)
        positions = (self.mask.cumsum(-1) - 1).clamp(min=0)[:, -width:]
        output = self.model(
            input_ids=ids, attention_mask=self.mask, position_ids=positions, cache=self.cache, use_cache=True
        )
        return output.logits[:, -1]


class GrowingLayer(DynamicLayer):
    """A key-value cache layer that appends into a buffer of doubling capacity: ``DynamicLayer``
    concatenates, copying the whole cache at every decoded token (most of the evaluation's time).
    ``keys`` and ``values`` stay views of the filled part, so the rest of ``DynamicLayer`` holds."""

    buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length, added = self.get_seq_length(), key_states.shape[-2]
        if not self.holds(length + added, key_states.shape[0]):  # first use, full, or rows selected or repeated
            shape = (*key_states.shape[:2], max(256, 2 * (length + added)), key_states.shape[-1])
            self.buffers = (key_states.new_empty(shape), value_states.new_empty(shape))
            if length:
                self.buffers[0][:, :, :length] = self.keys
                self.buffers[1][:, :, :length] = self.values
        keys, values = self.buffers
        keys[:, :, length : length + added] = key_states
        values[:, :, length : length + added] = value_states
        self.keys, self.values = keys[:, :, : length + added], values[:, :, : length + added]
        return self.keys, self.values

    def holds(self, length: int, rows: int) -> bool:
        """Whether the buffers exist, back the current keys and have room for ``length`` tokens."""
        if self.buffers is None or self.keys.numel() == 0:
            return False
        keys = self.buffers[0]
        return keys.shape[0] == rows and keys.shape[2] >= length and self.keys.data_ptr() == keys.data_ptr()


def growing_cache(config: Any) -> DynamicCache:
    cache = DynamicCache(config=config)
    if not all(type(layer) is DynamicLayer for layer in cache.layers):
        raise ValueError("the evaluator's cache supports full-attention models only (no sliding-window layers)")
    cache.layers = [GrowingLayer() for _ in cache.layers]
    return cache


def common_prefix(sequences: list[list[int]]) -> list[int]:
    first = sequences[0]
    length = len(first)
    for sequence in sequences[1:]:
        length = min(length, len(sequence))
        for i in range(length):
            if sequence[i] != first[i]:
                length = i
                break
    return first[:length]


class ToolGlue:
    """The template's tokens for tool messages after an assistant turn that ended with its end of
    turn: the rendering with them (and the next assistant header) minus the rendering without."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
        self.base = base
        ids = self.render(base, add_generation_prompt=False)
        last_eos = max(i for i, token in enumerate(ids) if token == tokenizer.eos_token_id)
        self.prefix = ids[: last_eos + 1]

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        return list(
            self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
            )
        )

    def tool_ids(self, replies: list[str]) -> list[int]:
        tools = [{"role": "tool", "content": reply} for reply in replies]
        full = self.render(self.base + tools, add_generation_prompt=True)
        if full[: len(self.prefix)] != self.prefix:
            raise ValueError("the chat template renders earlier turns differently once a tool message follows")
        return full[len(self.prefix) :]
