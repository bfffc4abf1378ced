"""Message contents tokenized as text: a substring of a system, user or tool message's content that
spells an added token of the tokenizer (``<|im_end|>``, ``<|im_start|>``, ``<tool_call>``, ``<think>``,
the EOS string ...) becomes the ordinary tokens of its characters, never that token's id, so an
environment, a tool or a user cannot forge a turn boundary in the model's context (``ChatTokenizer``'s
``content_special_tokens="text"``, the default; ``RolloutConfig.content_special_tokens``). The chat
template's own text keeps its tokens, and so does an assistant message's content: it is what the model
writes (its generated turns are the engine's ids anyway).

How: before the template renders a conversation, each such substring of a content is replaced by a mask,
so every added token left in the rendered text is the template's own. The text is cut at those as the
tokenizer cuts it (the tokens matched before normalization first, then the normalized ones: see
``rollout/transcript.py``), and a piece that holds a mask is encoded, the masks put back, by the tokenizer
without its added tokens. Only a conversation whose contents hold such a substring takes this path; any
other is encoded as it always was, and gets the same ids either way (a piece of text that spells no added
token encodes the same with them or without them).
"""

from __future__ import annotations

import contextlib
import json
import re
import secrets
import weakref
from collections.abc import Callable
from typing import Any

from rollout.template_pieces import TemplateError
from rollout.transcript import fast_encoder

Messages = list[dict[str, Any]]
Encode = Callable[[str], list[int]]

_MARK = f"\u2063{secrets.token_hex(6)}-"
"""A mask is ``_MARK``, the index of the substring it stands for, and ``\\u2063``; the random part keeps
a content from spelling one."""
_MASK = re.compile(re.escape(_MARK) + "([0-9]+)\u2063")


class ContentsAsText(str):
    """A rendered text whose ids hold its contents as text: not the tokenizer's own encoding of it, so
    the incremental consistency check (``rollout/transcript.py``) checks its ids rather than trust them."""


def _without_added_tokens(backend: Any) -> Encode:
    """``backend`` with no added tokens: every added token's string is encoded as the text it is."""
    from tokenizers import Tokenizer

    data = json.loads(backend.to_str())
    data["added_tokens"], data["truncation"], data["padding"] = [], None, None
    return fast_encoder(Tokenizer.from_str(json.dumps(data)))


