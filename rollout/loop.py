"""The driver: one coroutine moves one request through its states.

    create tools (+ start interaction) -> render prompt -> generate -> parse ->
        (call tools -> append results | user turn -> append it)* -> reward -> release (+ finalize)

Read ``run_request`` top to bottom; everything it calls is in this file or named by import.
A failure inside a request ends that request with ``finish_reason=error``; cancellation ends
it with ``abort``. Either way every created tool instance is released exactly once, and every
started interaction instance is finalized exactly once.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import orjson

from data.reward_fns import RewardFn
from data.text import truncate_middle, valid_text
from rollout.config import RolloutConfig
from rollout.deadlines import timeout_after, within
from rollout.engines.base import Engine, SamplingParams
from rollout.history import assistant_message, reasoning_token_count
from rollout.parsers import ToolCall, get_parser
from rollout.reasoning import ReasoningSplit, get_reasoning_format
from rollout.request import AsyncRolloutRequest, FinishReason, InteractionTurn, RequestState, ToolCallRecord
from rollout.scoring import UserTurns, default_reward, describe_error, interaction_name, note_error, score_request
from rollout.tokens import ChatTokenizer
from rollout.transcript import Transcript
from rollout.user_threads import CONTAINED
from tools.base import BaseTool, ToolError, ToolResponse


def user_turns_for(request: AsyncRolloutRequest, interactions: dict[str, Any] | None) -> UserTurns | None:
    """The interaction named by the request's ``interaction_kwargs`` (None without interactions
    or kwargs). An unknown name is a ValueError, which ends this request."""
    if not interactions:
        return None
    kwargs = request.extra.get("interaction_kwargs")
    if not kwargs:
        return None
    if not isinstance(kwargs, dict):
        raise ValueError(f"interaction_kwargs: expected a mapping, got {type(kwargs).__name__}")
    name = kwargs.get("name")
    if name is None and len(interactions) == 1:
        name = next(iter(interactions))
    interaction = interactions.get(name) if isinstance(name, str) else None
    if interaction is None:
        raise ValueError(
            f"interaction_kwargs.name: {name!r} names no interaction of the interaction config "
            f"(it has {', '.join(sorted(interactions))})"
        )
    return UserTurns(interaction, dict(kwargs))  # passed on whole, name included, as verl passes them


async def run_request(
    request: AsyncRolloutRequest,
    engine: Engine,
    chat: ChatTokenizer,
    tools: dict[str, BaseTool],
    config: RolloutConfig,
    reward_fn: RewardFn = default_reward,
    interactions: dict[str, Any] | None = None,
) -> AsyncRolloutRequest:
    """Drive ``request`` from PENDING to COMPLETED. Never raises, except CancelledError.
    ``interactions`` (by name) play the user's turns of requests whose record names one."""
    created: list[tuple[BaseTool, str]] = []
    user: UserTurns | None = None
    cancelled = False
    transcript: Transcript | None = None  # the tokens' text, checked piece by piece (rollout/transcript.py)
    try:
        # PENDING: one instance of every tool for this request, and of its interaction
        for name, tool in tools.items():
            create_kwargs = request.tools_kwargs.get(name, {}).get("create_kwargs", {})
            try:
                # the request's id, as verl passes it: tools of one environment share its instance by it
                instance_id = await within(tool.create(request.request_id, **create_kwargs),
                                           config.tool_reward_timeout_s)  # fmt: skip
            except CONTAINED as exc:
                raise ToolCreateError(f"create of tool {name} failed: {describe_error(exc)}") from exc
            created.append((tool, instance_id))
            request.tool_instance_ids[name] = instance_id
        user = user_turns_for(request, interactions)
        if user is not None:
            try:
                user.instance_id = await within(
                    user.interaction.start_interaction(None, **user.kwargs), config.tool_reward_timeout_s
                )
            except CONTAINED as exc:
                what = f"start_interaction of {interaction_name(user)}"
                raise ToolCreateError(f"{what} failed: {describe_error(exc)}") from exc
            await _start_messages(request, user, config)
        _add_initial_observations(request, created)
        prompt_text, request.prompt_ids = chat.prompt(request.messages)
        transcript = chat.transcript(prompt_text, request.prompt_ids)
        request.transition(RequestState.RUNNING)
        await _converse(request, engine, chat, tools, config, transcript, user)
    except asyncio.CancelledError:
        cancelled = True
        request.finish(FinishReason.ABORT, "cancelled")
        raise
    except (ToolCreateError, InteractionError) as exc:
        request.finish(FinishReason.ERROR, str(exc))
    except CONTAINED as exc:  # engine failure, template error: this request only
        request.finish(FinishReason.ERROR, f"{type(exc).__name__}: {exc}")
    finally:
        if request.state is not RequestState.COMPLETED:
            request.transition(RequestState.COMPLETED)
        try:
            if not cancelled:
                await score_request(request, created, chat, config, reward_fn, transcript, user)
        finally:  # even when cancelled while scoring
            await _release(request, created, config, user)
    return request


