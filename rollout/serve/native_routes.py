"""SGLang's native routes of ``rallyrl serve``: ``/generate`` (JSON or SSE), health and info, and the
control of generation and weights (``/flush_cache``, ``/abort_request``, ``/pause_generation``,
``/continue_generation``, ``/update_weights_from_disk``)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any

from aiohttp import web

from rollout.engines.base import EngineError, FlushesCache, SamplingParams
from rollout.serve.generate import generate_items, generate_output
from rollout.serve.generation import GenerateItem
from rollout.serve.http import BadRequest, json_body, json_response, model_config, send_event, sse_response
from rollout.serve.state import ServerState
from rollout.serve.weight_routes import MAX_BUCKET_BYTES, MAX_WEIGHT_BODY

SERVER_VERSION = "rallyrl-0.1.0"


class NativeRoutes:
    """The handlers of SGLang's native API over one ``ServerState``."""

    def __init__(self, server: ServerState):
        self.server = server

    def routes(self) -> list[tuple[str, str, Any]]:
        return [
            ("POST", "/generate", self.generate),
            ("PUT", "/generate", self.generate),
            ("GET", "/health", self.health),
            ("GET", "/health_generate", self.health_generate),
            ("GET", "/get_model_info", self.get_model_info),
            ("GET", "/model_info", self.get_model_info),
            ("GET", "/get_server_info", self.get_server_info),
            ("GET", "/server_info", self.get_server_info),
            ("GET", "/get_weight_version", self.get_weight_version),
            ("GET", "/flush_cache", self.flush_cache),
            ("POST", "/flush_cache", self.flush_cache),
            ("POST", "/abort_request", self.abort_request),
            ("POST", "/update_weights_from_disk", self.update_weights_from_disk),
            ("POST", "/pause_generation", self.pause_generation),
            ("POST", "/continue_generation", self.continue_generation),
        ]

    # ----- generation ----------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        """SGLang's ``/generate``: ``text`` or ``input_ids``, one or a batch (or ``n`` samples), answered
        at once or streamed."""
        body = await json_body(request, required=True)
        items, batched = await generate_items(self.server, body)
        started = time.monotonic()
        with self.server.pending.hold(len(items)):
            if body.get("stream"):
                return await self._generate_streamed(request, items, batched, started)
            generations = await asyncio.gather(*(self.server.generate_item(item) for item in items))
        outputs = [generate_output(self.server, item, gen, started)
                   for item, gen in zip(items, generations, strict=True)]  # fmt: skip
        return json_response(outputs if batched else outputs[0])

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
            async with contextlib.aclosing(self.server.stream_generations(items)) as chunks:
                async for index, chunk in chunks:
                    output = generate_output(self.server, items[index], chunk, started, first_of_stream=index in first)
                    first.discard(index)
                    await send_event(response, {**output, "index": index} if batched else output)
        except EngineError as exc:
            await send_event(response, {"error": {"message": f"engine error: {exc}"}})
        await send_event(response, "[DONE]")
        await response.write_eof()
        return response

    # ----- health and info -------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        healthy = await self.server.engine.health()
        return web.Response(status=200 if healthy else 503)

    async def health_generate(self, request: web.Request) -> web.Response:
        """Healthy when the engine generates one token within 20 s."""
        ids = self.server.encode("ok") or [0]
        try:
            sampling = SamplingParams(max_new_tokens=1, temperature=0.0)
            await asyncio.wait_for(self.server.engine.generate(ids, sampling, f"health-{uuid.uuid4().hex}"), 20)
        except (TimeoutError, EngineError):
            return web.Response(status=503)
        return web.Response(status=200)

    async def get_model_info(self, request: web.Request) -> web.Response:
        server = self.server
        config = model_config(server.config.model)
        return json_response(
            {
                "model_path": server.config.model,
                "served_model_name": server.model_name,
                "tokenizer_path": server.config.model,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": server.version_text(),
                "load_format": "auto",
                "reasoning_parser": None,
                "tool_call_parser": server.config.tool_parser,
                "disaggregation_mode": "null",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": config.get("model_type"),
                "architectures": config.get("architectures"),
            }
        )

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return json_response({"weight_version": self.server.version_text()})

    async def get_server_info(self, request: web.Request) -> web.Response:
        server = self.server
        state = {"model_path": server.config.model, "weight_version": server.version_text(), "dp_size": 1,
                 "tp_size": 1, "in_flight": server.in_flight, "paused": server.paused, **server.counters}  # fmt: skip
        return json_response(
            {
                "model_path": server.config.model,
                "tokenizer_path": server.config.model,
                "context_length": server.context_length,
                "is_embedding": False,
                "host": server.config.host,
                "port": server.config.port,
                "max_running_requests": server.config.engine.max_batch_size,
                "served_model_name": server.model_name,
                "weight_version": server.version_text(),
                "tool_call_parser": server.config.tool_parser,
                "tp_size": 1,
                "dp_size": 1,
                "disaggregation_mode": "null",
                "status": "ready",
                "internal_states": [state],
                "version": SERVER_VERSION,
                "engine": type(server.engine).__name__,
                "device": getattr(getattr(server.engine, "device", None), "type", "cpu"),
                "dtype": str(getattr(server.engine, "dtype", "auto")).removeprefix("torch."),
                "weight_limits": {"max_bucket_bytes": MAX_BUCKET_BYTES, "max_tensor_body_bytes": MAX_WEIGHT_BODY},
            }
        )

    # ----- control ---------------------------------------------------------------------------

    async def flush_cache(self, request: web.Request) -> web.Response:
        if isinstance(self.server.engine, FlushesCache):
            await self.server.engine.flush_cache()
        return web.Response(text="Cache flushed.\nPlease check backend logs for more details. (When there are running "
                            "or waiting requests, the operation will not be performed.)\n")  # fmt: skip

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        if body.get("abort_all") or not body.get("rid"):
            await self.server.engine.abort(None)
        else:
            await self.server.engine.abort(str(body["rid"]))
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
        await self.server.pause()
        return json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        if self.server.weights_half_updated:  # (SGLang would continue on them)
            raise BadRequest("a weight update has loaded part of the new weights: end it with end_weight_update "
                             "after the rest, or load whole weights, before generation continues")  # fmt: skip
        self.server.resume()
        return json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        """Load the safetensors weights of a model directory between requests."""
        body = await json_body(request)
        model_path = body.get("model_path")
        if not isinstance(model_path, str) or not model_path:
            raise BadRequest("model_path: expected the directory of the new weights", "schema")
        version = body.get("weight_version")
        failure = await self.server.update_weights(model_path, version, bool(body.get("abort_all_requests")))
        if failure is not None:
            return json_response({"success": False, "message": failure, "num_paused_requests": 0}, status=400)
        message = "Succeeded to update model weights."
        if version is not None:
            message += f" Weight version updated to {self.server.version_text()}."
        return json_response({"success": True, "message": message, "num_paused_requests": 0})
