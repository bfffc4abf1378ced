"""LoRA with peft: the adapter put on a base model (``lora:`` of a training config, ``LoRAConfig`` in
``trainer/config.py``), and the three forms the engines and the run directory take it in:

- the adapter alone (peft's ``adapter_model.safetensors`` and ``adapter_config.json``, whose
  ``base_model_name_or_path`` names the base model directory), for checkpoints, ``final/`` and
  servers that load adapters at run time;
- merged full weights under the model's own names (``W + scale * B @ A``), for in-process engines
  and servers that cannot load adapters;
- a merged model directory (``rollout/engines/adapter_dirs.py:export_merged``), which SGLang and vLLM load as
  any model.

Only the adapter's parameters train and have optimizer state; the KL reference is the base model
with the adapter turned off (``Policy``), not a copy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from data.config_tree import ConfigError
from trainer.config import LoRAConfig


def apply_lora(lm: torch.nn.Module, config: LoRAConfig) -> Any:
    """``lm`` with a fresh adapter (peft's ``PeftModel``; ``lm`` itself now holds the LoRA layers).
    The base weights are frozen; a target module the model lacks is a ConfigError naming the field."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ConfigError("lora: needs the peft package: pip install 'rallyrl[lora]'") from None

    if config.target_modules != "all-linear":
        names = {name.rsplit(".", 1)[-1] for name, _ in lm.named_modules()}
        missing = sorted(set(config.target_modules) - names)
        if missing:
            linear = {name.rsplit(".", 1)[-1] for name, m in lm.named_modules() if isinstance(m, torch.nn.Linear)}
            raise ConfigError(
                f"lora.target_modules: {missing} not in {type(lm).__name__}; its linear layers are {sorted(linear)} "
                "(or use all-linear)"
            )
    peft_config = LoraConfig(
        r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout, target_modules=config.target_modules,
        exclude_modules=config.exclude or None, task_type="CAUSAL_LM",
    )  # fmt: skip
    peft_model = get_peft_model(lm, peft_config)
    for name, parameter in lm.named_parameters():  # the adapter trains in float32 whatever the base dtype
        if "lora_" in name:
            parameter.data = parameter.data.float()
    return peft_model


def lora_layers(lm: torch.nn.Module) -> dict[str, Any]:
    """{module name: peft LoRA layer} of a model holding an adapter."""
    from peft.tuners.lora import LoraLayer

    return {name: module for name, module in lm.named_modules() if isinstance(module, LoraLayer)}


def merged_names(lm: torch.nn.Module) -> dict[str, str]:
    """{the base model's own name of each weight: its key in ``lm.state_dict()``} of a model holding an
    adapter (the adapter's own weights left out)."""
    return {key.replace(".base_layer.", "."): key for key in lm.state_dict() if "lora_" not in key}


@torch.no_grad()
def merged_weight(layer: Any) -> torch.Tensor:
    """A LoRA layer's weight with its active adapters merged in (``W + scale * B @ A``), in the base's dtype."""
    base = layer.get_base_layer().weight
    delta = sum((layer.get_delta_weight(adapter) for adapter in layer.active_adapters), torch.zeros_like(base))
    return base + delta.to(base.dtype)


@torch.no_grad()
def merged_state_dict(lm: torch.nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The full weights of ``lm`` (holding an adapter) with the adapter merged, under the base
    model's own names: what an engine without adapter support loads."""
    state = lm.state_dict()
    merged = {name: state[key] for name, key in merged_names(lm).items()}
    for name, layer in lora_layers(lm).items():
        merged[f"{name}.weight"] = merged_weight(layer)
    if dtype is not None:
        merged = {key: value.to(dtype) if value.is_floating_point() else value for key, value in merged.items()}
    return merged


def adapter_state_dict(peft_model: Any) -> dict[str, torch.Tensor]:
    """The adapter's weights alone, under peft's saved names."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(peft_model)


def save_adapter(peft_model: Any, directory: Path, base_model: Path, tokenizer: Any = None) -> None:
    """The adapter in peft's format in ``directory`` (which must exist): ``adapter_model.safetensors``,
    ``adapter_config.json`` naming ``base_model`` (resolved, so the directory works from anywhere),
    and the tokenizer."""
    peft_model.peft_config["default"].base_model_name_or_path = str(Path(base_model).resolve())
    peft_model.save_pretrained(str(directory), safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))