class ToolCreateError(RuntimeError):
    """A tool's create (or the interaction's start) failed or timed out: the request ends with this error."""


class InteractionError(RuntimeError):
    """The interaction failed or timed out producing the user's turn: the request ends with this error."""


async def _converse(
    request: AsyncRolloutRequest,
    engine: Engine,
    chat: ChatTokenizer,
    tools: dict[str, BaseTool],
    config: RolloutConfig,
    transcript: Transcript | None,
    user: UserTurns | None = None,
) -> None:
    """RUNNING <-> TOOL_CALLING (and INTERACTING, with a user) until the model stops calling tools
    and the user (if any) ends the conversation, or a budget runs out."""
    parser = get_parser(config.tool_parser, chat.tools)
    reasoning = get_reasoning_format(config.reasoning_parser)
    split: ReasoningSplit | None = None
    sampling: SamplingParams | None = None
    while True:
        budget = min(config.max_new_tokens, config.max_model_len - len(request.prompt_ids) - len(request.response_ids))
        if config.max_response_tokens is not None:
            budget = min(budget, config.max_response_tokens - len(request.response_ids))
        if budget <= 0:
            request.finish(FinishReason.LENGTH)
            return
        seed = None if config.seed is None else turn_seed(config.seed, request, request.metrics.turns)
        if sampling is None or sampling.max_new_tokens != budget or sampling.seed != seed:  # (else last turn's)
            sampling = SamplingParams(
                max_new_tokens=budget,
                temperature=config.temperature,
                top_p=config.top_p,
                top_k=config.top_k,
                stop_token_ids=chat.stop_token_ids,
                seed=seed,
            )
        generation = await engine.generate(request.all_ids, sampling, request.request_id)
        if generation.output_ids:
            request.metrics.turns += 1
            request.append_generated(
                generation.output_ids, generation.output_logprobs, generation.token_weight_versions()
            )
            text = chat.assistant_text(generation.output_ids)
            message, split = assistant_message(text, reasoning)  # reasoning beside content, tokens as generated
            request.messages.append(message)
            request.assistant_texts.append(text)
            request.metrics.reasoning_tokens += reasoning_token_count(chat, generation.output_ids, split, reasoning)
            chat.add_output(transcript, generation.output_ids, text)
        if generation.finish_reason == "abort":
            request.finish(FinishReason.ABORT, "aborted by the engine")
            return
        if generation.finish_reason == "length" or not generation.output_ids:
            request.metrics.truncated_in_reasoning = bool(generation.output_ids and split and split.truncated)
            request.finish(FinishReason.LENGTH)
            return
        turn = parser(message["content"])
        request.metrics.parsed_calls += len(turn.calls)  # (those of a turn with no turns left too)
        request.metrics.malformed_calls += sum(call.error is not None for call in turn.calls)
        if not turn.calls and user is None:
            request.finish(FinishReason.STOP)
            return
        if not turn.calls:  # the model answered: the user's turn
            request.transition(RequestState.INTERACTING)
            reply = await _user_turn(request, user, config)
            if reply is None:  # the user ended the conversation
                request.finish(FinishReason.STOP)
                return
            if request.metrics.turns >= config.max_turns or (
                config.max_user_turns is not None and request.metrics.user_turns > config.max_user_turns
            ):
                request.finish(FinishReason.MAX_TURNS)
                return
            new_messages = [{"role": "user", "content": reply}]
        else:
            if request.metrics.turns >= config.max_turns:
                request.finish(FinishReason.MAX_TURNS)
                return
            request.transition(RequestState.TOOL_CALLING)
            records = await _call_tools(request, turn.calls, tools, config)
            new_messages = [{"role": "tool", "content": record.text} for record in records]
        request.messages += new_messages
        delta = chat.delta_after(generation.output_ids, chat.delta(new_messages))
        request.append_context(chat.assistant_close_ids(generation.output_ids) + delta[1])
        chat.add_context(transcript, generation.output_ids, delta)
        request.transition(RequestState.RUNNING)


