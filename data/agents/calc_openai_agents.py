"""The calc agent written with the OpenAI Agents SDK (``pip install openai-agents``), as its documentation
shows for any OpenAI-compatible provider: an ``Agent`` with a ``function_tool``, run by ``Runner``, its
model an ``OpenAIChatCompletionsModel`` over an ``AsyncOpenAI`` client. The only rallyrl-specific part
is the client's base URL (the gateway's session).

    rallyrl rollout --agent data.agents.calc_openai_agents:run --num-prompts 8 -n 2 --out calc_agents.jsonl
    rallyrl train --config data/configs/grpo_calc_agent.yaml --agent data.agents.calc_openai_agents:run

Tracing is disabled (``set_tracing_disabled(True)``; ``OPENAI_AGENTS_DISABLE_TRACING=1`` does the same):
the SDK would otherwise export every run's trace to OpenAI's servers, and nothing here may reach the
internet. The SDK renders its own tool schema (titles, ``additionalProperties``, ``strict``), not the
one the embedded model was trained with, so that model answers less well here than in ``calc_openai``.

A run the SDK stops (``MaxTurnsExceeded``: still calling tools at its last turn; ``ModelBehaviorError``:
a call to a tool it does not have, or arguments that are not JSON) ends the session cleanly, so the
gateway grades it as it stands (reward 0 for no answer) and the trainer learns from it; left to
propagate, the session would end as an error, which training skips.
"""

from __future__ import annotations

from typing import Any

from agents import (
    Agent,
    MaxTurnsExceeded,
    ModelBehaviorError,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

from tools.calculator import CalculatorError, evaluate, format_number

MAX_TURNS = 3

set_tracing_disabled(True)


@function_tool
def calculator(expression: str) -> str:
    """Exact arithmetic: + - * / // % ** and parentheses."""
    try:
        return format_number(evaluate(expression))
    except CalculatorError as exc:
        return f"Error: {exc}"


async def run(base_url: str, record: dict[str, Any]) -> None:
    """Answer the record's user message under its system prompt, the SDK calling the calculator as the
    model asks, for at most ``MAX_TURNS`` model calls. The gateway grades the final answer."""
    system = next((m["content"] for m in record["prompt"] if m["role"] == "system"), None)
    question = next(m["content"] for m in reversed(record["prompt"]) if m["role"] == "user")
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    try:
        agent = Agent(
            name="calc",
            instructions=system,
            tools=[calculator],
            model=OpenAIChatCompletionsModel(model="rallyrl", openai_client=client),
        )
        await Runner.run(agent, question, max_turns=MAX_TURNS)
    except MaxTurnsExceeded:
        pass  # the model was still calling tools at its last turn: the session ends as it stands
    except ModelBehaviorError:
        pass  # it called a tool the agent does not have, or wrote arguments that are not JSON: graded as is
    finally:
        await client.close()
