"""Supervised fine-tuning on tool-calling conversations, in the exact token layout of rollouts.

Read ``run_sft`` top to bottom: model and tokenizer, examples, optimizer and schedule, then the
loop (batch, masked loss, clip, step, log) with a held-out greedy evaluation through the real
rollout path (local engine + runner + calculator) and a checkpoint at every ``eval_every`` steps.

Examples are tokenised in the rollout layout (``trainer/sft_data.py``); checkpoints are model
directories (``trainer/checkpoints.py``).

``TINY_CALC_RECIPE`` lists the stages that built the embedded model in ``data/assets/tiny-calc``.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import orjson
import torch
from accelerate import Accelerator
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase, get_cosine_schedule_with_warmup

from data.line_files import LineAppender
from data.model_padding import pad_model_dir
from data.synthetic import make_calc_records, spaced_expression
from data.tiny_model import TinyModelConfig, build_char_tokenizer, build_tiny_model
from rollout.api import resolve_model, set_threads
from rollout.config import RolloutConfig
from rollout.engines.adapter_dirs import merged_model_dir
from rollout.engines.config import LocalEngineConfig
from rollout.engines.local import LocalEngine
from rollout.request import AsyncRolloutRequest
from rollout.runner import RolloutRunner
from rollout.stats import accuracy
from rollout.tokens import ChatTokenizer, load_tokenizer
from tools.base import BaseTool
from trainer.checkpoints import quiet_transformers, save_adapter_dir, save_model_dir
from trainer.config import SFTConfig
from trainer.lora import apply_lora
from trainer.policy_model import PolicyModel, enable_checkpointing, wants_checkpointing
from trainer.sft_data import Batch, Example, batches, calc_chat, collate, load_examples, tokenize_conversation
from trainer.trackers import accelerator_options, log_to_trackers, run_trackers

__all__ = ["RECIPES", "Batch", "Example", "SFTConfig", "calc_chat", "collate", "load_examples", "run_recipe", "run_sft",
           "sft_loss", "tokenize_conversation"]  # fmt: skip


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


def sft_loss(model: PreTrainedModel | PolicyModel, batch: Batch, chunk_tokens: int = 1024) -> torch.Tensor:
    """Mean next-token cross-entropy over the trained tokens of a batch (a token mean), from the
    final hidden states in chunks through the LM head (``trainer/logprobs.py``): no ``[tokens,
    vocabulary]`` tensor outlives its chunk.

    With a shared prefix, the prefix is run once (batch 1) and its keys and values are repeated
    for every row: the same result as running every row in full, at a fraction of the cost when
    the rows share a long system prompt. Right padding needs no attention mask: causal attention
    keeps real tokens from seeing the padding after them, and padded positions carry no loss.
    """
    policy = model if isinstance(model, PolicyModel) or hasattr(model, "module") else PolicyModel(model)
    ids, p = batch.input_ids, batch.shared_prefix
    length = ids.shape[1]
    trained = batch.loss_mask[:, p + 1 :].bool()  # row r, column t: token p + 1 + t, predicted from p + t
    row_index, column = trained.nonzero(as_tuple=True)
    positions = row_index * (length - p) + column
    targets = ids[:, p + 1 :][trained]
    logprobs, _ = policy(ids, None, None, positions, targets, chunk_tokens=chunk_tokens, shared_prefix=p)
    return -logprobs.sum() / max(int(trained.sum()), 1)


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
        "accuracy": accuracy(requests) or 0.0,
        "tool_call_rate": sum(bool(r.tool_calls) for r in requests) / count,
        "well_formed_calls": sum(call.error is None for call in calls) / len(calls) if calls else None,
        "exact_calls": sum(exact(r) for r in requests) / count,
        "mean_turns": sum(r.metrics.turns for r in requests) / count,
        "consistency_failures": sum(r.consistency_diff is not None for r in requests),
        "sample": [m["content"] for m in sample if m["role"] in ("assistant", "tool")],
    }


def tiny_model_config(config: SFTConfig) -> TinyModelConfig:
    """The sizes of a fresh tiny Qwen2 (``model: null``)."""
    return TinyModelConfig(hidden_size=config.hidden_size, num_layers=config.num_layers, num_heads=config.num_heads,
                           num_kv_heads=config.num_kv_heads, intermediate_size=config.intermediate_size,
                           seed=config.seed)  # fmt: skip


def load_model(config: SFTConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The starting model and tokenizer: ``config.model`` from disk, or a fresh tiny Qwen2."""
    if config.model is None:
        tokenizer = build_char_tokenizer()
        return build_tiny_model(tokenizer, tiny_model_config(config)), tokenizer
    path = resolve_model(config.model)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    return model, load_tokenizer(path)


# ---------------------------------------------------------------------------------------------
# The run


