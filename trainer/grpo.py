"""GRPO on Accelerate, one step read top to bottom in ``GRPOTrainer.step``:

    rollout -> rewards -> advantages -> ppo_epochs x (micro-batches -> backward) -> clip -> step -> sync -> log

Data parallel with ``accelerate launch``: every process rolls out its share of the step's
prompts (whole groups), and the loss is normalised by global counts so that N processes make
the same update as one process on the same global batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import json
import math
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from transformers import AutoModelForCausalLM, get_constant_schedule_with_warmup

from data.reward_fns import reward_for_records
from data.schema import Record, load_records
from data.synthetic import make_task
from data.tiny_model import EMBEDDED_MODEL
from rollout.engines.base import Engine
from rollout.engines.local import LocalEngine, LocalEngineConfig
from rollout.engines.pool import connect
from rollout.loop import RewardFn, RolloutConfig, default_reward
from rollout.request import AsyncRolloutRequest
from rollout.runner import RolloutRunner
from rollout.tokens import ChatTokenizer, load_tokenizer
from tools.registry import DEFAULT_TOOLS, build_tools, load_tools
from trainer.advantages import (
    broadcast_advantages,
    filter_uniform_groups,
    per_step_advantages,
    present_mask,
    trajectory_advantages,
)
from trainer.batch import Sample, TrainBatch, collate, micro_batches, step_rewards, step_samples, trajectory_sample
from trainer.config import GRPOConfig
from trainer.losses import entropy_from_logits, policy_loss, token_logprobs, truncated_is_weights
from trainer.weight_sync import loads_from_disk, sync_weights


@dataclass
class TrainerState:
    """What a checkpoint needs beyond model, optimizer, scheduler and RNG (Accelerate saves those)."""

    step: int = 0
    data_position: int = 0


class PromptStream:
    """Prompts in a fixed, seeded order; ``take(n)`` continues where the last call stopped."""

    def __init__(self, config: GRPOConfig):
        if config.data:
            self.records = load_records(config.data)
            random.Random(config.seed).shuffle(self.records)
        else:
            per_step = math.ceil(config.prompts_per_step * (config.oversample if config.filter_groups else 1))
            self.records = make_task(config.task, per_step * config.steps, config.seed)
        self.position = 0

    def take(self, count: int) -> list[Record]:
        taken = [self.records[(self.position + i) % len(self.records)] for i in range(count)]
        self.position += count
        return taken


class GRPOTrainer:
    """Owns the policy, its optimizer, the rollout engine and the run directory."""

    def __init__(
        self,
        config: GRPOConfig,
        engine: Engine | None = None,
        reward_fn: RewardFn = default_reward,
        console: Console | None = None,
    ):
        self.config = config
        if config.reward and reward_fn is default_reward:
            reward_fn = reward_for_records(config.reward)
        self.reward_fn = reward_fn
        self.console = console or Console(stderr=True, soft_wrap=True)
        # cpu=True without CUDA: under torchrun (`accelerate launch --multi_gpu`) that gives gloo ranks
        cuda = torch.cuda.is_available()
        self.accelerator = Accelerator(cpu=not cuda, mixed_precision="bf16" if cuda else "no")
        set_seed(config.seed, device_specific=True)
        self.out = Path(config.out)
        model_dir = Path(config.model) if config.model else EMBEDDED_MODEL
        if not (model_dir / "config.json").is_file():
            raise ValueError(f"{model_dir}: not a Hugging Face model directory (no config.json)")
        self.model_dir = model_dir
        self.tokenizer = load_tokenizer(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
        self.reference = None
        if config.kl_beta > 0:  # a frozen copy of the initial policy; none when beta is 0
            self.reference = copy.deepcopy(model).eval().requires_grad_(False).to(self.accelerator.device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        scheduler = get_constant_schedule_with_warmup(optimizer, config.warmup_steps)
        self.model, self.optimizer, self.scheduler = self.accelerator.prepare(model, optimizer, scheduler)
        self.tools = load_tools(config.tools) if config.tools else build_tools(DEFAULT_TOOLS)
        self.chat = ChatTokenizer(self.tokenizer, [tool.schema for tool in self.tools.values()])
        self.rollout_config = RolloutConfig(
            max_turns=config.max_turns,
            max_new_tokens=config.max_new_tokens,
            max_model_len=config.max_model_len,
            temperature=config.temperature,
            top_p=config.top_p,
        )
        self.engine = engine
        self.prompts = PromptStream(config)
        self.state = TrainerState()

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    def policy_state_dict(self) -> dict[str, torch.Tensor]:
        return self.accelerator.unwrap_model(self.model).state_dict()

    def local_engine(self) -> LocalEngine:
        """The embedded engine on its own copy of the policy (synced in-process after each step)."""
        engine_model = copy.deepcopy(self.accelerator.unwrap_model(self.model)).eval()
        engine_config = LocalEngineConfig(
            max_batch_size=self.config.max_concurrency,
            max_model_len=self.config.max_model_len,
            device=self.config.device,
            seed=self.config.seed + 1000 * self.accelerator.process_index,
        )
        return LocalEngine(engine_model, engine_config)

    # ----- one step ----------------------------------------------------------------------------

    async def step(self, runner: RolloutRunner) -> dict[str, Any]:
        """One GRPO step; returns its metrics (the same on every process)."""
        config, accelerator = self.config, self.accelerator

        # 1. rollout: the step's prompts (oversampled when filtering), this process's share
        started = time.monotonic()
        wanted = config.prompts_per_step
        drawn = math.ceil(wanted * config.oversample) if config.filter_groups else wanted
        prompts = self.prompts.take(drawn)
        mine = list(range(accelerator.process_index, drawn, accelerator.num_processes))
        # group ids are global prompt positions in this step; sampling seeds follow them, so a
        # step's rollouts do not depend on how prompts are split or batched
        runner.config = dataclasses.replace(self.rollout_config, seed=config.seed * 100_003 + self.state.step)
        result = await runner.run([prompts[i] for i in mine], config.samples_per_prompt, prompt_indices=mine)
        requests = result.requests
        rollout_s = time.monotonic() - started

        # 2. advantages (groups live on one process, so they are computed locally)
        samples, group_stats = self.build_samples(requests, wanted)

        # 3. update: ppo_epochs passes, gradients accumulated over micro-batches
        started = time.monotonic()
        update = self.update(samples)
        train_s = time.monotonic() - started

        # 4. sync the engine (servers: save, then pause -> load -> continue)
        started = time.monotonic()
        if self.engine is not None:
            await self.sync(self.engine, self.state.step + 1)
        sync_s = time.monotonic() - started

        # 5. log
        rollout = self.rollout_metrics(requests, policy_version=self.state.step)
        self.state.step += 1
        self.state.data_position = self.prompts.position
        metrics = {
            "step": self.state.step,
            **rollout,
            **group_stats,
            **update,
            "lr": self.scheduler.get_last_lr()[0],
            "rollout_s": rollout_s,
            "train_s": train_s,
            "sync_s": sync_s,
            "rollout_tokens_per_s": rollout["generated_tokens"] / rollout_s if rollout_s > 0 else 0.0,
            "train_tokens_per_s": update["train_tokens"] / train_s if train_s > 0 else 0.0,
        }
        return metrics

    def build_samples(self, requests: list[AsyncRolloutRequest], wanted_groups: int) -> tuple[list[Sample], dict]:
        """Rewards -> advantages -> training samples; uniform groups dropped when filtering. Requests
        whose reward is missing (a failed judgment) are left out of their group and get no sample."""
        config = self.config
        present = present_mask([r.rewards.final for r in requests])
        missing = len(requests) - int(present.sum())
        requests = [r for r, p in zip(requests, present.tolist(), strict=True) if p]
        rewards = torch.tensor([r.rewards.final for r in requests], dtype=torch.float32)
        groups = torch.tensor([r.prompt_index for r in requests], dtype=torch.long)
        keep = torch.ones(len(requests), dtype=torch.bool)
        stats: dict[str, Any] = {"solve_all": 0, "solve_none": 0}
        if config.filter_groups and requests:
            keep, filtered = filter_uniform_groups(rewards, groups)
            stats = {"solve_all": filtered.solve_all, "solve_none": filtered.solve_none}
        stats["rewards_missing"] = missing
        stats = self._sum_across_processes(stats)
        kept_groups = sorted({int(g) for g, k in zip(groups, keep, strict=True) if k})
        # keep at most this process's share of the wanted groups, in draw order
        share = len(range(self.accelerator.process_index, wanted_groups, self.accelerator.num_processes))
        chosen = set(kept_groups[:share])
        kept = [r for r in requests if r.prompt_index in chosen]
        stats["groups_trained"] = self._sum_across_processes({"n": len(chosen)})["n"]
        if not kept:
            return [], stats

        rewards = torch.tensor([r.rewards.final for r in kept], dtype=torch.float32)
        groups = torch.tensor([r.prompt_index for r in kept], dtype=torch.long)
        samples: list[Sample] = []
        if config.advantage_mode == "per_step":
            per_step = per_step_advantages(
                [step_rewards(r) for r in kept], groups.tolist(), config.gamma, config.advantage_scale
            )
            for i, (request, advantages) in enumerate(zip(kept, per_step, strict=True)):
                samples += step_samples(request, i, advantages)
        else:
            advantages = trajectory_advantages(rewards, groups, config.advantage_scale)
            if config.advantage_mode == "trajectory":
                pairs = enumerate(zip(kept, advantages.tolist(), strict=True))
                samples = [trajectory_sample(request, i, advantage) for i, (request, advantage) in pairs]
            else:  # broadcast: every step sample carries its trajectory's advantage
                steps = [len(step_rewards(r)) for r in kept]
                flat = broadcast_advantages(advantages, steps).tolist()
                position = 0
                for i, (request, count) in enumerate(zip(kept, steps, strict=True)):
                    samples += step_samples(request, i, flat[position : position + count])
                    position += count
        return samples, stats

    def update(self, samples: list[Sample]) -> dict[str, float]:
        """ppo_epochs optimizer steps over ``samples``; the loss is normalised by global counts."""
        config, accelerator = self.config, self.accelerator
        self.model.train()
        chunks = micro_batches(samples, config.micro_batch_size)
        batches = [collate(chunk, self.tokenizer.pad_token_id or 0).to(accelerator.device) for chunk in chunks]
        local_tokens = sum(float(b.loss_mask[:, 1:].sum()) for b in batches)
        local_seqs = sum(int((b.loss_mask[:, 1:].sum(1) > 0).sum()) for b in batches)
        local_rows = sum(len(b) for b in batches)
        counts = self._sum_across_processes({"tokens": local_tokens, "seqs": local_seqs, "rows": local_rows})
        totals = {"loss": 0.0, "pg_loss": 0.0, "kl": 0.0, "clip_fraction": 0.0, "entropy": 0.0, "approx_kl": 0.0}
        if counts["tokens"] == 0:  # every group filtered out everywhere: no signal, so no optimizer step
            self.model.eval()
            return {**totals, "grad_norm": 0.0, "train_tokens": 0.0, "train_sequences": 0, "skipped_update": 1}
        longest = self._max_across_processes(max((b.input_ids.shape[1] for b in batches), default=1))
        rows = counts["rows"]
        normaliser = {  # the global denominator of each aggregation
            "token-mean": max(counts["tokens"], 1.0),
            "seq-mean-token-mean": max(counts["seqs"], 1.0),
            "seq-mean-token-sum-norm": max(rows, 1.0) * (config.loss_constant or longest),
        }[config.loss_aggregation]
        old = None
        if config.ppo_epochs > 1:  # the policy before this step's updates
            with torch.no_grad():
                old = [self.logprobs(b)[0] for b in batches]

        grad_norms = []
        for _ in range(config.ppo_epochs):
            for i, batch in enumerate(batches or [None]):
                last = i == max(len(batches), 1) - 1
                context = accelerator.no_sync(self.model) if not last else contextlib.nullcontext()
                with context:
                    if batch is None:  # nothing to train on here: join the gradient sync with zeros
                        loss = sum(p.sum() * 0.0 for p in self.model.parameters())
                        accelerator.backward(loss)
                        continue
                    out = self.micro_batch_loss(batch, None if old is None else old[i], normaliser)
                    accelerator.backward(out.pop("scaled_loss"))
                weight = float(batch.loss_mask[:, 1:].sum())
                for key in totals:
                    totals[key] += out[key] * weight
            grad_norm = accelerator.clip_grad_norm_(self.model.parameters(), config.max_grad_norm)
            grad_norms.append(float(grad_norm))
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.model.eval()
        summed = self._sum_across_processes({k: v for k, v in totals.items()})
        tokens = max(counts["tokens"], 1.0) * config.ppo_epochs
        metrics = {key: value / tokens for key, value in summed.items()}
        metrics["grad_norm"] = sum(grad_norms) / len(grad_norms)
        metrics["train_tokens"] = counts["tokens"] * config.ppo_epochs
        metrics["train_sequences"] = counts["seqs"]
        metrics["skipped_update"] = 0
        return metrics

    def logprobs(self, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token logprobs of ``input_ids[:, 1:]`` under the policy (at the rollout temperature),
        and the logits they came from."""
        logits = self.model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
        ).logits[:, :-1]
        if self.config.temperature > 0:
            logits = logits / self.config.temperature
        return token_logprobs(logits.float(), batch.input_ids[:, 1:]), logits

    def micro_batch_loss(self, batch: TrainBatch, old: torch.Tensor | None, normaliser: float) -> dict[str, Any]:
        config = self.config
        mask = batch.loss_mask[:, 1:]
        logprobs, logits = self.logprobs(batch)
        old_logprobs = logprobs.detach() if old is None else old
        reference = None
        if self.reference is not None:
            with torch.no_grad():
                ref_logits = self.reference(
                    input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
                ).logits[:, :-1]
                if config.temperature > 0:
                    ref_logits = ref_logits / config.temperature
                reference = token_logprobs(ref_logits.float(), batch.input_ids[:, 1:])
        is_weights = None
        if config.tis_cap is not None:
            is_weights = truncated_is_weights(old_logprobs, batch.engine_logprobs[:, 1:], config.tis_cap) * mask
        with torch.no_grad():
            entropy = entropy_from_logits(logits.float())
        drgrpo = config.loss_aggregation == "seq-mean-token-sum-norm"
        out = policy_loss(
            logprobs,
            old_logprobs,
            batch.advantages,
            mask,
            eps_low=config.eps_low,
            eps_high=config.eps_high,
            aggregation=config.loss_aggregation,
            agg_constant=1.0 if drgrpo else None,
            ref_logprobs=reference,
            kl_beta=config.kl_beta,
            is_weights=is_weights,
            entropy=entropy,
        )
        # the micro-batch's aggregate times its own count is its un-normalised share; divided by
        # the global count it becomes its share of the global loss. DDP averages gradients over
        # processes, hence the factor num_processes.
        own_count = {
            "token-mean": float(mask.sum()),
            "seq-mean-token-mean": float((mask.sum(1) > 0).sum()),
            "seq-mean-token-sum-norm": float(len(batch)),
        }[config.loss_aggregation]
        scale = own_count / normaliser * self.accelerator.num_processes
        return {
            "scaled_loss": out.loss * scale,
            "loss": float(out.loss.detach()),
            "pg_loss": out.pg_loss,
            "kl": out.kl,
            "clip_fraction": out.clip_fraction,
            "entropy": out.entropy or 0.0,
            "approx_kl": out.approx_kl,
        }

    # ----- helpers across processes ---------------------------------------------------------------

    def _sum_across_processes(self, values: dict[str, float]) -> dict[str, float]:
        if self.accelerator.num_processes == 1:
            return dict(values)
        keys = sorted(values)
        tensor = torch.tensor([float(values[k]) for k in keys], device=self.accelerator.device)
        summed = self.accelerator.reduce(tensor, reduction="sum")
        return {k: float(v) for k, v in zip(keys, summed.tolist(), strict=True)}

    def _max_across_processes(self, value: int) -> int:
        if self.accelerator.num_processes == 1:
            return value
        gathered = self.accelerator.gather(torch.tensor([value], device=self.accelerator.device))
        return int(gathered.max())

    async def sync(self, engine: Engine, version: int) -> None:
        """The policy's weights to ``engine`` as ``version``. Servers are shared by every process,
        so the main process saves and syncs them while the others wait."""
        policy = self.accelerator.unwrap_model(self.model)
        if not loads_from_disk(engine):
            await sync_weights(engine, policy, self.tokenizer, self.out / "weights", version)
            return
        if self.is_main:
            await sync_weights(engine, policy, self.tokenizer, self.out / "weights", version)
        self.accelerator.wait_for_everyone()

    def rollout_metrics(self, requests: list[AsyncRolloutRequest], policy_version: int = 0) -> dict[str, float]:
        """Reward mean and std, accuracy, lengths, turns, tool calls, and staleness (the policy
        version minus the weight version that produced each generated token) over every process."""
        gaps = [policy_version - v for r in requests for v in r.weight_versions if v is not None]
        rewards = [r.rewards.final for r in requests if r.rewards.final is not None and not math.isnan(r.rewards.final)]
        sums = self._sum_across_processes(
            {
                "n": len(requests),
                "rewarded": len(rewards),
                "reward": sum(rewards),
                "reward_sq": sum(reward**2 for reward in rewards),
                "graded": sum(r.rewards.answer is not None for r in requests),
                "correct": sum(r.rewards.answer == 1.0 for r in requests),
                "response_length": sum(r.metrics.generated_tokens for r in requests),
                "turns": sum(r.metrics.turns for r in requests),
                "tool_calls": sum(r.metrics.tool_calls for r in requests),
                "tool_errors": sum(r.metrics.tool_errors for r in requests),
                "errors": sum(r.finish_reason is not None and r.finish_reason.value == "error" for r in requests),
                "truncated": sum(r.finish_reason is not None and r.finish_reason.value == "length" for r in requests),
                "stale_sum": sum(gaps),
                "stale_tokens": len(gaps),
            }
        )
        stale_max = self._max_across_processes(max(gaps, default=0))
        n = max(sums["n"], 1.0)
        mean = std = 0.0 if not sums["n"] else math.nan  # reward statistics leave missing rewards out
        if sums["rewarded"]:
            mean = sums["reward"] / sums["rewarded"]
            std = math.sqrt(max(sums["reward_sq"] / sums["rewarded"] - mean**2, 0.0))
        return {
            "trajectories": int(sums["n"]),
            "reward_mean": mean,
            "reward_std": std,
            "rewards_missing": int(sums["n"] - sums["rewarded"]),
            "accuracy": sums["correct"] / sums["graded"] if sums["graded"] else float("nan"),
            "response_length": sums["response_length"] / n,
            "turns": sums["turns"] / n,
            "tool_calls": sums["tool_calls"] / n,
            "tool_errors": sums["tool_errors"] / n,
            "error_rate": sums["errors"] / n,
            "truncated_rate": sums["truncated"] / n,
            "generated_tokens": sums["response_length"],
            "weight_version": policy_version,
            "staleness_mean": sums["stale_sum"] / sums["stale_tokens"] if sums["stale_tokens"] else 0.0,
            "staleness_max": stale_max,
        }

    # ----- the run: steps, logs, checkpoints ---------------------------------------------------------

    async def train(self, resume: bool = False) -> list[dict[str, Any]]:
        """Run ``config.steps`` steps (from the last checkpoint with ``resume``); returns the metrics."""
        config = self.config
        if self.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
        history: list[dict[str, Any]] = []
        if resume:
            history = self.load_checkpoint()
        elif self.is_main and (self.out / "metrics.jsonl").exists():
            (self.out / "metrics.jsonl").unlink()
        owned = self.engine is None
        if owned:
            self.engine = connect(config.engine_urls) if config.engine_urls else self.local_engine()
        engine = self.engine
        async with _maybe_enter(engine, owned):
            if loads_from_disk(engine) or (resume and self.state.step):
                # servers started from any checkpoint of this model get exactly the policy's weights
                await self.sync(engine, self.state.step)
            runner = RolloutRunner(
                engine, self.chat, self.tools, self.rollout_config,
                max_concurrency=config.max_concurrency, reward_fn=self.reward_fn, progress=False,
            )  # fmt: skip
            with self.progress_bar() as bar:
                task = bar.add_task(
                    "grpo", total=config.steps, completed=self.state.step, reward=math.nan, acc=math.nan
                )
                while self.state.step < config.steps:
                    metrics = await self.step(runner)
                    history.append(metrics)
                    self.log(metrics)
                    bar.update(task, advance=1, reward=metrics["reward_mean"], acc=metrics["accuracy"])
                    due = config.checkpoint_every and self.state.step % config.checkpoint_every == 0
                    if due or self.state.step == config.steps:
                        self.save_checkpoint()
        self.save_final(history)
        return history

    def progress_bar(self) -> Progress:
        """Steps done, reward and accuracy of the last step, time left; off on other processes."""
        return Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("reward {task.fields[reward]:.3f}  acc {task.fields[acc]:.3f}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=self.console,
            disable=not (self.config.progress and self.is_main),
        )

    def log(self, metrics: dict[str, Any]) -> None:
        if not self.is_main:
            return
        with (self.out / "metrics.jsonl").open("ab") as f:
            f.write(orjson.dumps(metrics, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
        self.console.print(
            f"step {metrics['step']:>3}  reward {metrics['reward_mean']:.3f}±{metrics['reward_std']:.3f}  "
            f"acc {metrics['accuracy']:.3f}  solve_all {metrics['solve_all']:.0f} none {metrics['solve_none']:.0f}  "
            f"len {metrics['response_length']:.0f}  turns {metrics['turns']:.2f}  tools {metrics['tool_calls']:.2f}  "
            f"kl {metrics['kl']:.4f}  clip {metrics['clip_fraction']:.3f}  ent {metrics['entropy']:.3f}  "
            f"gnorm {metrics['grad_norm']:.3f}  lr {metrics['lr']:.2e}  "
            f"rollout {metrics['rollout_s']:.1f}s train {metrics['train_s']:.1f}s sync {metrics['sync_s']:.2f}s  "
            f"stale {metrics['staleness_mean']:.2f}  "
            f"{metrics['train_tokens_per_s']:.0f} train tok/s",
            highlight=False,
        )

    def checkpoint_dir(self) -> Path:
        return self.out / "checkpoints"

    def save_checkpoint(self) -> None:
        """Model, optimizer, scheduler, RNG (Accelerate) and step + data position, written to a
        temporary directory and renamed into place, so a kill never leaves a half checkpoint."""
        final = self.checkpoint_dir() / f"step-{self.state.step:06d}"
        partial = final.with_name(final.name + ".partial")
        if self.is_main:
            shutil.rmtree(partial, ignore_errors=True)
        self.accelerator.wait_for_everyone()
        self.accelerator.save_state(str(partial))
        self.accelerator.wait_for_everyone()
        if self.is_main:
            (partial / "trainer_state.json").write_text(json.dumps(self.state.__dict__))
            shutil.rmtree(final, ignore_errors=True)
            os.replace(partial, final)
            kept = sorted(p for p in self.checkpoint_dir().glob("step-*") if not p.name.endswith(".partial"))
            for old in kept[: -self.config.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)
        self.accelerator.wait_for_everyone()

    def load_checkpoint(self) -> list[dict[str, Any]]:
        """Restore the last complete checkpoint; returns the metrics logged up to it."""
        found = sorted(p for p in self.checkpoint_dir().glob("step-*") if not p.name.endswith(".partial"))
        if not found:
            raise ValueError(f"--resume: no checkpoint under {self.checkpoint_dir()}")
        last = found[-1]
        self.accelerator.load_state(str(last))
        state = json.loads((last / "trainer_state.json").read_text())
        self.state = TrainerState(**state)
        self.prompts.position = self.state.data_position
        history = []
        metrics_file = self.out / "metrics.jsonl"
        if metrics_file.exists():
            history = _read_metrics(metrics_file)
            history = [m for m in history if m["step"] <= self.state.step]
            if self.is_main:  # drop lines of steps after the checkpoint (they will be run again)
                data = b"".join(orjson.dumps(m) + b"\n" for m in history)
                tmp = metrics_file.with_suffix(".jsonl.tmp")
                tmp.write_bytes(data)
                os.replace(tmp, metrics_file)
        self.console.print(f"resumed from {last} (step {self.state.step})")
        return history

    def save_final(self, history: list[dict[str, Any]]) -> None:
        """``out/final/``: a Hugging Face model directory the engines load; ``out/curves.png``."""
        self.accelerator.wait_for_everyone()
        if not self.is_main:
            return
        final = self.out / "final"
        partial = self.out / "final.partial"
        shutil.rmtree(partial, ignore_errors=True)
        self.accelerator.unwrap_model(self.model).save_pretrained(partial)
        self.tokenizer.save_pretrained(partial)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        if history:
            plot_curves(history, self.out / "curves.png")


def _read_metrics(path: Path) -> list[dict[str, Any]]:
    """The lines of ``metrics.jsonl``; a last line cut short by a kill is left out."""
    raw = path.read_bytes()
    complete = raw[: raw.rfind(b"\n") + 1]
    return [orjson.loads(line) for line in complete.splitlines() if line.strip()]


def plot_curves(history: list[dict[str, Any]], path: Path) -> None:
    """Reward and accuracy per step, one PNG (written atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in history]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for axis, key, label in ((axes[0], "reward_mean", "mean reward"), (axes[1], "accuracy", "accuracy")):
        values = np.array([m[key] for m in history], dtype=float)
        axis.plot(steps, values, marker="o", markersize=3, label="per step")
        if len(values) >= 5:
            window = np.ones(5) / 5
            axis.plot(steps[4:], np.convolve(values, window, mode="valid"), label="5-step mean")
        axis.set_xlabel("GRPO step")
        axis.set_title(label)
        axis.grid(alpha=0.3)
        axis.legend()
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


class _maybe_enter:
    """``async with`` an engine only when this trainer created it."""

    def __init__(self, engine: Engine, owned: bool):
        self.engine, self.owned = engine, owned

    async def __aenter__(self) -> Engine:
        if self.owned:
            await self.engine.__aenter__()  # type: ignore[attr-defined]
        return self.engine

    async def __aexit__(self, *exc: object) -> None:
        if self.owned:
            await self.engine.__aexit__(*exc)  # type: ignore[attr-defined]


def train(config: GRPOConfig, resume: bool = False) -> list[dict[str, Any]]:
    """Run GRPO from a config (the ``rallyrl train`` entry point)."""
    trainer = GRPOTrainer(config)
    return asyncio.run(trainer.train(resume=resume))
