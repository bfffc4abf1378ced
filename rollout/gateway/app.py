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

Errors are OpenAI's error objects: 400 bad request or a spent budget (``code`` says which), 404
unknown session, 409 a finished session, 429 too many open sessions, 502 engine failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from data.reward_fns import RewardFn
from rollout.config import GatewayConfig, RolloutConfig
from rollout.engines.base import Engine, EngineError
from rollout.gateway.calls import Call
from rollout.gateway.errors import GatewayError, error_response
from rollout.gateway.session import CallRefused, GatewaySession, chat_for, new_session_id
from rollout.loop import default_reward, score_request
from rollout.request import AsyncRolloutRequest, FinishReason, RequestState
from rollout.serve.http import BadRequest, json_body, json_response
from rollout.serve.openai_routes import stop_strings
from rollout.tokens import ChatTokenizer

logger = logging.getLogger(__name__)



class Gateway:
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
    ):
        self.engine, self.tokenizer = engine, tokenizer
        self.config, self.rollout = config, rollout
        self.reward_fn = reward_fn
        self.model_name = config.served_model_name or model_name
        self.on_finish = on_finish
        self.sessions: dict[str, GatewaySession] = {}
        self.finished: OrderedDict[str, AsyncRolloutRequest] = OrderedDict()  # the newest keep_finished
        self.counters = {"sessions_opened": 0, "sessions_finished": 0, "sessions_expired": 0, "calls": 0,
                         "samples_split": 0, "calls_refused": 0, "calls_failed": 0}  # fmt: skip
        self._chats: dict[str, ChatTokenizer] = {}
        self._runner: web.AppRunner | None = None
        self._reaper: asyncio.Task[None] | None = None
        self._finishing: set[asyncio.Task[Any]] = set()
        self.port = config.port

    # ----- lifetime ------------------------------------------------------------------------------

    async def __aenter__(self) -> Gateway:
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
        if self._finishing:
            await asyncio.gather(*self._finishing, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    def base_url(self, session_id: str) -> str:
        """The OpenAI base URL of a session (what ``openai.AsyncOpenAI(base_url=...)`` takes)."""
        return f"{self.url}/sessions/{session_id}/v1"

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 2**20, middlewares=[self._errors])
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
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except GatewayError as exc:
            return error_response(exc.status, str(exc), exc.code)
        except CallRefused as exc:
            self.counters["calls_refused"] += 1
            return error_response(400, str(exc), exc.code)
        except BadRequest as exc:
            return error_response(400, str(exc))
        except EngineError as exc:
            self.counters["calls_failed"] += 1
            return error_response(502, f"engine error: {exc}")
        except web.HTTPException as exc:
            if exc.status >= 400:
                return error_response(exc.status, exc.reason or str(exc))
            raise
        except Exception as exc:  # a bug: answer, log the trace, keep serving
            logger.exception("%s %s failed", request.method, request.path)
            return error_response(500, f"internal error: {type(exc).__name__}: {exc}")

    # ----- sessions --------------------------------------------------------------------------------

    def open_session(self, request: AsyncRolloutRequest | None = None, session_id: str | None = None,
                     rollout: RolloutConfig | None = None) -> GatewaySession:  # fmt: skip
        """A new session recording into ``request`` (a fresh one by default), under ``rollout``'s limits."""
        if len(self.sessions) >= self.config.max_sessions:
            raise GatewayError(429, f"{len(self.sessions)} sessions are open, the most gateway.max_sessions allows; "
                                    "finish some first", "too_many_sessions")  # fmt: skip
        session_id = session_id or new_session_id()
        if session_id in self.sessions or session_id in self.finished:
            raise GatewayError(409, f"session {session_id} already exists", "session_exists")
        if request is None:
            request = AsyncRolloutRequest(request_id=session_id, prompt_index=0, sample_index=0, messages=[])
        session = GatewaySession(session_id, request, rollout or self.rollout, self.config.sampling)
        self.sessions[session_id] = session
        self.counters["sessions_opened"] += 1
        return session

    async def finish_session(self, session: GatewaySession, *, reason: FinishReason | None = None,
                             error: str | None = None, reward: float | None = None) -> AsyncRolloutRequest:  # fmt: skip
        """End a session once: its finish reason, reward (posted, else ``reward``, else the reward
        function), the token check of its last sample; then hand it to ``on_finish`` and free it."""
        session.closing = True
        async with session.lock:  # after the call in flight, if any
            if session.finished:
                return session.request
            request = session.request
            if request.rewards.posted is None and reward is not None:
                request.rewards.posted = reward
            if error is not None or reason is not None:
                request.finish(reason or FinishReason.ERROR, error)
            elif session.refused is not None:  # its last call was refused: a budget was spent
                request.finish(*session.refused)
            elif session.calls == 0:
                request.finish(FinishReason.ERROR, "the agent made no call through the gateway")
            else:
                request.finish(session.end_reason())
            if request.state is not RequestState.COMPLETED:
                request.transition(RequestState.COMPLETED)
            posted = request.rewards.posted

            def reward_fn(r: AsyncRolloutRequest) -> Any:
                return posted if posted is not None else self.reward_fn(r)

            try:  # (a session with no call has no tokens to check)
                await score_request(request, [], session.chat, session.config, reward_fn,  # type: ignore[arg-type]
                                    session.transcript)  # fmt: skip
            finally:
                session.finished = True
                self.sessions.pop(session.id, None)
                self.counters["sessions_finished"] += 1
                self.counters["samples_split"] += len(request.segments)
                self.finished[session.id] = request
                while len(self.finished) > self.config.keep_finished:
                    self.finished.popitem(last=False)
        if self.on_finish is not None:
            self.on_finish(request)
        return request

    def _session(self, request: web.Request) -> GatewaySession:
        """The session a request names in its path, or in ``Authorization: Bearer``."""
        sid = request.match_info.get("sid")
        if sid is None:
            auth = request.headers.get("Authorization", "")
            sid = auth[7:].strip() if auth.startswith("Bearer ") else ""
            if not sid:
                raise GatewayError(404, "no session: use the base URL /sessions/{id}/v1, or the session id as the "
                                        "API key (Authorization: Bearer {id}); POST /sessions opens one",
                                   "session_not_found")  # fmt: skip
        session = self.sessions.get(sid)
        if session is None:
            if sid in self.finished:
                raise GatewayError(409, f"session {sid} is finished", "session_finished")
            raise GatewayError(404, f"unknown session {sid!r} (POST /sessions opens one)", "session_not_found")
        return session

    async def _expire_idle(self) -> None:
        """End sessions with no call for ``session_timeout_s`` (their agent is gone)."""
        timeout = self.config.session_timeout_s
        while True:
            await asyncio.sleep(min(5.0, timeout / 4))
            now = time.monotonic()
            for session in list(self.sessions.values()):
                if not session.lock.locked() and not session.closing and now - session.last_used > timeout:
                    self.counters["sessions_expired"] += 1
                    error = f"the session had no call for {timeout:g} s"
                    task = asyncio.create_task(self.finish_session(session, reason=FinishReason.ABORT, error=error))
                    self._finishing.add(task)
                    task.add_done_callback(self._finishing.discard)

    # ----- session routes ----------------------------------------------------------------------

    async def create_session(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        sid = body.get("session_id")
        if sid is not None and (not isinstance(sid, str) or not sid or len(sid) > 200 or "/" in sid):
            raise BadRequest("session_id: expected a string of at most 200 characters without '/'")
        fields = {}
        for name, kind in (("prompt_index", int), ("sample_index", int), ("ground_truth", str), ("data_source", str),
                           ("metadata", dict)):  # fmt: skip
            value = body.get(name)
            if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
                raise BadRequest(f"{name}: expected {kind.__name__}, got {value!r}")
            fields[name] = value
        sid = sid or new_session_id()
        record = AsyncRolloutRequest(
            request_id=sid, prompt_index=fields["prompt_index"] or 0, sample_index=fields["sample_index"] or 0,
            messages=[], data_source=fields["data_source"] or "gateway", ground_truth=fields["ground_truth"],
            extra=dict(fields["metadata"] or {}),
        )  # fmt: skip
        self.open_session(record, sid)
        return json_response({"session_id": sid, "base_url": self.base_url(sid), "api_key": sid}, status=201)

    async def list_sessions(self, request: web.Request) -> web.Response:
        return json_response({"open": len(self.sessions), "finished_kept": len(self.finished), **self.counters})

    async def get_session(self, request: web.Request) -> web.Response:
        sid = request.match_info["sid"]
        if sid in self.finished:
            return json_response({"session_id": sid, "state": "completed",
                                  "trajectory": self.finished[sid].to_record()})  # fmt: skip
        session = self._session(request)
        r = session.request
        return json_response({"session_id": sid, "state": r.state.value, "calls": session.calls,
                              "turns": r.metrics.turns, "samples": len(r.segments) + (session.calls > 0),
                              "reward": r.rewards.posted})  # fmt: skip

    async def post_reward(self, request: web.Request) -> web.Response:
        session = self._session(request)
        reward = _reward((await json_body(request, required=True)).get("reward"))
        if reward is None:
            raise BadRequest("reward: required, a finite number")
        session.request.rewards.posted = reward
        return json_response({"session_id": session.id, "reward": reward})

    async def post_finish(self, request: web.Request) -> web.Response:
        session = self._session(request)
        body = await json_body(request)
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

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """One call of a session: plan (extend or new sample), generate, commit, answer."""
        session = self._session(request)
        if request.content_type != "application/json":
            raise BadRequest(f"Content-Type: only application/json is accepted, got {request.content_type!r}")
        body = await json_body(request, required=True)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages: required, a non-empty list of messages")
        if body.get("n") not in (None, 1):
            raise BadRequest("n: a session records one conversation; open one session per sample")
        tools = body.get("tools") if body.get("tool_choice") != "none" else None
        if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
            raise BadRequest("tools: expected a list of tool objects")
        for i, tool in enumerate(tools or []):
            function = tool.get("function")
            if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
                raise BadRequest(f'tools[{i}]: expected {{"type": "function", "function": {{"name": ..., '
                                 f'"parameters": ...}}}}, got {tool!r}')  # fmt: skip
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                       or max_tokens < 1):  # fmt: skip
            raise BadRequest(f"max_tokens: expected a positive integer, got {max_tokens!r}")
        stop = stop_strings(body)
        chat, tools_key = chat_for(self.tokenizer, tools or None, self._chats)
        if session.closing or session.finished:
            raise GatewayError(409, f"session {session.id} is finished", "session_finished")
        async with session.lock:
            if session.finished:
                raise GatewayError(409, f"session {session.id} is finished", "session_finished")
            session.last_used = time.monotonic()
            try:
                plan = session.plan(messages, chat, tools_key, max_tokens)
            except CallRefused as exc:  # the session ends so unless the agent goes on (a shorter history)
                session.refused = (exc.finish_reason, str(exc))
                raise
            sampling = session.sampling_params(body, plan)
            call = Call(self, session, plan, sampling, stop, body, tools is not None)
            session.request.transition(RequestState.RUNNING)
            try:
                return await (call.stream(request) if body.get("stream") else call.answer())
            finally:
                session.between_calls()
                session.last_used = time.monotonic()



def _reward(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadRequest(f"reward: expected a finite number, got {value!r}")
    return float(value)


def write_sessions(path: str | Path) -> tuple[Callable[[AsyncRolloutRequest], None], Callable[[], None]]:
    """An ``on_finish`` that appends each finished session to a JSONL file (flushed), and its closer."""
    import orjson

    from rollout.output_file import open_output

    file = open_output(path, append=True)
    assert file is not None

    def write(request: AsyncRolloutRequest) -> None:
        file.write(orjson.dumps(request.to_record()) + b"\n")
        file.flush()

    return write, file.close
