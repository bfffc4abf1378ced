"""Supervised fine-tuning on tool-calling conversations, in the exact token layout of rollouts.

Read ``run_sft`` top to bottom: model and tokenizer, examples, optimizer and schedule, then the
loop (batch, masked loss, clip, step, log) with a held-out greedy evaluation through the real
rollout path (local engine + runner + calculator) and a checkpoint at every ``eval_every`` steps.

A conversation is tokenised the way a rollout builds it, so SFT trains exactly the tokens the
engine will later generate: the prompt rendered once with the tool schemas, each assistant
message as its text's tokens plus the turn-close stop token (loss mask 1), and the template
glue and tool messages by delta rendering (loss mask 0). Rollout trajectories (``rallyrl
rollout`` JSONL) are used as they are: ``prompt_ids + response_ids`` with their ``loss_mask``.

``TINY_CALC_RECIPE`` lists the stages that built the embedded model in ``data/assets/tiny-calc``.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase, get_cosine_schedule_with_warmup
from transformers.utils import logging as transformers_logging

from data.schema import RecordError, load_records
from data.synthetic import make_calc_records, make_calc_sft_records, spaced_expression
from data.tiny_model import TinyModelConfig, build_char_tokenizer, build_tiny_model
from rollout.engines.local import LocalEngine, LocalEngineConfig
from rollout.loop import RolloutConfig
from rollout.request import AsyncRolloutRequest, validate_trajectory
from rollout.runner import RolloutRunner
from rollout.tokens import ChatTokenizer, load_tokenizer
from tools.base import BaseTool
from tools.registry import DEFAULT_TOOLS, build_tools


@dataclass
class SFTConfig:
    """Every setting of an SFT run; the defaults train a fresh tiny Qwen2 on calc traces (the
    embedded model's stages are ``TINY_CALC_RECIPE``)."""

    model: str | None = None
    """Hugging Face model directory to start from; None builds a fresh tiny Qwen2 (sizes below)."""
    hidden_size: int = 128
    """Fresh model only: hidden size."""
    num_layers: int = 4
    """Fresh model only: decoder layers."""
    num_heads: int = 8
    """Fresh model only: attention heads (8 of size 16 learn to copy operands much sooner than 4)."""
    num_kv_heads: int = 8
    """Fresh model only: key/value heads (no grouping: 2 groups slowed copying down)."""
    intermediate_size: int = 512
    """Fresh model only: MLP size."""
    data: str | None = None
    """JSONL of conversations (dataset records whose prompt holds the whole chat) or of rollout
    trajectories; None generates ``calc`` traces with ``seed``."""
    tool_call_share: float = 1.0
    """Generated traces only: the share that calls the calculator; the rest answer at once (a guess)."""
    num_examples: int = 20000
    """Examples to use: generated traces, or the first N of ``data`` (0 = all of ``data``)."""
    min_reward: float | None = None
    """Trajectory data only: keep trajectories whose reward is at least this (rejection sampling)."""
    max_length: int = 2048
    """Longer examples are cut to this many tokens."""
    steps: int = 1200
    """Optimizer steps."""
    schedule_steps: int | None = None
    """Length of the learning-rate schedule (default: ``steps``); a longer one stops the run partway."""
    batch_size: int = 32
    """Examples per step."""
    lr: float = 3e-3
    """Peak learning rate (AdamW)."""
    warmup_steps: int = 30
    """Linear warmup steps before the cosine decay to 0."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm."""
    seed: int = 0
    """Seed of the model initialisation, the data order and the generated calc traces."""
    eval_every: int = 50
    """Evaluate and save a checkpoint every this many steps (and after the last step)."""
    eval_prompts: int = 128
    """Held-out calc problems rolled out greedily at each evaluation (0 = save checkpoints only)."""
    eval_seed: int = 1000
    """Seed of the held-out problems; must differ from ``seed``."""
    log_every: int = 10
    """Print and log the training loss every this many steps."""
    stop_accuracy: float | None = None
    """Stop at the first evaluation whose held-out accuracy reaches this (None: run every step)."""
    out: str = "runs/sft"
    """Output directory: ``step-N/`` checkpoints and ``sft_log.jsonl``."""
    export: str | None = None
    """Also copy the last checkpoint here (``data/assets/tiny-calc`` rebuilds the embedded model)."""
    device: str = "cpu"
    """"cpu", or "auto" to let Accelerate pick (CUDA when present)."""
    torch_threads: int = 0
    """CPU threads for torch (0 = torch's default); 1 is much faster on a CPU shared with other jobs."""
    progress: bool = True
    """Show a progress bar."""

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "eval_every", "log_every", "max_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"SFTConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_examples", "eval_prompts", "warmup_steps", "torch_threads"):
            if getattr(self, name) < 0:
                raise ValueError(f"SFTConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.data is None and self.num_examples < 1:
            raise ValueError("SFTConfig.num_examples must be >= 1 when traces are generated (data is None)")
        if self.eval_seed == self.seed:
            raise ValueError(f"SFTConfig.eval_seed must differ from the training seed ({self.seed}): it is held out")
        if self.schedule_steps is not None and self.schedule_steps < self.steps:
            raise ValueError(f"SFTConfig.schedule_steps must be >= steps ({self.steps}), got {self.schedule_steps}")
        if self.lr <= 0:
            raise ValueError(f"SFTConfig.lr must be > 0, got {self.lr}")
        if self.stop_accuracy is not None and (self.eval_prompts == 0 or not 0 < self.stop_accuracy <= 1):
            raise ValueError("SFTConfig.stop_accuracy must be in (0, 1] and needs eval_prompts > 0")

    def tiny_model_config(self) -> TinyModelConfig:
        return TinyModelConfig(
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            intermediate_size=self.intermediate_size,
            seed=self.seed,
        )


TINY_CALC_RECIPE: tuple[dict[str, Any], ...] = (
    # 1. the tool-call format and copying the question into the call: a fresh model, a cosine
    #    schedule over 2400 steps, stopped at 1400 (copying forms slowly: held-out accuracy ~14 %)
    {"steps": 1400, "schedule_steps": 2400},
    # 2. more copying on freshly drawn problems; copying "clicks" late in this stage (held-out
    #    accuracy 19 % at step 1200, 27 % at 1600, 70 % at 1800, 66 % at 2000)
    {"steps": 2000, "schedule_steps": 3000, "lr": 2e-3, "seed": 5},
    # 3. a habit for RL to unlearn: 45 % of the traces call the calculator, the rest answer at
    #    once; stopped while the model calls its tool on ~40 % of problems (held-out accuracy ~20 %)
    {"steps": 150, "schedule_steps": 200, "lr": 1e-3, "warmup_steps": 10, "tool_call_share": 0.45, "seed": 7},
)
"""The stages that built ``data/assets/tiny-calc`` (``rallyrl sft --recipe tiny-calc``), each
starting from the last checkpoint of the one before; the fields not named are SFTConfig's defaults."""

RECIPES = {"tiny-calc": TINY_CALC_RECIPE}


EVAL_ROLLOUT = RolloutConfig(max_turns=3, max_new_tokens=128, temperature=0.0)
"""How held-out problems are rolled out: greedy, at most 3 turns of 128 tokens (a calc call is 67-76)."""


# ---------------------------------------------------------------------------------------------
# Examples: conversations and trajectories -> token ids with a loss mask


@dataclass
class Example:
    """One training sequence: token ids and a mask that is 1 on the tokens trained on."""

    input_ids: list[int]
    loss_mask: list[int]


def calc_chat(tokenizer: PreTrainedTokenizerBase) -> tuple[ChatTokenizer, dict[str, BaseTool]]:
    """The chat tokenizer and tools of a default rollout (the calculator), so SFT sees the same prompt."""
    tools = build_tools(DEFAULT_TOOLS)
    return ChatTokenizer(tokenizer, [tool.schema for tool in tools.values()]), tools


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
        prompt = trajectory["prompt_ids"]
        examples.append(Example(prompt + trajectory["response_ids"], [0] * len(prompt) + trajectory["loss_mask"]))
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


def collate(examples: list[Example], pad_token_id: int, min_shared_prefix: int = 32) -> Batch:
    """Pad on the right; find the prefix all rows share (the system prompt, for calc traces)."""
    length = max(len(e.input_ids) for e in examples)
    input_ids = torch.full((len(examples), length), pad_token_id, dtype=torch.long)
    loss_mask = torch.zeros((len(examples), length), dtype=torch.long)
    for row, example in enumerate(examples):
        input_ids[row, : len(example.input_ids)] = torch.tensor(example.input_ids)
        loss_mask[row, : len(example.loss_mask)] = torch.tensor(example.loss_mask)
    shared = shared_prefix_length(examples)
    return Batch(input_ids, loss_mask, shared if shared >= min_shared_prefix and len(examples) > 1 else 0)


def shared_prefix_length(examples: list[Example]) -> int:
    """Tokens ``0..p-1`` all rows share, with no row trained on any token ``1..p``.

    Logits at positions below ``p`` predict tokens ``1..p``, so a prefix computed apart (with
    no logits kept) must end before every row's first trained token.
    """
    first = examples[0].input_ids
    limit = min(len(e.input_ids) for e in examples) - 1
    for e in examples:
        trained = [i for i, m in enumerate(e.loss_mask) if m]
        limit = min(limit, (trained[0] if trained else len(e.loss_mask)) - 1)
    p = 0
    while p < limit and all(e.input_ids[p] == first[p] for e in examples):
        p += 1
    return max(p, 0)


def masked_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the tokens where ``mask`` is 1 (a token mean over the whole batch)."""
    losses = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
    mask = mask.flatten().to(losses.dtype)
    return (losses * mask).sum() / mask.sum().clamp(min=1)


def sft_loss(model: PreTrainedModel, batch: Batch) -> torch.Tensor:
    """Next-token cross-entropy on the trained tokens of a batch.

    With a shared prefix, the prefix is run once (batch 1) and its keys and values are repeated
    for every row: the same result as running every row in full, at a fraction of the cost when
    the rows share a long system prompt. Right padding needs no attention mask: causal attention
    keeps real tokens from seeing the padding after them, and padded positions carry no loss.
    """
    ids, p = batch.input_ids, batch.shared_prefix
    if p:
        cache = model(input_ids=ids[:1, :p], use_cache=True).past_key_values
        cache.batch_repeat_interleave(ids.shape[0])
        logits = model(input_ids=ids[:, p:], past_key_values=cache, use_cache=True).logits
    else:
        logits = model(input_ids=ids, use_cache=False).logits
    return masked_cross_entropy(logits[:, :-1], ids[:, p + 1 :], batch.loss_mask[:, p + 1 :])


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


# ---------------------------------------------------------------------------------------------
# Held-out evaluation and checkpoints


async def evaluate_greedy(
    model_dir: str | Path, chat: ChatTokenizer, tools: dict[str, BaseTool], num_prompts: int, seed: int, device: str
) -> dict[str, Any]:
    """Greedy rollouts of ``num_prompts`` calc problems (seed ``seed``) through the local engine."""
    records = make_calc_records(num_prompts, seed)
    engine_config = LocalEngineConfig(
        max_batch_size=num_prompts, max_model_len=EVAL_ROLLOUT.max_model_len, device=device, seed=seed
    )
    started = time.monotonic()
    async with LocalEngine.from_pretrained(model_dir, engine_config) as engine:
        runner = RolloutRunner(engine, chat, tools, EVAL_ROLLOUT, max_concurrency=num_prompts, progress=False)
        result = await runner.run(records)
    metrics = eval_metrics(result.requests)
    metrics["eval_s"] = round(time.monotonic() - started, 2)
    return metrics


def eval_metrics(requests: list[AsyncRolloutRequest]) -> dict[str, Any]:
    """Accuracy, how often the model calls the tool, how well-formed and how exact its calls are."""
    count = len(requests) or 1
    calls = [call for r in requests for call in r.tool_calls]

    def exact(r: AsyncRolloutRequest) -> bool:
        expression = r.extra.get("expression")
        return bool(r.tool_calls) and r.tool_calls[0].arguments == {"expression": spaced_expression(expression or "")}

    sample = requests[0].messages if requests else []
    return {
        "accuracy": sum(r.rewards.answer == 1.0 for r in requests) / count,
        "tool_call_rate": sum(bool(r.tool_calls) for r in requests) / count,
        "well_formed_calls": sum(call.error is None for call in calls) / len(calls) if calls else None,
        "exact_calls": sum(exact(r) for r in requests) / count,
        "mean_turns": sum(r.metrics.turns for r in requests) / count,
        "consistency_failures": sum(r.consistency_diff is not None for r in requests),
        "sample": [m["content"] for m in sample if m["role"] in ("assistant", "tool")],
    }


def save_checkpoint(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, directory: str | Path) -> Path:
    """Write a Hugging Face model directory (weights, configs, tokenizer) atomically: temp dir, then rename."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.with_name(f".{directory.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    for file in tmp.iterdir():  # some files come out of a private temp file (mode 600)
        file.chmod(0o644)
    return _replace_dir(tmp, directory)


def copy_model_dir(source: str | Path, directory: str | Path) -> Path:
    """Replace ``directory`` with a copy of the model directory ``source`` (atomically, as a checkpoint is)."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.with_name(f".{directory.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    return _replace_dir(tmp, directory)


def _replace_dir(tmp: Path, directory: Path) -> Path:
    """Move the finished ``tmp`` to ``directory``, replacing an older one with two renames."""
    if directory.exists():
        old = directory.with_name(f".{directory.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(directory, old)
        os.replace(tmp, directory)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, directory)
    return directory


def load_model(config: SFTConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The starting model and tokenizer: ``config.model`` from disk, or a fresh tiny Qwen2."""
    if config.model is None:
        tokenizer = build_char_tokenizer()
        return build_tiny_model(tokenizer, config.tiny_model_config()), tokenizer
    path = Path(config.model)
    if not (path / "config.json").is_file():
        raise ValueError(f"model {path}: not a Hugging Face model directory (no config.json)")
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    return model, load_tokenizer(path)


# ---------------------------------------------------------------------------------------------
# The run


def run_sft(config: SFTConfig, console: Console | None = None) -> list[dict[str, Any]]:
    """Train, evaluating and checkpointing every ``eval_every`` steps; returns the evaluation history."""
    console = console or Console(stderr=True)
    started = time.monotonic()
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    torch.manual_seed(config.seed)
    accelerator = Accelerator(cpu=config.device == "cpu")
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)

    # model, tokenizer and the rollout's chat layout
    model, tokenizer = load_model(config)
    model.train()
    chat, tools = calc_chat(tokenizer)
    examples = load_examples(config, chat)
    num_params = sum(p.numel() for p in model.parameters())
    console.print(
        f"sft: {num_params / 1e6:.2f} M parameters, {len(examples)} examples, "
        f"{config.steps} steps of {config.batch_size}, lr {config.lr:g}, out {out}"
    )

    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(optimizer, config.warmup_steps, config.schedule_steps or config.steps)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    data = batches(examples, config.batch_size, config.seed)

    log = (out / "sft_log.jsonl").open("wb")
    log.write(orjson.dumps({"kind": "config", **asdict(config), "num_params": num_params}) + b"\n")
    history: list[dict[str, Any]] = []
    recent: list[float] = []
    progress = _progress_bar(console) if config.progress else None
    task = progress.add_task("sft", total=config.steps, loss=math.nan, accuracy="-") if progress else None
    try:
        if progress is not None:
            progress.start()
        for step in range(1, config.steps + 1):
            # one optimizer step on a batch
            batch = collate(next(data), tokenizer.pad_token_id).to(accelerator.device)
            loss = sft_loss(model, batch)
            accelerator.backward(loss)
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), config.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            recent.append(loss.item())

            # log the training loss
            if step % config.log_every == 0 or step == config.steps:
                entry = {
                    "kind": "train",
                    "step": step,
                    "loss": sum(recent) / len(recent),
                    "lr": scheduler.get_last_lr()[0],
                    "grad_norm": float(grad_norm),
                    "elapsed_s": round(time.monotonic() - started, 1),
                }
                recent = []
                log.write(orjson.dumps(entry) + b"\n")
                log.flush()
                if progress is not None:
                    progress.update(task, loss=entry["loss"])
                console.print(
                    f"step {step:>5}  loss {entry['loss']:.4f}  lr {entry['lr']:.2e}  grad {entry['grad_norm']:.2f}"
                )

            # checkpoint and held-out greedy evaluation
            if step % config.eval_every == 0 or step == config.steps:
                with _no_transformers_progress_bars():
                    checkpoint = save_checkpoint(accelerator.unwrap_model(model), tokenizer, out / f"step-{step}")
                entry = {"kind": "eval", "step": step, "checkpoint": str(checkpoint)}
                if config.eval_prompts:
                    device = "cpu" if config.device == "cpu" else str(accelerator.device)
                    with _no_transformers_progress_bars():
                        metrics = asyncio.run(
                            evaluate_greedy(checkpoint, chat, tools, config.eval_prompts, config.eval_seed, device)
                        )
                    entry.update(metrics)
                    if progress is not None:
                        progress.update(task, accuracy=f"{metrics['accuracy']:.0%}")
                    well_formed = metrics["well_formed_calls"]
                    console.print(
                        f"step {step:>5}  held-out accuracy {metrics['accuracy']:.1%}  "
                        f"tool calls {metrics['tool_call_rate']:.0%} "
                        f"(well-formed {'-' if well_formed is None else f'{well_formed:.0%}'}, "
                        f"exact {metrics['exact_calls']:.0%})  [{metrics['eval_s']:.0f} s]"
                    )
                entry["elapsed_s"] = round(time.monotonic() - started, 1)
                history.append(entry)
                log.write(orjson.dumps(entry) + b"\n")
                log.flush()
                if config.stop_accuracy is not None and entry["accuracy"] >= config.stop_accuracy:
                    console.print(f"step {step:>5}  held-out accuracy reached {config.stop_accuracy:.0%}: stopping")
                    break
            if progress is not None:
                progress.update(task, advance=1)
    finally:
        if progress is not None:
            progress.stop()
        log.close()
    if config.export and history:
        exported = copy_model_dir(history[-1]["checkpoint"], config.export)
        console.print(f"exported {history[-1]['checkpoint']} to {exported}")
    return history


def run_recipe(
    name: str, out: str | Path, export: str | Path | None = None, console: Console | None = None, **settings: Any
) -> list[dict[str, Any]]:
    """Run the stages of ``RECIPES[name]`` into ``out/stage-N``, each from the last checkpoint of
    the one before; ``settings`` (evaluation, device, progress) apply to every stage. Returns the
    last stage's history; ``export`` receives its last checkpoint."""
    if name not in RECIPES:
        raise ValueError(f"unknown SFT recipe {name!r}; known recipes: {', '.join(sorted(RECIPES))}")
    console = console or Console(stderr=True)
    model: str | None = settings.pop("model", None)
    history: list[dict[str, Any]] = []
    for number, stage in enumerate(RECIPES[name], start=1):
        console.print(f"[bold]recipe {name}: stage {number} of {len(RECIPES[name])}[/] {stage}")
        config = SFTConfig(**{**settings, **stage, "model": model, "out": str(Path(out) / f"stage-{number}")})
        history = run_sft(config, console)
        model = history[-1]["checkpoint"]
    if export is not None and model is not None:
        console.print(f"exported {model} to {copy_model_dir(model, export)}")
    return history


@contextlib.contextmanager
def _no_transformers_progress_bars():
    """Keep transformers' per-file save/load bars out of the SFT progress display."""
    enabled = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            transformers_logging.enable_progress_bar()


def _progress_bar(console: Console) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.4f}"),
        TextColumn("held-out acc {task.fields[accuracy]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
    )
