"""Evaluation: greedy accuracy and unbiased pass@k of a model on a task or dataset, overall and
per ``data_source``, with a Markdown report (overall table, per-data_source table, example failures)."""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from math import comb
from pathlib import Path
from typing import Any

from rich.table import Table
from rich.text import Text

from data.files import atomic_write_text
from data.reward_fns import RewardFn, final_answer_text
from data.schema import Record
from rollout.config import RolloutConfig
from rollout.engines.base import Engine
from rollout.loop import default_reward
from rollout.request import AsyncRolloutRequest
from rollout.runner import RolloutRunner
from rollout.stats import accuracy
from rollout.tokens import ChatTokenizer
from tools.base import BaseTool
from trainer.config import EvalConfig


def pass_at_k(n: int, correct: int, k: int) -> float:
    """Unbiased pass@k from n samples of which ``correct`` are right (Chen et al., 2021)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - correct < k:
        return 1.0
    return 1.0 - comb(n - correct, k) / comb(n, k)


MAX_FAILURES_PER_SOURCE = 3
"""Greedy failures kept per data_source in the report, as examples."""


def _correct_by_prompt(requests: list[AsyncRolloutRequest]) -> dict[int, list[bool]]:
    by_prompt: dict[int, list[bool]] = defaultdict(list)
    for request in requests:
        by_prompt[request.prompt_index].append(request.rewards.answer == 1.0)
    return by_prompt


def _pass_at_ks(requests: list[AsyncRolloutRequest], ks: list[int]) -> dict[str, float | None]:
    """Mean unbiased pass@k over the graded prompts of ``requests``; None when none is graded."""
    by_prompt = _correct_by_prompt([r for r in requests if r.rewards.answer is not None])
    if not by_prompt:
        return {str(k): None for k in ks}
    return {str(k): sum(pass_at_k(len(c), sum(c), k) for c in by_prompt.values()) / len(by_prompt) for k in ks}


def _failure(request: AsyncRolloutRequest) -> dict[str, Any]:
    """A greedy request graded wrong, as the report shows it: the question and the last answer."""
    users = [m["content"] for m in request.messages if m.get("role") == "user"]
    return {
        "data_source": request.data_source,
        "prompt_index": request.prompt_index,
        "request_id": request.request_id,
        "question": users[-1] if users else "",
        "ground_truth": request.ground_truth,
        "response": final_answer_text(request),
        "finish_reason": request.finish_reason.value if request.finish_reason else None,
        "error": request.error,
        "turns": request.metrics.turns,
        "tool_calls": request.metrics.tool_calls,
    }


async def evaluate(
    engine: Engine,
    chat: ChatTokenizer,
    tools: dict[str, BaseTool],
    records: list[Record],
    config: RolloutConfig,
    *,
    samples_per_prompt: int = 1,
    progress: bool = True,
    reward_fn: RewardFn = default_reward,
    interactions: dict[str, Any] | None = None,
    agent: Any = None,
) -> dict[str, Any]:
    """Greedy accuracy over ``records``, and unbiased pass@k for k = 1, 2, 4, ..., ``samples_per_prompt``
    from that many samples per prompt at ``config.temperature``; the same per ``data_source``
    (``by_data_source``), and up to ``MAX_FAILURES_PER_SOURCE`` greedy failures per source."""
    greedy = dataclasses.replace(config, temperature=0.0)
    runner = RolloutRunner(engine, chat, tools, greedy, progress=progress, reward_fn=reward_fn,
                           interactions=interactions, agent=agent)  # fmt: skip
    result = await runner.run(records, 1)
    report: dict[str, Any] = {
        "prompts": len(records),
        "accuracy": accuracy(result.requests),
        "greedy": result.summary.to_dict(),
        "pass_at_k": {},
    }
    sources = sorted({record.data_source for record in records})
    greedy_by_source = {source: [r for r in result.requests if r.data_source == source] for source in sources}
    by_source: dict[str, dict[str, Any]] = {
        source: {
            "prompts": sum(record.data_source == source for record in records),
            "accuracy": accuracy(greedy_by_source[source]),
            "pass_at_k": {},
        }
        for source in sources
    }
    if samples_per_prompt >= 1:
        runner = RolloutRunner(engine, chat, tools, config, progress=progress, reward_fn=reward_fn,
                               interactions=interactions, agent=agent)  # fmt: skip
        sampled = await runner.run(records, samples_per_prompt)
        ks = sorted({k for k in (1, 2, 4, 8, 16, 32, 64, 128) if k <= samples_per_prompt} | {samples_per_prompt})
        report["pass_at_k"] = {k: v or 0.0 for k, v in _pass_at_ks(sampled.requests, ks).items()}
        report["sampled"] = sampled.summary.to_dict()
        for source in sources:
            by_source[source]["pass_at_k"] = _pass_at_ks([r for r in sampled.requests if r.data_source == source], ks)
    report["by_data_source"] = by_source
    report["failures"] = []
    for source in sources:
        wrong = [r for r in greedy_by_source[source] if r.rewards.answer is not None and r.rewards.answer != 1.0]
        report["failures"] += [_failure(r) for r in wrong[:MAX_FAILURES_PER_SOURCE]]
    return report


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _pass_ks(report: dict[str, Any]) -> list[str]:
    return list(report.get("pass_at_k") or {})


def _cells(part: dict[str, Any], ks: list[str]) -> list[str]:
    """prompts, greedy accuracy and pass@k of the report or of one data_source in it."""
    return [str(part["prompts"]), _number(part["accuracy"]), *(_number(part["pass_at_k"].get(k)) for k in ks)]


def breakdown_table(report: dict[str, Any]) -> Table:
    """The per-data_source table of an ``evaluate`` report, with the overall row last (rich)."""
    ks = _pass_ks(report)
    table = Table(title="evaluation by data_source")
    for name in ("data_source", "prompts", "greedy accuracy", *(f"pass@{k}" for k in ks)):
        table.add_column(name, justify="left" if name == "data_source" else "right")
    rows = [*report.get("by_data_source", {}).items(), ("(all)", report)]
    for i, (source, part) in enumerate(rows):
        last = i == len(rows) - 1
        table.add_row(Text(source), *_cells(part, ks), style="bold" if last else None, end_section=i == len(rows) - 2)
    return table


def _cell(text: Any) -> str:
    """Text for one Markdown table cell: pipes escaped, line breaks flattened."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _code(text: Any) -> str:
    """Inline code (on one line) that backticks inside ``text`` cannot close early."""
    text = " ".join(str(text).split())
    fence = "`" * (max((len(run) for run in re.findall("`+", text)), default=0) + 1)
    return f"{fence} {text} {fence}" if len(fence) > 1 else f"`{text}`"


