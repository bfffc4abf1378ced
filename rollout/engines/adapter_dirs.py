"""LoRA adapter directories (peft's format) wherever a model directory is taken: ``--model`` of
``rollout``, ``eval`` and ``serve`` accepts one, its base resolved from ``adapter_config.json``,
and gets the base with the adapter merged in (``merged_model_dir``); ``rallyrl export-model
--merge`` writes such a merged directory for good.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


class AdapterError(ValueError):
    """An adapter directory that cannot be used: the message names the file and the fix."""


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def adapter_base(path: str | Path) -> Path:
    """The base model directory an adapter directory names (its ``base_model_name_or_path``)."""
    config_file = Path(path) / ADAPTER_CONFIG
    try:
        base = json.loads(config_file.read_text()).get("base_model_name_or_path")
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{config_file}: cannot read the adapter's config ({exc})") from None
    if not base or not (Path(base) / "config.json").is_file():
        raise AdapterError(
            f"{config_file}: base_model_name_or_path {base!r} is not a model directory on this machine; "
            "set it to the base model's directory"
        )
    return Path(base)


def load_merged(adapter_dir: str | Path, dtype: Any = None) -> Any:
    """The base model of ``adapter_dir`` with the adapter merged in: a plain Hugging Face model."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_dir = adapter_base(adapter_dir)
    base = AutoModelForCausalLM.from_pretrained(base_dir, local_files_only=True, dtype=dtype or torch.float32)
    return PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()


def export_merged(adapter_dir: str | Path, out_dir: str | Path, dtype: Any = None) -> Path:
    """A merged model directory (weights, config, tokenizer) from an adapter directory, written
    atomically: what SGLang and vLLM load as any model."""
    from data.disk_space import tensor_bytes
    from data.files import atomic_directory
    from rollout.tokens import load_tokenizer

    model = load_merged(adapter_dir, dtype)
    has_tokenizer = (Path(adapter_dir) / "tokenizer_config.json").is_file()
    tokenizer = load_tokenizer(Path(adapter_dir) if has_tokenizer else adapter_base(adapter_dir))

    def write(partial: Path) -> None:
        model.save_pretrained(partial, safe_serialization=True)
        tokenizer.save_pretrained(partial)

    needed = tensor_bytes(model.state_dict())
    return atomic_directory(Path(out_dir), write, needed, "merged model")


def merged_model_dir(adapter_dir: str | Path) -> Path:
    """A merged model directory for ``adapter_dir``, made once per adapter version under the temp
    directory (keyed by the adapter's files and base) and reused after."""
    adapter_dir = Path(adapter_dir).resolve()
    key = hashlib.sha256(str(adapter_base(adapter_dir).resolve()).encode())
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        key.update((adapter_dir / name).read_bytes() if (adapter_dir / name).is_file() else b"")
    out = Path(tempfile.gettempdir()) / f"rallyrl-merged-{os.getuid()}-{key.hexdigest()[:16]}"
    if not (out / "config.json").is_file():
        export_merged(adapter_dir, out)
    return out
