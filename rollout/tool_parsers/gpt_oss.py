"""gpt-oss (harmony): the turn is a sequence of messages, ``HEADER<|message|>BODY`` ended by
``<|end|>``, ``<|call|>`` or ``<|return|>``, each after the first opened by ``<|start|>assistant``.

The header holds ``<|channel|>CHANNEL`` and, for a call, ``to=functions.NAME`` (before or after the
channel) and ``<|constrain|>json``. Calls are the messages with a recipient (arguments: the JSON
body); content is the ``final`` channel's text, else the commentary not addressed to a tool;
``analysis`` is reasoning and is left out. A recipient outside ``functions.`` (``browser.search``,
``python``) is kept whole as the call's name.
"""

from __future__ import annotations

import re

from rollout.tool_parsers.base import (
    ParsedTurn,
    ToolCall,
    _safe,
    _snippet,
    arguments_call,
    dump_json,
    register_parser,
    register_renderer,
)

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL = "<|end|>", "<|call|>"
_MESSAGE_END = re.compile(r"<\|(?:end|call|return)\|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


def _call(recipient: str, body: str) -> ToolCall:
    """The call a message addressed to ``recipient`` makes."""
    name = _safe(recipient.removeprefix("functions."))
    if not name:
        return ToolCall("", None, f"tool call has no function name after to=: {_snippet(body)}")
    if not body.strip():
        return ToolCall(name, None, f"tool call {name!r} has no arguments (expected a JSON object after <|message|>)")
    return arguments_call(name, body)


@register_parser("gpt-oss")
def parse_gpt_oss(text: str) -> ParsedTurn:
    """Harmony messages; text with neither ``<|message|>`` nor ``<|channel|>`` is all content."""
    if MESSAGE not in text and CHANNEL not in text:
        return ParsedTurn(content=text)
    finals: list[str] = []
    commentary: list[str] = []
    calls: list[ToolCall] = []
    position = 0
    while position < len(text):
        message = text.find(MESSAGE, position)
        header = text[position:] if message < 0 else text[position:message]
        recipient = _RECIPIENT.search(header)
        if message < 0:
            if recipient:  # the turn stopped inside a call's header
                name = _safe(recipient[1].removeprefix("functions."))
                calls.append(ToolCall(name, None, f"unfinished tool call header (no <|message|>): {_snippet(header)}"))
            break
        body_start = message + len(MESSAGE)
        end = _MESSAGE_END.search(text, body_start)
        body = text[body_start : end.start() if end else len(text)]
        position = end.end() if end else len(text)
        channel = _CHANNEL.search(header)
        if recipient:
            calls.append(_call(recipient[1], body))
        elif channel and channel[1] == "final":
            finals.append(body)
        elif not channel or channel[1] != "analysis":
            commentary.append(body)
    return ParsedTurn("\n".join(finals or commentary).rstrip(), calls)


@register_renderer("gpt-oss")
def render_gpt_oss(content: str, calls: list[tuple[str, dict]]) -> str:
    """As gpt-oss writes a turn: without calls, a final message; with calls, the content as a
    commentary preamble, then one commentary message per call, each but the first opened by
    ``<|start|>assistant`` (the prompt ends with it) and each but the last ended by ``<|call|>``
    (the turn's stop token)."""
    if not calls:
        return f"{CHANNEL}final{MESSAGE}{content}"
    preamble = f"{CHANNEL}commentary{MESSAGE}{content}{END}{START}assistant" if content else ""
    invocations = [f"{CHANNEL}commentary to=functions.{name} {CONSTRAIN}json{MESSAGE}{dump_json(args, compact=True)}"
                   for name, args in calls]  # fmt: skip
    return preamble + f"{CALL}{START}assistant".join(invocations)