def _fenced(text: str) -> str:
    """A fenced code block that ``text`` (backticks and all) cannot close early."""
    longest = max((len(run) for run in re.findall("`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}text\n{text}\n{fence}"


def markdown_report(report: dict[str, Any], meta: dict[str, Any] | None = None) -> str:
    """An ``evaluate`` report as Markdown: what was evaluated (``meta``), the overall table, the
    per-data_source table and a few greedy failures."""
    ks = _pass_ks(report)
    head = ["prompts", "greedy accuracy", *(f"pass@{k}" for k in ks)]

    def table(header: list[str], rows: list[list[str]]) -> list[str]:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        return lines + ["| " + " | ".join(cells) + " |" for cells in rows]

    lines = ["# Evaluation report", ""]
    for key, value in (meta or {}).items():
        lines.append(f"- {key}: {_code(value)}")
    if meta:
        lines.append("")
    lines += ["## Overall", "", *table(head, [_cells(report, ks)]), ""]
    by_source = report.get("by_data_source", {})
    lines += ["## By data_source", ""]
    lines += table(["data_source", *head], [[_cell(s), *_cells(part, ks)] for s, part in by_source.items()])
    lines.append("")
    failures = report.get("failures", [])
    lines += ["## Example failures", ""]
    if not failures:
        lines += ["No graded greedy answer was wrong.", ""]
    for number, failure in enumerate(failures, start=1):
        error = f"; error: {_cell(failure['error'])}" if failure["error"] else ""
        lines += [
            f"### {number}. {_cell(failure['data_source'])}, prompt {failure['prompt_index']}",
            "",
            f"- ground truth: {_code(failure['ground_truth'])}",
            f"- finish reason: {failure['finish_reason']}; turns: {failure['turns']}; "
            f"tool calls: {failure['tool_calls']}{error}",
            "",
            "Question:",
            "",
            _fenced(failure["question"]),
            "",
            "Last answer:",
            "",
            _fenced(failure["response"]),
            "",
        ]
    return "\n".join(lines)


def write_markdown_report(report: dict[str, Any], path: str | Path, meta: dict[str, Any] | None = None) -> None:
    """Write ``markdown_report`` to ``path`` atomically (a temporary file renamed over it)."""
    atomic_write_text(path, markdown_report(report, meta))


async def run_eval(config: EvalConfig, records: list[Record] | None = None) -> dict[str, Any]:
    """``rallyrl eval``: the prompts, tools, reward and engine of ``config``, then ``evaluate``."""
    from rollout.api import load_prompts, rollout_session, set_threads

    set_threads(config.threads)
    records = load_prompts(config, config.prompts_wanted) if records is None else records
    async with rollout_session(config) as s:
        return await evaluate(s.engine, s.chat, s.tools, records, config.rollout,
                              samples_per_prompt=config.samples_per_prompt, progress=config.progress,
                              reward_fn=s.reward_fn, interactions=s.interactions, agent=s.agent)  # fmt: skip
