"""One chat completion of a gateway session: the generation, the commit to the session and the
OpenAI answer (JSON, or streamed as SSE chunks)."""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from typing import Any, Protocol

from aiohttp import web

from rollout.engines.base import Engine, EngineError, Generation, PartialGeneration, SamplingParams
from rollout.gateway.errors import GatewayError
from rollout.gateway.session import CallPlan, GatewaySession, answer_message
from rollout.serve.generation import generate_chunks
from rollout.serve.http import json_response, send_event, sse_response

logger = logging.getLogger(__name__)


class Serving(Protocol):
    """What a call reads of the gateway that serves it (``rollout.gateway.app.Gateway``)."""

    engine: Engine
    tokenizer: Any
    model_name: str
    counters: dict[str, int]


class Call:
    """One chat completion: the generation, the commit to the session and the OpenAI answer."""

    def __init__(self, gateway: Serving, session: GatewaySession, plan: CallPlan, sampling: SamplingParams,
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
