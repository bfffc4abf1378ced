"""A plain ``openai.AsyncOpenAI`` tool-calling agent for the calc task, as anyone would write it for any
OpenAI-compatible endpoint: it owns its calculator and its loop; rallyrl only gives it a base URL.

    rallyrl train --config data/configs/grpo_calc_agent.yaml      # trains it (agent: data.agents.calc_openai:run)

``run_rewriting`` is the same agent with a history-rewriting step: after each tool round it folds
the assistant's call and the tool's result into one short note, as context-compressing agents do.
The gateway then cannot keep the session one token sequence, and records it as several samples.
"""

from __future__ import annotations

import json
from typing import Any

import openai

from tools.calculator import CalculatorError, evaluate, format_number

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Exact arithmetic: + - * / // % ** and parentheses.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
MAX_TURNS = 3


def calculator(arguments: str) -> str:
    """The tool: the result of ``{"expression": ...}``, or an ``Error: ...`` text for the model to read."""
    try:
        expression = json.loads(arguments).get("expression")
        if not isinstance(expression, str):
            raise CalculatorError("calculator needs 'expression', a string such as '12*(3+4)'")
        return format_number(evaluate(expression))
    except (CalculatorError, json.JSONDecodeError, AttributeError) as exc:
        return f"Error: {exc}"


async def run(base_url: str, record: dict[str, Any], rewrite: bool = False) -> None:
    """Answer ``record["prompt"]``, calling the calculator as the model asks, for at most ``MAX_TURNS``
    answers. The gateway grades the final answer against the record's ground truth."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages: list[dict[str, Any]] = list(record["prompt"])
    try:
        for _ in range(MAX_TURNS):
            reply = await client.chat.completions.create(model="rallyrl", messages=messages, tools=[CALCULATOR])
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return
            results = [(call, calculator(call.function.arguments)) for call in message.tool_calls]
            if rewrite:  # fold the call and its result into one note
                notes = [f"{json.loads(c.function.arguments or '{}').get('expression', '?')} = {r}" for c, r in results]
                messages[-1:] = [{"role": "user", "content": "Calculator results: " + "; ".join(notes)}]
            else:
                messages += [{"role": "tool", "tool_call_id": call.id, "content": result} for call, result in results]
    finally:
        await client.close()


async def run_rewriting(base_url: str, record: dict[str, Any]) -> None:
    """``run`` with the history-rewriting step."""
    await run(base_url, record, rewrite=True)
