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
tokens in the session's ``AsyncRolloutRequest`` (``rollout/gateway_session.py``: one trajectory
while the agent only appends, a new sample when it rewrites its history). A finished session is
scored like a rollout (posted reward, else the reward function), checked, handed to ``on_finish``
and freed. The trainer runs the gateway in-process (``rollout/agents.py``); ``rallyrl gateway``
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
import uuid
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from data.reward_fns import RewardFn
from rollout.config import GatewayConfig, RolloutConfig
from rollout.engines.base import Engine, EngineError, Generation, PartialGeneration, SamplingParams
from rollout.gateway_session import CallPlan, CallRefused, GatewaySession, answer_message, chat_for, new_session_id
from rollout.loop import default_reward, score_request
from rollout.request import AsyncRolloutRequest, FinishReason, RequestState
from rollout.server_generate import generate_chunks
from rollout.server_http import BadRequest, json_body, json_response, send_event, sse_response
from rollout.server_openai import stop_strings
from rollout.tokens import ChatTokenizer

logger = logging.getLogger(__name__)


class GatewayError(Exception):
    """An HTTP error of the gateway: status, message and OpenAI's ``type``/``code``."""

    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.status, self.code = status, code


def _error(status: int, message: str, code: str | None = None) -> web.Response:
    kind = {400: "invalid_request_error", 404: "not_found_error", 409: "conflict_error", 429: "rate_limit_error",
            502: "engine_error", 503: "engine_error"}.get(status, "server_error")  # fmt: skip
    return json_response({"error": {"message": message, "type": kind, "param": None, "code": code}}, status)


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
            return _error(exc.status, str(exc), exc.code)
        except CallRefused as exc:
            self.counters["calls_refused"] += 1
            return _error(400, str(exc), exc.code)
        except BadRequest as exc:
            return _error(400, str(exc))
        except EngineError as exc:
            self.counters["calls_failed"] += 1
            return _error(502, f"engine error: {exc}")
        except web.HTTPException as exc:
            if exc.status >= 400:
                return _error(exc.status, exc.reason or str(exc))
            raise
        except Exception as exc:  # a bug: answer, log the trace, keep serving
            logger.exception("%s %s failed", request.method, request.path)
            return _error(500, f"internal error: {type(exc).__name__}: {exc}")

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
            call = _Call(self, session, plan, sampling, stop, body, tools is not None)
            session.request.transition(RequestState.RUNNING)
            try:
                return await (call.stream(request) if body.get("stream") else call.answer())
            finally:
                session.between_calls()
                session.last_used = time.monotonic()


