"""GRPO on Accelerate, one step read top to bottom in ``GRPOTrainer.step``:

    rollout (refilled until enough groups have signal) -> rewards -> advantages
    -> update (``trainer/policy.py``: ppo_epochs x micro-batches -> clip -> step) -> sync -> log

``GRPOConfig.async_rl`` overlaps the two halves (``trainer/grpo_async.py``): rollouts run on
in the background (``trainer/async_rl.py``) while the trainer updates on the groups that
finished, within ``max_staleness`` policy versions.

Data parallel with ``accelerate launch``: every process rolls out its share of the step's
prompts (whole groups), and the loss is normalised by global counts so that N processes make
the same update as one process on the same global batch. With Accelerate's FSDP plugin each
process holds shards of the weights and optimizer state; the full weights are gathered for the
engines, ``final/`` and each checkpoint's model files.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import gather_object, set_seed
from rich.console import Console

from data.reward_fns import RewardFn
from rollout.api import (
    agent_gateway,
    enter_interactions,
    make_judge,
    make_reward,
    open_engine,
    resolve_model,
    set_threads,
    setup_interactions,
    setup_tools,
)
from rollout.engines.base import Engine, PushesWeights
from rollout.event_loop import run as run_on_loop
from rollout.gateway.agents import AgentDriver, load_agent
from rollout.request import AsyncRolloutRequest
from rollout.runner import RolloutRunner
from rollout.stats import RolloutCounts, source_metrics, source_sums
from rollout.tokens import load_tokenizer
from trainer.async_rl import MeteredEngine, PromptLedger
from trainer.batch import Sample
from trainer.checkpoints import complete_checkpoints
from trainer.collapse import CollapseWatch
from trainer.colocation import Colocation, plan_colocation, prepare_sglang, wants_sglang_colocation
from trainer.config import GRPOConfig
from trainer.distributed import make_accelerator, max_across_processes, sum_across_processes
from trainer.groups import group_samples, select_groups
from trainer.grpo_async import train_async
from trainer.metrics_log import PhaseTimer, append_metrics, console_line, step_progress
from trainer.policy import Policy
from trainer.policy_model import compute_dtype, load_lm
from trainer.preemption import Abandoned, Preempted, Preemption
from trainer.prompt_stream import PromptStream
from trainer.run_files import RunFiles, TrainerState
from trainer.trackers import accelerator_options, log_to_trackers, run_trackers
from trainer.weight_check import logprob_gap
from trainer.weight_files import save_adapter_version
from trainer.weight_source import PolicyWeights
from trainer.weight_sync import plan_servers, sync_engine


class GRPOTrainer(RunFiles):
    """Owns the policy, its optimizer, the rollout engine and the run directory."""

    def __init__(
        self,
        config: GRPOConfig,
        engine: Engine | None = None,
        reward_fn: RewardFn | None = None,
        console: Console | None = None,
    ):
        self.config = config
        if config.agent:
            load_agent(config.agent)  # a bad entry point fails before the model loads
        self.console = console or Console(stderr=True, soft_wrap=True)
        set_threads(config.threads)
        self.accelerator = make_accelerator(**accelerator_options(config.log_with, config.out))  # (DDP/FSDP: launch)
        set_seed(config.seed, device_specific=True)
        self.out = Path(config.out)
        self.model_dir = resolve_model(config.model)
        self.tokenizer = load_tokenizer(self.model_dir)
        with_reference = config.kl_beta > 0 and config.lora is None  # (LoRA's reference: the base, adapter off)
        reference = load_lm(self.model_dir, compute_dtype(self.accelerator)) if with_reference else None
        self.policy = Policy(config, self.accelerator, load_lm(self.model_dir), self.tokenizer.pad_token_id or 0,
                             reference)  # fmt: skip
        self.model, self.optimizer, self.scheduler = self.policy.model, self.policy.optimizer, self.policy.scheduler
        self.policy.say = self.say
        self.tools, self.chat = setup_tools(
            config.tools, self.tokenizer, config.task, config.rollout.content_special_tokens
        )
        self.interactions = setup_interactions(config.interactions, config.task)
        self.judge = make_judge(config.judge) if reward_fn is None else None
        self.reward_fn = reward_fn or make_reward(config.reward, self.judge)
        self.engine = engine
        self.metered: MeteredEngine | None = None  # the engine as rollouts see it (idle time)
        self.ledger: PromptLedger | None = None  # async: this process's prompts and which were consumed
        self.agent: AgentDriver | None = None  # with config.agent: runs it through the in-process gateway
        self._step_began = self._engine_idle_began = 0.0  # the step clock: when the last step ended
        self.prompts = PromptStream(config)
        self.state = TrainerState()
        self.server_adapter = False  # LoRA: the servers load the adapter alone at each sync
        self.weights = PolicyWeights(self.policy, self.tokenizer, self.out / "weights")  # what a sync sends
        self.last_sync: dict[str, float] = {}  # the sync/ metrics of the last step
        self.colocation: Colocation | None = None  # an in-process engine on the trainer's device: released per update
        self.preemption = Preemption(self.accelerator, config.checkpoint_on_signal, lambda: self.state.step)
        self.saved_step: int | None = None  # the step of the newest checkpoint this run wrote or resumed from
        self.watch = CollapseWatch()  # the collapse warning, once a run (trainer/collapse.py)

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    def say(self, line: str) -> None:
        if self.is_main:
            self.console.print(line, highlight=False)

    def policy_state_dict(self) -> dict[str, torch.Tensor]:
        """The policy's full state dict under the LM's own names (gathered under FSDP)."""
        return self.policy.state_dict()

    def open_engine(self) -> Any:
        """The configured engine, not yet entered: servers, or an in-process engine on its own copy
        of the policy (synced in-process after each step); in-process SGLang set up for colocation."""
        config, policy = self.config.engine, None
        if not config.urls and config.kind == "local":
            policy = self.policy.engine_copy()
        if wants_sglang_colocation(self.config, self.accelerator.device):
            config = dataclasses.replace(config, sglang=prepare_sglang(config.sglang))
        return open_engine(config, self.model_dir, max_model_len=self.config.rollout.max_model_len,
                           seed=self.config.seed + 1000 * self.accelerator.process_index, model=policy,
                           pooled=True)  # fmt: skip

    # ----- one step ----------------------------------------------------------------------------

    async def step(self, runner: RolloutRunner) -> dict[str, Any]:
        """One GRPO step; returns its metrics (the same on every process)."""
        config = self.config

        # 1. rollout: the step's prompts, refilled while filtering leaves it short (this process's share)
        timer = PhaseTimer()
        with timer("rollout"):  # (a signal drops it: Abandoned, the step redone after --resume)
            requests, draws = await self.preemption.abandonable("rollout", self.roll_out_step(runner))
        await self.preemption.check()  # (a signal to any process meanwhile: Abandoned too)

        # 2. advantages (groups live on one process, so they are computed locally)
        samples, group_stats = self.build_samples(requests, config.prompts_per_step)
        group_stats.update(draws)

        # 3. update: ppo_epochs passes, gradients accumulated over micro-batches
        await self.preemption.pause("update")  # (tests only: RALLYRL_TEST_PAUSE_AT)
        with timer("update"):
            async with self.weights.changing():  # (a server brought back meanwhile waits for the sync)
                if self.colocation is not None:  # the engine's memory, for the update
                    await self.colocation.release()
                update = self.update(samples)

        # 4. sync the engine (servers: pause -> weights by broadcast, tensor or disk -> continue)
        await self.preemption.pause("sync")
        with timer("sync"):
            if self.engine is not None:
                await self.sync(self.engine, self.state.step + 1)

        # 5. log
        rollout = self.rollout_metrics(requests, policy_version=self.state.step)
        self.state.step += 1
        self.state.data_position = self.prompts.position
        return self.step_metrics(rollout, group_stats, update, timer)

    async def roll_out_step(self, runner: RolloutRunner) -> tuple[list[AsyncRolloutRequest], dict[str, float]]:
        """Roll out ``prompts_per_step`` prompts (``oversample`` times that when filtering); while
        fewer than ``prompts_per_step`` groups have signal, draw more (DAPO's dynamic sampling),
        sized by the share kept so far, up to ``max_draws`` x ``prompts_per_step`` prompts."""
        config, accelerator = self.config, self.accelerator
        wanted = config.prompts_per_step
        size = math.ceil(wanted * config.oversample) if config.filter_groups else wanted
        cap = max(size, math.floor(wanted * config.max_draws)) if config.filter_groups else wanted
        # group ids are global prompt positions in this step; sampling seeds follow them, so a
        # step's rollouts do not depend on how prompts are split or batched
        runner.config = dataclasses.replace(config.rollout, seed=config.seed * 100_003 + self.state.step)
        requests: list[AsyncRolloutRequest] = []
        drawn = rounds = 0
        usable = 0.0
        while True:
            prompts = self.prompts.take(size)
            mine = [i for i in range(drawn, drawn + size) if i % accelerator.num_processes == accelerator.process_index]
            records = [prompts[i - drawn] for i in mine]
            result = await runner.run(records, config.samples_per_prompt, prompt_indices=mine)
            requests += result.requests
            drawn, rounds = drawn + size, rounds + 1
            if not config.filter_groups:
                break
            local = select_groups(requests, True, len(requests))[1]["groups_trained"]
            usable = sum_across_processes(accelerator, {"usable": local})["usable"]
            if usable >= wanted or drawn >= cap:
                break
            kept_share = max(usable / drawn, 1 / config.max_draws)
            size = min(cap - drawn, math.ceil((wanted - usable) / kept_share))
        cap_hit = float(bool(config.filter_groups) and usable < wanted)
        return requests, {"prompts_drawn": drawn, "draw_rounds": rounds, "draw_cap_hit": cap_hit}

    def step_metrics(self, rollout: dict[str, Any], group_stats: dict[str, float], update: dict[str, float],
                     timer: PhaseTimer) -> dict[str, Any]:  # fmt: skip
        """The step's metrics: ``rollout/``, ``train/``, ``correction/`` (the rollout correction's) and
        ``time/`` (wall of the step, the run's clock, and the shares of it the engine and the trainer sat idle)."""
        now, engine_idle = time.monotonic(), self.metered_idle()
        wall = now - self._step_began  # since the last step ended: its checkpoint save included
        self.state.elapsed_s += wall
        idle = engine_idle - self._engine_idle_began
        self._step_began, self._engine_idle_began = now, engine_idle
        update.setdefault("lr", self.scheduler.get_last_lr()[0])  # (a step that updated nothing: the rate to come)
        times = timer.seconds()
        rollout_s = times.get("rollout_s", wall)
        times["rollout_tokens_per_s"] = rollout["generated_tokens"] / rollout_s if rollout_s else 0.0
        times["update_tokens_per_s"] = update["tokens"] / times["update_s"] if times["update_s"] else 0.0
        times["step_wall_s"] = wall
        times["elapsed_s"] = self.state.elapsed_s
        busy = times["update_s"] + times["sync_s"]
        times["trainer_idle_fraction"] = max(0.0, 1 - busy / wall) if wall > 0 else 0.0
        times["engine_idle_fraction"] = min(1.0, max(0.0, idle / wall)) if wall > 0 else 0.0
        return {
            "step": self.state.step,
            **{f"rollout/{k}": v for k, v in {**rollout, **group_stats}.items()},
            **{k if k.startswith("correction/") else f"train/{k}": v for k, v in update.items()},
            **{f"sync/{k}": v for k, v in self.last_sync.items()},
            **{f"colocate/{k}": v for k, v in (self.colocation.metrics() if self.colocation else {}).items()},
            **{f"time/{k}": v for k, v in times.items()},
        }

    def metered_idle(self) -> float:
        return self.metered.idle_seconds() if self.metered is not None else 0.0

    def build_samples(self, requests: list[AsyncRolloutRequest], wanted_groups: int) -> tuple[list[Sample], dict]:
        """Rewards -> advantages -> training samples (``trainer/groups.py``): failed and unrewarded
        requests left out, uniform groups dropped when filtering, then the first ``wanted_groups``
        usable groups of the step in draw order, over all processes."""
        config, accelerator = self.config, self.accelerator
        kept, stats = select_groups(requests, config.filter_groups, len(requests))
        usable = sorted({r.prompt_index for r in kept})
        every = sorted(gather_object(usable)) if accelerator.num_processes > 1 else usable
        chosen = set(every[:wanted_groups])
        kept = [r for r in kept if r.prompt_index in chosen]
        stats["groups_trained"] = len(chosen.intersection(usable))
        stats = sum_across_processes(accelerator, stats)
        return self.samples_of(kept), stats

    def samples_of(self, kept: list[AsyncRolloutRequest]) -> list[Sample]:
        config = self.config
        return group_samples(kept, config.advantage_mode, config.advantage_scale, config.gamma)

    def update(self, samples: list[Sample]) -> dict[str, float]:
        """ppo_epochs optimizer steps over ``samples`` (``trainer/policy.py``)."""
        return self.policy.update(samples)

    async def sync(self, engine: Engine, version: int) -> None:
        """The policy's weights (or LoRA adapter) to ``engine`` as ``version``. Servers are shared by
        every process, so the main process syncs them while the others wait (under FSDP all gather
        the full weights first); ``last_sync`` keeps the step's ``sync/`` metrics."""
        servers = isinstance(engine, PushesWeights)
        if self.server_adapter:
            if self.is_main:
                path = save_adapter_version(self.policy.peft, self.model_dir, self.out / "weights", version)
                await engine.sync_adapter_from_disk(str(path.resolve()), version)  # type: ignore[attr-defined]
            self.last_sync = {"weight_version": version, "servers_failed": 0.0}
        else:
            self.weights.gather()  # (a collective under FSDP)
            try:
                self.weights.version = version
                if self.colocation is not None:  # the engine's memory back, with these weights
                    self.last_sync = await self.colocation.resume(self.weights, version)
                elif self.is_main or not servers:
                    self.last_sync = await sync_engine(engine, self.weights, version)
            finally:
                self.weights.release()
        if self.config.weight_sync.check_logprobs and (self.is_main or not servers):
            rid = f"weight-check-{version}-{self.accelerator.process_index}"
            self.last_sync["logprob_gap"] = await logprob_gap(engine, self.policy.language_model(), self.tokenizer, rid)
        await asyncio.to_thread(self.accelerator.wait_for_everyone)  # the event loop keeps requests moving

    async def plan_server_sync(self, engine: Engine) -> None:
        """With servers: how each will take the weights (``plan_servers``), said before the first rollout."""
        self.server_adapter, lines = await plan_servers(engine, self.config, self.policy, self.weights)
        for line in lines if self.is_main else []:
            self.console.print(line, highlight=False)

    def rollout_metrics(self, requests: list[AsyncRolloutRequest], policy_version: int = 0) -> dict[str, Any]:
        """The rollout statistics (``rollout/stats.py``) over every process, and the weight version."""
        counts = RolloutCounts.of(requests, policy_version)
        summed = sum_across_processes(self.accelerator, counts.sums())
        counts = counts.with_sums(summed, max_across_processes(self.accelerator, counts.stale_max))
        metrics = counts.metrics()
        metrics["accuracy"] = math.nan if metrics["accuracy"] is None else metrics["accuracy"]  # none graded: a gap
        if len(sources := self.prompts.sources) > 1:  # a mix (reasoning-gym's, a data file's): each source apart
            metrics |= source_metrics(sum_across_processes(self.accelerator, source_sums(requests, sources)), sources)
        return {**metrics, "weight_version": policy_version}

    # ----- the run: steps, logs, checkpoints ---------------------------------------------------------

    async def train(self, resume: bool = False) -> list[dict[str, Any]]:
        """Run ``config.steps`` steps (from the last checkpoint with ``resume``); returns the metrics.
        Preempted after a signal, its checkpoint written (``trainer/preemption.py``)."""
        config = self.config
        if self.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
        history: list[dict[str, Any]] = []
        if resume:
            history = self.load_checkpoint()
            self.saved_step = self.state.step if complete_checkpoints(self.out / "checkpoints") else None
        elif self.is_main and (self.out / "metrics.jsonl").exists():
            (self.out / "metrics.jsonl").unlink()
        self.watch.replay(history)
        async with contextlib.AsyncExitStack() as stack:
            stack.enter_context(self.preemption)  # SIGTERM, SIGINT, checkpoint_on_signal: stop at a safe point
            stack.enter_context(run_trackers(self.accelerator, self.out, config.to_dict(), self.say))  # log_with
            if self.judge is not None:
                await stack.enter_async_context(self.judge)
            await enter_interactions(stack, self.interactions)
            if self.engine is None:  # ours: opened and closed here
                self.engine = await stack.enter_async_context(self.open_engine())
            engine = self.engine
            await self.plan_server_sync(engine)
            self.colocation, line = plan_colocation(config, engine, self.accelerator.device)
            if line:
                self.say(line)
            if isinstance(engine, PushesWeights) or (resume and self.state.step):
                # servers started from any checkpoint of this model get exactly the policy's weights
                await self.sync(engine, self.state.step)
            self.metered = MeteredEngine(engine)
            gateway = agent_gateway(config, self.metered, self.tokenizer, self.reward_fn, self.model_dir)
            self.agent = await stack.enter_async_context(gateway)
            self._step_began, self._engine_idle_began = time.monotonic(), 0.0
            with step_progress(self.console, enabled=config.progress and self.is_main) as bar:
                task = bar.add_task("grpo", total=config.steps, completed=self.state.step, reward=math.nan,
                                    acc=math.nan)  # fmt: skip

                def finished(metrics: dict[str, Any]) -> bool:
                    """Log a step; True when a checkpoint is due."""
                    history.append(metrics)
                    self.log(metrics)
                    bar.update(task, advance=1, reward=metrics["rollout/reward_mean"],
                               acc=metrics["rollout/accuracy"])  # fmt: skip
                    due = config.checkpoint_every and self.state.step % config.checkpoint_every == 0
                    return bool(due) or self.state.step == config.steps

                if config.async_rl and self.colocation is None:
                    await train_async(self, finished)
                else:
                    runner = RolloutRunner(self.metered, self.chat, self.tools, config.rollout,
                                           reward_fn=self.reward_fn, progress=False,
                                           interactions=self.interactions, agent=self.agent)  # fmt: skip
                    with contextlib.suppress(Abandoned):  # a signal dropped the step's rollout
                        while not await self.preemption.stopping() and self.state.step < config.steps:
                            if finished(await self.step(runner)):
                                self.save_checkpoint()
            if self.preemption.stopped:  # the last finished step's checkpoint, then exit 75 (cli.py)
                raise self.preemption.preempted(self)
        self.save_final(history)
        return history

    def save_checkpoint(self) -> None:
        super().save_checkpoint()
        self.saved_step = self.state.step

    def log(self, metrics: dict[str, Any]) -> None:
        warning = self.watch.observe(metrics)  # train/grad_norm_ratio and train/collapse_warning added
        if self.is_main:
            append_metrics(self.out / "metrics.jsonl", metrics)
            self.console.print(console_line(metrics), highlight=False)
            if warning:
                self.console.print(warning, style="bold yellow", highlight=False)
        log_to_trackers(self.accelerator, metrics)


def train(config: GRPOConfig, resume: bool = False) -> list[dict[str, Any]]:
    """Run GRPO from a config (the ``rallyrl train`` entry point)."""
    trainer = GRPOTrainer(config)
    try:
        history = run_on_loop(trainer.train(resume=resume), config.event_loop)
    except Preempted:
        trainer.accelerator.end_training()
        raise
    trainer.accelerator.end_training()  # the process group, before the interpreter exits
    return history
