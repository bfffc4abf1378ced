"""The agent gateway: an OpenAI-compatible endpoint in front of any rallyrl engine that records
every agent run as a session, token for token, so that agents we do not own can be trained.

    POST /sessions                           open a session -> {session_id, base_url, api_key}
    POST /sessions/{id}/v1/chat/completions  the agent's calls (JSON or streamed), base URL in the path
    POST /v1/chat/completions                the same, the session named by ``Authorization: Bearer {id}``
    GET  /v1/models, /sessions/{id}/v1/models
    POST /sessions/{id}/reward               {"reward": x}: the session's reward (before it finishes)
    POST /sessions/{id}/finish               end it: scored, checked, written; -> its trajectory
    GET  /sessions, /sessions/{id}, /health

Each call renders its messages and tools with the model's chat template, generates with token ids
and logprobs, parses tool calls with rallyrl's parsers into OpenAI ``tool_calls`` and records the
tokens in the session's ``AsyncRolloutRequest`` (``rollout/gateway/session.py``: one trajectory
while the agent only appends, a new sample when it rewrites its history). A finished session is
scored like a rollout (posted reward, else the reward function), checked, handed to ``on_finish``
and freed. The trainer runs the gateway in-process (``rollout/gateway/agents.py``); ``rallyrl gateway``
runs it alone and writes the finished sessions to JSONL.

Every request first passes the HTTP guard shared with ``rallyrl serve`` (``rollout/serve/guard.py``:
loopback ``Host`` only, no cross-site requests, JSON bodies within ``gateway.max_body_mb``), then the
gateway's caps (``limits.py``); large calls are prepared on worker threads (``offload.py``).

Errors are OpenAI's error objects: 400 bad request or a spent budget (``code`` says which), 403 a
refused origin or a bearer naming another session, 404 unknown session, 405 a method a route does not
serve, 409 a finished session, 413 a body or a cap exceeded, 415 not JSON, 429 too many open sessions
(each having made a call), 502 engine failure, 507 a full disk (the finished session not written).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import math
from collections.abc import Callable
from typing import Any

from aiohttp import web

from data.reward_fns import RewardFn
from rollout.config import GatewayConfig, RolloutConfig
from rollout.engines.base import Engine
from rollout.gateway.calls import Call
from rollout.gateway.chats import ChatCache
from rollout.gateway.errors import GatewayError, error_middleware, guard_reply
from rollout.gateway.lifecycle import SessionLifecycle
from rollout.gateway.limits import (
    CallInput,
    call_input,
    check_session_id,
    read_json,
    session_fields,
)
from rollout.gateway.offload import BIG_BODY, BIG_TOOLS
from rollout.gateway.output import write_sessions
from rollout.gateway.session import CallRefused, GatewaySession, new_session_id
from rollout.loop import default_reward
from rollout.request import AsyncRolloutRequest, FinishReason, RequestState, TraceEvent
from rollout.serve.guard import HttpGuard
from rollout.serve.http import BadRequest, TooLarge, TooManyJSONValues, json_response
from rollout.tokens import ChatTokenizer, longest_token_chars

__all__ = ["Gateway", "write_sessions"]

OPEN_BODY_SLACK = 4096
"""Bytes a ``POST /sessions`` body may have beyond ``gateway.max_metadata_bytes`` (its other fields)."""
CALL_BODY_SLACK = 64 * 2**10
"""Bytes a call's body may have beyond ``gateway.max_history_bytes`` and ``max_tools_bytes`` (its other fields)."""