async def _call_tools(
    request: AsyncRolloutRequest, calls: list[ToolCall], tools: dict[str, BaseTool], config: RolloutConfig
) -> list[ToolCallRecord]:
    """Run the calls of one turn concurrently; one record (and tool message) per call, in order."""
    turn = request.metrics.turns
    allowed, skipped = calls[: config.max_parallel_calls], calls[config.max_parallel_calls :]
    if len(allowed) == 1:  # no task for a single call
        records = [await _call_tool(request, turn, allowed[0], tools, config)]
    else:
        records = list(await asyncio.gather(*(_call_tool(request, turn, call, tools, config) for call in allowed)))
    for call in skipped:
        message = f"skipped: at most {config.max_parallel_calls} tool calls are run per turn"
        records.append(ToolCallRecord(turn, call.name, call.arguments, f"Error: {message}", error=message))
    for call, record in zip(calls, records, strict=True):  # (allowed, then skipped: the calls' order)
        request.tool_calls.append(record)
        request.rewards.step.append(record.reward)
        request.metrics.tool_calls += 1
        request.metrics.tool_errors += record.error is not None
        request.metrics.failed_calls += record.error is not None and call.error is None
    return records


async def _call_tool(
    request: AsyncRolloutRequest, turn: int, call: ToolCall, tools: dict[str, BaseTool], config: RolloutConfig
) -> ToolCallRecord:
    """Execute one call. Every failure becomes an ``Error: ...`` text for the model to read."""
    record = ToolCallRecord(turn, call.name, call.arguments, "")
    started = time.monotonic()
    tool = tools.get(call.name)
    error: str | None = None
    if call.error is not None:
        error = call.error
    elif tool is None:
        error = f"unknown tool {call.name!r}; available tools: {', '.join(sorted(tools)) or 'none'}"
    elif (problem := tool.check_arguments(call.arguments or {})) is not None:
        error = f"bad arguments for {call.name}: {problem}"
    else:
        execute_kwargs = request.tools_kwargs.get(call.name, {}).get("execute_kwargs", {})
        try:
            instance_id = request.tool_instance_ids[call.name]
            with timeout_after(config.tool_timeout_s):
                response = await tool.execute(instance_id, call.arguments or {}, **execute_kwargs)
            if not isinstance(response, ToolResponse):
                raise TypeError(f"execute returned {type(response).__name__}, not ToolResponse")
            record.text, record.reward = str(response.text), float(response.reward)
            if not math.isfinite(record.reward):
                raise ValueError(f"step reward {record.reward} is not a finite number")
            if type(response.metrics) is not dict or response.metrics:  # JSON-safe, whatever it held
                record.metrics = orjson.loads(orjson.dumps(response.metrics, default=repr))
        except TimeoutError:
            error = f"tool {call.name} timed out after {config.tool_timeout_s:g} s"
        except ToolError as exc:
            error = str(exc)
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():  # type: ignore[union-attr]  # this request is being cancelled
                raise
            error = f"tool {call.name} failed: it raised CancelledError"  # the tool's own, not ours
        except CONTAINED as exc:
            error = f"tool {call.name} failed: {type(exc).__name__}: {exc}"
    if error is not None:
        error = valid_text(truncate_middle(error, config.max_tool_response_chars))
        record.error, record.text = error, f"Error: {error}"
    record.text = valid_text(truncate_middle(record.text, config.max_tool_response_chars))
    record.latency_s = time.monotonic() - started
    return record


