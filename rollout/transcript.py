"""Checking a conversation's tokens as it is built, piece by piece (the incremental consistency check).

A fast tokenizer first cuts its input at its *split tokens* (the added tokens matched before
normalization: ``<|im_start|>``, ``<|im_end|>``, ...; without a normalizer, all added tokens)
and encodes the text between two of them, a *segment*, on its own. So a conversation's ids
equal a full re-encoding of its text exactly when the split tokens agree and every segment's
ids are the encoding of that segment's text.
``SegmentSplitter.of`` admits a tokenizer only when that holds for it (no strip or single-word
rules on split tokens, none inside or overlapping another, no truncation or padding, and probes across every
split token encode the same whole and in parts); otherwise there is no incremental check and
``ChatTokenizer.check_consistency`` re-encodes the whole conversation, as it always did.

``Transcript`` checks each segment once, when the split token that closes it is appended. A
segment inside one piece that rallyrl encoded itself (the prompt, the template's glue, a tool
result) holds by construction; a segment holding engine tokens, or spanning two pieces, is
encoded and compared. What is left for the end is the text: one render of the whole
conversation compared with the pieces' text. Whenever any of it fails, the full check decides,
so the report is always the one a full re-render gives.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from rollout.ascii_tokens import AsciiEncoder

_PROBES = ("", "a", " a", "a ", "\n", "\n\nb 1", "12")
_MAX_KEPT = 4096
"""Template pieces and template-only segments kept encoded."""


def _overlapping(texts: list[str]) -> bool:
    """Whether a split token holds another, or ends with the start of one."""
    if any(a != b and a in b for a in texts for b in texts):
        return True
    starts = {text[:i] for text in texts for i in range(1, len(text))}
    return any(text[i:] in starts for text in texts for i in range(1, len(text)))


def fast_encoder(backend: Any) -> Callable[[str], list[int]]:
    """``backend.encode(text).ids``, through ``encode_batch_fast`` where this tokenizers has it and
    it gives the same ids on probes: it skips computing offsets, a quarter of an encoding's time."""

    def plain(text: str) -> list[int]:
        return backend.encode(text, add_special_tokens=False).ids

    batch = getattr(backend, "encode_batch_fast", None)
    if batch is None:
        return plain

    def fast(text: str) -> list[int]:
        return batch([text], add_special_tokens=False)[0].ids

    try:
        probes = [*_PROBES, "<|im_start|>user\nx = 12 + 3.5 \u65e5\u672c \U0001f600<|im_end|>\n"]
        return fast if all(fast(text) == plain(text) for text in probes) else plain
    except Exception:
        return plain


def _segment_encoder(backend: Any, split_tokens: set[str]) -> Callable[[str], list[int]]:
    """Plain ASCII text in Python where the tokenizer allows it (``rollout/ascii_tokens.py``), else Rust."""
    rust = fast_encoder(backend)
    ascii_encoder = AsciiEncoder.of(backend, split_tokens)
    if ascii_encoder is None:
        return rust

    def encode(text: str) -> list[int]:
        ids = ascii_encoder(text)
        return rust(text) if ids is None else ids

    return encode


