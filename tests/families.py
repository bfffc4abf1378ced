"""Test models of each chat family, built in code (no download): a tokenizer with the family's
markers and a chat template that behaves like the family's own, and a tiny random Qwen2 to run on.

The tokenizer is rallyrl's character tokenizer (``data/tiny_model.py``) widened to every byte: a
``Qwen2Tokenizer`` (byte-level BPE, no merges) whose vocabulary is the family's framing markers
(special tokens) and all 256 byte symbols, with the family's content markers (``<think>``,
``<tool_call>``, ...) as plain added tokens. ASCII characters are one token each, any other
character its UTF-8 bytes. Like Qwen's own tokenizer it normalizes text to NFC (a saved ``qwen2``
directory is loaded as ``Qwen2Tokenizer``, which puts NFC back), so text in NFC form encodes and
decodes back exactly.

The templates (``tests/families_templates/``) print an assistant message's content as given,
except where the family's own template drops the reasoning of earlier turns (``FamilySpec.history``),
and accept system, user, assistant and tool messages and ``tools=``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedTokenizerBase, Qwen2Tokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from data.tiny_model import CHAT_TEMPLATE, TinyModelConfig, build_tiny_model

TEMPLATES = Path(__file__).resolve().parent / "families_templates"

_QWEN_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_QWEN_PLAIN = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
_THINK = ("<think>", "</think>")
_DEEPSEEK_SPECIAL = (
    "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", "<｜User｜>", "<｜Assistant｜>",
    "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
    "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>",
)  # fmt: skip
_DEEPSEEK_HEADER = "{{%- set drop_reasoning = {drop} %}}{{%- set generation_prompt = '{prompt}' %}}"


@dataclass(frozen=True)
class _Recipe:
    template: str
    """File stem under ``families_templates/``."""
    special: tuple[str, ...]
    """Framing markers: special tokens (the first is the padding token)."""
    plain: tuple[str, ...]
    """Content markers: plain added tokens (kept by ``decode(skip_special_tokens=True)``)."""
    eos: str
    stops: tuple[str, ...]
    """What ends the model's turn, ``end_of_turn`` first (a generation config's ``eos_token_id``)."""
    tool_parser: str
    reasoning_parser: str
    history: str
    bos: str | None = None
    header: str = ""
    """Jinja prepended to the template file (settings of a shared file)."""


_RECIPES: dict[str, _Recipe] = {
    "qwen25": _Recipe("", (*_QWEN_SPECIAL,), _QWEN_PLAIN, "<|im_end|>", ("<|im_end|>", "<|endoftext|>"),
                      "qwen25", "none", "keep"),
    "qwen3": _Recipe("qwen3", _QWEN_SPECIAL, _QWEN_PLAIN + _THINK, "<|im_end|>", ("<|im_end|>", "<|endoftext|>"),
                     "qwen25", "qwen3", "drop_before_last_user"),
    "qwen3-thinking": _Recipe("qwen3", _QWEN_SPECIAL, _QWEN_PLAIN + _THINK, "<|im_end|>",
                              ("<|im_end|>", "<|endoftext|>"), "qwen25", "qwen3-thinking", "drop_before_last_user"),
    "qwen3-coder": _Recipe("qwen3_coder", _QWEN_SPECIAL, _QWEN_PLAIN, "<|im_end|>", ("<|im_end|>", "<|endoftext|>"),
                           "qwen3_coder", "none", "keep"),
    "llama3": _Recipe("llama3", ("<|finetune_right_pad_id|>", "<|begin_of_text|>", "<|end_of_text|>",
                                 "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                                 "<|python_tag|>"), (), "<|eot_id|>", ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"),
                      "llama3", "none", "keep", bos="<|begin_of_text|>"),
    "mistral": _Recipe("mistral", ("<pad>", "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                                   "[TOOL_CALLS]", "[ARGS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                                   "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[THINK]", "[/THINK]"),
                       (), "</s>", ("</s>",), "mistral", "mistral", "keep", bos="<s>"),
    "deepseek-r1": _Recipe("deepseek", _DEEPSEEK_SPECIAL, _THINK, "<｜end▁of▁sentence｜>", ("<｜end▁of▁sentence｜>",),
                           "deepseekv3", "deepseek-r1", "drop_all", bos="<｜begin▁of▁sentence｜>",
                           header=_DEEPSEEK_HEADER.format(drop="true", prompt="<｜Assistant｜><think>\\n")),
    "deepseek-v3": _Recipe("deepseek", _DEEPSEEK_SPECIAL, _THINK, "<｜end▁of▁sentence｜>", ("<｜end▁of▁sentence｜>",),
                           "deepseekv3", "deepseek-v3", "keep", bos="<｜begin▁of▁sentence｜>",
                           header=_DEEPSEEK_HEADER.format(drop="false", prompt="<｜Assistant｜>")),
    "gpt-oss": _Recipe("gpt_oss", ("<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                                   "<|constrain|>", "<|return|>", "<|call|>"),
                       (), "<|return|>", ("<|return|>", "<|call|>", "<|endoftext|>"), "gpt-oss", "gpt-oss", "keep"),
    "kimi_k2": _Recipe("kimi_k2", ("[PAD]", "[BOS]", "[EOS]", "<|im_system|>", "<|im_user|>", "<|im_assistant|>",
                                   "<|im_middle|>", "<|im_end|>", "<|tool_calls_section_begin|>",
                                   "<|tool_calls_section_end|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
                                   "<|tool_call_end|>"),
                       ("\u25c1think\u25b7", "\u25c1/think\u25b7"), "[EOS]", ("<|im_end|>", "[EOS]"),
                       "kimi_k2", "kimi", "keep"),
    "glm45": _Recipe("glm45", ("<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
                               "<|observation|>"),
                     _THINK + ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<arg_key>",
                               "</arg_key>", "<arg_value>", "</arg_value>"),
                     "<|endoftext|>", ("<|user|>", "<|observation|>", "<|endoftext|>"), "glm45", "glm45",
                     "drop_before_last_user"),
}  # fmt: skip

FAMILIES: tuple[str, ...] = tuple(_RECIPES)


@dataclass(frozen=True)
class FamilySpec:
    """A family's test tokenizer and the names rallyrl's settings use for it."""

    name: str
    tokenizer: PreTrainedTokenizerBase
    tool_parser: str
    """SGLang's ``--tool-call-parser`` name."""
    reasoning_parser: str
    """SGLang's ``--reasoning-parser`` name, or ``"none"``."""
    end_of_turn: str
    """The token the model ends its turn with (what an engine stops at)."""
    stop_tokens: tuple[str, ...]
    """Every token that ends the model's turn, ``end_of_turn`` first."""
    history: str
    """What this template does with earlier assistant turns' reasoning (``rollout.reasoning.HISTORY_POLICIES``)."""

    @property
    def stop_token_ids(self) -> list[int]:
        return [self.tokenizer.convert_tokens_to_ids(token) for token in self.stop_tokens]