async def _user_turn(request: AsyncRolloutRequest, user: UserTurns, config: RolloutConfig) -> str | None:
    """INTERACTING: the interaction's reply to the conversation so far; None when it ends it.
    Its turn score is kept per turn; a failure or timeout ends this request (InteractionError)."""
    started = time.monotonic()
    try:
        response = await within(
            user.interaction.generate_response(user.instance_id, [dict(m) for m in request.messages], **user.kwargs),
            config.interaction_timeout_s,
        )
    except TimeoutError:
        raise InteractionError(f"{interaction_name(user)} timed out after {config.interaction_timeout_s:g} s") from None
    except asyncio.CancelledError:
        if asyncio.current_task().cancelling():  # type: ignore[union-attr]  # this request is being cancelled
            raise
        raise InteractionError(f"{interaction_name(user)} failed: it raised CancelledError") from None
    except CONTAINED as exc:
        raise InteractionError(f"{interaction_name(user)} failed: {type(exc).__name__}: {exc}") from exc
    try:
        should_terminate, text, score, metadata = response
        score = float(score)
        if not math.isfinite(score):
            raise ValueError(f"the turn score {score} is not a finite number")
    except (TypeError, ValueError) as exc:
        raise InteractionError(
            f"{interaction_name(user)}: generate_response must return (should_terminate, text, score, metadata): {exc}"
        ) from None
    text = valid_text(truncate_middle(str(text if text is not None else ""), config.max_tool_response_chars))
    if metadata is None or type(metadata) is not dict or metadata:  # JSON-safe, whatever it held
        metadata = orjson.loads(orjson.dumps(metadata or {}, default=repr))
    request.metrics.user_turns += 1
    latency = time.monotonic() - started
    request.interaction_turns.append(
        InteractionTurn(request.metrics.turns, text, score, bool(should_terminate), latency, metadata)
    )
    request.rewards.turn_scores.append(score)
    return None if should_terminate else text


async def _start_messages(request: AsyncRolloutRequest, user: UserTurns, config: RolloutConfig) -> None:
    """An interaction that opens the conversation (a step environment's first observation, from
    ``start_messages``) gives the messages the prompt is rendered from; a failure ends this request."""
    start = getattr(user.interaction, "start_messages", None)
    if start is None:
        return
    try:
        messages = await within(start(user.instance_id, [dict(m) for m in request.messages]),
                                config.interaction_timeout_s)  # fmt: skip
    except TimeoutError:
        raise InteractionError(f"{interaction_name(user)} timed out after {config.interaction_timeout_s:g} s "
                               "opening the conversation") from None  # fmt: skip
    except CONTAINED as exc:
        raise InteractionError(f"{interaction_name(user)} failed opening the conversation: "
                               f"{type(exc).__name__}: {exc}") from exc  # fmt: skip
    if messages is not None:  # what the interaction added is cut as a step's observation is
        given = request.messages
        cut = config.max_tool_response_chars
        request.messages = [
            {"role": m["role"], "content": valid_text(str(m["content"]) if m in given else
                                                      truncate_middle(str(m["content"]), cut))}
            for m in messages
        ]  # fmt: skip


def _add_initial_observations(request: AsyncRolloutRequest, created: list[tuple[BaseTool, str]]) -> None:
    """What an environment's ``reset`` returned (a TRL environment class's tools keep it as
    ``initial_observation``) is appended to the last user message, as TRL appends it."""
    for tool, instance_id in created:
        observe = getattr(tool, "initial_observation", None)
        text = observe(instance_id) if callable(observe) else None
        if text is not None:
            last = next((m for m in reversed(request.messages) if m["role"] == "user"), None)
            if last is None:
                raise ToolCreateError(f"tool {tool.name}: its environment's first observation needs a user message")
            last["content"] = valid_text(f"{last['content']}{text}")


def turn_seed(seed: int, request: AsyncRolloutRequest, turn: int) -> int:
    """A sampling seed for one turn of one (prompt, sample), stable across runs and processes."""
    return (seed * 1_000_003 + request.prompt_index * 10_007 + request.sample_index * 101 + turn) % 2**62


async def _release(
    request: AsyncRolloutRequest, created: list[tuple[BaseTool, str]], config: RolloutConfig,
    user: UserTurns | None = None,
) -> None:  # fmt: skip
    """Finalize the interaction's instance and release every created tool instance, each once, even
    if one fails or the request is cancelled in the middle (the cancellation is passed on at the end)."""
    cancelled: asyncio.CancelledError | None = None
    if user is not None and user.instance_id is not None:
        try:
            await within(user.interaction.finalize_interaction(user.instance_id, **user.kwargs),
                         config.tool_reward_timeout_s)  # fmt: skip
        except asyncio.CancelledError as exc:
            cancelled = exc
        except CONTAINED as exc:
            note_error(request, f"finalize_interaction of {interaction_name(user)} failed: {describe_error(exc)}")
    for tool, instance_id in created:
        kwargs = request.tools_kwargs.get(tool.name, {}).get("release_kwargs", {})
        try:
            await within(tool.release(instance_id, **kwargs), config.tool_reward_timeout_s)
        except asyncio.CancelledError as exc:
            cancelled = exc
        except CONTAINED as exc:
            note_error(request, f"release of {tool.name} failed: {describe_error(exc)}")
    if cancelled is not None:
        raise cancelled
