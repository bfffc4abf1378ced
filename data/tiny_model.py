"""The tiny embedded model's pieces: a character-level tokenizer with a tool-aware ChatML
template, and a small Qwen2-architecture model built from scratch (no download).

Every printable ASCII character (plus newline and tab) is one token; the chat markers and
the tool tags are single tokens. The tokenizer is a ``Qwen2Tokenizer`` (byte-level BPE with
Qwen2's pre-tokenizer and no merges) whose vocabulary holds just those bytes, so every loader
reads the directory the same way: transformers 5 gives a ``qwen2`` model directory that class
whatever its ``tokenizer_config.json`` says, and SGLang and vLLM load it through
``AutoTokenizer``. As in any byte-level BPE, a byte with no token is dropped: characters
outside printable ASCII have none.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase, Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from data.embedded import EMBEDDED_MODEL  # noqa: F401  (its home before; many import it from here)

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


def build_char_tokenizer() -> PreTrainedTokenizerBase:
    """A character-level ``Qwen2Tokenizer`` with the chat template: one token per character.

    Its vocabulary is ``char_vocab()`` with each character written as its byte-level symbol
    (a space is ``\u0120``, a newline ``\u010a``), no merges; the special tokens and tool tags
    are added tokens matched whole.
    """
    symbols = bytes_to_unicode()  # GPT-2's byte-level alphabet
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for token in char_vocab()[len(SPECIAL_TOKENS) :]:
        vocab[token if token in TOOL_TOKENS else symbols[ord(token)]] = len(vocab)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        extra_special_tokens=["<|im_start|>"],
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


def build_tiny_model(tokenizer: PreTrainedTokenizerBase, config: TinyModelConfig | None = None) -> Qwen2ForCausalLM:
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
