"""One agent run recorded by the gateway: an ``AsyncRolloutRequest`` built call by call, token for token.

Agents resend the whole conversation on every call. A call *extends* the session when its messages
are the last call's messages, then the answer the gateway gave (compared by role, text and tool
calls, however the client library re-serialised it), then new tool, user or system messages. Those
new messages are appended as the rollout loop appends tool results: the template's glue after the
assistant turn and a *delta* rendering of the new messages (``rollout/tokens.py``), loss mask 0, and
the assistant tokens stay exactly as the engine sampled them. The trajectory is then the one the
native loop builds for the same conversation and sampled tokens.

Any other call *splits* the session: the agent rewrote its history (truncated it, summarised it,
edited the system prompt, changed the tools, dropped or edited an answer). The sample so far is
checked and kept as a ``Segment`` with the reason, and the call starts a new sample from a full
rendering of its messages. Training uses every sample with the session's one reward.

States: PENDING until the first call; RUNNING while a call generates; between calls, TOOL_CALLING
when the last answer called tools (the agent runs them), else INTERACTING (the agent or its user
has the turn); COMPLETED when the session is finished. A call is planned without touching the
session and committed only once its generation is done, so a failed or abandoned call (a client
that disconnects) leaves the session as it was.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rollout.config import RolloutConfig
from rollout.engines.base import Generation, SamplingParams
from rollout.history import assistant_message, check_history, reasoning_token_count
from rollout.loop import turn_seed
from rollout.parsers import get_parser
from rollout.reasoning import get_reasoning_format
from rollout.request import AsyncRolloutRequest, FinishReason, RequestState, Segment, ToolCallRecord
from rollout.serve.http import BadRequest
from rollout.serve.openai_requests import sampling_numbers, template_message
from rollout.tokens import ChatTokenizer, TemplateError
from rollout.transcript import Transcript

Canonical = tuple[str, str, tuple[tuple[str, str], ...]]
"""A message as compared between calls: role, text (an answer's stripped), tool calls (name, arguments)."""


class CallRefused(BadRequest):
    """A call the session cannot take (its budget is spent); the session ends with ``finish_reason``.
    Answered with HTTP 400 and ``code``, as OpenAI answers a conversation too long for the context."""

    def __init__(self, message: str, finish_reason: FinishReason, code: str):
        super().__init__(message)
        self.finish_reason = finish_reason
        self.code = code


def canonical(message: dict[str, Any], index: int) -> Canonical:
    """What must match when an agent sends a message again: an answer's text without surrounding
    whitespace and its tool calls' names and arguments (JSON with sorted keys), else role and text."""
    text = template_message({**message, "tool_calls": None} if isinstance(message, dict) else message, index)["content"]
    role = message["role"]
    calls: list[tuple[str, str]] = []
    for call in message.get("tool_calls") or []:
        function = (call.get("function") or {}) if isinstance(call, dict) else {}
        arguments = function.get("arguments", "{}") if isinstance(function, dict) else "{}"
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except (json.JSONDecodeError, RecursionError):
            raise BadRequest(f"messages[{index}].tool_calls: arguments are not valid JSON") from None
        calls.append((str(function.get("name")), json.dumps(arguments, sort_keys=True, ensure_ascii=False)))
    return role, text.strip() if role == "assistant" else text, tuple(calls)


@dataclass
class CallPlan:
    """What a call adds to its session, computed before generating and committed after."""

    messages: list[dict[str, Any]]  # the call's messages, as the chat template takes them
    canonicals: list[Canonical]
    chat: ChatTokenizer
    tools_key: str
    input_ids: list[int]  # what the engine continues
    max_new_tokens: int
    new_sample: str | None  # None: extends the sample; else why a new sample starts ("" for the first)
    prompt_text: str = ""  # a new sample's prompt
    appended: list[dict[str, Any]] | None = None  # an extension's new messages
    answered: list[str | None] | None = None  # the tool_call_id each of them answers (tool messages)
    delta: tuple[str, list[int]] | None = None  # their rendering, after the template's glue


@dataclass
class PendingCall:
    """A tool call the gateway returned, waiting for the agent to send its result."""

    call_id: str
    turn: int
    name: str
    arguments: dict[str, Any] | None
    returned_at: float


RecordFactory = Callable[[float], AsyncRolloutRequest]
"""Builds a session's record when it is first used, given the time the session was opened."""


class GatewaySession:
    """The recording of one agent run. Calls are taken one at a time (``lock``)."""

    def __init__(self, session_id: str, request: AsyncRolloutRequest | RecordFactory, config: RolloutConfig,
                 sampling: str, held: bool = True):  # fmt: skip
        self.id = session_id
        self._request = request if isinstance(request, AsyncRolloutRequest) else None
        self._make_request = None if self._request is not None else request
        self.opened_at = time.monotonic()
        self.config = config
        self.sampling = sampling
        self.held = held  # opened by its driver in-process (which ends it), not by an HTTP client
        self.heavy = False  # a call brought a large body: its memory is given back when the session ends
        self.lock = asyncio.Lock()
        self.last_used = self.opened_at
        self.finished = False
        self.closing = False  # finish requested: new calls are refused
        self.calls = 0  # calls answered
        self.refused: tuple[FinishReason, str] | None = None  # the last call was refused (a spent budget): why
        self.chat: ChatTokenizer | None = None
        self.transcript: Transcript | None = None
        self._tools_key: str | None = None
        self._expected: list[Canonical] | None = None  # what the next call must start with to extend
        self._last_output: list[int] = []
        self._last_finish: str | None = None
        self._sample_turns = 0  # assistant turns in the current sample
        self._pending: list[PendingCall] = []

    @property
    def request(self) -> AsyncRolloutRequest:
        """The session's record. One opened over HTTP builds it when it is first used: an open that is
        never called keeps a handful of objects for the garbage collector to walk, not the record's
        twenty (4,096 abandoned opens made each full collection hold the event loop over 100 ms)."""
        if self._request is None:
            assert self._make_request is not None
            self._request, self._make_request = self._make_request(self.opened_at), None
        return self._request

    @property
    def evictable(self) -> bool:
        """Opened over HTTP and never called: an abandoned open, which gives way when the gateway is full."""
        return not self.held and self.calls == 0

    def chat_of(self, tools_key: str) -> ChatTokenizer | None:
        """The session's chat tokenizer if it renders the tools of ``tools_key``."""
        return self.chat if self.chat is not None and tools_key == self._tools_key else None

    # ----- a call ----------------------------------------------------------------------------------

    def plan(self, raw_messages: list[Any], chat: ChatTokenizer, tools_key: str, max_tokens: int | None) -> CallPlan:
        """What this call's messages do to the session (extend it or start a new sample), and the
        tokens to generate from. Raises ``CallRefused`` when a budget is spent; changes nothing."""
        request, config = self.request, self.config
        if request.metrics.turns >= config.max_turns:
            raise CallRefused(f"the session has had its {config.max_turns} assistant turns (rollout.max_turns)",
                              FinishReason.MAX_TURNS, "max_turns_exceeded")  # fmt: skip
        messages = [template_message(m, i, self.config.tool_parser) for i, m in enumerate(raw_messages)]
        canonicals = [canonical(m, i) for i, m in enumerate(raw_messages)]
        reason = self._split_reason(canonicals, tools_key)
        if reason is None:
            assert self._expected is not None
            appended = messages[len(self._expected) :]
            try:
                delta = chat.delta(appended)
            except TemplateError as exc:  # the template rewrites history: the tokens cannot be appended
                reason = str(exc)
        if reason is None:
            input_ids = request.all_ids + chat.assistant_close_ids(self._last_output) + delta[1]
            answered = [m.get("tool_call_id") for m in raw_messages[len(self._expected) :]]
            plan = CallPlan(messages, canonicals, chat, tools_key, input_ids, 0, None, appended=appended, delta=delta,
                            answered=answered)  # fmt: skip
        else:
            prompt_text, prompt_ids = chat.prompt(messages)
            plan = CallPlan(messages, canonicals, chat, tools_key, prompt_ids, 0, reason, prompt_text=prompt_text)
        prompt_len = len(request.prompt_ids) if plan.new_sample is None else len(plan.input_ids)
        budget = min(config.max_new_tokens, config.max_model_len - len(plan.input_ids))
        if config.max_response_tokens is not None:
            budget = min(budget, config.max_response_tokens - (len(plan.input_ids) - prompt_len))
        if max_tokens is not None:
            budget = min(budget, max_tokens)
        if budget <= 0:
            raise CallRefused(
                f"the conversation has {len(plan.input_ids)} tokens: no room for an answer within "
                f"rollout.max_model_len {config.max_model_len}" + (
                    f" and rollout.max_response_tokens {config.max_response_tokens}"
                    if config.max_response_tokens is not None else ""),
                FinishReason.LENGTH, "context_length_exceeded",
            )  # fmt: skip
        plan.max_new_tokens = budget
        return plan

    def _split_reason(self, canonicals: list[Canonical], tools_key: str) -> str | None:
        """None when the call extends the session; else why it starts a new sample ("" for the first)."""
        expected = self._expected
        if expected is None:
            return ""
        if tools_key != self._tools_key:
            return "the tools changed"
        for i, (sent, recorded) in enumerate(zip(canonicals, expected, strict=False)):
            if sent != recorded:
                what = "the answer the gateway gave" if recorded[0] == "assistant" else "the recorded message"
                return f"messages[{i}] ({sent[0]}) is not {what}"
        if len(canonicals) < len(expected):
            return f"the conversation was cut: {len(canonicals)} messages, {len(expected)} recorded"
        if len(canonicals) == len(expected):
            return "no new message after the last answer"
        roles = [c[0] for c in canonicals[len(expected) :]]
        if "assistant" in roles:
            return f"messages[{len(expected) + roles.index('assistant')}] is an answer the gateway did not give"
        return None

    def sampling_params(self, body: dict[str, Any], plan: CallPlan) -> SamplingParams:
        """The rollout's sampling (``gateway.sampling: rollout``) or the request's own."""
        config, stop_ids = self.config, plan.chat.stop_token_ids
        values = sampling_numbers(body)  # checked in both modes: a bad request is bad whatever is sampled
        if self.sampling == "rollout":
            seed = None if config.seed is None else turn_seed(config.seed, self.request, self.request.metrics.turns)
            return SamplingParams(plan.max_new_tokens, config.temperature, config.top_p, config.top_k,
                                  list(stop_ids), seed)  # fmt: skip
        try:
            return SamplingParams(
                plan.max_new_tokens,
                1.0 if values["temperature"] is None else float(values["temperature"]),
                1.0 if values["top_p"] is None else float(values["top_p"]),
                -1 if values["top_k"] is None else values["top_k"],
                list(stop_ids),
                values["seed"],
            )
        except ValueError as exc:
            raise BadRequest(str(exc)) from None

    def commit(self, plan: CallPlan, generation: Generation, answer: dict[str, Any]) -> None:
        """Record a call whose generation is done: the new sample or the extension, then the answer's
        tokens (mask 1, logprobs and weight versions) and the message the agent will send back."""
        request, chat = self.request, plan.chat
        if plan.new_sample is not None:
            self._start_sample(plan)
        else:
            assert plan.appended is not None and plan.delta is not None
            self._tool_results(plan.appended, plan.answered or [])
            request.messages += plan.appended
            delta = chat.delta_after(self._last_output, plan.delta)
            request.append_context(chat.assistant_close_ids(self._last_output) + delta[1])
            chat.add_context(self.transcript, self._last_output, delta)
        output = generation.output_ids
        if output:
            request.metrics.turns += 1
            self._sample_turns += 1
            request.append_generated(output, generation.output_logprobs, generation.token_weight_versions())
            text = chat.assistant_text(output)
            reasoning = get_reasoning_format(self.config.reasoning_parser)
            message, split = assistant_message(text, reasoning)
            request.messages.append(message)
            request.assistant_texts.append(text)
            request.metrics.reasoning_tokens += reasoning_token_count(chat, output, split, reasoning)
            chat.add_output(self.transcript, output, text)
        # an answer with no tokens (cannot be extended token-exactly): a call that sends it back starts anew
        self._expected = [*plan.canonicals, canonical(answer, len(plan.canonicals))] if output else plan.canonicals
        self._last_output, self._last_finish = list(output), generation.finish_reason
        now = time.monotonic()
        self._pending = [
            PendingCall(call["id"], request.metrics.turns, call["function"]["name"],
                        json.loads(call["function"]["arguments"]), now)
            for call in answer.get("tool_calls") or []
        ]  # fmt: skip
        self.calls += 1
        self.refused = None

    def _start_sample(self, plan: CallPlan) -> None:
        request = self.request
        if self._sample_turns:  # the sample so far is kept, checked, with why the session left it
            request.segments.append(self._segment(plan.new_sample or "a new sample"))
        request.prompt_ids = plan.input_ids
        request.response_ids, request.loss_mask, request.logprobs, request.weight_versions = [], [], [], []
        request.messages = [dict(m) for m in plan.messages]
        request.assistant_texts = []
        self.chat, self._tools_key = plan.chat, plan.tools_key
        self.transcript = plan.chat.transcript(plan.prompt_text, plan.input_ids)
        self._sample_turns = 0
        self._pending = []

    def _segment(self, reason: str) -> Segment:
        request = self.request
        diff = self.check_tokens()
        return Segment(request.messages, request.prompt_ids, request.response_ids, request.loss_mask,
                       request.logprobs, request.weight_versions, self._sample_turns, reason, diff)  # fmt: skip

    def check_tokens(self) -> str | None:
        """The consistency check of the current sample (None: its tokens are the template's)."""
        if self.chat is None or not self.request.prompt_ids or not self.config.check_consistency:
            return None
        request = self.request
        try:
            reasoning = get_reasoning_format(self.config.reasoning_parser)
            diff, rewrite = check_history(self.chat, request.messages, request.all_ids, request.assistant_texts,
                                          reasoning, self.transcript)  # fmt: skip
        except Exception as exc:  # a message the template or tokenizer cannot take
            return f"the consistency check failed: {type(exc).__name__}: {exc}"
        request.history_rewrite = rewrite or request.history_rewrite
        return diff

    def _tool_results(self, appended: list[dict[str, Any]], answered: list[str | None]) -> None:
        """Tool messages answering the calls the gateway returned become the request's tool call records,
        matched by ``tool_call_id`` (in order where a message has none or an unknown one)."""
        pending = {call.call_id: call for call in self._pending}
        now = time.monotonic()
        for message, call_id in zip(appended, answered, strict=True):
            if message["role"] != "tool":
                continue
            call = pending.pop(call_id, None) if isinstance(call_id, str) else None
            if call is None and pending:
                call = pending.pop(next(iter(pending)))
            if call is None:
                continue
            record = ToolCallRecord(call.turn, call.name, call.arguments, message["content"], now - call.returned_at)
            self.request.tool_calls.append(record)
            self.request.rewards.step.append(0.0)
            self.request.metrics.tool_calls += 1
        self._pending = [c for c in self._pending if c.call_id in pending]

    def between_calls(self) -> None:
        """The state while the agent has the turn: running the tools it was given, or its own."""
        state = RequestState.TOOL_CALLING if self._pending else RequestState.INTERACTING
        if self.request.state is not state and not self.finished:
            self.request.transition(state)

    def end_reason(self) -> FinishReason:
        """How a session the agent ended without a refusal finished: as its last generation did."""
        if self._last_finish == "length":
            return FinishReason.LENGTH
        if self._last_finish == "abort":
            return FinishReason.ABORT
        return FinishReason.STOP


def new_session_id() -> str:
    return f"sess-{uuid.uuid4().hex}"


def answer_message(text: str, parser_name: str | None, reasoning_name: str = "none",
                   tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:  # fmt: skip
    """The OpenAI assistant message of an answer's text: its reasoning (with a reasoning parser) in
    ``reasoning_content``, its tool calls parsed (when the request gave tools) into ``tool_calls``,
    as SGLang answers with the same ``--reasoning-parser`` and ``--tool-call-parser``."""
    reasoning = get_reasoning_format(reasoning_name)
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if reasoning is not None:
        split = reasoning.split(text)
        text = split.content
        message = {"role": "assistant", "content": text, "reasoning_content": split.reasoning}
    if parser_name is None:
        return message
    turn = get_parser(parser_name, tools)(text)
    calls = [call for call in turn.calls if call.error is None]
    if not calls:
        return message
    message["content"] = turn.content.strip() or None
    message["tool_calls"] = [
        {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
         "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}
        for call in calls
    ]  # fmt: skip
    return message
