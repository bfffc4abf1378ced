"""Plain-ASCII encoding and decoding in Python (``rollout/ascii_tokens.py``) give the Rust tokenizer's
ids and text exactly, on byte-level BPE tokenizers with merges built here the way Qwen's, Llama 3's
and GPT-2's are; tokenizers of other kinds are left to Rust."""

from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from data.tiny_model import CHAT_TEMPLATE
from rollout.ascii_tokens import AsciiDecoder, AsciiEncoder
from rollout.tokens import ChatTokenizer

WORDS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|DIGITS| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
WORDS += r"|\s+(?!\S)|\s+"
QWEN = WORDS.replace("DIGITS", r"\p{N}")
LLAMA3 = WORDS.replace("DIGITS", r"\p{N}{1,3}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TAGS = ["<tool_call>", "</tool_call>", "<think>", "</think>"]
CORPUS = [
    "The answer is 42. Let's compute 12 * 7 = 84, then 84 + 3 = 87.\n",
    '<tool_call>{"name": "calculator", "arguments": {"expression": "3*(4+5)"}}</tool_call>\n',
    "def f(x):\n    return x ** 2  # it's squared\n\n",
    "We'll see: they've done it, I'm sure you'd agree; don't worry!\n",
    "  indented\ttabs\r\nand windows lines   trailing   \n",
] * 40


def byte_level_bpe(kind: str) -> PreTrainedTokenizerFast:
    """A small byte-level BPE with merges, trained here: ``qwen`` (NFC, Qwen's split regex), ``llama3``
    (no normalizer, digits in threes) or ``gpt2`` (ByteLevel's own regex)."""
    tokenizer = Tokenizer(models.BPE())
    if kind == "qwen":
        tokenizer.normalizer = normalizers.NFC()
    if kind == "gpt2":
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN if kind == "qwen" else LLAMA3), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])  # fmt: skip
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIAL,
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.add_tokens([AddedToken(tag, normalized=True, special=False) for tag in TAGS])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", chat_template=CHAT_TEMPLATE)


KINDS = ["qwen", "llama3", "gpt2"]


@pytest.fixture(scope="module", params=KINDS)
def bpe(request):
    return byte_level_bpe(request.param)


@functools.cache
def chat_of(tokenizer) -> ChatTokenizer:
    return ChatTokenizer(tokenizer)


@functools.cache
def backend_and_encoder(tokenizer):
    backend = tokenizer.backend_tokenizer
    chat = ChatTokenizer(tokenizer)
    assert chat._splitter is not None
    encoder = AsciiEncoder.of(backend, set(chat._splitter.id_of))
    assert encoder is not None
    return backend, encoder, chat._splitter


ASCII_TEXT = st.lists(
    st.one_of(
        st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=12),
        st.sampled_from(["\n", "\r\n", "\t", "  ", "'s", "'LL", " 123456", "\n\n  ", *TAGS]),
    ),
    max_size=12,
).map("".join)


@settings(max_examples=300, deadline=None)
@given(text=ASCII_TEXT)
def test_ascii_text_encodes_to_the_rust_tokenizers_ids(bpe, text):
    backend, encoder, splitter = backend_and_encoder(bpe)
    assert len(bpe.get_vocab()) > 300  # merges were learned
    for segment in splitter.pattern.split(text)[::2]:  # (the text between split tokens is what it gets)
        assert encoder(segment) == backend.encode(segment, add_special_tokens=False).ids
    assert splitter.encode(text) == backend.encode(text, add_special_tokens=False).ids


def test_the_merges_are_used_and_other_text_goes_to_rust(bpe):
    _, encoder, _ = backend_and_encoder(bpe)
    text = "The answer is 42. Let's compute"
    assert len(encoder(text)) < len(text) / 2
    for text in ["caf\u00e9", "\u65e5\u672c", "a\x0bb", "bell\x07", "\x7f"]:
        assert encoder(text) is None


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_chat_tokenizer_decodes_any_ids_as_rust_does(bpe, data):
    chat = chat_of(bpe)
    assert chat._ascii_decode is not None
    ids = data.draw(st.lists(st.integers(0, len(bpe) - 1), max_size=40))
    assert chat.decode(ids) == bpe.backend_tokenizer.decode(ids, skip_special_tokens=False)


def test_the_decoder_leaves_partial_characters_and_control_bytes_to_rust(bpe):
    decoder = AsciiDecoder.of(bpe.backend_tokenizer)
    vocab = bpe.backend_tokenizer.get_vocab(with_added_tokens=False)
    partial = vocab["\u00c3"]  # the byte 0xC3 alone: the start of a two-byte character
    with pytest.raises(KeyError):
        decoder([partial])
    chat = ChatTokenizer(bpe)
    assert chat.decode([partial]) == bpe.backend_tokenizer.decode([partial], skip_special_tokens=False) == "\ufffd"


def test_pipelines_it_does_not_reproduce_get_no_python_path():
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    assert AsciiEncoder.of(tokenizer, set()) is None  # a lowercasing normalizer

    wordpiece = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.Whitespace()
    wordpiece.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]"]))
    assert AsciiEncoder.of(wordpiece, set()) is None
    assert AsciiDecoder.of(wordpiece) is None


def test_an_encoder_that_disagrees_on_the_probes_is_refused(monkeypatch):
    import rollout.ascii_tokens as ascii_tokens

    tokenizer = byte_level_bpe("qwen")
    monkeypatch.setattr(ascii_tokens, "_pattern_of", lambda backend: r"\S+|\s+")  # words with their punctuation
    assert AsciiEncoder.of(tokenizer.backend_tokenizer, set(SPECIAL)) is None


def test_a_whole_conversation_is_checked_without_rust_and_still_catches_a_non_canonical_split(bpe):
    """Engine tokens that spell the right text the wrong way (one merge undone) fail the incremental
    check, as they fail the full re-render."""
    from test_consistency_incremental import assert_same_as_full_check, run

    from tests.conftest import ScriptedEngine

    chat = ChatTokenizer(bpe)
    text = "The answer is 42."
    canonical = chat.encode(text) + [bpe.convert_tokens_to_ids("<|im_end|>")]
    split = next(i for i, token in enumerate(canonical) if len(bpe.decode([token])) > 1)
    pieces = [chat.encode(c) for c in bpe.decode([canonical[split]])]
    bent = canonical[:split] + [p for piece in pieces for p in piece] + canonical[split + 1 :]
    assert chat.decode(bent) == chat.decode(canonical)

    class Fixed(ScriptedEngine):
        async def generate(self, input_ids, sampling, rid):
            generation = await super().generate(input_ids, sampling, rid)
            generation.output_ids, generation.output_logprobs = bent, [0.0] * len(bent)
            return generation

    request = run(Fixed(chat, lambda turn, prompt, rid: text), chat)
    assert request.consistency_diff is not None
    assert_same_as_full_check(chat, request)


def test_a_tokenizer_is_checked_once_and_again_after_it_changes():
    backend = byte_level_bpe("qwen").backend_tokenizer
    first = AsciiEncoder.of(backend, set(SPECIAL))
    assert AsciiEncoder.of(backend, set(SPECIAL)) is first
    backend.add_tokens([AddedToken("<calc>", normalized=True, special=False)])
    second = AsciiEncoder.of(backend, set(SPECIAL))
    assert second is not first
    assert second("x <calc>y") == backend.encode("x <calc>y", add_special_tokens=False).ids
