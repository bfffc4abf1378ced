"""A model directory's tokenizer as the directory declares it, with the model's own stop tokens."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

_GENERIC_TOKENIZER_CLASSES = {"TokenizersBackend", "PreTrainedTokenizerFast"}
MODEL_STOP_IDS = "rallyrl_model_stop_ids"
"""The attribute ``load_tokenizer`` sets on a tokenizer: the model's ``generation_config.json``
``eos_token_id`` list, where it stops generating."""


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Load a local tokenizer as its directory declares it (nothing is downloaded).

    transformers 5 swaps in the model type's own tokenizer class for some models (qwen2
    among them) even when ``tokenizer_config.json`` names the generic fast tokenizer, which
    rebuilds the pre-tokenizer; a directory that declares the generic class gets exactly its
    ``tokenizer.json`` here.
    """
    path = Path(path)
    config_file = path / "tokenizer_config.json"
    declared = json.loads(config_file.read_text()).get("tokenizer_class") if config_file.is_file() else None
    if declared in _GENERIC_TOKENIZER_CLASSES and (path / "tokenizer.json").is_file():
        tokenizer = PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    else:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    generation = path / "generation_config.json"  # the model's stop tokens ride along (ChatTokenizer reads them)
    stops = json.loads(generation.read_text()).get("eos_token_id") if generation.is_file() else None
    if stops is not None:
        setattr(tokenizer, MODEL_STOP_IDS, [stops] if isinstance(stops, int) else list(stops))
    return tokenizer