class ContentText:
    """The added tokens of one tokenizer, and encoding a conversation with its contents as text."""

    def __init__(self, added: dict[int, Any], plain: bool, text_encoder: Callable[[], Encode]):
        """``added``: the tokenizer's added tokens by id; ``plain``: whether all of them are matched before
        normalization (no normalizer); ``text_encoder`` builds the encoder without added tokens."""
        self.id_of = {token.content: token_id for token_id, token in added.items() if token.content}
        self.pattern = _alternatives(self.id_of)
        self.search = self.pattern.search if self.pattern is not None else (lambda text: None)
        raw = {text for text, token_id in self.id_of.items() if plain or not added[token_id].normalized}
        self._raw = _alternatives(raw)
        self._normalized = _alternatives(set(self.id_of) - raw)
        self._lstrip = {token.content for token in added.values() if token.lstrip}
        self._rstrip = {token.content for token in added.values() if token.rstrip}
        self._text_encoder = text_encoder
        self._text_encode: Encode | None = None

    @classmethod
    def of(cls, tokenizer: Any) -> ContentText:
        """The tokenizer's (one per tokenizer object: building the encoder without added tokens reads
        its whole vocabulary, so it is built on first use and kept)."""
        size = len(tokenizer)  # (tokens added since: build it again)
        try:
            kept = _KEPT[tokenizer]
            if kept[0] == size:
                return kept[1]
        except (KeyError, TypeError):
            pass
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            content = cls(backend.get_added_tokens_decoder(), backend.normalizer is None,
                          lambda: _without_added_tokens(backend))  # fmt: skip
        else:  # transformers' Python tokenizers match every added token on the text as it is
            content = cls(dict(tokenizer.added_tokens_decoder), True, lambda: lambda text: tokenizer.encode(
                text, add_special_tokens=False, split_special_tokens=True))  # fmt: skip
        with contextlib.suppress(TypeError):  # (not weakly referenceable: built again next time)
            _KEPT[tokenizer] = (size, content)
        return content

    def holds(self, messages: Messages) -> bool:
        """Whether a content that is not the model's (any role but assistant) spells an added token."""
        search = self.search
        for message in messages:
            content = message.get("content")
            if type(content) is str and message.get("role") != "assistant" and search(content):
                return True
        return False

    def render(self, messages: Messages, render: Callable[[Messages], str], encode: Encode) -> tuple[str, list[int]]:
        """The text ``render`` gives for ``messages`` and its ids, with the added tokens spelled by
        contents (``holds``) encoded as text; ``encode`` encodes the pieces that hold none of them. A
        TemplateError where the template does anything with such a content but print it."""
        originals: list[str] = []

        def mask(match: re.Match[str]) -> str:
            originals.append(match.group())
            return f"{_MARK}{len(originals) - 1}\u2063"

        masked, roles = [], set()
        for message in messages:
            content = message.get("content")
            if type(content) is str and message.get("role") != "assistant" and self.search(content):
                message = {**message, "content": self.pattern.sub(mask, content)}  # type: ignore[union-attr]
                roles.add(str(message.get("role")))
            masked.append(message)
        masked_text = render(masked)
        text = _MASK.sub(lambda match: originals[int(match.group(1))], masked_text)
        if text != render(messages):
            raise TemplateError(
                f"the chat template renders a {'/'.join(sorted(roles))} message whose content spells a special "
                "token otherwise than around its text, so the content cannot be tokenized as text; set "
                "rollout.content_special_tokens: tokens to encode such strings as special tokens"
            )
        return ContentsAsText(text), self._ids(masked_text, originals, encode)

    def _ids(self, masked_text: str, originals: list[str], encode: Encode) -> list[int]:
        """Cut at the template's tokens matched before normalization; a piece holding a mask is cut at
        its normalized ones and the rest encoded as text, any other piece encoded by ``encode``."""
        ids: list[int] = []
        for part, token in self._cut(masked_text, self._raw):
            if part and _MARK not in part:
                ids += encode(part)
            elif part:
                for piece, inner in self._cut(part, self._normalized):
                    if piece:
                        ids += self._encode_text(_MASK.sub(lambda match: originals[int(match.group(1))], piece))
                    if inner is not None:
                        ids.append(self.id_of[inner])
            if token is not None:
                ids.append(self.id_of[token])
        return ids

    def _cut(self, text: str, pattern: re.Pattern[str] | None) -> list[tuple[str, str | None]]:
        """``text`` as (text before a token, the token) pairs, the last token None; whitespace a token
        takes on its left or right (its ``lstrip``, ``rstrip``) is left out, as the tokenizer leaves it."""
        parts = [text] if pattern is None else pattern.split(text)
        cut: list[tuple[str, str | None]] = []
        for i in range(0, len(parts), 2):
            part, token = parts[i], parts[i + 1] if i + 1 < len(parts) else None
            if i and parts[i - 1] in self._rstrip:
                part = part.lstrip()
            if token in self._lstrip:
                part = part.rstrip()
            cut.append((part, token))
        return cut

    def _encode_text(self, text: str) -> list[int]:
        if self._text_encode is None:
            self._text_encode = self._text_encoder()
        return self._text_encode(text)


def _alternatives(texts: set[str] | dict[str, int]) -> re.Pattern[str] | None:
    """One of ``texts``, the longest first (None for none)."""
    if not texts:
        return None
    return re.compile("(" + "|".join(re.escape(text) for text in sorted(texts, key=len, reverse=True)) + ")")


_KEPT: weakref.WeakKeyDictionary[Any, tuple[int, ContentText]] = weakref.WeakKeyDictionary()
