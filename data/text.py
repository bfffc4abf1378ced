"""Text helpers shared by the rollout loop, the judge and the tools."""

from __future__ import annotations

import re
from typing import Any


def truncate_middle(text: str, limit: int) -> str:
    """Keep the head and tail of ``text`` within ``limit`` characters, marking the cut."""
    if len(text) <= limit:
        return text
    marker = f"\n...[{len(text) - limit} characters cut]...\n"
    keep = max(limit - len(marker), 0)
    head = keep - keep // 2
    return text[:head] + marker + text[len(text) - keep // 2 :]


def valid_text(text: str) -> str:
    """``text`` with lone surrogates (which no tokenizer or JSON encoder takes) replaced."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")


_UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def terminal_safe(text: str) -> str:
    """``text`` for a terminal: control characters (NUL, ESC and the rest of C0 and C1 but newline and
    tab, DEL) and bidirectional overrides written as escapes (``\\x1b``, ``\\u202e``), so that nothing
    a program or a model wrote can move the cursor, recolour or rewrite the screen. Trajectories keep
    the raw text (what the model saw); this is for printing only."""
    return _UNPRINTABLE.sub(lambda m: repr(m[0])[1:-1], text)


def terminal_safe_value(value: Any) -> Any:
    """``value`` (JSON-like: dicts, lists, strings, numbers) with every string made ``terminal_safe``."""
    if isinstance(value, str):
        return terminal_safe(value)
    if isinstance(value, dict):
        return {terminal_safe_value(k): terminal_safe_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [terminal_safe_value(item) for item in value]
    return value
