"""Reasoning turns and the history policy: what a trajectory keeps when a chat template renders earlier
turns otherwise than they were sampled.

Each assistant turn is split by the reasoning format (``rollout/reasoning.py``) into ``reasoning`` and
``content`` (the message keeps both; rewards, answers and tool calls read the content) while its
tokens stay exactly as generated. Some families' templates rewrite history: Qwen3 and GLM-4.5 drop
the reasoning of assistant turns before the last user message, DeepSeek-R1 of every assistant turn.

The policy is to keep the tokens the model actually saw: a trajectory is what was sampled, each
turn conditioned on the reasoning before it, which is what RL must train on (verl does the same). So
the re-rendered conversation differs from the tokens exactly where the format declares. The
consistency check renders the conversation with each assistant turn's text as generated, and when
that differs it applies the declared rewrite to the tokens' own text: if the template's rendering is
then matched, the request records a ``history_rewrite`` (expected, counted apart); anything else is
a real mismatch (``consistency_diff``). An agent that rewrites its own history through the gateway
starts a new sample instead (``rollout/gateway/session.py``).
"""

from __future__ import annotations

from typing import Any

from rollout.reasoning import HarmonyFormat, ReasoningFormat, ReasoningSplit
from rollout.tokens import ChatTokenizer
from rollout.transcript import Transcript


def assistant_message(text: str, fmt: ReasoningFormat | None) -> tuple[dict[str, Any], ReasoningSplit | None]:
    """The assistant message of a generated ``text`` (reasoning beside content) and its split."""
    if fmt is None:
        return {"role": "assistant", "content": text}, None
    split = fmt.split(text)
    message: dict[str, Any] = {"role": "assistant", "content": split.content}
    if split.reasoning is not None:
        message["reasoning"] = split.reasoning
    return message, split


def reasoning_token_count(chat: ChatTokenizer, output_ids: list[int], split: ReasoningSplit | None,
                          fmt: ReasoningFormat | None) -> int:  # fmt: skip
    """Generated tokens of one turn that belong to its reasoning: up to the end marker's token when it
    is one token, every token of a turn that ended inside its reasoning, else the reasoning's encoding."""
    if fmt is None or split is None or split.reasoning is None:
        return 0
    if split.truncated:
        return len(output_ids)
    end = chat.encode(fmt.end) if fmt.end else []
    if len(end) == 1 and end[0] in output_ids:
        return output_ids.index(end[0]) + 1
    return len(chat.encode(split.reasoning))


def generated_turns(messages: list[dict[str, Any]], texts: list[str]) -> list[int]:
    """The indices of the assistant messages ``texts`` were generated for: the last ``len(texts)``
    (earlier ones came with the prompt, as few-shot turns or an agent's history)."""
    assistants = [i for i, message in enumerate(messages) if message.get("role") == "assistant"]
    return assistants[len(assistants) - len(texts) :] if texts else []


def template_view(messages: list[dict[str, Any]], texts: list[str]) -> list[dict[str, Any]]:
    """``messages`` as the template must render them to reproduce the tokens: each generated
    assistant turn's text as generated (``texts``, in order) and no ``reasoning`` key."""
    if not texts:
        return messages
    view = list(messages)
    for index, text in zip(generated_turns(messages, texts), texts, strict=True):
        message = {key: value for key, value in messages[index].items() if key != "reasoning"}
        message["content"] = text
        view[index] = message
    return view


def check_history(
    chat: ChatTokenizer, messages: list[dict[str, Any]], ids: list[int], texts: list[str],
    fmt: ReasoningFormat | None, transcript: Transcript | None = None,
) -> tuple[str | None, str | None]:  # fmt: skip
    """The consistency check of a conversation with reasoning: ``(consistency_diff, history_rewrite)``,
    both None when the re-render reproduces ``ids``; a declared rewrite is not a diff."""
    view = template_view(messages, texts)
    report = chat.check_consistency(view, ids, transcript)
    if report.ok:
        return None, None
    rewrite = None if fmt is None or fmt.history == "keep" else declared_rewrite(chat, view, ids, texts, fmt)
    return (None, rewrite) if rewrite is not None else (report.diff, None)


def declared_rewrite(chat: ChatTokenizer, view: list[dict[str, Any]], ids: list[int], texts: list[str],
                     fmt: ReasoningFormat) -> str | None:  # fmt: skip
    """How the template rewrote history when that explains the whole difference between its rendering
    of ``view`` and ``ids``; None when something else differs."""
    ends_with_assistant = view[-1].get("role") == "assistant"
    if ends_with_assistant and ids and chat.opens_next_message(ids[-1]):  # (GLM-4.5: the last stop opened none)
        ids = ids[:-1]
    kept = chat.decode(ids)
    if chat.encode(kept) != ids:
        return None
    assistants = generated_turns(view, texts)
    users = [i for i, m in enumerate(view) if m.get("role") == "user"]
    last_user = users[-1] if users else -1
    dropped = [k for k, i in enumerate(assistants) if fmt.history == "drop_all" or i < last_user]
    rendered = chat.render(view, add_generation_prompt=not ends_with_assistant)
    tails = chat.closing_tails() if ends_with_assistant else ("",)
    for style in DROP_STYLES:
        rewritten = _drop_reasoning(kept, texts, set(dropped), fmt, style)
        if rewritten is None or rewritten == kept:
            return None
        if rendered.startswith(rewritten) and rendered[len(rewritten) :] in tails:
            changed = sum(fmt.end in texts[k] for k in dropped)
            return f"the {fmt.name} template drops the reasoning of {changed} assistant turn(s); the tokens keep it"
    return None


DROP_STYLES = ("strip", "keep", "empty")
"""How templates cut earlier reasoning: ``content.split(end)[-1]`` with its leading newlines stripped
(Qwen3), as is (DeepSeek-R1), or replaced by an empty block (GLM-4.5: ``\\n<think></think>\\n``)."""


def _drop_reasoning(kept: str, texts: list[str], dropped: set[int], fmt: ReasoningFormat,
                    style: str) -> str | None:  # fmt: skip
    """``kept`` with the reasoning of the assistant turns in ``dropped`` cut as a template cuts it
    (``DROP_STYLES``; gpt-oss: its analysis messages; for a forced format also the opening the
    generation prompt wrote); None when a turn's text cannot be found in order."""
    pieces, cursor = [], 0
    for k, text in enumerate(texts):
        at = kept.find(text, cursor)
        if at < 0:
            return None
        if k not in dropped or fmt.end not in text:
            pieces.append(kept[cursor : at + len(text)])
            cursor = at + len(text)
            continue
        before = kept[cursor:at]
        if fmt.forced and fmt.start and before.rstrip(" \n").endswith(fmt.start):
            before = before[: before.rstrip(" \n").rfind(fmt.start)]
        if isinstance(fmt, HarmonyFormat):
            rest = fmt.split(text).content
        else:
            rest = text.split(fmt.end)[-1]
            rest = rest if style == "keep" else rest.lstrip("\n")
            rest = f"\n{fmt.start}{fmt.end}\n{rest}" if style == "empty" else rest
        pieces.append(before + rest)
        cursor = at + len(text)
    pieces.append(kept[cursor:])
    return "".join(pieces)