def run_sft(config: SFTConfig, console: Console | None = None) -> list[dict[str, Any]]:
    """Train, evaluating and checkpointing every ``eval_every`` steps; returns the evaluation history."""
    console = console or Console(stderr=True)
    started = time.monotonic()
    set_threads(config.threads)
    torch.manual_seed(config.seed)
    accelerator = Accelerator(cpu=config.device == "cpu", **accelerator_options(config.log_with, config.out))
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)

    # model, tokenizer and the rollout's chat layout
    lm, tokenizer = load_model(config)
    peft, base_dir = None, None
    if config.lora is not None:  # only the adapter trains; checkpoints are adapter directories
        if config.model is None:
            raise ValueError("lora: needs `model`, the base model directory (a fresh tiny model has nothing to adapt)")
        base_dir = resolve_model(config.model)
        lm = lm.to(getattr(torch, config.lora.base_dtype))
        peft = apply_lora(lm, config.lora)
    checkpointing = wants_checkpointing(config.gradient_checkpointing, lm)
    if checkpointing:
        enable_checkpointing(lm)
    model = PolicyModel(lm)
    model.train()
    chat, tools = calc_chat(tokenizer)
    examples = load_examples(config, chat)
    num_params = sum(p.numel() for p in model.parameters())
    adapter = sum(p.numel() for p in model.parameters() if p.requires_grad)
    trained = "" if peft is None else f" ({adapter:,} in the adapter)"
    console.print(
        f"sft: {num_params / 1e6:.2f} M parameters{trained}, {len(examples)} examples, "
        f"{config.steps} steps of {config.batch_size}, lr {config.lr:g}, out {out}"
    )

    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=config.lr, weight_decay=config.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(optimizer, config.warmup_steps, config.schedule_steps or config.steps)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    data = batches(examples, config.batch_size, config.seed)

    log = LineAppender(out / "sft_log.jsonl", append=False, what="log line")
    log.write(orjson.dumps({"kind": "config", **asdict(config), "num_params": num_params}) + b"\n")
    history: list[dict[str, Any]] = []
    recent: list[float] = []
    progress = _progress_bar(console) if config.progress else None
    task = progress.add_task("sft", total=config.steps, loss=math.nan, accuracy="-") if progress else None
    tracking = contextlib.ExitStack()  # log_with: train/ and eval/ entries to Accelerate's trackers
    try:
        tracking.enter_context(run_trackers(accelerator, out, asdict(config), console.print))
        if progress is not None:
            progress.start()
        for step in range(1, config.steps + 1):
            # one optimizer step on a batch
            batch = collate(next(data), tokenizer.pad_token_id).to(accelerator.device)
            if checkpointing:  # recomputed layers cannot share a cached prefix: rows run in full
                batch.shared_prefix = 0
            loss = sft_loss(model, batch, config.logprob_chunk_tokens)
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
                log_to_trackers(accelerator, _family(entry, "train"))
                if progress is not None:
                    progress.update(task, loss=entry["loss"])
                console.print(
                    f"step {step:>5}  loss {entry['loss']:.4f}  lr {entry['lr']:.2e}  grad {entry['grad_norm']:.2f}"
                )

            # checkpoint and held-out greedy evaluation
            if step % config.eval_every == 0 or step == config.steps:
                with quiet_transformers():
                    if peft is not None:
                        checkpoint = save_adapter_dir(peft, tokenizer, out / f"step-{step}", base_dir)
                    else:
                        checkpoint = save_model_dir(lm, tokenizer, out / f"step-{step}")
                entry = {"kind": "eval", "step": step, "checkpoint": str(checkpoint)}
                if peft is not None:  # the engine runs the base with the adapter merged
                    checkpoint = merged_model_dir(checkpoint)
                if config.eval_prompts:
                    device = "cpu" if config.device == "cpu" else str(accelerator.device)
                    with quiet_transformers():
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
                log_to_trackers(accelerator, _family(entry, "eval"))
                if config.stop_accuracy is not None and entry["accuracy"] >= config.stop_accuracy:
                    console.print(f"step {step:>5}  held-out accuracy reached {config.stop_accuracy:.0%}: stopping")
                    break
            if progress is not None:
                progress.update(task, advance=1)
    finally:
        if progress is not None:
            progress.stop()
        log.close()
        tracking.close()
    if config.export and history:
        last = history[-1]["checkpoint"]
        exported = pad_model_dir(merged_model_dir(last) if peft else last, config.export, config.export_head_dim)
        console.print(f"exported {history[-1]['checkpoint']} to {exported}")
    return history


def _family(entry: dict[str, Any], family: str) -> dict[str, Any]:
    """A log entry's values as ``family/...`` metrics at its step (for the trackers)."""
    return {"step": entry["step"], **{f"{family}/{k}": v for k, v in entry.items() if k not in ("kind", "step")}}


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
        console.print(f"exported {model} to {pad_model_dir(model, export, config.export_head_dim)}")
    return history


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
