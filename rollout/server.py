"""``rallyrl serve``: any rallyrl engine behind SGLang's HTTP API, so SGLang clients work unchanged.

Native API (as ``sglang.launch_server`` serves it), here: ``/generate`` (one request, a batch or
``n`` samples; JSON or SSE-streamed), ``/health``, ``/health_generate``, ``/get_model_info``,
``/get_server_info``, ``/flush_cache``, ``/abort_request``, ``/update_weights_from_disk``,
``/pause_generation``, ``/continue_generation``. OpenAI-compatible (``rollout/server_openai.py``):
``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``. ``sampling_params`` are read with
SGLang's defaults and generations end where SGLang ends them (``rollout/server_generate.py``).
Answers, errors included, have SGLang 0.5.23's shapes: ``tests/real_engines/test_sglang_conformance.py``
compares them with a real SGLang and lists where rallyrl serve differs on purpose.

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
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import torch
from aiohttp import web
from safetensors.torch import load_file

from rollout.config import ServeConfig
from rollout.engines.base import Engine, EngineError, FlushesCache, Generation, PartialGeneration, SamplingParams
from rollout.engines.sglang_protocol import parse_weight_version
from rollout.faults import install_faults
from rollout.server_generate import GenerateItem, eos_token_ids, generate_chunks, generate_items, generate_output
from rollout.server_http import (
    BadRequest,
    error_response,
    json_body,
    json_response,
    model_config,
    send_event,
    sse_response,
)
from rollout.server_openai import OpenAIRoutes

SERVER_VERSION = "rallyrl-0.1.0"
OPEN_PATHS = frozenset({"/health", "/health_generate"})
"""Paths answered without the API key (as in SGLang), so that health probes need no secret."""
logger = logging.getLogger(__name__)


class EngineServer:
    """The aiohttp application around one engine. ``tokenizer`` decodes text fields and renders
    chat messages; the engine itself sees token ids only."""

    def __init__(self, engine: Engine, tokenizer: Any, config: ServeConfig):
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = config
        self.model_name = config.served_model_name or Path(config.model).name
        self.vocab_size: int | None = model_config(config.model).get("vocab_size")
        self.context_length: int | None = config.engine.max_model_len or model_config(config.model).get(
            "max_position_embeddings")  # fmt: skip
        """Prompt and new tokens together; longer requests are refused, as SGLang refuses them."""
        self.eos_token_ids = eos_token_ids(config.model, tokenizer)
        """Where a generation ends unless ``ignore_eos`` (besides the request's ``stop_token_ids``)."""
        self.weight_version: int | None = None  # None until the first update ("default" in SGLang)
        self._version_names: dict[int, str] = {}
        """The name each update gave its version (``weight_version`` of the request, as SGLang keeps it)."""
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
            *OpenAIRoutes(self).routes(),
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
            return error_response(request, 401, "missing or wrong API key (Authorization: Bearer ...)")
        try:
            return await handler(request)
        except BadRequest as exc:
            return error_response(request, 400, str(exc), exc.kind)
        except EngineError as exc:
            return error_response(request, 500, f"engine error: {exc}")
        except web.HTTPException:
            raise
        except Exception as exc:  # a bug: answer, log the trace, keep serving
            logger.exception("%s %s failed", request.method, request.path)
            return error_response(request, 500, f"internal error: {type(exc).__name__}: {exc}")

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

    async def generate_tokens(
        self, input_ids: list[int], sampling: SamplingParams, rid: str, stop: Sequence[str] = ()
    ) -> Generation:
        """The engine's generation, ended where SGLang ends it (at a stop string too)."""
        chunks = generate_chunks(self.engine, self.tokenizer, input_ids, sampling, rid, stop)
        async with self._admitted(), contextlib.aclosing(chunks):
            async for chunk in chunks:
                generation = chunk
        assert isinstance(generation, Generation)
        self._count(generation)
        return generation

    def _count(self, generation: Generation) -> None:
        self.counters["requests"] += 1
        self.counters["generated_tokens"] += len(generation.output_ids)
        self.counters["aborted"] += generation.finish_reason == "abort"

    async def generate(self, request: web.Request) -> web.StreamResponse:
        """SGLang's ``/generate``: ``text`` or ``input_ids``, one or a batch (or ``n`` samples), answered
        at once or streamed."""
        body = await json_body(request, required=True)
        items, batched = generate_items(self, body)
        started = time.monotonic()
        if body.get("stream"):
            return await self._generate_streamed(request, items, batched, started)
        generations = await asyncio.gather(*(self.generate_item(item) for item in items))
        outputs = [generate_output(self, item, gen, started) for item, gen in zip(items, generations, strict=True)]
        return json_response(outputs if batched else outputs[0])

    async def generate_item(self, item: GenerateItem) -> Generation:
        """One item's generation, ended where SGLang ends it."""
        if item.no_tokens:  # max_new_tokens 0: SGLang answers "length" with no tokens
            return Generation([], [], "length", self.weight_version or 0)
        return await self.generate_tokens(item.input_ids, item.sampling, item.rid, item.options.stop)

    def check_vocabulary(self, ids: list[int], name: str) -> None:
        low, high = min(ids), max(ids)
        if low < 0 or (self.vocab_size is not None and high >= self.vocab_size):
            bad = low if low < 0 else high
            raise BadRequest(f"{name}: token id {bad} is outside the vocabulary (0..{(self.vocab_size or 0) - 1})")

    async def _generate_streamed(
        self, request: web.Request, items: list[GenerateItem], batched: bool, started: float
    ) -> web.StreamResponse:
        """SSE: ``data: {...}`` with the cumulative text and ids after each decode step, then
        ``data: [DONE]``; the prompts of a batch stream together, each chunk naming its ``index``.
        An engine failure on the way is sent as ``data: {"error": {"message": ...}}``, as SGLang
        sends its own."""
        response = await sse_response(request)
        first = set(range(len(items)))
        try:
            async with contextlib.aclosing(self.stream_generations(items)) as chunks:
                async for index, chunk in chunks:
                    output = generate_output(self, items[index], chunk, started, first_of_stream=index in first)
                    first.discard(index)
                    await send_event(response, {**output, "index": index} if batched else output)
        except EngineError as exc:
            await send_event(response, {"error": {"message": f"engine error: {exc}"}})
        await send_event(response, "[DONE]")
        await response.write_eof()
        return response

    async def stream_generations(
        self, items: Sequence[GenerateItem]
    ) -> AsyncIterator[tuple[int, Generation | PartialGeneration]]:
        """The generations of ``items`` made together, as SGLang ends and streams them (``stream_interval``
        1): the tokens so far after each new token, the last step being the final ``Generation``, each
        with its item's index, in the order they come. The items are admitted together (held while
        paused)."""
        chunks: asyncio.Queue[tuple[int, Generation | PartialGeneration | BaseException | None]] = asyncio.Queue()

        async def stream(index: int, item: GenerateItem) -> None:
            try:
                if item.no_tokens:
                    await chunks.put((index, await self.generate_item(item)))
                    return
                parts = generate_chunks(self.engine, self.tokenizer, item.input_ids, item.sampling, item.rid,
                                        item.options.stop, True)  # fmt: skip
                async with contextlib.aclosing(parts):
                    async for part in parts:
                        await chunks.put((index, part))
            except Exception as exc:  # raised where the chunks are read
                await chunks.put((index, exc))
            finally:
                await chunks.put((index, None))

        async with self._admitted():
            tasks = [asyncio.create_task(stream(index, item)) for index, item in enumerate(items)]
            shown = [0] * len(items)  # tokens sent per item; the newest waits: the final may be next
            try:
                running = len(tasks)
                while running:
                    index, chunk = await chunks.get()
                    if chunk is None:
                        running -= 1
                        continue
                    if isinstance(chunk, BaseException):
                        raise chunk
                    for count in range(shown[index] + 1, len(chunk.output_ids)):
                        yield index, PartialGeneration(chunk.output_ids[:count], chunk.output_logprobs[:count])
                    shown[index] = max(shown[index], len(chunk.output_ids) - 1)
                    if isinstance(chunk, Generation):
                        self._count(chunk)
                        yield index, chunk
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    # ----- health and info -------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        healthy = await self.engine.health()
        return web.Response(status=200 if healthy else 503)

    async def health_generate(self, request: web.Request) -> web.Response:
        """Healthy when the engine generates one token within 20 s."""
        ids = self.encode("ok") or [0]
        try:
            sampling = SamplingParams(max_new_tokens=1, temperature=0.0)
            await asyncio.wait_for(self.engine.generate(ids, sampling, f"health-{uuid.uuid4().hex}"), 20)
        except (TimeoutError, EngineError):
            return web.Response(status=503)
        return web.Response(status=200)

    async def get_model_info(self, request: web.Request) -> web.Response:
        config = model_config(self.config.model)
        return json_response(
            {
                "model_path": self.config.model,
                "served_model_name": self.model_name,
                "tokenizer_path": self.config.model,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.version_text(),
                "load_format": "auto",
                "reasoning_parser": None,
                "tool_call_parser": self.config.tool_parser,
                "disaggregation_mode": "null",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": config.get("model_type"),
                "architectures": config.get("architectures"),
            }
        )

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return json_response({"weight_version": self.version_text()})

    async def get_server_info(self, request: web.Request) -> web.Response:
        state = {"model_path": self.config.model, "weight_version": self.version_text(), "dp_size": 1,
                 "tp_size": 1, "in_flight": self._in_flight, "paused": self._paused, **self.counters}  # fmt: skip
        return json_response(
            {
                "model_path": self.config.model,
                "tokenizer_path": self.config.model,
                "context_length": self.context_length,
                "is_embedding": False,
                "host": self.config.host,
                "port": self.config.port,
                "max_running_requests": self.config.engine.max_batch_size,
                "served_model_name": self.model_name,
                "weight_version": self.version_text(),
                "tool_call_parser": self.config.tool_parser,
                "tp_size": 1,
                "dp_size": 1,
                "disaggregation_mode": "null",
                "status": "ready",
                "internal_states": [state],
                "version": SERVER_VERSION,
                "engine": type(self.engine).__name__,
            }
        )

    def version_text(self) -> str:
        """The name of the weights served now: "default" until the first update, then the
        ``weight_version`` that update was given (its number when it was given none)."""
        return "default" if self.weight_version is None else self.version_name(self.weight_version)

    def version_name(self, version: int) -> str:
        """The name of the engine's weight ``version`` (versions older than every update: "default")."""
        if version in self._version_names:
            return self._version_names[version]
        return "default" if not self._version_names or version < min(self._version_names) else str(version)

    # ----- control ---------------------------------------------------------------------------

    async def flush_cache(self, request: web.Request) -> web.Response:
        if isinstance(self.engine, FlushesCache):
            await self.engine.flush_cache()
        return web.Response(text="Cache flushed.\nPlease check backend logs for more details. (When there are running "
                            "or waiting requests, the operation will not be performed.)\n")  # fmt: skip

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        if body.get("abort_all") or not body.get("rid"):
            await self.engine.abort(None)
        else:
            await self.engine.abort(str(body["rid"]))
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        """Hold new requests; abort the ones in flight (their clients resume them)."""
        body = await json_body(request)
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise BadRequest(f"mode: expected abort, retract or in_place, got {mode!r}", "schema")
        if mode == "in_place":
            raise BadRequest("mode: in_place is not supported by rallyrl serve (the engine cannot hold a request "
                             "half-way): use abort or retract, whose requests the clients resume")  # fmt: skip
        self._paused = True
        self._open.clear()
        await self.engine.abort(None)
        return json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        self._paused = False
        if not self._update_lock.locked():
            self._open.set()
        return json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        """Load the safetensors weights of a model directory between requests."""
        body = await json_body(request)
        model_path = body.get("model_path")
        if not isinstance(model_path, str) or not model_path:
            raise BadRequest("model_path: expected the directory of the new weights", "schema")
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
                    self._version_names[self.weight_version] = str(self.weight_version if version is None else version)
                except (OSError, ValueError, EngineError) as exc:
                    failure = {"success": False, "message": f"{model_path}: {exc}", "num_paused_requests": 0}
                    return json_response(failure, status=400)
            finally:
                if not self._paused:
                    self._open.set()
        message = "Succeeded to update model weights."
        if version is not None:
            message += f" Weight version updated to {self.version_text()}."
        return json_response({"success": True, "message": message, "num_paused_requests": 0})

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


# ----- helpers -------------------------------------------------------------------------------------


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