class Gateway(SessionLifecycle):
    """The gateway's application and sessions over one engine. ``async with`` it to serve."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        config: GatewayConfig,
        rollout: RolloutConfig,
        *,
        reward_fn: RewardFn = default_reward,
        model_name: str = "rallyrl",
        on_finish: Callable[[AsyncRolloutRequest], None] | None = None,
        freeze_heap: bool = False,
    ):
        """``freeze_heap``: a process that only serves the gateway (``rallyrl gateway``) moves what it has
        loaded (the model, torch) out of the garbage collector's reach on entry: a full collection over
        it takes ~0.4 s of the event loop, which thousands of sessions opened at once would trigger."""
        self.engine, self.tokenizer = engine, tokenizer
        self.config, self.rollout = config, rollout
        self.reward_fn = reward_fn
        self.model_name = config.served_model_name or model_name
        self.on_finish = on_finish
        self.counters = {"sessions_opened": 0, "sessions_finished": 0, "sessions_expired": 0, "sessions_evicted": 0,
                         "calls": 0, "samples_split": 0, "calls_refused": 0, "calls_failed": 0}  # fmt: skip
        super().__init__()
        self._chats = ChatCache(tokenizer, content_special_tokens=rollout.content_special_tokens)
        self._longest_token = longest_token_chars(tokenizer)
        self._runner: web.AppRunner | None = None
        self._reaper: asyncio.Task[None] | None = None
        self.port = config.port
        self._freeze_heap = freeze_heap

    # ----- lifetime ------------------------------------------------------------------------------

    async def __aenter__(self) -> Gateway:
        if self._freeze_heap:
            gc.freeze()
        self._runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port, backlog=4096, reuse_address=True)
        await site.start()
        self.port = self._runner.addresses[0][1]
        self._reaper = asyncio.create_task(self._expire_idle())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        for session in list(self.sessions.values()):
            await self.finish_session(session, reason=FinishReason.ABORT, error="the gateway stopped")
        if self._ender is not None:
            await asyncio.gather(self._ender, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()
        self._offload.close()

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    def base_url(self, session_id: str) -> str:
        """The OpenAI base URL of a session (what ``openai.AsyncOpenAI(base_url=...)`` takes)."""
        return f"{self.url}/sessions/{session_id}/v1"

    def app(self) -> web.Application:
        """The routes, behind the shared HTTP guard (loopback ``Host``, no cross-site requests, JSON bodies
        within ``gateway.max_body_mb``) and the middleware answering every failure as an error object."""
        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=[error_middleware(self.counters)])
        routes = [
            ("GET", "/health", self.health),
            ("GET", "/v1/models", self.models),
            ("GET", "/sessions/{sid}/v1/models", self.models),
            ("POST", "/v1/chat/completions", self.chat_completions),
            ("POST", "/sessions/{sid}/v1/chat/completions", self.chat_completions),
            ("POST", "/sessions", self.create_session),
            ("GET", "/sessions", self.list_sessions),
            ("GET", "/sessions/{sid}", self.get_session),
            ("POST", "/sessions/{sid}/reward", self.post_reward),
            ("POST", "/sessions/{sid}/finish", self.post_finish),
        ]
        for method, path, handler in routes:
            app.router.add_route(method, path, handler)
        config = self.config
        guard = HttpGuard(config.host, guard_reply, open_paths=frozenset({"/health"}),
                          max_body_bytes=config.max_body_bytes, body_limit_hint="gateway.max_body_mb",
                          max_json_items=config.max_json_items, json_items_hint="gateway.max_json_items")  # fmt: skip
        guard.install(app)
        return app

    # ----- sessions --------------------------------------------------------------------------------

    def _sid(self, request: web.Request) -> str:
        """The session a request names: in its path, else in ``Authorization: Bearer``. Both given, they
        must agree when the bearer names a session (a client's own API key, ``unused``, is no session id)."""
        path = request.match_info.get("sid")
        auth = request.headers.get("Authorization", "")
        bearer = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        if path is None:
            if not bearer:
                raise GatewayError(404, "no session: use the base URL /sessions/{id}/v1, or the session id as the "
                                        "API key (Authorization: Bearer {id}); POST /sessions opens one",
                                   "session_not_found")  # fmt: skip
            return bearer
        if bearer and bearer != path and self.table.knows(bearer):
            raise GatewayError(403, f"the path names session {path!r} but Authorization: Bearer names session "
                                    f"{bearer!r}: a call belongs to one session, send its id in both (or the path "
                                    "alone)", "session_mismatch")  # fmt: skip
        return path

    def _session(self, request: web.Request) -> GatewaySession:
        """The open session a request names (``_sid``); 409 if it is finished, 404 if unknown."""
        return self.table.lookup(self._sid(request))

    # ----- session routes ----------------------------------------------------------------------

    async def create_session(self, request: web.Request) -> web.Response:
        limit = self.config.max_metadata_bytes + OPEN_BODY_SLACK
        try:
            body = await read_json(request, limit=limit)
        except TooManyJSONValues:
            raise
        except TooLarge:
            raise GatewayError(413, f"the body of POST /sessions is over {limit} bytes: gateway.max_metadata_bytes "
                                    f"({self.config.max_metadata_bytes}) for metadata, ground_truth and data_source, "
                                    f"{OPEN_BODY_SLACK} for the rest", "metadata_too_large") from None  # fmt: skip
        sid = body.get("session_id")
        sid = new_session_id() if sid is None else check_session_id(sid)
        fields = session_fields(body, self.config)
        self.table.check_new(sid)
        self.open_session(functools.partial(_session_record, sid, fields), sid, held=False)
        return json_response({"session_id": sid, "base_url": self.base_url(sid), "api_key": sid}, status=201)

    async def list_sessions(self, request: web.Request) -> web.Response:
        return json_response({"open": len(self.sessions) - len(self.table.closing), "finished_kept": len(self.finished),
                              "finished_remembered": len(self.table.finished_ids), **self.counters})  # fmt: skip

    async def get_session(self, request: web.Request) -> web.Response:
        sid = self._sid(request)
        if sid in self.finished:
            return json_response({"session_id": sid, "state": "completed",
                                  "trajectory": self.finished[sid].to_record()})  # fmt: skip
        session = self.table.lookup(sid)
        r = session.request
        return json_response({"session_id": sid, "state": r.state.value, "calls": session.calls,
                              "turns": r.metrics.turns, "samples": len(r.segments) + (session.calls > 0),
                              "reward": r.rewards.posted})  # fmt: skip

    async def post_reward(self, request: web.Request) -> web.Response:
        session = self._session(request)
        reward = _reward((await read_json(request, required=True)).get("reward"))
        if reward is None:
            raise BadRequest("reward: required, a finite number")
        session.request.rewards.posted = reward
        return json_response({"session_id": session.id, "reward": reward})

    async def post_finish(self, request: web.Request) -> web.Response:
        session = self._session(request)
        body = await read_json(request)
        error = body.get("error")
        if error is not None and not isinstance(error, str):
            raise BadRequest("error: expected a string (why the agent failed)")
        if session.closing:
            raise GatewayError(409, f"session {session.id} is finishing", "session_finished")
        done = await self.finish_session(session, error=error, reward=_reward(body.get("reward")))
        return json_response({"session_id": session.id, "trajectory": done.to_record()})

    # ----- OpenAI routes -------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if await self.engine.health() else 503)

    async def models(self, request: web.Request) -> web.Response:
        if "sid" in request.match_info:
            self._session(request)
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "rallyrl"}
        return json_response({"object": "list", "data": [model]})

    async def _call_body(self, request: web.Request) -> dict[str, Any]:
        """A call's JSON body, at most what its messages and tools may hold (refused unparsed past that)."""
        config = self.config
        limit = min(config.max_body_bytes, config.max_history_bytes + config.max_tools_bytes + CALL_BODY_SLACK)
        try:
            return await read_json(request, required=True, limit=limit)
        except TooManyJSONValues:
            raise
        except TooLarge:
            raise GatewayError(413, f"the body of the call is over {limit} bytes: gateway.max_history_bytes "
                                    f"({config.max_history_bytes}) for messages, gateway.max_tools_bytes "
                                    f"({config.max_tools_bytes}) for tools, {CALL_BODY_SLACK} for the rest",
                               "call_too_large") from None  # fmt: skip

    def _fits(self, session: GatewaySession, call: CallInput) -> bool:
        """Whether the call's text could fit the context at all (``check_fits``)."""
        longest = self._longest_token
        return longest is None or call.verbatim_chars <= session.config.max_model_len * longest

    def _check_fits(self, session: GatewaySession, call: CallInput) -> None:
        """Refuse at once a call whose text cannot fit the context, however it were tokenized (before
        spending seconds rendering and tokenizing megabytes of it)."""
        if not self._fits(session, call):
            raise CallRefused(f"the conversation and its tools have {call.verbatim_chars} characters of text: more "
                              f"than rollout.max_model_len {session.config.max_model_len} tokens can hold (at most "
                              f"{self._longest_token} characters a token)", FinishReason.LENGTH,
                              "context_length_exceeded")  # fmt: skip

    def _chat(self, session: GatewaySession, call: CallInput) -> ChatTokenizer | None:
        """The chat tokenizer of the call's tools (none for a call that cannot fit: it is refused)."""
        if not self._fits(session, call):
            return None
        return self._chats.get(call.tools, call.tools_key, session.chat_of(call.tools_key))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """One call of a session: plan (extend or new sample), generate, commit, answer. A large body is
        checked, rendered and tokenized on a worker thread (``offload.py``)."""
        session = self._session(request)
        if request.content_type != "application/json" and not request.content_type.endswith("+json"):
            raise GatewayError(415, f"Content-Type {request.content_type!r}: send the body as application/json",
                               "not_json")  # fmt: skip
        big = request.content_length is None or request.content_length >= BIG_BODY
        try:
            body = await self._call_body(request)
            call = await self._offload.run(call_input, body, self.config, request.content_length) if big else (
                call_input(body, self.config, request.content_length))  # fmt: skip
            big = big or len(call.tools_key) >= BIG_TOOLS  # (rendering them is the work)
            chat = await self._offload.run(self._chat, session, call) if big else self._chat(session, call)
            if session.closing or session.finished:
                raise GatewayError(409, f"session {session.id} is finished", "session_finished")
            session.heavy = session.heavy or big
            async with session.lock:
                if session.finished:
                    raise GatewayError(409, f"session {session.id} is finished", "session_finished")
                self.table.touch(session)
                try:
                    self._check_fits(session, call)
                    assert chat is not None
                    plan_args = (call.messages, chat, call.tools_key, call.max_tokens)
                    plan = await self._offload.run(session.plan, *plan_args) if big else session.plan(*plan_args)
                except CallRefused as exc:  # the session ends so unless the agent goes on (a shorter history)
                    session.refused = (exc.finish_reason, str(exc))
                    raise
                sampling = session.sampling_params(body, plan)
                answer = Call(self, session, plan, sampling, call.stop, body, call.tools is not None)
                session.request.transition(RequestState.RUNNING)
                try:
                    return await (answer.stream(request) if body.get("stream") else answer.answer())
                finally:
                    session.between_calls()
                    self.table.touch(session)
        finally:
            if big:
                self._offload.trim_soon()


def _session_record(sid: str, fields: dict[str, Any], opened_at: float) -> AsyncRolloutRequest:
    """The record of a session opened by ``POST /sessions`` with ``fields`` (built at its first use)."""
    return AsyncRolloutRequest(
        request_id=sid, prompt_index=fields["prompt_index"] or 0, sample_index=fields["sample_index"] or 0,
        messages=[], data_source=fields["data_source"] or "gateway", ground_truth=fields["ground_truth"],
        extra=dict(fields["metadata"] or {}), trace=[TraceEvent(RequestState.PENDING, opened_at)],
    )  # fmt: skip


def _reward(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadRequest(f"reward: expected a finite number, got {value!r}")
    return float(value)