class SegmentSplitter:
    """The split tokens of a fast tokenizer, and encoding segment by segment with a cache."""

    def __init__(self, backend: Any, id_of: dict[str, int]):
        self.backend = backend
        self.id_of = id_of
        self.encode_segment: Callable[[str], list[int]] = _segment_encoder(backend, set(id_of))
        """The ids of text that holds no split token."""
        self.split_ids = frozenset(id_of.values())
        alternatives = "|".join(re.escape(text) for text in sorted(id_of, key=len, reverse=True))
        self.pattern = re.compile(f"({alternatives})")
        self._cache: OrderedDict[str, list[int]] = OrderedDict()
        self.cache_size = 512
        self._plans: dict[str, tuple[str, list[int] | None, str]] = {}
        self._fixed: dict[str, list[int] | None] = {}

    @classmethod
    def of(cls, backend: Any) -> SegmentSplitter | None:
        """A splitter when encoding ``backend`` segment by segment is exactly encoding it whole."""
        if backend is None or getattr(backend, "truncation", None) or getattr(backend, "padding", None):
            return None
        if getattr(backend, "encode_special_tokens", False):
            return None
        try:
            added = backend.get_added_tokens_decoder()
        except Exception:
            return None
        plain = backend.normalizer is None  # normalized added tokens then match the text as it is, too
        id_of: dict[str, int] = {}
        for token_id, token in added.items():
            if token.normalized and not plain:
                continue  # matched after normalization, inside a segment: the segment's encoding covers it
            if token.lstrip or token.rstrip or token.single_word or not token.content:
                return None
            id_of[token.content] = token_id
        if not id_of or len(id_of) > 512 or _overlapping(list(id_of)):
            return None  # where a split falls could depend on what follows it
        splitter = cls(backend, id_of)
        return splitter if splitter._probes_agree() else None

    def _probes_agree(self) -> bool:
        def encode(text: str) -> list[int]:
            return self.backend.encode(text, add_special_tokens=False).ids

        try:
            for text, token_id in list(self.id_of.items())[:64]:
                for before in _PROBES:
                    for after in _PROBES:
                        if encode(before + text + after) != encode(before) + [token_id] + encode(after):
                            return False
        except Exception:
            return False
        return True

    def encode(self, text: str, remember: bool = False) -> list[int]:
        """``backend.encode(text)``, segment by segment; a segment's ids are looked up in the cache
        and, with ``remember``, kept there (the prompt's: a system prompt and tool schemas that
        every request shares are encoded once)."""
        ids: list[int] = []
        cache, id_of = self._cache, self.id_of
        for i, part in enumerate(self.pattern.split(text)):
            if i % 2:
                ids.append(id_of[part])
            elif part:
                hit = cache.get(part)
                if hit is None:
                    hit = self.encode_segment(part)
                    if remember:
                        cache[part] = hit
                        if len(cache) > self.cache_size:
                            cache.popitem(last=False)
                elif remember:
                    cache.move_to_end(part)
                ids += hit
        return ids

    def encode_around(self, pieces: list[str], contents: list[str]) -> list[int] | None:
        """The ids of ``pieces[0] + contents[0] + pieces[1] + ...`` (a template's text around message
        contents), encoding only the segments that hold a content: the template's own segments
        are encoded once. None where a split token would fall elsewhere than in the pieces (a
        content that holds one): encode the text then."""
        ids: list[int] = []
        open_text, holds_content = "", False
        for k, piece in enumerate(pieces):
            if k and contents[k - 1]:
                open_text += contents[k - 1]
                holds_content = True
            plan = self._plans.get(piece)
            if plan is None:
                plan = self._plan(piece)
            head, inner, tail = plan
            if inner is None:  # no split token in the piece
                open_text += piece
                continue
            open_text += head
            if open_text:
                segment = self._segment(open_text, holds_content)
                if segment is None:
                    return None
                ids += segment
            ids += inner
            open_text, holds_content = tail, False
        if open_text:
            segment = self._segment(open_text, holds_content)
            if segment is None:
                return None
            ids += segment
        return ids

    def ids_of(self, parts: list[str]) -> list[int]:
        """The ids of ``parts`` as ``pattern.split`` cuts text: segments (encoded) and split tokens, alternately."""
        ids: list[int] = []
        for i, part in enumerate(parts):
            if i % 2:
                ids.append(self.id_of[part])
            elif part:
                ids += self.encode_segment(part)
        return ids

    def _plan(self, piece: str) -> tuple[str, list[int] | None, str]:
        """A piece as (text before its first split token, the ids from there to its last split token
        inclusive, text after it); ``(piece, None, "")`` when it holds none."""
        parts = self.pattern.split(piece)
        if len(parts) == 1:
            plan: tuple[str, list[int] | None, str] = (piece, None, "")
        else:
            plan = (parts[0], self.ids_of(["", *parts[1:-1]]), parts[-1])
        if len(self._plans) < _MAX_KEPT:
            self._plans[piece] = plan
        return plan

    def _segment(self, text: str, holds_content: bool) -> list[int] | None:
        """The ids of the text between two split tokens, None if it holds one (then it is not a segment)."""
        if holds_content:
            return None if self.pattern.search(text) else self.encode_segment(text)
        ids = self._fixed.get(text, False)
        if ids is False:
            ids = None if self.pattern.search(text) else self.encode_segment(text)
            if len(self._fixed) < _MAX_KEPT:
                self._fixed[text] = ids
        return ids  # type: ignore[return-value]


def _positions(ids: list[int], wanted: frozenset[int]) -> list[int]:
    """Where ``wanted`` ids occur in ``ids``, in order (searched in C, not id by id)."""
    positions = []
    for token in wanted.intersection(ids):
        i = ids.index(token)
        while True:
            positions.append(i)
            try:
                i = ids.index(token, i + 1)
            except ValueError:
                break
    positions.sort()
    return positions


