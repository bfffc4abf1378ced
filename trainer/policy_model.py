"""The model side of the policy: ``PolicyModel`` (a causal LM whose forward ends at the logprobs of
the trained tokens, through the LM head in chunks), and the memory switches every trainer shares:
gradient checkpointing, packing, the compute dtype.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from trainer.logprobs import chunked_logprobs, full_logits_logprobs

PACKED_ATTENTION = ("flash_attention_2", "flash_attention_3", "flex_attention")
"""Attention implementations that read packed sequences from position ids without a [T, T] mask
(transformers' varlen paths); with sdpa and eager, packing builds a block-diagonal mask over the
whole micro-batch, costlier than padding, so ``packing: null`` pads there."""

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


def load_lm(model_dir: Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A local Hugging Face causal LM in ``dtype``."""
    return AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=dtype)
