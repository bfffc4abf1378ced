"""The policy being trained: its forward, token logprobs, the GRPO loss of a micro-batch and the
update over a step's micro-batches. The memory of training at a real model's size lives here:

- the model's forward ends at the final hidden states of the *trained* tokens (``PolicyModel``);
  their logprobs and entropy go through the LM head in token chunks (``trainer/logprobs.py``),
  so no ``[tokens, vocab]`` float32 tensor outlives its chunk;
- decoder layers are checkpointed where that pays (``gradient_checkpointing``);
- micro-batches are sized by tokens (``micro_batch_tokens``, ``auto``: to the device's memory, by a
  probe: ``trainer/memory_budget.py``) and packed without padding where the attention
  implementation reads packed sequences (``packing``);
- the frozen reference of the KL term is held in the compute dtype and prepared like the policy.

The same ``Policy`` serves one process, data parallel (DDP) and FSDP runs (``accelerate launch``).
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from data.config_tree import ConfigError
from trainer.batch import Sample, TrainBatch, collate, micro_batches
from trainer.config import GRPOConfig
from trainer.distributed import (
    full_state_dict,
    gather_rows,
    is_fsdp,
    max_across_processes,
    shard_like_policy,
    sum_across_processes,
)
from trainer.lora import apply_lora, merged_state_dict, save_adapter
from trainer.losses import policy_loss
from trainer.memory_budget import (
    FIXED_TOKENS,
    Budget,
    BudgetProbe,
    GiB,
    device_meter,
    probes_on,
    rounded_length,
)
from trainer.policy_model import PolicyModel, enable_checkpointing, wants_checkpointing, wants_packing
from trainer.rollout_correction import CorrectionStats, correct

log = logging.getLogger(__name__)


class Policy:
    """The policy and its optimizer, prepared by Accelerate, with the frozen reference of the KL term."""

    def __init__(self, config: GRPOConfig, accelerator: Any, lm: PreTrainedModel, pad_id: int,
                 reference: PreTrainedModel | None = None):  # fmt: skip
        """``lm``: the policy in float32 (master weights; autocast computes in bf16 on CUDA);
        ``reference``: the initial policy in ``compute_dtype`` when ``kl_beta > 0``."""
        self.config, self.accelerator, self.pad_id = config, accelerator, pad_id
        self.checkpointing = wants_checkpointing(config.gradient_checkpointing, lm)
        self.packing = wants_packing(config.packing, lm)
        self.peft: Any = None  # with ``lora``: the PeftModel around ``lm`` (which holds the LoRA layers)
        if config.lora is not None:
            if is_fsdp(accelerator):
                raise ConfigError(
                    "lora: not with FSDP; the adapter's gradients and optimizer state are small, so run data "
                    "parallel (accelerate launch without --use_fsdp), with lora.base_dtype: bfloat16 to halve the base"
                )
            if reference is not None:
                raise ValueError("with lora the KL reference is the base model with the adapter off: pass none")
            lm = lm.to(getattr(torch, config.lora.base_dtype))
            self.peft = apply_lora(lm, config.lora)
        elif (reference is None) != (config.kl_beta <= 0):
            raise ValueError("a reference model is needed exactly when kl_beta > 0")
        if reference is not None:
            reference = PolicyModel(reference.eval().requires_grad_(False))
        if self.checkpointing:
            enable_checkpointing(lm)
        model = PolicyModel(lm)
        trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]  # (LoRA: the adapter)
        optimizer = torch.optim.AdamW(trainable, lr=config.lr, weight_decay=config.weight_decay)
        scheduler = warmup_schedule(optimizer, config.warmup_steps)
        self.model, self.optimizer, self.scheduler = accelerator.prepare(model, optimizer, scheduler)
        self.reference = None
        if reference is not None:
            device = accelerator.device
            self.reference = shard_like_policy(accelerator, reference) if self.sharded else reference.to(device)
        self.meter = device_meter(accelerator.device, config.memory_limit_gib)  # the update's peak memory
        self.auto = config.micro_batch_tokens == "auto" and probes_on(accelerator.device, config.memory_limit_gib)
        self.budget: Budget | None = None  # auto's decision, once probed
        self.say: Callable[[str], None] = log.info  # (the trainer prints it)

    # ----- the model as others need it --------------------------------------------------------

    def language_model(self) -> PreTrainedModel:
        """The Hugging Face model (its config, ``save_pretrained``); under FSDP its parameters are shards."""
        return self.accelerator.unwrap_model(self.model).lm

    @property
    def sharded(self) -> bool:
        """Whether each process holds only shards of the weights (FSDP)."""
        return is_fsdp(self.accelerator)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full state dict under the LM's own names, on every process (gathered under FSDP:
        every process must call it); with LoRA, the base weights with the adapter merged in."""
        if self.sharded:
            return full_state_dict(self.model)
        if self.peft is not None:
            return merged_state_dict(self.language_model())
        return self.language_model().state_dict()

    def engine_copy(self) -> PreTrainedModel:
        """A separate, unsharded copy of the policy in eval mode, for an in-process engine (with
        LoRA: a plain model holding the merged weights, in float32)."""
        if not self.sharded and self.peft is None:
            return copy.deepcopy(self.language_model()).eval()
        plain = AutoModelForCausalLM.from_config(self.language_model().config, dtype=torch.float32)
        plain.load_state_dict(self.state_dict())
        return plain.eval()

    def save_adapter(self, directory: Path, base_model: Path) -> None:
        """With LoRA: the adapter in peft's format in ``directory``, naming ``base_model``."""
        save_adapter(self.peft, directory, base_model)

    # ----- logprobs and the loss --------------------------------------------------------------

    def logprobs(self, batch: TrainBatch, model: torch.nn.Module | None = None,
                 with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """``[B, T - 1]`` logprobs of each trained token (0 elsewhere) under ``model`` (the policy by
        default) at the rollout temperature, and their entropy (no gradient) when asked."""
        temperature = self.config.rollout.temperature
        shared = batch.shared_prefix  # (right padding needs no mask with a shared prefix: causal attention)
        logprobs, entropy = (model or self.model)(
            batch.input_ids, None if shared else batch.attention_mask, batch.position_ids, batch.positions,
            batch.targets, temperature=temperature if temperature > 0 else 1.0,
            chunk_tokens=self.config.logprob_chunk_tokens, with_entropy=with_entropy,
            **({"shared_prefix": shared} if shared else {}),
        )  # fmt: skip
        return batch.unflatten(logprobs), None if entropy is None else batch.unflatten(entropy)

    def micro_batch_loss(self, batch: TrainBatch, old: torch.Tensor | None, normaliser: float) -> dict[str, Any]:
        """The GRPO loss of one micro-batch, scaled to its share of the step's global loss, with its
        rollout correction (``correction``: for the step's ``correction/`` metrics). ``old``: the
        trainer's logprobs before the step (None: this pass's, as at the first pass)."""
        config, correction = self.config, self.config.correction
        mask, engine = batch.loss_mask[:, 1:], batch.engine_logprobs[:, 1:]
        logprobs, entropy = self.logprobs(batch, with_entropy=True)
        trainer_old = logprobs.detach() if old is None else old  # (bypass: this pass's, the first pass's old)
        # PPO's old policy: the trainer's (decoupled), the engine's (bypass), this pass's (bypass-pg: ratio 1)
        old_logprobs = {"decoupled": trainer_old, "bypass": engine, "bypass-pg": logprobs.detach()}[correction.mode]
        corrected = correct(trainer_old, engine, mask, correction)
        reference = None
        if self.reference is not None:
            with torch.no_grad():
                reference = self.logprobs(batch, model=self.reference)[0]
        elif self.peft is not None and config.kl_beta > 0:  # the base model: the same weights, adapter off
            with torch.no_grad(), self.peft.disable_adapter():
                reference = self.logprobs(batch, model=self.accelerator.unwrap_model(self.model))[0]
        drgrpo = config.loss_aggregation == "seq-mean-token-sum-norm"
        out = policy_loss(
            logprobs, old_logprobs, batch.advantages, mask, eps_low=config.eps_low, eps_high=config.eps_high,
            aggregation=config.loss_aggregation, agg_constant=1.0 if drgrpo else None, ref_logprobs=reference,
            kl_beta=config.kl_beta, kl_estimator=config.kl_estimator, is_weights=corrected.loss_weights,
            entropy=entropy,
        )  # fmt: skip
        # the micro-batch's aggregate times its own count is its un-normalised share; divided by
        # the global count it becomes its share of the global loss. DDP and FSDP average gradients
        # over processes, hence the factor num_processes.
        own_count = {
            "token-mean": float(mask.sum()),
            "seq-mean-token-mean": float((mask.sum(1) > 0).sum()),
            "seq-mean-token-sum-norm": float(len(batch)),
        }[config.loss_aggregation]
        share = own_count / normaliser
        return {
            "scaled_loss": out.loss * share * self.accelerator.num_processes,
            "share": share,
            "loss": float(out.loss.detach()),
            "pg_loss": out.pg_loss,
            "kl": out.kl,
            "clip_fraction": out.clip_fraction,
            "entropy": out.entropy or 0.0,
            "approx_kl": out.approx_kl,
            "correction": corrected,
        }

    # ----- the update ---------------------------------------------------------------------------

    def batches(self, samples: list[Sample], max_tokens: int | None = None) -> list[TrainBatch]:
        """``samples`` in micro-batches of at most ``micro_batch_size`` sequences and ``max_tokens``
        tokens (default ``micro_batch_tokens``), on the device."""
        config = self.config
        budget = self.micro_batch_tokens if max_tokens is None else max_tokens
        chunks = micro_batches(samples, config.micro_batch_size, budget, packed=self.packing)
        # rows run in full where layers run again (checkpointing: they cannot read a prefix's cache) or
        # may run only once per forward (FSDP frees a layer's gathered weights after its backward)
        share = config.share_prompt_prefix and not self.checkpointing and not self.sharded
        return [collate(chunk, self.pad_id, packed=self.packing, share_prefix=share).to(self.accelerator.device)
                for chunk in chunks]  # fmt: skip

    def update(self, samples: list[Sample]) -> dict[str, float]:
        """ppo_epochs optimizer steps over ``samples``, with the metrics of the micro-batch budget and the
        peak memory. Out of memory on the device before the first optimizer step (a longer trajectory
        than the budget was set for) is answered once: the step starts again with half the micro-batch
        token budget (``oom_retries`` 1 in the metrics; under ``auto`` the run keeps the half); a second
        is an ``UpdateOutOfMemory`` that names ``micro_batch_tokens`` and the longest sequence."""
        self.plan_budget(samples)
        self.stepped = False  # set by the first optimizer step: after it, the step cannot run again
        self.meter.reset_peak()
        try:
            metrics = {**self.update_once(samples, None), "oom_retries": 0}
        except torch.OutOfMemoryError as exc:
            budget = self.budget_after_oom(samples, exc)
            log.warning("out of memory in the update (%s); the step runs again with micro_batch_tokens %d",
                        str(exc).splitlines()[0][:200], budget)  # fmt: skip
            if self.budget is not None:
                self.budget.tokens = budget
            try:
                metrics = {**self.update_once(samples, budget), "oom_retries": 1}
            except torch.OutOfMemoryError as exc:
                raise self.out_of_memory(samples, f"again with micro_batch_tokens {budget}", exc) from None
        tokens = self.micro_batch_tokens
        metrics["micro_batch_tokens"] = float(tokens) if tokens is not None else float("nan")
        metrics["gradient_checkpointing"] = float(self.checkpointing)
        metrics["peak_memory_gib"] = self.meter.peak() / GiB
        return metrics

    @property
    def micro_batch_tokens(self) -> int | None:
        """The token budget of a micro-batch: as configured, or what ``auto`` decided (8,192 where it
        does not probe, and before its first probe)."""
        setting = self.config.micro_batch_tokens
        if setting != "auto":
            return setting
        return self.budget.tokens if self.budget is not None else FIXED_TOKENS

    def plan_budget(self, samples: list[Sample]) -> None:
        """Under ``auto``: probe (``trainer/memory_budget.py``) at the first step, and again when a step's
        longest sequence exceeds the probed length or a budget the step's size capped meets a step of
        twice that size (steps vary: not at every larger one); said once each."""
        if not self.auto:
            return
        longest = max_across_processes(self.accelerator, longest_of(samples))  # (every process decides alike)
        step_tokens = max_across_processes(self.accelerator, sum(len(s.input_ids) for s in samples))
        if not longest:
            return
        budget = self.budget
        grew = budget is None or longest > budget.probed_length or (budget.capped and step_tokens > 2 * budget.tokens)
        if not grew:
            return
        length = rounded_length(longest)
        setting = self.config.gradient_checkpointing
        self.budget = BudgetProbe(self, self.meter, self.config.memory_headroom).decide(length, step_tokens, setting)
        self.set_checkpointing(self.budget.checkpointing)
        if self.accelerator.is_main_process:
            self.say(self.budget.describe())

    def set_checkpointing(self, on: bool) -> None:
        """Turn gradient checkpointing of the decoder layers on or off."""
        if on != self.checkpointing:
            lm = self.language_model()
            enable_checkpointing(lm) if on else lm.gradient_checkpointing_disable()
            self.checkpointing = on

    def min_across_processes(self, value: int) -> int:
        return -max_across_processes(self.accelerator, -value)

    def budget_after_oom(self, samples: list[Sample], exc: torch.OutOfMemoryError) -> int:
        """The halved token budget of the retry; an UpdateOutOfMemory when the step cannot run again
        (an optimizer step was taken already, or other processes would wait for this one)."""
        if self.stepped:
            raise self.out_of_memory(samples, "after an optimizer step (ppo_epochs > 1)", exc) from None
        if self.accelerator.num_processes > 1:
            raise self.out_of_memory(samples, "in one of several processes", exc) from None
        self.release_update_memory()
        used = self.micro_batch_tokens or max(len(chunk) * longest_of(chunk) for chunk in
                                              micro_batches(samples, self.config.micro_batch_size))  # fmt: skip
        return max(1, used // 2)

    def out_of_memory(self, samples: list[Sample], when: str, exc: torch.OutOfMemoryError) -> UpdateOutOfMemory:
        self.release_update_memory()
        return UpdateOutOfMemory(
            f"out of memory in the update {when} (micro_batch_tokens {self.micro_batch_tokens}); the "
            f"longest sequence has {longest_of(samples)} tokens: set micro_batch_tokens lower, turn "
            f"gradient_checkpointing on, or bound max_model_len. {str(exc).splitlines()[0][:300]}"
        )

    def release_update_memory(self) -> None:
        """Drop the gradients of a failed step and give the allocator's cached blocks back."""
        self.optimizer.zero_grad(set_to_none=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def update_once(self, samples: list[Sample], max_tokens: int | None) -> dict[str, float]:
        """ppo_epochs optimizer steps over ``samples``; the loss is normalised by global counts."""
        config, accelerator = self.config, self.accelerator
        self.model.train()
        batches = self.batches(samples, max_tokens)
        local_tokens = sum(float(b.loss_mask[:, 1:].sum()) for b in batches)
        local_seqs = sum(int((b.loss_mask[:, 1:].sum(1) > 0).sum()) for b in batches)
        local = {"tokens": local_tokens, "seqs": local_seqs, "rows": sum(len(b) for b in batches)}
        counts = sum_across_processes(accelerator, local)
        totals = {"loss": 0.0, "pg_loss": 0.0, "kl": 0.0, "clip_fraction": 0.0, "entropy": 0.0, "approx_kl": 0.0}
        weighted = config.correction.weights != "none"
        corrections = CorrectionStats()
        if counts["tokens"] == 0:  # every group filtered out everywhere: no signal, so no optimizer step
            self.model.eval()
            return {**totals, "grad_norm": 0.0, "tokens": 0.0, "sequences": 0, "skipped_update": 1,
                    **corrections.metrics(weighted)}  # fmt: skip
        normaliser = {  # the global denominator of each aggregation
            "token-mean": max(counts["tokens"], 1.0),
            "seq-mean-token-mean": max(counts["seqs"], 1.0),
            "seq-mean-token-sum-norm": max(counts["rows"], 1.0) * config.generation_budget,  # Dr. GRPO
        }[config.loss_aggregation]
        old = None
        if config.ppo_epochs > 1 and config.correction.mode == "decoupled":  # the policy before the step's updates
            with torch.no_grad():
                old = [self.logprobs(b)[0] for b in batches]

        grad_norms, lrs = [], []
        for epoch in range(config.ppo_epochs):
            for i, batch in enumerate(batches or [None]):
                last = i == max(len(batches), 1) - 1
                with self.gradient_sync(last):
                    if batch is None:  # nothing to train on here: join the gradient sync with zeros, through
                        # a forward of one token (FSDP reduces gradients in hooks the forward sets up)
                        idle = Sample([self.pad_id, self.pad_id], [0, 1], [0.0, 0.0])
                        idle_batch = collate([idle], self.pad_id).to(accelerator.device)
                        accelerator.backward(self.micro_batch_loss(idle_batch, None, normaliser)["scaled_loss"] * 0.0)
                        continue
                    out = self.micro_batch_loss(batch, None if old is None else old[i], normaliser)
                    accelerator.backward(out.pop("scaled_loss"))
                if epoch == 0:  # the correction's metrics: of the step's data, as the first pass sees it
                    corrections.add(out["correction"])
                # the losses: each micro-batch's share of the global aggregate (their sum is the
                # step's loss, however samples are grouped); the rest: means over trained tokens
                weight = float(batch.loss_mask[:, 1:].sum())
                for key in totals:
                    totals[key] += out[key] * (out["share"] if key in ("loss", "pg_loss") else weight)
            grad_norm = accelerator.clip_grad_norm_(self.model.parameters(), config.max_grad_norm)
            grad_norms.append(float(grad_norm))
            lrs.append(self.optimizer.param_groups[0]["lr"])  # (the rate this pass ran at, before the schedule moves)
            self.optimizer.step()
            self.stepped = True
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.model.eval()
        summed = sum_across_processes(accelerator, totals)
        tokens = max(counts["tokens"], 1.0) * config.ppo_epochs
        metrics = {key: value / (config.ppo_epochs if key in ("loss", "pg_loss") else tokens)
                   for key, value in summed.items()}  # fmt: skip
        metrics["grad_norm"] = sum(grad_norms) / len(grad_norms)
        metrics["lr"] = sum(lrs) / len(lrs)
        metrics["tokens"] = counts["tokens"] * config.ppo_epochs
        metrics["sequences"] = counts["seqs"]
        metrics["skipped_update"] = 0
        correction = corrections.metrics(weighted, lambda rows: gather_rows(accelerator, rows),
                                         lambda counts: sum_across_processes(accelerator, counts))  # fmt: skip
        return {**metrics, **correction}

    def gradient_sync(self, last: bool) -> Any:
        """Gradients are reduced across processes on a step's last micro-batch only (DDP's
        ``no_sync``, FSDP2's ``set_requires_gradient_sync`` through Accelerate)."""
        return contextlib.nullcontext() if last else self.accelerator.no_sync(self.model)


class UpdateOutOfMemory(RuntimeError):
    """The update ran out of device memory twice; the message names the budget and the longest sequence."""


def warmup_schedule(optimizer: torch.optim.Optimizer, warmup_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The learning rate rises linearly over ``warmup_steps`` updates, then stays: update ``s`` (from 0) runs at
    ``lr x min(1, (s + 1) / (warmup_steps + 1))``, so the first update moves the weights too (Hugging Face's
    constant schedule with warmup spends it at 0). Why warm up: AdamW's first updates move every weight by about
    ``lr`` whatever its gradient (docs/training.md, "Why a run collapses")."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / (warmup_steps + 1)))


def longest_of(samples: list[Sample]) -> int:
    return max((len(sample.input_ids) for sample in samples), default=0)