def chat_template(name: str) -> str:
    """The family's chat template text."""
    recipe = _recipe(name)
    if not recipe.template:
        return CHAT_TEMPLATE
    text = recipe.header + (TEMPLATES / f"{recipe.template}.jinja").read_text()
    if name == "qwen3-thinking":  # Qwen3-Thinking-2507: the generation prompt opens the reasoning
        prompt = "{{- '<|im_start|>assistant\\n' }}"
        assert text.count(prompt) == 1
        text = text.replace(prompt, "{{- '<|im_start|>assistant\\n<think>\\n' }}")
    return text


def build_family_tokenizer(name: str) -> PreTrainedTokenizerBase:
    """The family's tokenizer: its markers, every byte, its chat template."""
    recipe = _recipe(name)
    symbols = bytes_to_unicode()  # GPT-2's byte-level alphabet
    vocab = {token: i for i, token in enumerate(recipe.special)}
    for byte in range(256):
        vocab[symbols[byte]] = len(vocab)
    named = {recipe.special[0], recipe.eos, recipe.bos}
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        bos_token=recipe.bos,
        eos_token=recipe.eos,
        pad_token=recipe.special[0],
        unk_token=None,
        extra_special_tokens=[token for token in recipe.special if token not in named],
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    if recipe.plain:
        tokenizer.add_tokens(list(recipe.plain))  # plain added tokens: kept by decode, matched whole by encode
    tokenizer.chat_template = chat_template(name)
    return tokenizer


def family(name: str) -> FamilySpec:
    """The test model spec of family ``name`` (a fresh tokenizer each call)."""
    recipe = _recipe(name)
    return FamilySpec(name, build_family_tokenizer(name), recipe.tool_parser, recipe.reasoning_parser,
                      recipe.stops[0], recipe.stops, recipe.history)  # fmt: skip


def save_family_model(name: str, directory: str | Path, config: TinyModelConfig | None = None) -> Path:
    """Save family ``name``'s tokenizer and a tiny random Qwen2 of its vocabulary size into ``directory``
    (its generation config stops at the family's ``stop_tokens``)."""
    spec = family(name)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(spec.tokenizer, config)
    model.generation_config.eos_token_id = spec.stop_token_ids
    model.save_pretrained(directory)
    spec.tokenizer.save_pretrained(directory)
    return directory


def _recipe(name: str) -> _Recipe:
    try:
        return _RECIPES[name]
    except KeyError:
        raise ValueError(f"unknown family {name!r}: known are {', '.join(FAMILIES)}") from None