class _Call:
    """One chat completion: the generation, the commit to the session and the OpenAI answer."""

    def __init__(self, gateway: Gateway, session: GatewaySession, plan: CallPlan, sampling: SamplingParams,
                 stop: list[str], body: dict[str, Any], parse_tools: bool):  # fmt: skip
        self.gateway, self.session, self.plan, self.sampling = gateway, session, plan, sampling
        self.stop, self.body = stop, body
        self.parser = session.config.tool_parser if parse_tools else None
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.rid = f"{session.id}-{session.calls}-{uuid.uuid4().hex[:8]}"
        self.created = int(time.time())
        model = body.get("model")
        self.model = model if isinstance(model, str) and model else gateway.model_name

    def _chunks(self, stream: bool) -> Any:
        return generate_chunks(self.gateway.engine, self.gateway.tokenizer, self.plan.input_ids, self.sampling,
                               self.rid, self.stop, stream)  # fmt: skip

    def _commit(self, generation: Generation) -> dict[str, Any]:
        """The answer message of a finished generation, recorded in the session."""
        if generation.finish_reason == "abort":
            raise GatewayError(503, "the engine aborted the generation (a weight update or a pause): call again",
                               "engine_aborted")  # fmt: skip
        text = self.plan.chat.assistant_text(generation.output_ids)
        shown = _cut_at_stop(text, generation)
        message = answer_message(shown, self.parser, self.session.config.reasoning_parser, self.plan.chat.tools)
        split = len(self.session.request.segments)
        self.session.commit(self.plan, generation, message)
        self.gateway.counters["calls"] += 1
        if len(self.session.request.segments) > split:
            logger.info("session %s: a new sample (%s)", self.session.id, self.plan.new_sample)
        return message

    def _finish(self, message: dict[str, Any], generation: Generation) -> str:
        return "tool_calls" if message.get("tool_calls") else generation.finish_reason

    def _metadata(self, generation: Generation) -> dict[str, Any]:
        """What the gateway recorded, under ``rallyrl`` in the answer (OpenAI's own ``metadata`` holds strings only)."""
        request = self.session.request
        return {"session_id": self.session.id, "sample": len(request.segments), "turn": request.metrics.turns,
                "new_sample": self.plan.new_sample or None, "weight_version": generation.weight_version}  # fmt: skip

    def _usage(self, generation: Generation) -> dict[str, Any]:
        prompt, completion = len(self.plan.input_ids), len(generation.output_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    async def answer(self) -> web.Response:
        generation: Generation | None = None
        async with contextlib.aclosing(self._chunks(False)) as chunks:
            async for chunk in chunks:
                generation = chunk  # type: ignore[assignment]
        assert isinstance(generation, Generation)
        message = self._commit(generation)
        choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": None,
                                  "finish_reason": self._finish(message, generation)}  # fmt: skip
        if self.body.get("logprobs"):
            decode = self.plan.chat.decode
            choice["logprobs"] = {"content": [
                {"token": decode([t]), "logprob": lp, "bytes": list(decode([t]).encode()), "top_logprobs": []}
                for t, lp in zip(generation.output_ids, generation.output_logprobs, strict=True)]}  # fmt: skip
        return json_response({"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                              "choices": [choice], "usage": self._usage(generation),
                              "rallyrl": self._metadata(generation)})  # fmt: skip

    async def stream(self, request: web.Request) -> web.StreamResponse:
        """SSE: the role, then the text as it is generated (with tools, the content and the tool calls
        once the answer is whole, as they are parsed from all of it), the finish reason, ``[DONE]``."""
        response = await sse_response(request)
        await send_event(response, self._chunk({"role": "assistant", "content": ""}))
        sent = ""
        hold = max((len(s) for s in self.stop), default=1) - 1
        generation: Generation | None = None
        try:
            async with contextlib.aclosing(self._chunks(True)) as chunks:
                async for chunk in chunks:
                    if isinstance(chunk, Generation):
                        generation = chunk
                        break
                    if self.parser is not None or self.session.config.reasoning_parser != "none":
                        continue  # parsed from the whole answer
                    text = self._partial_text(chunk)
                    visible = text[: len(text) - hold] if hold else text
                    if len(visible) > len(sent) and visible.startswith(sent):
                        await send_event(response, self._chunk({"content": visible[len(sent) :]}))
                        sent = visible
        except EngineError as exc:  # the answer has begun: the error can only be an event of the stream
            self.gateway.counters["calls_failed"] += 1
            await send_event(response, {"error": {"message": f"engine error: {exc}", "type": "engine_error",
                                                  "code": None}})  # fmt: skip
            await send_event(response, "[DONE]")
            return response
        assert generation is not None
        try:
            message = self._commit(generation)
        except GatewayError as exc:
            await send_event(response, {"error": {"message": str(exc), "type": "engine_error", "code": exc.code}})
            await send_event(response, "[DONE]")
            return response
        content = message.get("content") or ""
        if message.get("reasoning_content"):
            await send_event(response, self._chunk({"reasoning_content": message["reasoning_content"]}))
        if self.parser is None and "reasoning_content" not in message:
            rest = content[len(sent) :] if content.startswith(sent) else ""
            if rest:
                await send_event(response, self._chunk({"content": rest}))
        else:
            if content:
                await send_event(response, self._chunk({"content": content}))
            for index, call in enumerate(message.get("tool_calls") or []):
                function = call["function"]
                tool_call = {"index": index, "id": call["id"], "type": "function",
                             "function": {"name": function["name"], "arguments": function["arguments"]}}  # fmt: skip
                await send_event(response, self._chunk({"tool_calls": [tool_call]}))
        final = self._chunk({}, self._finish(message, generation))
        final["usage"], final["rallyrl"] = self._usage(generation), self._metadata(generation)
        await send_event(response, final)
        await send_event(response, "[DONE]")
        await response.write_eof()
        return response

    def _partial_text(self, chunk: PartialGeneration) -> str:
        text = self.plan.chat.decode(chunk.output_ids)
        return text.rstrip("\ufffd")  # a character whose bytes are not all there yet

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}  # fmt: skip


def _cut_at_stop(text: str, generation: Generation) -> str:
    """The answer's text as OpenAI shows it: cut before a matched stop string."""
    matched = generation.meta.get("matched_stop")
    if isinstance(matched, str) and (cut := text.find(matched)) >= 0:
        return text[:cut]
    return text


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
