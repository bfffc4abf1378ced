"""Reasoning ("thinking") parts of a model turn, by model family: how each marks them and how to split them off.

A format is named as SGLang's ``--reasoning-parser``. ``split`` separates a turn's text into its
reasoning and its content (what rewards, answer extraction and tool parsing read) and says whether
the text ended inside the reasoning (the token budget ran out while thinking). It never raises.

- ``<think>``-style families: reasoning is the text between the markers (surrounding newlines
  stripped); content the text after the end marker with leading newlines stripped, as the chat
  templates themselves cut it (``content.split('</think>')[-1].lstrip('\\n')``). A *forced* format's
  generation prompt already opened the reasoning, so its output starts inside it (an opening marker
  the model writes anyway is skipped); the others have reasoning only when the text opens with
  the start marker (after whitespace).
- ``gpt-oss`` (harmony): reasoning is the text of the ``analysis`` channel's messages; content is
  the rest of the text unchanged (the tool parser reads the commentary and final channels from it).

``history`` declares what the family's own chat template does with the reasoning of earlier
assistant turns when it renders a conversation again: ``keep``, ``drop_before_last_user`` (turns
before the last user message lose it) or ``drop_all``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

HISTORY_POLICIES = ("keep", "drop_before_last_user", "drop_all")


@dataclass(frozen=True)
class ReasoningSplit:
    """A turn's text cut in two."""

    reasoning: str | None
    """The reasoning part; None where the turn has none."""
    content: str
    """The rest: what rewards, answer extraction and tool parsing read."""
    truncated: bool
    """The text ended inside the reasoning (no closing marker): the budget ran out while thinking."""


@dataclass(frozen=True)
class ReasoningFormat:
    """How one family marks reasoning in its output."""

    name: str
    start: str
    end: str
    forced: bool
    """The generation prompt already opened the reasoning: the output starts inside it."""
    history: str
    """What the family's chat template does with earlier turns' reasoning (``HISTORY_POLICIES``)."""

    def split(self, text: str) -> ReasoningSplit:
        """The reasoning and content of ``text``; never raises."""
        stripped = text.lstrip()
        opened = stripped.startswith(self.start)
        if not opened and not self.forced:
            return ReasoningSplit(None, text, False)
        body = stripped if opened else text  # forced, with no opening marker: all of it is reasoning
        while body.startswith(self.start):  # a forced prompt's marker the model wrote again, too
            body = body[len(self.start) :]
        reasoning, found, content = body.rpartition(self.end)
        if not found:
            return ReasoningSplit(body.strip("\n"), "", True)
        return ReasoningSplit(reasoning.strip("\n"), content.lstrip("\n"), False)


_HARMONY_HEADER = re.compile(r"(?:<\|start\|>assistant[^<]*)?<\|channel\|>analysis(?:\s[^<]*)?<\|message\|>")
"""An analysis message's header: ``<|channel|>analysis<|message|>``, after ``<|start|>assistant`` past the first."""
_HARMONY_END = "<|end|>"


@dataclass(frozen=True)
class HarmonyFormat(ReasoningFormat):
    """gpt-oss's harmony messages: reasoning is the ``analysis`` channel."""

    def split(self, text: str) -> ReasoningSplit:
        """The analysis messages' text as reasoning, the rest of ``text`` unchanged as content."""
        parts: list[str] = []
        kept: list[str] = []
        position, truncated = 0, False
        while (header := _HARMONY_HEADER.search(text, position)) is not None:
            kept.append(text[position : header.start()])
            stop = text.find(_HARMONY_END, header.end())
            if stop < 0:  # the message never ended: generation stopped inside the reasoning
                parts.append(text[header.end() :].strip("\n"))
                position, truncated = len(text), True
                break
            parts.append(text[header.end() : stop].strip("\n"))
            position = stop + len(_HARMONY_END)
        kept.append(text[position:])
        if not parts:
            return ReasoningSplit(None, text, False)
        return ReasoningSplit("\n".join(parts), "".join(kept), truncated)


REASONING_FORMATS: dict[str, ReasoningFormat] = {
    fmt.name: fmt
    for fmt in (
        ReasoningFormat("qwen3", "<think>", "</think>", forced=False, history="drop_before_last_user"),
        ReasoningFormat("qwen3-thinking", "<think>", "</think>", forced=True, history="drop_before_last_user"),
        ReasoningFormat("deepseek-r1", "<think>", "</think>", forced=True, history="drop_all"),
        ReasoningFormat("deepseek-v3", "<think>", "</think>", forced=False, history="drop_all"),
        ReasoningFormat("glm45", "<think>", "</think>", forced=False, history="drop_before_last_user"),
        ReasoningFormat("kimi", "\u25c1think\u25b7", "\u25c1/think\u25b7", forced=False, history="keep"),
        HarmonyFormat("gpt-oss", "<|channel|>analysis<|message|>", _HARMONY_END, False, "drop_before_last_user"),
        ReasoningFormat("mistral", "[THINK]", "[/THINK]", forced=False, history="keep"),
    )
}
"""The known formats by SGLang ``--reasoning-parser`` name."""


def get_reasoning_format(name: str | None) -> ReasoningFormat | None:
    """The format called ``name``; None for ``"none"`` (or no name). A ValueError names the known ones."""
    if name is None or name == "none":
        return None
    try:
        return REASONING_FORMATS[name]
    except KeyError:
        known = ", ".join(["none", *REASONING_FORMATS])
        raise ValueError(f"unknown reasoning format {name!r}: known are {known}") from None
