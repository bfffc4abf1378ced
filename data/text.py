"""Text helpers shared by the rollout loop, the judge and the tools."""

from __future__ import annotations


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