class Transcript:
    """The pieces of one conversation's text and ids, each segment checked when it closes.

    ``ok`` stays True while every closed segment's ids are the encoding of its text; ``parts``
    and ``id_parts`` hold what was appended, in order."""

    def __init__(self, splitter: SegmentSplitter):
        self.splitter = splitter
        self.parts: list[str] = []
        self.id_parts: list[list[int]] = []
        self.ok = True
        self._open_text = ""
        self._open_ids: list[int] = []
        self._open_trusted = True

    def append(self, text: str, ids: list[int], trusted: bool) -> None:
        """Add a piece. ``trusted``: ``ids`` is the tokenizer's own encoding of ``text``."""
        self.parts.append(text)
        self.id_parts.append(ids)
        if self.ok:
            self.ok = self._check(text, ids, trusted)

    def _check(self, text: str, ids: list[int], trusted: bool) -> bool:
        splitter, encode = self.splitter, self.splitter.encode_segment
        open_text, open_ids = self._open_text, self._open_ids
        if trusted and not open_text and not open_ids:
            # the segments inside the piece hold by construction: only find its open tail
            last = None
            for last in splitter.pattern.finditer(text):  # noqa: B007 (the last match is wanted)
                pass
            j = len(ids) - 1
            while j >= 0 and ids[j] not in splitter.split_ids:
                j -= 1
            if (last is None) != (j < 0):
                return False
            self._open_text = text if last is None else text[last.end() :]
            self._open_ids = ids if j < 0 else ids[j + 1 :]
            return True  # (still trusted)
        pieces = splitter.pattern.split(open_text + text)
        if not trusted or len(pieces[0]) < len(open_text):
            # engine tokens, or a split token across the boundary (so the piece was not encoded as it
            # is cut here): every segment the piece closes is encoded and compared
            return self._check_untrusted(pieces, open_ids + ids)
        # a trusted piece: its own segments hold; the open segment it closes is checked unless it was trusted too
        ids = open_ids + ids
        positions = _positions(ids, splitter.split_ids)
        if len(positions) != len(pieces) // 2:
            return False
        for k, position in enumerate(positions):
            if splitter.id_of[pieces[2 * k + 1]] != ids[position]:
                return False
        if positions:
            first = positions[0]
            opened_trusted = self._open_trusted and len(pieces[0]) == len(open_text) and first == len(open_ids)
            if not opened_trusted and encode(pieces[0]) != ids[:first]:
                return False
            self._open_trusted = True
            self._open_text, self._open_ids = pieces[-1], ids[positions[-1] + 1 :]
        else:  # the open segment grew
            self._open_trusted = self._open_trusted and not text and len(ids) == len(open_ids)
            self._open_text, self._open_ids = pieces[-1], ids
        return True

    def _check_untrusted(self, pieces: list[str], ids: list[int]) -> bool:
        """The text from the start of the open segment, cut at split tokens (``pieces``), and its ``ids``:
        the segments it closes, encoded one by one, must be where ``ids`` starts; the rest stays open."""
        expected = self.splitter.ids_of(pieces[:-1])
        closed = len(expected)
        if ids[:closed] != expected:
            return False
        self._open_text, self._open_ids = pieces[-1], ids[closed:]
        self._open_trusted = not self._open_text and not self._open_ids
        return True

    def closes(self) -> bool:
        """Whether everything appended checks out, the segment still open included."""
        if not self.ok:
            return False
        if self._open_trusted or (not self._open_text and not self._open_ids):
            return True
        return self.splitter.encode_segment(self._open_text) == self._open_ids

    def holds(self, ids: list[int]) -> bool:
        """Whether ``ids`` is exactly the appended ids, in order."""
        start = 0
        for part in self.id_parts:
            if ids[start : start + len(part)] != part:
                return False
            start += len(part)
        return start == len(ids)

    def closes_after(self, text: str, ids: list[int], trusted: bool) -> bool:
        """Whether everything appended and one more piece (the template's tail after the last turn)
        checks out, without appending it."""
        if not self.ok:
            return False
        state = self._open_text, self._open_ids, self._open_trusted
        try:
            return self._check(text, ids, trusted) and self.closes()
        finally:
            self._open_text, self._open_ids, self._open_trusted = state
