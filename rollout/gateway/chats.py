"""The chat tokenizers of the tool lists agents send, shared between sessions within a memory budget.

A ``ChatTokenizer`` renders one tool list: building it renders and tokenizes the tools several times
(seconds for a large list), and it keeps those renderings, several times the size of the tools' JSON.
Kept for every list ever sent, six different 1 MB lists pinned 800 MiB after their sessions ended. So
the cache holds at most ``MAX_ENTRIES`` of them and ``MAX_BYTES`` of their tools' JSON in all, the least
recently used going first; a list over ``MAX_BYTES / 4`` is not shared at all: the session that sent it
keeps its own, freed when it finishes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from rollout.serve.http import BadRequest
from rollout.tokens import ChatTokenizer, TemplateError

MAX_ENTRIES = 64
"""Most tool lists whose chat tokenizers are kept."""
MAX_BYTES = 512 * 2**10
"""Most bytes of tools JSON, all kept chat tokenizers together."""


class ChatCache:
    """Chat tokenizers by their tools' JSON (``""`` for none), least recently used first out.
    Safe to use from several threads (calls are prepared on worker threads)."""

    def __init__(self, tokenizer: Any, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES,
                 content_special_tokens: str = "text"):  # fmt: skip
        self.tokenizer = tokenizer
        self.content_special_tokens = content_special_tokens
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._chats: OrderedDict[str, ChatTokenizer] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._chats)

    @property
    def bytes(self) -> int:
        """Bytes of tools JSON of the chat tokenizers kept."""
        return self._bytes

    def get(self, tools: list[dict[str, Any]] | None, key: str, own: ChatTokenizer | None = None) -> ChatTokenizer:
        """The chat tokenizer rendering ``tools`` (JSON ``key``): ``own`` (the session's, for the same
        tools) if given, else a kept one, else a new one (kept if it fits the budget)."""
        if own is not None:
            return own
        with self._lock:
            chat = self._chats.get(key)
            if chat is not None:
                self._chats.move_to_end(key)
                return chat
        try:
            chat = ChatTokenizer(self.tokenizer, tools, self.content_special_tokens)
        except TemplateError as exc:
            raise BadRequest(f"tools: {exc}") from None
        except RecursionError:
            raise BadRequest("tools: nested too deeply for the chat template") from None
        if len(key) <= self.max_bytes // 4:
            with self._lock:
                if key not in self._chats:
                    self._chats[key] = chat
                    self._bytes += len(key)
                while len(self._chats) > self.max_entries or self._bytes > self.max_bytes:
                    old, _ = self._chats.popitem(last=False)
                    self._bytes -= len(old)
        return chat
