"""The tiny embedded model's pieces: a character-level tokenizer with a tool-aware ChatML
template, and a small Qwen2-architecture model built from scratch (no download).

Every printable ASCII character (plus newline and tab) is one token; the chat markers and
the tool tags are single tokens. Other characters map to ``<unk>``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

EMBEDDED_MODEL = Path(__file__).resolve().parent / "assets" / "tiny-calc"
"""The shipped tiny-calc model (``rallyrl sft --recipe tiny-calc`` rebuilds it): the default of every command."""

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

# ChatML with tools, laid out like Qwen2.5's template but short, for a model that reads
# characters: tool schemas as JSON in the system turn, consecutive tool results grouped
# into one user turn of <tool_response> blocks.
CHAT_TEMPLATE = (
    "{% if messages and messages[0].role == 'system' %}"
    "{% set system = messages[0].content %}{% set rest = messages[1:] %}"
    "{% else %}{% set system = none %}{% set rest = messages %}{% endif %}"
    "{% if tools %}"
    "<|im_start|>system\n{% if system %}{{ system }}\n\n{% endif %}"
    "# Tools\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    'Call a tool as <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>\n'
    "{% elif system %}<|im_start|>system\n{{ system }}<|im_end|>\n{% endif %}"
    "{% for message in rest %}"
    "{% if message.role == 'tool' %}"
    "{% if loop.first or rest[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n<tool_response>\\n' }}{{ message.content }}\n</tool_response>"
    "{% if loop.last or rest[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def char_vocab() -> list[str]:
    """Token strings in id order: special tokens, tool tags, then one per character."""
    chars = ["\n", "\t"] + [chr(c) for c in range(32, 127)]
    return SPECIAL_TOKENS + TOOL_TOKENS + chars


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level ``PreTrainedTokenizerFast`` with the chat template: one token per character.

    It is a BPE model with no merges and no pre-tokenizer, which splits text into characters
    (an unknown one becomes ``<unk>``) about three times faster than a per-character regex
    pre-tokenizer in front of a WordLevel model, with the same ids.
    """
    vocab = {token: i for i, token in enumerate(char_vocab())}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>"],
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    tokenizer.add_tokens(TOOL_TOKENS)  # plain added tokens: kept by decode, matched whole by encode
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@dataclass
class TinyModelConfig:
    """Size of a tiny Qwen2 model; the defaults give about 0.9 M parameters."""

    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 384
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02
    seed: int = 0


def build_tiny_model(tokenizer: PreTrainedTokenizerFast, config: TinyModelConfig | None = None) -> Qwen2ForCausalLM:
    """A randomly initialised Qwen2ForCausalLM sized for ``tokenizer`` (float32, eval mode)."""
    config = config or TinyModelConfig()
    qwen = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        max_position_embeddings=config.max_position_embeddings,
        initializer_range=config.initializer_range,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(config.seed)
    model = Qwen2ForCausalLM(qwen)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval()


def save_tiny_model(directory: str | Path, config: TinyModelConfig | None = None) -> Path:
    """Build the tokenizer and a random tiny model and save both as a Hugging Face directory."""
    directory = Path(directory)
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, config)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
