"""``rallyrl serve``: any rallyrl engine behind SGLang's HTTP API, so SGLang clients work unchanged.

Native API (as ``sglang.launch_server`` serves it): ``/generate`` (one request or a batch;
JSON or SSE-streamed), ``/health``, ``/health_generate``, ``/get_model_info``,
``/get_server_info``, ``/flush_cache``, ``/abort_request``, ``/update_weights_from_disk``,
``/pause_generation``, ``/continue_generation``. OpenAI-compatible: ``/v1/models``,
``/v1/completions``, ``/v1/chat/completions`` (tool calls parsed by rallyrl's parsers and
returned as ``tool_calls``).

Weight updates follow SGLang: ``/update_weights_from_disk`` waits for the requests in flight
(or aborts them with ``abort_all_requests``) while new ones wait, so every ``/generate``
response comes from one weight version. ``/pause_generation`` aborts what is in flight (the
clients resume it) and holds new requests until ``/continue_generation``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import torch
from aiohttp import web
from safetensors.torch import load_file

from rollout.config import ServeConfig
from rollout.engines.base import Engine, EngineError, Generation, PartialGeneration, SamplingParams
from rollout.engines.sglang_protocol import finish_reason_payload, parse_weight_version, sampling_from_payload
from rollout.faults import install_faults
from rollout.parsers import get_parser
from rollout.tokens import ChatTokenizer, TemplateError

SERVER_VERSION = "rallyrl-0.1.0"
OPEN_PATHS = frozenset({"/health", "/health_generate"})
"""Paths answered without the API key (as in SGLang), so that health probes need no secret."""
logger = logging.getLogger(__name__)


class BadRequest(ValueError):
    """A request the server cannot serve; answered with HTTP 400 and this message."""


class EngineServer:
    """The aiohttp application around one engine. ``tokenizer`` decodes text fields and renders
    chat messages; the engine itself sees token ids only."""

    def __init__(self, engine: Engine, tokenizer: Any, config: ServeConfig):
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = config
        self.model_name = config.served_model_name or Path(config.model).name
        self.vocab_size: int | None = _model_config(config.model).get("vocab_size")
        self.weight_version: int | None = None  # None until the first update ("default" in SGLang)
        self.started = time.time()
        self._open = asyncio.Event()  # set while new requests may start
        self._open.set()
        self._paused = False
        self._in_flight = 0
        self._idle = asyncio.Condition()
        self._update_lock = asyncio.Lock()
        self.counters = {"requests": 0, "generated_tokens": 0, "aborted": 0}

    # ----- application ------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 2**20, middlewares=[self._errors])
        routes = [
            ("*", "/generate", self.generate),
            ("GET", "/health", self.health),
            ("GET", "/health_generate", self.health_generate),
            ("GET", "/get_model_info", self.get_model_info),
            ("GET", "/model_info", self.get_model_info),
            ("GET", "/get_server_info", self.get_server_info),
            ("GET", "/server_info", self.get_server_info),
            ("GET", "/get_weight_version", self.get_weight_version),
            ("*", "/flush_cache", self.flush_cache),
            ("POST", "/abort_request", self.abort_request),
            ("POST", "/update_weights_from_disk", self.update_weights_from_disk),
            ("POST", "/pause_generation", self.pause_generation),
            ("POST", "/continue_generation", self.continue_generation),
            ("GET", "/v1/models", self.models),
            ("POST", "/v1/completions", self.completions),
            ("POST", "/v1/chat/completions", self.chat_completions),
        ]
        for method, path, handler in routes:
            app.router.add_route(method, path, handler)
        if self.config.faults is not None:
            install_faults(app, self.config.faults)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """API key check; bad requests and engine failures as JSON errors in SGLang's shapes."""
        authorized = request.headers.get("Authorization") == f"Bearer {self.config.api_key}"
        if self.config.api_key and not authorized and request.path not in OPEN_PATHS:
            return _error(request, 401, "missing or wrong API key (Authorization: Bearer ...)")
        try:
            return await handler(request)
        except BadRequest as exc:
            return _error(request, 400, str(exc))
        except EngineError as exc:
            return _error(request, 500, f"engine error: {exc}")
        except web.HTTPException:
            raise
        except Exception as exc:  # a bug: answer, log the trace, keep serving
            logger.exception("%s %s failed", request.method, request.path)
            return _error(request, 500, f"internal error: {type(exc).__name__}: {exc}")

    # ----- generation ----------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _admitted(self) -> AsyncIterator[None]:
        """Wait while generation is paused or weights are loading; count the request in flight."""
        await self._open.wait()
        self._in_flight += 1
        try:
            yield
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                async with self._idle:
                    self._idle.notify_all()

    async def _generate(self, input_ids: list[int], sampling: SamplingParams, rid: str) -> Generation:
        async with self._admitted():
            generation = await self.engine.generate(input_ids, sampling, rid)
        self.counters["requests"] += 1
        self.counters["generated_tokens"] += len(generation.output_ids)
        self.counters["aborted"] += generation.finish_reason == "abort"
        return generation

    async def generate(self, request: web.Request) -> web.StreamResponse:
        """SGLang's ``/generate``: ``text`` or ``input_ids``, one or a batch."""
        body = await _json_body(request)
        items, batched = self._generate_items(body)
        if body.get("stream"):
            if batched:
                raise BadRequest("stream: streaming a batch is not supported; send one request per prompt")
            return await self._generate_streamed(request, *items[0])
        started = time.monotonic()
        generations = await asyncio.gather(*(self._generate(ids, sampling, rid) for ids, sampling, rid, _ in items))
        latency = time.monotonic() - started
        outputs = [
            self._generate_output(ids, generation, rid, logprob, latency)
            for (ids, _, rid, logprob), generation in zip(items, generations, strict=True)
        ]
        return _json(outputs if batched else outputs[0])

    def _generate_items(self, body: dict[str, Any]) -> tuple[list[tuple[list[int], SamplingParams, str, bool]], bool]:
        """(input_ids, sampling, rid, return_logprob) per prompt, and whether the request was a batch."""
        if "input_ids" in body and body["input_ids"] is not None:
            prompts = body["input_ids"]
            if not isinstance(prompts, list) or not prompts:
                raise BadRequest("input_ids: expected a non-empty list of token ids (or a list of such lists)")
            batched = isinstance(prompts[0], list)
            prompts = prompts if batched else [prompts]
            for i, ids in enumerate(prompts):
                name = f"input_ids[{i}]" if batched else "input_ids"
                if not isinstance(ids, list) or not ids or not all(type(t) is int for t in ids):
                    raise BadRequest(f"{name}: expected a non-empty list of token ids")
                self._check_vocabulary(ids, name)
        elif isinstance(body.get("text"), (str, list)):
            texts = body["text"]
            batched = isinstance(texts, list)
            if not all(isinstance(t, str) for t in (texts if batched else [texts])):
                raise BadRequest("text: expected a string or a list of strings")
            prompts = [self._encode(t) for t in (texts if batched else [texts])]
            if not all(prompts):
                raise BadRequest("text: an empty prompt (no tokens)")
        else:
            raise BadRequest("give text or input_ids")
        count = len(prompts)

        def per_prompt(name: str, default: Any) -> list[Any]:
            value = body.get(name, default)
            if batched and isinstance(value, list):
                if len(value) != count:
                    raise BadRequest(f"{name}: {len(value)} values for {count} prompts")
                return value
            return [value] * count

        params = per_prompt("sampling_params", {})
        logprob = per_prompt("return_logprob", False)
        rids = body.get("rid")
        if rids is None:
            rids = [uuid.uuid4().hex for _ in range(count)]
        elif batched:
            if not isinstance(rids, list) or len(rids) != count:
                raise BadRequest(f"rid: expected a list of {count} request ids for a batch")
        else:
            rids = [rids]
        try:
            samplings = [sampling_from_payload(p) for p in params]
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        items = [(ids, s, str(r), bool(lp)) for ids, s, r, lp in zip(prompts, samplings, rids, logprob, strict=True)]
        return items, batched

    def _check_vocabulary(self, ids: list[int], name: str) -> None:
        low, high = min(ids), max(ids)
        if low < 0 or (self.vocab_size is not None and high >= self.vocab_size):
            bad = low if low < 0 else high
            raise BadRequest(f"{name}: token id {bad} is outside the vocabulary (0..{(self.vocab_size or 0) - 1})")

    def _generate_output(
        self, input_ids: list[int], generation: Generation | PartialGeneration, rid: str, logprob: bool, latency: float
    ) -> dict[str, Any]:
        """One ``/generate`` result object, as SGLang builds it."""
        finished = isinstance(generation, Generation)
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": finish_reason_payload(generation) if finished else None,
            "prompt_tokens": len(input_ids),
            "weight_version": self._version_text(),
            "total_retractions": 0,
        }
        if logprob:  # SGLang's default logprob_start_len=-1: only the last prompt token, without a logprob
            meta["input_token_logprobs"] = [[None, input_ids[-1], None]]
            meta["output_token_logprobs"] = [
                [lp, token, None] for lp, token in zip(generation.output_logprobs, generation.output_ids, strict=True)
            ]
        meta["completion_tokens"] = len(generation.output_ids)
        meta["cached_tokens"] = 0
        if finished:
            meta["e2e_latency"] = latency
        return {
            "text": self._decode(generation.output_ids),
            "output_ids": list(generation.output_ids),
            "meta_info": meta,
        }

    async def _generate_streamed(
        self, request: web.Request, input_ids: list[int], sampling: SamplingParams, rid: str, logprob: bool
    ) -> web.StreamResponse:
        """SSE: ``data: {...}`` with the cumulative text and ids after each step, then ``data: [DONE]``."""
        response = await _sse_response(request)
        started = time.monotonic()
        async with self._admitted():
            async for chunk in _stream(self.engine, input_ids, sampling, rid):
                output = self._generate_output(input_ids, chunk, rid, logprob, time.monotonic() - started)
                await response.write(b"data: " + orjson.dumps(output) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    # ----- health and info -------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        healthy = await self.engine.health()
        return web.Response(status=200 if healthy else 503)

    async def health_generate(self, request: web.Request) -> web.Response:
        """Healthy when the engine generates one token within 20 s."""
        ids = self._encode("ok") or [0]
        try:
            sampling = SamplingParams(max_new_tokens=1, temperature=0.0)
            await asyncio.wait_for(self.engine.generate(ids, sampling, f"health-{uuid.uuid4().hex}"), 20)
        except (TimeoutError, EngineError):
            return web.Response(status=503)
        return web.Response(status=200)

    async def get_model_info(self, request: web.Request) -> web.Response:
        config = _model_config(self.config.model)
        return _json(
            {
                "model_path": self.config.model,
                "tokenizer_path": self.config.model,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self._version_text(),
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": config.get("model_type"),
                "architectures": config.get("architectures"),
            }
        )

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return _json({"weight_version": self._version_text()})

    async def get_server_info(self, request: web.Request) -> web.Response:
        state = {"model_path": self.config.model, "weight_version": self._version_text(), "dp_size": 1,
                 "tp_size": 1, "in_flight": self._in_flight, "paused": self._paused, **self.counters}  # fmt: skip
        return _json(
            {
                "model_path": self.config.model,
                "tokenizer_path": self.config.model,
                "context_length": _model_config(self.config.model).get("max_position_embeddings"),
                "is_embedding": False,
                "host": self.config.host,
                "port": self.config.port,
                "max_running_requests": self.config.engine.max_batch_size,
                "served_model_name": self.model_name,
                "weight_version": self._version_text(),
                "tool_call_parser": self.config.tool_parser,
                "dp_size": 1,
                "status": "ready",
                "internal_states": [state],
                "version": SERVER_VERSION,
                "engine": type(self.engine).__name__,
            }
        )

    def _version_text(self) -> str:
        return "default" if self.weight_version is None else str(self.weight_version)

    # ----- control ---------------------------------------------------------------------------

    async def flush_cache(self, request: web.Request) -> web.Response:
        flush = getattr(self.engine, "flush_cache", None)
        if flush is not None:
            result = flush()
            if asyncio.iscoroutine(result):
                await result
        return web.Response(text="Cache flushed.\nPlease check backend logs for more details. (When there are running "
                            "or waiting requests, the operation will not be performed.)\n")  # fmt: skip

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        if body.get("abort_all") or not body.get("rid"):
            await self.engine.abort(None)
        else:
            await self.engine.abort(str(body["rid"]))
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        """Hold new requests; abort the ones in flight (their clients resume them)."""
        body = await _json_body(request)
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract"):
            raise BadRequest(f"mode: {mode!r} is not supported by rallyrl serve (abort or retract)")
        self._paused = True
        self._open.clear()
        await self.engine.abort(None)
        return _json({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        self._paused = False
        if not self._update_lock.locked():
            self._open.set()
        return _json({"message": "Generation continued successfully.", "status": "ok"})

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        """Load the safetensors weights of a model directory between requests."""
        body = await _json_body(request)
        model_path = body.get("model_path")
        if not isinstance(model_path, str) or not model_path:
            raise BadRequest("model_path: expected the directory of the new weights")
        version = body.get("weight_version")
        async with self._update_lock:
            self._open.clear()
            try:
                if body.get("abort_all_requests"):
                    await self.engine.abort(None)
                async with self._idle:
                    await self._idle.wait_for(lambda: self._in_flight == 0)
                try:
                    state_dict = await asyncio.to_thread(load_weights_dir, Path(model_path))
                    new = _version_number(version, self.weight_version)
                    self.weight_version = await self.engine.update_weights(state_dict, weight_version=new)
                except (OSError, ValueError, EngineError) as exc:
                    failure = {"success": False, "message": f"{model_path}: {exc}", "num_paused_requests": 0}
                    return _json(failure, status=400)
            finally:
                if not self._paused:
                    self._open.set()
        message = "Succeeded to update model weights."
        if version is not None:
            message += f" Weight version updated to {self._version_text()}."
        return _json({"success": True, "message": message, "num_paused_requests": 0})

    # ----- OpenAI-compatible ----------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        model = {"id": self.model_name, "object": "model", "created": int(self.started), "owned_by": "rallyrl",
                 "root": self.config.model, "max_model_len": _model_config(self.config.model).get(
                     "max_position_embeddings")}  # fmt: skip
        return _json({"object": "list", "data": [model]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompts = [self._encode(prompt)]
        elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            self._check_vocabulary(prompt, "prompt")
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            prompts = [self._encode(p) for p in prompt]
        else:
            raise BadRequest("prompt: expected a string, a list of strings or a list of token ids")
        if not all(prompts):
            raise BadRequest("prompt: an empty prompt (no tokens)")
        if body.get("stream"):
            raise BadRequest("stream: streamed /v1/completions is not supported by rallyrl serve; use /generate")
        sampling, n, stops = self._openai_sampling(body, [], default_max_tokens=16)
        jobs = [(ids, i * n + j) for i, ids in enumerate(prompts) for j in range(n)]
        generations = await asyncio.gather(
            *(self._generate(ids, sampling, f"cmpl-{uuid.uuid4().hex}") for ids, _ in jobs)
        )
        choices, usage = [], _usage()
        for (ids, index), generation in zip(jobs, generations, strict=True):
            text, finish = _apply_stop_strings(self._decode(generation.output_ids), stops, generation.finish_reason)
            choices.append({"index": index, "text": text, "logprobs": None, "finish_reason": finish,
                            "matched_stop": None})  # fmt: skip
            _add_usage(usage, ids, generation)
        return _json({"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                      "model": self.model_name, "choices": choices, "usage": usage,
                      "metadata": {"weight_version": self._version_text()}})  # fmt: skip

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """Chat with tools: the chat template renders ``messages`` and ``tools``; tool calls in the
        answer come back as ``message.tool_calls`` with ``finish_reason`` "tool_calls"."""
        body = await _json_body(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages: expected a non-empty list")
        tools = body.get("tools") if body.get("tool_choice") != "none" else None
        schemas = [t.get("function", t) for t in tools] if isinstance(tools, list) else None
        try:
            chat = ChatTokenizer(self.tokenizer, schemas)
            prompt_ids = chat.prompt_ids([_template_message(m, i) for i, m in enumerate(messages)])
        except TemplateError as exc:
            raise BadRequest(f"messages: {exc}") from None
        sampling, n, stops = self._openai_sampling(body, chat.stop_token_ids, default_max_tokens=4096)
        generations = await asyncio.gather(
            *(self._generate(prompt_ids, sampling, f"chatcmpl-{uuid.uuid4().hex}") for _ in range(n))
        )
        parser = get_parser(self.config.tool_parser)
        choices, usage = [], _usage()
        for index, generation in enumerate(generations):
            text, finish = _apply_stop_strings(chat.assistant_text(generation.output_ids), stops,
                                               generation.finish_reason)  # fmt: skip
            turn = parser(text) if schemas else None
            message: dict[str, Any] = {"role": "assistant", "content": text, "reasoning_content": None,
                                       "tool_calls": None}  # fmt: skip
            calls = [call for call in turn.calls if call.error is None] if turn else []
            if calls:
                message["content"] = turn.content.strip() or None  # type: ignore[union-attr]
                message["tool_calls"] = [
                    {"id": f"call_{uuid.uuid4().hex[:24]}", "index": i, "type": "function",
                     "function": {"name": call.name, "arguments": orjson.dumps(call.arguments).decode()}}
                    for i, call in enumerate(calls)
                ]  # fmt: skip
                finish = "tool_calls"
            choice: dict[str, Any] = {"index": index, "message": message, "logprobs": None, "finish_reason": finish,
                                      "matched_stop": None}  # fmt: skip
            if body.get("logprobs"):
                choice["logprobs"] = {"content": [
                    {"token": self._decode([t]), "logprob": lp, "bytes": list(self._decode([t]).encode()),
                     "top_logprobs": []}
                    for t, lp in zip(generation.output_ids, generation.output_logprobs, strict=True)
                ]}  # fmt: skip
            choices.append(choice)
            _add_usage(usage, prompt_ids, generation)
        completion = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                      "model": self.model_name, "choices": choices, "usage": usage,
                      "metadata": {"weight_version": self._version_text()}}  # fmt: skip
        if body.get("stream"):
            return await self._chat_stream(request, completion)
        return _json(completion)

    async def _chat_stream(self, request: web.Request, completion: dict[str, Any]) -> web.StreamResponse:
        """A finished completion sent as ``chat.completion.chunk`` events: the role, the content,
        the tool calls, then the finish reason (the text is not streamed token by token)."""
        response = await _sse_response(request)
        base = {"id": completion["id"], "object": "chat.completion.chunk", "created": completion["created"],
                "model": completion["model"]}  # fmt: skip
        for choice in completion["choices"]:
            message, index = choice["message"], choice["index"]
            deltas: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
            if message["content"]:
                deltas.append({"content": message["content"]})
            if message["tool_calls"]:
                deltas.append({"tool_calls": message["tool_calls"]})
            for delta in deltas:
                chunk = {**base, "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}]}
                await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
            last = {"index": index, "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"]}
            await response.write(b"data: " + orjson.dumps({**base, "choices": [last]}) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def _openai_sampling(
        self, body: dict[str, Any], stop_token_ids: list[int], default_max_tokens: int
    ) -> tuple[SamplingParams, int, list[str]]:
        """SamplingParams, n and stop strings from an OpenAI request (the engine's context limit
        ends a generation that asks for more than fits)."""
        n = body.get("n") or 1
        if not isinstance(n, int) or n < 1:
            raise BadRequest(f"n: expected a positive integer, got {n!r}")
        stops = body.get("stop") or []
        stops = [stops] if isinstance(stops, str) else stops
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise BadRequest("stop: expected a string or a list of strings")
        extra = body.get("stop_token_ids") or []
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or default_max_tokens
        try:
            sampling = SamplingParams(
                max_new_tokens=int(max_tokens),
                temperature=float(body.get("temperature", 1.0) if body.get("temperature") is not None else 1.0),
                top_p=float(body.get("top_p") or 1.0),
                top_k=int(body.get("top_k") or -1),
                stop_token_ids=sorted({*stop_token_ids, *extra}),
                seed=body.get("seed"),
            )
        except (TypeError, ValueError) as exc:
            raise BadRequest(str(exc)) from None
        return sampling, n, stops

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


# ----- helpers -------------------------------------------------------------------------------------


async def _stream(
    engine: Engine, input_ids: list[int], sampling: SamplingParams, rid: str
) -> AsyncIterator[PartialGeneration | Generation]:
    """The engine's own stream when it has one, else the whole generation as one chunk."""
    stream = getattr(engine, "generate_stream", None)
    if stream is None:
        yield await engine.generate(input_ids, sampling, rid)
        return
    async for chunk in stream(input_ids, sampling, rid):
        yield chunk


def load_weights_dir(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files of a model directory (or one file)."""
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError("no *.safetensors files (save the model with save_pretrained or safetensors)")
    state_dict: dict[str, torch.Tensor] = {}
    for file in files:
        state_dict.update(load_file(str(file)))
    return state_dict


def _version_number(requested: Any, current: int | None) -> int:
    """The new weight version: the requested one when it names a number ("7", "step_7"), else the next."""
    number = parse_weight_version(requested)
    return (current or 0) + 1 if number is None else number


def _model_config(model_path: str) -> dict[str, Any]:
    try:
        return orjson.loads((Path(model_path) / "config.json").read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return {}


def _template_message(message: Any, index: int) -> dict[str, Any]:
    """An OpenAI chat message as the chat template takes it: assistant tool calls written back
    in the model's own ``<tool_call>`` format, content parts joined into text."""
    if not isinstance(message, dict) or message.get("role") not in ("system", "user", "assistant", "tool"):
        raise BadRequest(f"messages[{index}]: expected an object with role system, user, assistant or tool")
    content = message.get("content") or ""
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    if not isinstance(content, str):
        raise BadRequest(f"messages[{index}].content: expected a string or a list of text parts")
    for call in message.get("tool_calls") or []:
        function = call.get("function", {}) if isinstance(call, dict) else {}
        arguments = function.get("arguments", "{}")
        try:
            arguments = orjson.loads(arguments) if isinstance(arguments, str) else arguments
        except orjson.JSONDecodeError:
            raise BadRequest(f"messages[{index}].tool_calls: arguments are not valid JSON") from None
        text = orjson.dumps({"name": function.get("name"), "arguments": arguments}).decode()
        content += ("\n" if content else "") + f"<tool_call>\n{text}\n</tool_call>"
    return {"role": message["role"], "content": content}


def _apply_stop_strings(text: str, stops: list[str], finish: str) -> tuple[str, str]:
    """Cut ``text`` at the first stop string (OpenAI's ``stop``)."""
    cuts = [text.find(s) for s in stops if s and s in text]
    if cuts:
        return text[: min(cuts)], "stop"
    return text, "stop" if finish == "stop" else finish


def _usage() -> dict[str, int]:
    return {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}


def _add_usage(usage: dict[str, int], prompt_ids: list[int], generation: Generation) -> None:
    usage["prompt_tokens"] += len(prompt_ids)
    usage["completion_tokens"] += len(generation.output_ids)
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]


async def _json_body(request: web.Request) -> dict[str, Any]:
    if request.method == "GET" or not request.can_read_body:
        return dict(request.query)
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


def _error(request: web.Request, status: int, message: str) -> web.Response:
    """OpenAI's error object under /v1, SGLang's native ``{"error": {...}}`` elsewhere."""
    if request.path.startswith("/v1/"):
        kind = {400: "BadRequestError", 401: "AuthenticationError"}.get(status, "InternalServerError")
        return _json({"object": "error", "message": message, "type": kind, "param": None, "code": status}, status)
    return _json({"error": {"message": message}}, status)


async def _sse_response(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    return response


async def serve(engine: Engine, tokenizer: Any, config: ServeConfig, ready: asyncio.Event | None = None) -> None:
    """Serve until cancelled. Client disconnects cancel their handlers (and so abort their requests)."""
    server = EngineServer(engine, tokenizer, config)
    runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port, backlog=4096, reuse_address=True)
    await site.start()
    config.port = runner.addresses[0][1]  # the port bound when config.port was 0
    server.config.port = config.port
    if ready is not None:
        ready.set()
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
