"""Encoding plain ASCII text for a byte-level BPE tokenizer in Python, word by word with a cache.

Most of what a rollout encodes is short ASCII text: an output to check, a tool result, a user
turn. The Rust tokenizer spends most of each call outside the BPE model (a Python-to-Rust call,
normalizing, a regex pass, building an ``Encoding`` with offsets), about 15 us for 64 characters.
For tokenizers built the way byte-level BPE tokenizers are (GPT-2, Llama 3, Qwen: no normalizer
or NFC, a regex ``Split`` and ``ByteLevel`` pre-tokenizer, a BPE model), ``AsciiEncoder`` does the
same steps in Python, where the text is printable ASCII (tabs and line breaks allowed):

- NFC leaves ASCII as it is;
- added tokens matched after normalization are cut out first, longest first, as the tokenizer's
  added vocabulary does;
- the pre-tokenizer's own regex (compiled by the ``regex`` module, which reads its ``\\p{L}`` and
  ``\\p{N}`` the same way on ASCII) cuts the rest into words;
- each word is mapped to the byte-level alphabet and split by the tokenizer's own BPE model
  (``model.tokenize``), once: its ids are kept in a cache.

Anything else (non-ASCII or control characters, text the regex leaves gaps in) returns None and
goes to the Rust tokenizer. ``AsciiEncoder.of`` admits a tokenizer only when its configuration is
one of these and the two agree on a probe corpus (``_probe_texts``).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from itertools import chain
from typing import Any

import regex
from transformers.convert_slow_tokenizer import bytes_to_unicode

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
"""What ``ByteLevel`` splits by when ``use_regex`` is on."""

_NOT_PLAIN = re.compile(r"[^\t\n\r -~]")
"""A character outside printable ASCII, tab and line breaks."""

_MAX_WORDS = 1 << 17


_ALPHABET = str.maketrans(bytes_to_unicode())  # GPT-2's byte-level alphabet: what ``ByteLevel`` feeds the model


class AsciiEncoder:
    """``backend.encode(text).ids`` for printable ASCII text, in Python; None for other text."""

    def __init__(self, model: Any, pattern: str, added: dict[str, int]):
        self.model = model
        self.words = _compiled(pattern)
        self.added = added
        alternatives = "|".join(re.escape(text) for text in sorted(added, key=len, reverse=True))
        self.added_pattern = re.compile(f"({alternatives})") if added else None
        self._cache: dict[str, list[int]] = {}

    @classmethod
    def of(cls, backend: Any, split_tokens: set[str]) -> AsciiEncoder | None:
        """An encoder for ``backend`` when its pipeline is one this reproduces and the two agree on
        probes; ``split_tokens`` are the added tokens the caller cuts text at before (none reach here).
        Kept per backend: a tokenizer is checked once however many chat tokenizers wrap it."""
        return _kept(("encoder", frozenset(split_tokens)), backend, lambda: cls._of(backend, split_tokens))

    @classmethod
    def _of(cls, backend: Any, split_tokens: set[str]) -> AsciiEncoder | None:
        try:
            pattern = _pattern_of(backend)
            if pattern is None:
                return None
            added: dict[str, int] = {}
            for token_id, token in backend.get_added_tokens_decoder().items():
                if token.content in split_tokens:
                    continue
                if token.lstrip or token.rstrip or token.single_word or not token.content:
                    return None
                if not token.content.isascii() or _NOT_PLAIN.search(token.content):
                    return None
                added[token.content] = token_id
            encoder = cls(backend.model, pattern, added)
            for text in _probe_texts(list(added)):
                if any(token in text for token in split_tokens):
                    continue  # (the caller cuts those out first)
                if encoder(text) != backend.encode(text, add_special_tokens=False).ids:
                    return None
            encoder._cache.clear()
            return encoder
        except Exception:  # another tokenizers, another pipeline
            return None

    def __call__(self, text: str) -> list[int] | None:
        if not text.isascii() or _NOT_PLAIN.search(text):
            return None
        if self.added_pattern is None:
            return self._words(text)
        ids: list[int] = []
        for i, part in enumerate(self.added_pattern.split(text)):
            if i % 2:
                ids.append(self.added[part])
            elif part:
                words = self._words(part)
                if words is None:
                    return None
                ids += words
        return ids

    def _words(self, text: str) -> list[int] | None:
        words = self.words.findall(text)
        if sum(map(len, words)) != len(text):  # a gap the regex left: not a case handled here
            return None
        try:
            return list(chain.from_iterable(map(self._cache.__getitem__, words)))
        except KeyError:  # a word not met yet
            pass
        cache = self._cache
        if len(cache) + len(words) > _MAX_WORDS:
            cache.clear()
        found: dict[str, list[int]] = {}  # this call's own: another thread may clear the cache meanwhile
        for word in words:
            if word not in found:
                ids = cache.get(word)
                if ids is None:
                    ids = cache[word] = [token.id for token in self.model.tokenize(word.translate(_ALPHABET))]
                found[word] = ids
        return list(chain.from_iterable(map(found.__getitem__, words)))


def _compiled(pattern: str) -> Any:
    """The word regex for ASCII text: with its Unicode classes spelled out in ASCII for the ``re``
    module (twice as fast as ``regex`` on these patterns) where that is possible, else as it is."""
    ascii_pattern = _ascii_pattern(pattern)
    if ascii_pattern is not None:
        try:
            return re.compile(ascii_pattern, re.ASCII)
        except re.error:
            pass
    return regex.compile(pattern)


_ASCII_CLASSES = {"L": "A-Za-z", "N": "0-9"}
_PROPERTY = re.compile(r"\\([pP])\{(\w+)\}")


def _ascii_pattern(pattern: str) -> str | None:
    """``pattern`` with ``\\p{L}`` and ``\\p{N}`` as ASCII ranges (what they match in ASCII text);
    None where it holds another property or a nested class."""
    out: list[str] = []
    i, in_class = 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            match = _PROPERTY.match(pattern, i)
            if match is None:
                out.append(pattern[i : i + 2])
                i += 2
                continue
            if match.group(1) == "P" or match.group(2) not in _ASCII_CLASSES:
                return None
            chars = _ASCII_CLASSES[match.group(2)]
            out.append(chars if in_class else f"[{chars}]")
            i = match.end()
            continue
        if c == "[":
            if in_class:
                return None
            in_class = True
            out.append(c)
            i += 1
            if pattern.startswith("^", i):
                out.append("^")
                i += 1
            if pattern.startswith("]", i):  # a literal ] first in a class
                out.append("\\]")
                i += 1
            continue
        if c == "]" and in_class:
            in_class = False
        out.append(c)
        i += 1
    return "".join(out)


_KEPT: dict[tuple[Any, ...], tuple[Any, Any]] = {}


def _kept(key: tuple[Any, ...], backend: Any, make: Callable[[], Any]) -> Any:
    """``make()``, once per key and state of ``backend`` (held here, so that its id is not reused):
    its vocabulary size (added tokens included) and pipeline, so that a tokenizer changed since
    is checked again."""
    try:
        steps = (backend.normalizer, backend.pre_tokenizer, backend.decoder)
        state = (
            backend.get_vocab_size(with_added_tokens=True),
            *(None if s is None else s.__getstate__() for s in steps),
        )
    except Exception:
        return make()
    key = (*key, id(backend), state)
    hit = _KEPT.get(key)
    if hit is not None and hit[0] is backend:
        return hit[1]
    if len(_KEPT) >= 32:
        _KEPT.clear()
    made = make()
    _KEPT[key] = (backend, made)
    return made


def _pattern_of(backend: Any) -> str | None:
    """The word regex of a byte-level BPE pipeline this module reproduces, else None."""
    normalizer = backend.normalizer
    if normalizer is not None and json.loads(normalizer.__getstate__()).get("type") not in ("NFC", "NFKC"):
        return None
    if type(backend.model).__name__ != "BPE":
        return None
    model = json.loads(backend.model.__getstate__())
    if model.get("dropout") or model.get("byte_fallback") or model.get("continuing_subword_prefix"):
        return None
    if model.get("end_of_word_suffix"):
        return None
    if backend.pre_tokenizer is None:
        return None
    spec = json.loads(backend.pre_tokenizer.__getstate__())
    steps = spec["pretokenizers"] if spec.get("type") == "Sequence" else [spec]
    if len(steps) == 1 and _byte_level(steps[0], use_regex=True):
        return GPT2_PATTERN
    if len(steps) == 2 and _byte_level(steps[1], use_regex=False):
        split = steps[0]
        if split.get("type") == "Split" and split.get("behavior") == "Isolated" and not split.get("invert"):
            regex_text = (split.get("pattern") or {}).get("Regex")
            return regex_text if isinstance(regex_text, str) else None
    return None


def _byte_level(step: dict[str, Any], use_regex: bool) -> bool:
    return step.get("type") == "ByteLevel" and not step.get("add_prefix_space") and step.get("use_regex") == use_regex


def _probe_texts(added: list[str]) -> list[str]:
    """Texts the two encoders must agree on: the hard cases of the usual regexes (runs of spaces and
    line breaks, contractions in both cases, digits, punctuation runs) and seeded random mixes."""
    texts = [
        "",
        " ",
        "  ",
        "\n",
        "\n\n",
        " \n ",
        "\r\n",
        "\t",
        "a",
        " a",
        "a ",
        "a  b",
        "a   \n  b",
        "x\n\n\ny",
        "it's",
        "IT'S",
        "we'll they've I'M you'd don't",
        "'s",
        "''",
        "12345",
        " 12 + 3.5 = 15.5",
        "x=-1e-9",
        '{"name": "calculator", "arguments": {"expression": "3*(4+5)"}}',
        "<think>\nok</think>\n\n",
        "  leading and trailing  ",
        "tabs\tand\ttabs",
        "$$\\frac{1}{2}$$",
        "a.b,c;d:e!f?g",
        "~`!@#$%^&*()_+-=[]{}|",
        "The answer is 42.",
        "def f(x):\n    return x ** 2\n",
    ]
    rng = random.Random(1234)
    alphabet = "aZ09 \n\t\r'.,:;!?-_()[]{}\"/\\<>|=+*&^%$#@~`sStTmMlLdDvVrReE"
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        if added and rng.random() < 0.5:
            cut = rng.randint(0, len(text))
            text = text[:cut] + rng.choice(added) + text[cut:]
        texts.append(text)
    return texts


class AsciiDecoder:
    """``backend.decode(ids, skip_special_tokens=False)`` for byte-level BPE tokenizers, where every id
    decodes to printable ASCII on its own: their texts joined (what the ``ByteLevel`` decoder does
    with such tokens). Ids with other bytes (a part of a multi-byte character, a control byte) or
    unknown ids raise KeyError: decode those with the Rust tokenizer."""

    def __init__(self, texts: dict[int, str]):
        self.texts = texts

    @classmethod
    def of(cls, backend: Any) -> AsciiDecoder | None:
        """A decoder for ``backend`` when its decoder is ``ByteLevel`` alone and the two agree on probes
        (kept per backend)."""
        return _kept(("decoder",), backend, lambda: cls._of(backend))

    @classmethod
    def _of(cls, backend: Any) -> AsciiDecoder | None:
        try:
            if backend.decoder is None or json.loads(backend.decoder.__getstate__()).get("type") != "ByteLevel":
                return None
            if type(backend.model).__name__ != "BPE":
                return None
            byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
            texts: dict[int, str] = {}
            for token, token_id in backend.get_vocab(with_added_tokens=False).items():
                raw = bytes(byte_of[char] for char in token if char in byte_of)
                if len(raw) == len(token) and raw.isascii() and not _NOT_PLAIN.search(text := raw.decode()):
                    texts[token_id] = text
            for token_id, token in backend.get_added_tokens_decoder().items():
                texts.pop(token_id, None)
                if token.content.isascii() and not _NOT_PLAIN.search(token.content):
                    texts[token_id] = token.content
            decoder = cls(texts)
            rng = random.Random(1234)
            ids = sorted(texts)
            for n in [*range(1, 9), *[rng.randint(1, 64) for _ in range(300)]]:
                probe = [rng.choice(ids) for _ in range(n)]
                if decoder(probe) != backend.decode(probe, skip_special_tokens=False):
                    return None
            return decoder if texts else None
        except Exception:
            return None

    def __call__(self, ids: list[int]) -> str:
        return "".join(map(self.texts.__getitem__, ids))
