"""The policy being trained: its forward, token logprobs, the GRPO loss of a micro-batch and the
update over a step's micro-batches. The memory of training at a real model's size lives here:

- the model's forward ends at the final hidden states of the *trained* tokens (``PolicyModel``);
  their logprobs and entropy go through the LM head in token chunks (``trainer/logprobs.py``),
  so no ``[tokens, vocab]`` float32 tensor outlives its chunk;
- decoder layers are checkpointed where that pays (``gradient_checkpointing``);
- micro-batches are sized by tokens and packed without padding where the attention
  implementation reads packed sequences (``packing``);
- the frozen reference of the KL term is held in the compute dtype and prepared like the policy.

The same ``Policy`` serves one process, data parallel (DDP) and FSDP runs (``accelerate launch``).
"""

from __future__ import annotations

import contextlib
import copy
import logging
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, get_constant_schedule_with_warmup

from data.config_tree import ConfigError
from trainer.batch import Sample, TrainBatch, collate, micro_batches
from trainer.config import GRPOConfig
from trainer.distributed import full_state_dict, is_fsdp, shard_like_policy, sum_across_processes
from trainer.logprobs import chunked_logprobs, full_logits_logprobs
from trainer.lora import apply_lora, merged_state_dict, save_adapter
from trainer.losses import policy_loss, truncated_is_weights

PACKED_ATTENTION = ("flash_attention_2", "flash_attention_3", "flex_attention")
"""Attention implementations that read packed sequences from position ids without a [T, T] mask
(transformers' varlen paths); with sdpa and eager, packing builds a block-diagonal mask over the
whole micro-batch, costlier than padding, so ``packing: null`` pads there."""

log = logging.getLogger(__name__)

CHECKPOINTING_FROM_PARAMETERS = 100_000_000
"""``gradient_checkpointing: null`` turns it on for models of at least this many parameters: every
real language model, whose activations dominate a long micro-batch; off for the embedded model and
other tiny ones, where it would only cost the recomputation (README, "Training at a real model's size")."""


class PolicyModel(torch.nn.Module):
    """A causal LM whose forward returns the logprobs (and entropy) of chosen next tokens, computed
    from the final hidden states in chunks, instead of logits.

    Its children are the LM's own (``model``, ``lm_head`` for Qwen2/Llama), so its state dict is the
    LM's, key for key: checkpoints stay Hugging Face model directories. Every parameter is used
    inside this module's forward, which DDP and FSDP need of the module they wrap.
    """

    def __init__(self, lm: PreTrainedModel):
        super().__init__()
        if any(True for _ in lm.named_parameters(recurse=False)):
            raise ValueError(f"{type(lm).__name__} has parameters outside its submodules: not supported")
        for name, child in lm.named_children():
            self.add_module(name, child)
        self._no_split_modules = getattr(lm, "_no_split_modules", None)  # FSDP's auto-wrap reads it
        object.__setattr__(self, "lm", lm)  # not a child: its modules are registered above

    @property
    def config(self) -> Any:
        return self.lm.config

    def tie_weights(self, *args: Any, **kwargs: Any) -> Any:
        """The LM's own (Accelerate's FSDP loading re-ties the weights through the module it wraps)."""
        return self.lm.tie_weights(*args, **kwargs)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor,
                positions: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, chunk_tokens: int = 1024,
                with_entropy: bool = False, shared_prefix: int = 0,
                ) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """Logprobs ``[M]`` of ``targets`` after the tokens at flat ``positions`` of ``input_ids``.

        ``shared_prefix`` (SFT): the first tokens, the same in every row and not trained, run once
        (batch 1) and their keys and values serve every row; ``positions`` then index the rows
        without them (``[R, N - shared_prefix]``)."""
        if chunk_tokens == 0:  # the computation before chunking: every position's logits at once
            logits = self.lm(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             use_cache=False).logits[:, shared_prefix:]  # fmt: skip
            return full_logits_logprobs(logits.flatten(0, 1), positions, targets, temperature, with_entropy)
        decoder = getattr(self, self.lm.base_model_prefix)
        if shared_prefix:
            cache = decoder(input_ids=input_ids[:1, :shared_prefix], use_cache=True).past_key_values
            cache.batch_repeat_interleave(input_ids.shape[0])
            hidden = decoder(input_ids=input_ids[:, shared_prefix:], past_key_values=cache,
                             use_cache=True).last_hidden_state  # fmt: skip
        else:
            hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             use_cache=False).last_hidden_state  # fmt: skip
        hidden = hidden.flatten(0, 1).index_select(0, positions)
        head = self.lm.get_output_embeddings()
        return chunked_logprobs(hidden, head.weight, targets, bias=head.bias, temperature=temperature,
                                chunk_tokens=chunk_tokens, with_entropy=with_entropy)  # fmt: skip


