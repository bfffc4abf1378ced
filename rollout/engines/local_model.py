"""The embedded engine's model: where it runs (device, dtype), loading it from a directory, and
checking a weight update against it before it reaches the batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from rollout.engines.base import EngineError


def resolve_device(name: str) -> torch.device:
    """``auto``: CUDA when present, else the CPU; any other name as torch reads it."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 on CUDA, float32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def load_model(path: str | Path) -> PreTrainedModel:
    """A local Hugging Face model directory, in float32 (nothing is downloaded)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise EngineError(f"{path} is not a model directory (no config.json)")
    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)


def check_state_dict(model: torch.nn.Module, state_dict: dict[str, Any]) -> None:
    """EngineError when ``state_dict`` names a parameter ``model`` lacks or has one of another shape."""
    current = model.state_dict()
    unknown = sorted(set(state_dict) - set(current))
    if unknown:
        raise EngineError(f"update_weights: unknown parameters {unknown[:5]}")
    wrong = [k for k, v in state_dict.items() if tuple(v.shape) != tuple(current[k].shape)]
    if wrong:
        name = wrong[0]
        raise EngineError(
            f"update_weights: {name} has shape {tuple(state_dict[name].shape)}, "
            f"the model's is {tuple(current[name].shape)}"
        )
