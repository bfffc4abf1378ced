"""One trajectory, pretty-printed: what happened in a request, turn by turn, and which tokens train.

``rallyrl show FILE [--index I] [--model DIR]`` reads a rollout JSONL file or its parquet export
(``rollout/files/export.py``) and prints, with rich:

1. a header: request id, prompt and sample index, data_source, ground truth, finish_reason,
   error, reward and its parts, turns, tool calls, token counts, weight versions, the state timeline;
2. the conversation: every message, each assistant turn with its tool calls (arguments, latency,
   reward, error) and each tool result under the call it answers;
3. the token view: ``response_ids`` cut into spans of equal ``loss_mask``, trained (1) or
   context (0), with token counts, positions, weight versions and mean logprob, then each span
   in its colour: decoded text with a tokenizer (``--model``), else a summary of the ids.

A split gateway session (``segments``) shows each segment first, as "sample 1 of 3 — split:
<split_reason>" with its conversation and token view, then the request's own (last) sample; the
header counts the tokens of every sample, and turns are numbered over the whole session.

Message text is printed as text, never as rich markup, and with control characters escaped.
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from data.text import terminal_safe, terminal_safe_value
from rollout.files.export import count_parquet_trajectories, is_parquet, read_parquet_trajectory
from rollout.request import validate_trajectory

ROLE_STYLES = {"system": "magenta", "user": "cyan", "assistant": "green", "tool": "yellow"}
TRAINED_STYLE, CONTEXT_STYLE = "green", "dim"


class ShowError(ValueError):
    """Bad input to ``show``: a missing file, a bad line, an index out of range."""


@dataclass
class Located:
    """A trajectory, where it was found, and how many the file holds."""

    record: dict[str, Any]
    index: int
    count: int
    where: str  # "line 3" of a JSONL file, "row 2" of a parquet file


def load_trajectory(path: str | Path, index: int = 0) -> Located:
    """Trajectory ``index`` (0-based, in file order) of a rollout JSONL or parquet file, validated.
    A JSONL file is read line by line and only the chosen line is parsed."""
    path = Path(path)
    try:
        parquet = is_parquet(path)
    except OSError as exc:
        raise ShowError(f"{path}: {exc.strerror or exc}") from None
    if parquet:
        count = count_parquet_trajectories(path)
        _check_index(path, index, count)
        record, where = read_parquet_trajectory(path, index), f"row {index}"
    else:
        count, chosen, number = 0, None, 0
        with path.open("rb") as handle:
            for line_number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                if count == index:
                    chosen, number = line, line_number
                count += 1
        _check_index(path, index, count)
        where = f"line {number}"
        try:
            record = orjson.loads(chosen)  # type: ignore[arg-type]
        except orjson.JSONDecodeError as exc:
            raise ShowError(f"{path} {where}: not JSON: {exc}") from None
    try:
        validate_trajectory(record)
    except ValueError as exc:
        raise ShowError(f"{path} {where}: not a trajectory: {exc}") from None
    return Located(record, index, count, where)


def _check_index(path: Path, index: int, count: int) -> None:
    if count == 0:
        raise ShowError(f"{path} holds no trajectories")
    if not 0 <= index < count:
        raise ShowError(f"--index {index} is out of range: {path} holds {count} trajectories (0..{count - 1})")


def render(located: Located, path: str | Path, tokenizer: Any = None) -> Group:
    """Header, conversation and token view of one trajectory, as rich renderables (every string of it
    ``terminal_safe``: the file keeps a program's NUL or escape bytes, the terminal sees them escaped)."""
    record = terminal_safe_value(located.record)
    title = Text(f"trajectory {located.index} of {located.count} in {path} ({located.where})", style="bold")
    if located.count > 1:
        title.append(f"; --index 0..{located.count - 1} shows the others", style="dim")
    segments = _segments(record)
    if not segments:
        return Group(title, _header(record), *_conversation(record, record), _token_view(record, tokenizer))
    parts: list[Any] = [title, _header(record)]
    total, first = len(segments) + 1, 0
    for number, segment in enumerate(segments, start=1):
        parts.append(Text(f"sample {number} of {total} — split: {segment['split_reason']}", style="bold reverse"))
        parts += _conversation(record, segment, first)
        if segment.get("consistency_diff"):
            parts.append(Text(f"consistency diff: {segment['consistency_diff']}", style="red"))
        parts.append(_token_view(segment, tokenizer))
        first += segment["turns"]
    parts.append(Text(f"sample {total} of {total} — the session's last", style="bold reverse"))
    last = {**record, "turns": max(record["turns"] - first, 0)}
    parts += _conversation(record, last, first)
    parts.append(_token_view(record, tokenizer))
    return Group(*parts)


def _segments(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The earlier samples of a split gateway session (none for other trajectories and older files)."""
    return record.get("segments") or []


# ---------------------------------------------------------------------------------------------
# Header


def _header(record: dict[str, Any]) -> Table:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    rewards = record.get("rewards") if isinstance(record.get("rewards"), dict) else {}
    calls = record["tool_calls"]
    samples = [*_segments(record), record]
    mask = [m for sample in samples for m in sample["loss_mask"]]
    finish = record["finish_reason"]
    rows: list[tuple[str, Text]] = [
        ("request_id", Text(str(record["request_id"]))),
        ("prompt / sample", Text(f"prompt_index {record['prompt_index']}, sample_index {record['sample_index']}")),
        ("data_source", Text(str(record.get("data_source")))),
        ("ground_truth", Text(str(record.get("ground_truth")))),
        ("finish_reason", Text(str(finish), style="green" if finish == "stop" else "yellow")),
    ]
    if record.get("error"):
        rows.append(("error", Text(str(record["error"]), style="red")))
    rows.append(("reward", Text(_number(record["reward"]), style="bold")))
    parts = [f"answer {_number(rewards.get('answer'))}"]
    for key, value in rewards.items():
        if key in ("answer", "final") or value in (None, [], {}):
            continue
        if isinstance(value, list):
            value = ", ".join(map(_number, value))
        elif isinstance(value, dict):
            value = ", ".join(f"{name} {_number(r)}" for name, r in value.items())
        parts.append(f"{key} {_number(value)}")
    rows.append(("reward parts", Text("; ".join(parts))))
    rows.append(("turns", Text(str(record["turns"]))))
    errors = sum(1 for call in calls if isinstance(call, dict) and call.get("error"))
    rows.append(("tool calls", Text(f"{len(calls)}" + (f" ({errors} failed)" if errors else ""))))
    user_turns = _user_turns(record)
    if user_turns:
        scores = ", ".join(_number(t.get("score")) for t in user_turns.values())
        ended = any(t.get("terminated") for t in user_turns.values())
        text = f"{len(user_turns)} (scores {scores}){'; the interaction ended the conversation' if ended else ''}"
        rows.append(("user turns", Text(text)))
    if len(samples) > 1:
        reasons = "; ".join(f"after sample {n}: {s['split_reason']}" for n, s in enumerate(samples[:-1], start=1))
        rows.append(("split session", Text(f"{len(samples)} samples, one reward ({reasons})")))
    trained = sum(mask)
    prompt = sum(len(sample["prompt_ids"]) for sample in samples)
    over = f", over {len(samples)} samples" if len(samples) > 1 else ""
    rows.append(
        (
            "tokens",
            Text(
                f"prompt {prompt}, response {len(mask)}: "
                f"{trained} trained (loss_mask 1), {len(mask) - trained} context (loss_mask 0){over}"
            ),
        )
    )
    versions = Counter(v for s in samples for v in s.get("weight_versions") or [] if isinstance(v, int))
    if versions:
        text = ", ".join(f"{v} ({n} tokens)" for v, n in sorted(versions.items()))
        rows.append(("weight versions", Text(text)))
    rows.append(("timeline", Text(_timeline(_trace(record)))))
    if record.get("consistency_diff"):
        rows.append(("consistency diff", Text(str(record["consistency_diff"]), style="red")))
    if record.get("history_rewrite"):  # declared by the reasoning format, not a failure
        rows.append(("history rewrite", Text(str(record["history_rewrite"]), style="yellow")))
    for key, value in rows:
        table.add_row(key, value)
    return table


def _number(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:g}" if isinstance(value, (int, float)) else str(value)


def _trace(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The trace events that have a state and a time (a hand-edited file may hold others)."""
    return [e for e in record["trace"] if isinstance(e, dict) and isinstance(e.get("t"), (int, float))]


def _timeline(trace: list[dict[str, Any]]) -> str:
    """``pending 0.001 s -> running 0.650 s -> ... -> completed``, from the trace's offsets."""
    steps = []
    for event, following in zip(trace, [*trace[1:], None], strict=True):
        if following is None:
            steps.append(str(event.get("state")))
        else:
            steps.append(f"{event.get('state')} {_seconds(following['t'] - event['t'])}")
    return " -> ".join(steps)


def _user_turns(record: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """The interaction's turns by the assistant turn each answers (none in older files)."""
    turns = record.get("interaction_turns")
    if not isinstance(turns, list):
        return {}
    return {t["turn"]: t for t in turns if isinstance(t, dict) and isinstance(t.get("turn"), int)}


def _float(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) else 0.0


def _seconds(value: float) -> str:
    return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"


def _running_seconds(trace: list[dict[str, Any]]) -> list[float]:
    """Seconds of each RUNNING stretch: the k-th is assistant turn k's generation (and parsing)."""
    return [b["t"] - a["t"] for a, b in itertools.pairwise(trace) if a.get("state") == "running"]


# ---------------------------------------------------------------------------------------------
# Conversation


def _conversation(record: dict[str, Any], sample: dict[str, Any], first: int = 0) -> list[Any]:
    """The messages of ``sample`` (the record itself, or one of its segments) panel by panel; its
    ``turns`` assistant turns are numbered after the session's ``first``, as its tool calls are."""
    messages = sample["messages"]
    turns = sample["turns"]
    assistant_at = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    generated = assistant_at[max(len(assistant_at) - turns, 0) :] if turns else []
    turn_of = {at: k for k, at in enumerate(generated, start=first + 1)}
    spans = [span for span in _spans(sample["loss_mask"]) if span[0] == 1]
    running = _running_seconds(_trace(record))
    calls_by_turn: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for call in record["tool_calls"]:
        if isinstance(call, dict):
            calls_by_turn[call.get("turn", 0)].append(call)
    user_turns = _user_turns(record)
    pending: list[dict[str, Any]] = []  # this turn's calls, answered by the tool messages that follow
    answering: dict[str, Any] | None = None  # the user turn answering the last assistant turn
    out: list[Any] = [Text("conversation", style="bold underline")]
    for i, message in enumerate(messages):
        role = str(message.get("role"))
        title, subtitle = role, None
        if i in turn_of:
            turn = turn_of[i]
            title = f"assistant, turn {turn}"
            facts = []
            if turn - first <= len(spans):
                facts.append(f"{spans[turn - first - 1][2] - spans[turn - first - 1][1]} tokens")
            if turn <= len(running):
                facts.append(f"running {_seconds(running[turn - 1])}")
            subtitle = ", ".join(facts) or None
            pending = list(calls_by_turn.get(turn, []))
            answering = user_turns.get(turn)
        elif role == "assistant":
            title = "assistant (prompt)"
        elif role == "tool" and pending:
            call = pending.pop(0)
            title = f"tool result: {call.get('name')}"
            subtitle = f"latency {_seconds(_float(call.get('latency_s')))}"
            if call.get("error"):
                subtitle += f", error: {call['error']}"
        elif role == "user" and answering is not None:
            title = f"user turn (interaction), answering turn {answering['turn']}"
            latency = _seconds(_float(answering.get("latency_s")))
            subtitle = f"score {_number(answering.get('score'))}, latency {latency}"
            answering = None
        style = ROLE_STYLES.get(role, "white")
        body: Any = Text(str(message.get("content", "")))
        if message.get("reasoning") is not None:  # (a reasoning parser split it off the content)
            body = Group(Text(f"reasoning: {message['reasoning']}", style="dim italic"), body)
        out.append(
            Panel(
                body,
                title=Text(title, style=f"bold {style}"),
                title_align="left",
                subtitle=Text(subtitle) if subtitle else None,
                subtitle_align="right",
                border_style=style,
            )
        )
        if i in turn_of and calls_by_turn.get(turn_of[i]):
            out.append(_calls_table(turn_of[i], calls_by_turn[turn_of[i]]))
        ended = user_turns.get(turn_of.get(i, -1))
        if ended is not None and ended.get("terminated"):
            note = f"the interaction ended the conversation here (score {_number(ended.get('score'))})"
            out.append(Text(note, style="cyan"))
    return out


def _calls_table(turn: int, calls: list[dict[str, Any]]) -> Table:
    table = Table(title=f"tool calls of turn {turn}", title_justify="left", expand=False)
    for name in ("#", "tool", "arguments", "latency", "reward", "error"):
        table.add_column(name)
    for number, call in enumerate(calls, start=1):
        arguments = call.get("arguments")
        shown = "(unparsed)" if arguments is None else orjson.dumps(arguments).decode()
        table.add_row(
            str(number),
            Text(str(call.get("name"))),
            Text(shown),
            _seconds(_float(call.get("latency_s"))),
            _number(call.get("reward")),
            Text(str(call.get("error") or "-"), style="red" if call.get("error") else ""),
        )
    return table


# ---------------------------------------------------------------------------------------------
# Token view


def _spans(mask: list[int]) -> list[tuple[int, int, int]]:
    """(loss_mask value, start, end) of each run of equal mask values in ``response_ids``."""
    spans: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            spans.append((mask[start], start, i))
            start = i
    return spans


def _decode(tokenizer: Any, ids: list[int]) -> str | None:
    try:
        return terminal_safe(tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))
    except Exception:  # a tokenizer that does not know these ids: fall back to the ids
        return None


def _ids_summary(ids: list[int], head: int = 8, tail: int = 4) -> str:
    if len(ids) <= head + tail:
        return " ".join(map(str, ids))
    return " ".join(map(str, ids[:head])) + " ... " + " ".join(map(str, ids[-tail:]))


def _token_view(record: dict[str, Any], tokenizer: Any) -> Group:
    """A table of the loss_mask spans of response_ids, then each span's text (or ids) in its colour."""
    ids, mask, logprobs = record["response_ids"], record["loss_mask"], record["logprobs"]
    versions = record.get("weight_versions") or []
    table = Table(title="response_ids by loss_mask", title_justify="left")
    for name in ("span", "loss_mask", "tokens", "positions", "weight versions", "mean logprob"):
        table.add_column(name, justify="right" if name in ("span", "tokens", "mean logprob") else "left")
    segments: list[Text] = []
    for number, (value, start, end) in enumerate(_spans(mask), start=1):
        span_ids = ids[start:end]
        kind, style = ("trained", TRAINED_STYLE) if value == 1 else ("context", CONTEXT_STYLE)
        used = sorted({v for v in versions[start:end] if isinstance(v, int)})
        lps = [lp for lp in logprobs[start:end] if lp is not None]
        table.add_row(
            str(number),
            Text(f"{value} {kind}", style=style),
            str(end - start),
            f"{start}..{end - 1}",
            ", ".join(map(str, used)) or "-",
            f"{sum(lps) / len(lps):.3f}" if lps else "-",
        )
        decoded = _decode(tokenizer, span_ids) if tokenizer is not None else None
        segment = Text(f"span {number}, {kind}, {end - start} tokens: ", style="bold")
        segment.append(decoded if decoded is not None else f"ids {_ids_summary(span_ids)}", style=style)
        segments.append(segment)
    parts: list[Any] = [Text("tokens", style="bold underline"), table, *segments]
    if not mask:
        parts.append(Text("no response tokens"))
    elif tokenizer is None:
        parts.append(Text("(--model DIR decodes the spans to text)", style="dim"))
    return Group(*parts)