def wants_checkpointing(setting: bool | None, model: torch.nn.Module) -> bool:
    """``gradient_checkpointing``: as set, or (null) on for models of real size."""
    if setting is not None:
        return setting
    return sum(p.numel() for p in model.parameters()) >= CHECKPOINTING_FROM_PARAMETERS


def enable_checkpointing(lm: PreTrainedModel) -> None:
    """Recompute each decoder layer in backward (non-reentrant: works under DDP and FSDP)."""
    if not lm.supports_gradient_checkpointing:
        raise ValueError(f"gradient_checkpointing: {type(lm).__name__} does not support it; set it to false")
    lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def wants_packing(setting: bool | None, lm: PreTrainedModel) -> bool:
    """``packing``: as set, or (null) where the attention implementation reads packed sequences."""
    if setting is not None:
        return setting
    return getattr(lm.config, "_attn_implementation", None) in PACKED_ATTENTION


def compute_dtype(accelerator: Any) -> torch.dtype:
    """The dtype the forward computes in: bf16/fp16 under mixed precision, else float32."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision, torch.float32)


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
        scheduler = get_constant_schedule_with_warmup(optimizer, config.warmup_steps)
        self.model, self.optimizer, self.scheduler = accelerator.prepare(model, optimizer, scheduler)
        self.reference = None
        if reference is not None:
            device = accelerator.device
            self.reference = shard_like_policy(accelerator, reference) if self.sharded else reference.to(device)

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
        logprobs, entropy = (model or self.model)(
            batch.input_ids, batch.attention_mask, batch.position_ids, batch.positions, batch.targets,
            temperature=temperature if temperature > 0 else 1.0, chunk_tokens=self.config.logprob_chunk_tokens,
            with_entropy=with_entropy,
        )  # fmt: skip
        return batch.unflatten(logprobs), None if entropy is None else batch.unflatten(entropy)

    def micro_batch_loss(self, batch: TrainBatch, old: torch.Tensor | None, normaliser: float) -> dict[str, Any]:
        """The GRPO loss of one micro-batch, scaled to its share of the step's global loss."""
        config = self.config
        mask = batch.loss_mask[:, 1:]
        logprobs, entropy = self.logprobs(batch, with_entropy=True)
        old_logprobs = logprobs.detach() if old is None else old
        reference = None
        if self.reference is not None:
            with torch.no_grad():
                reference = self.logprobs(batch, model=self.reference)[0]
        elif self.peft is not None and config.kl_beta > 0:  # the base model: the same weights, adapter off
            with torch.no_grad(), self.peft.disable_adapter():
                reference = self.logprobs(batch, model=self.accelerator.unwrap_model(self.model))[0]
        is_weights = None
        if config.tis_cap is not None:
            is_weights = truncated_is_weights(old_logprobs, batch.engine_logprobs[:, 1:], config.tis_cap) * mask
        drgrpo = config.loss_aggregation == "seq-mean-token-sum-norm"
        out = policy_loss(
            logprobs, old_logprobs, batch.advantages, mask, eps_low=config.eps_low, eps_high=config.eps_high,
            aggregation=config.loss_aggregation, agg_constant=1.0 if drgrpo else None, ref_logprobs=reference,
            kl_beta=config.kl_beta, kl_estimator=config.kl_estimator, is_weights=is_weights, entropy=entropy,
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
        }

    # ----- the update ---------------------------------------------------------------------------

    def batches(self, samples: list[Sample], max_tokens: int | None = None) -> list[TrainBatch]:
        """``samples`` in micro-batches of at most ``micro_batch_size`` sequences and ``max_tokens``
        tokens (default ``micro_batch_tokens``), on the device."""
        config = self.config
        budget = config.micro_batch_tokens if max_tokens is None else max_tokens
        chunks = micro_batches(samples, config.micro_batch_size, budget, packed=self.packing)
        return [collate(chunk, self.pad_id, packed=self.packing).to(self.accelerator.device) for chunk in chunks]

    def update(self, samples: list[Sample]) -> dict[str, float]:
        """ppo_epochs optimizer steps over ``samples``. Out of memory on the device before the first
        optimizer step (a longer trajectory than the budget was set for) is answered once: the step
        starts again with half the micro-batch token budget (``oom_retries`` 1 in the metrics); a second
        is an ``UpdateOutOfMemory`` that names ``micro_batch_tokens`` and the longest sequence."""
        self.stepped = False  # set by the first optimizer step: after it, the step cannot run again
        try:
            return {**self.update_once(samples, None), "oom_retries": 0}
        except torch.OutOfMemoryError as exc:
            budget = self.budget_after_oom(samples, exc)
            log.warning("out of memory in the update (%s); the step runs again with micro_batch_tokens %d",
                        str(exc).splitlines()[0][:200], budget)  # fmt: skip
        try:
            return {**self.update_once(samples, budget), "oom_retries": 1}
        except torch.OutOfMemoryError as exc:
            raise self.out_of_memory(samples, f"again with micro_batch_tokens {budget}", exc) from None

    def budget_after_oom(self, samples: list[Sample], exc: torch.OutOfMemoryError) -> int:
        """The halved token budget of the retry; an UpdateOutOfMemory when the step cannot run again
        (an optimizer step was taken already, or other processes would wait for this one)."""
        if self.stepped:
            raise self.out_of_memory(samples, "after an optimizer step (ppo_epochs > 1)", exc) from None
        if self.accelerator.num_processes > 1:
            raise self.out_of_memory(samples, "in one of several processes", exc) from None
        self.release_update_memory()
        used = self.config.micro_batch_tokens or max(len(chunk) * longest(chunk) for chunk in
                                                     micro_batches(samples, self.config.micro_batch_size))  # fmt: skip
        return max(1, used // 2)

    def out_of_memory(self, samples: list[Sample], when: str, exc: torch.OutOfMemoryError) -> UpdateOutOfMemory:
        self.release_update_memory()
        return UpdateOutOfMemory(
            f"out of memory in the update {when} (micro_batch_tokens {self.config.micro_batch_tokens}); the "
            f"longest sequence has {longest(samples)} tokens: set micro_batch_tokens lower, turn "
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
        if counts["tokens"] == 0:  # every group filtered out everywhere: no signal, so no optimizer step
            self.model.eval()
            return {**totals, "grad_norm": 0.0, "tokens": 0.0, "sequences": 0, "skipped_update": 1}
        normaliser = {  # the global denominator of each aggregation
            "token-mean": max(counts["tokens"], 1.0),
            "seq-mean-token-mean": max(counts["seqs"], 1.0),
            "seq-mean-token-sum-norm": max(counts["rows"], 1.0) * config.generation_budget,  # Dr. GRPO
        }[config.loss_aggregation]
        old = None
        if config.ppo_epochs > 1:  # the policy before this step's updates
            with torch.no_grad():
                old = [self.logprobs(b)[0] for b in batches]

        grad_norms = []
        for _ in range(config.ppo_epochs):
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
                # the losses: each micro-batch's share of the global aggregate (their sum is the
                # step's loss, however samples are grouped); the rest: means over trained tokens
                weight = float(batch.loss_mask[:, 1:].sum())
                for key in totals:
                    totals[key] += out[key] * (out["share"] if key in ("loss", "pg_loss") else weight)
            grad_norm = accelerator.clip_grad_norm_(self.model.parameters(), config.max_grad_norm)
            grad_norms.append(float(grad_norm))
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
        metrics["tokens"] = counts["tokens"] * config.ppo_epochs
        metrics["sequences"] = counts["seqs"]
        metrics["skipped_update"] = 0
        return metrics

    def gradient_sync(self, last: bool) -> Any:
        """Gradients are reduced across processes on a step's last micro-batch only (DDP's
        ``no_sync``, FSDP2's ``set_requires_gradient_sync`` through Accelerate)."""
        return contextlib.nullcontext() if last else self.accelerator.no_sync(self.model)


class UpdateOutOfMemory(RuntimeError):
    """The update ran out of device memory twice; the message names the budget and the longest sequence."""


def longest(samples: list[Sample]) -> int:
    return max((len(sample.input_ids) for sample in samples), default=0)


def load_lm(model_dir: Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A local Hugging Face causal LM in ``dtype``."""
    return AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=dtype)
