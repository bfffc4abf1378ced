"""The OpenAI-compatible endpoints of ``rallyrl serve``: ``/v1/models``, ``/v1/completions`` and
``/v1/chat/completions`` (tools rendered by the chat template, tool calls parsed by rallyrl's
parsers and returned as ``tool_calls``), over the server's engine."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from rollout.engines.base import Generation, SamplingParams
from rollout.parsers import get_parser
from rollout.server_http import BadRequest, json_body, json_response, model_config, sse_response
from rollout.tokens import ChatTokenizer, TemplateError

if TYPE_CHECKING:
    from rollout.server import EngineServer


class OpenAIRoutes:
    """``/v1/...`` of one ``EngineServer``: requests are rendered to token ids and generated through
    the server (so pauses and weight updates hold them as they hold ``/generate``)."""

    def __init__(self, server: EngineServer):
        self.server = server

    def routes(self) -> list[tuple[str, str, Any]]:
        return [
            ("GET", "/v1/models", self.models),
            ("POST", "/v1/completions", self.completions),
            ("POST", "/v1/chat/completions", self.chat_completions),
        ]

    async def models(self, request: web.Request) -> web.Response:
        server = self.server
        model = {"id": server.model_name, "object": "model", "created": int(server.started), "owned_by": "rallyrl",
                 "root": server.config.model, "max_model_len": model_config(server.config.model).get(
                     "max_position_embeddings")}  # fmt: skip
        return json_response({"object": "list", "data": [model]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        server = self.server
        body = await json_body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompts = [server.encode(prompt)]
        elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            server.check_vocabulary(prompt, "prompt")
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            prompts = [server.encode(p) for p in prompt]
        else:
            raise BadRequest("prompt: expected a string, a list of strings or a list of token ids")
        if not all(prompts):
            raise BadRequest("prompt: an empty prompt (no tokens)")
        if body.get("stream"):
            raise BadRequest("stream: streamed /v1/completions is not supported by rallyrl serve; use /generate")
        sampling, n, stops = self._openai_sampling(body, [], default_max_tokens=16)
        jobs = [(ids, i * n + j) for i, ids in enumerate(prompts) for j in range(n)]
        generations = await asyncio.gather(
            *(server.generate_tokens(ids, sampling, f"cmpl-{uuid.uuid4().hex}", stops) for ids, _ in jobs)
        )
        choices, usage = [], _usage()
        for (ids, index), generation in zip(jobs, generations, strict=True):
            text, finish = _apply_stop_strings(server.decode(generation.output_ids), stops, generation.finish_reason)
            choices.append({"index": index, "text": text, "logprobs": None, "finish_reason": finish,
                            "matched_stop": None})  # fmt: skip
            _add_usage(usage, ids, generation)
        completion = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                      "model": server.model_name, "choices": choices, "usage": usage,
                      "metadata": {"weight_version": server.version_text()}}  # fmt: skip
        return json_response(completion)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """Chat with tools: the chat template renders ``messages`` and ``tools``; tool calls in the
        answer come back as ``message.tool_calls`` with ``finish_reason`` "tool_calls"."""
        server = self.server
        body = await json_body(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages: expected a non-empty list")
        tools = body.get("tools") if body.get("tool_choice") != "none" else None
        schemas = [t.get("function", t) for t in tools] if isinstance(tools, list) else None
        try:
            chat = ChatTokenizer(server.tokenizer, schemas)
            prompt_ids = chat.prompt_ids([_template_message(m, i) for i, m in enumerate(messages)])
        except TemplateError as exc:
            raise BadRequest(f"messages: {exc}") from None
        sampling, n, stops = self._openai_sampling(body, chat.stop_token_ids, default_max_tokens=4096)
        generations = await asyncio.gather(
            *(server.generate_tokens(prompt_ids, sampling, f"chatcmpl-{uuid.uuid4().hex}", stops) for _ in range(n))
        )
        parser = get_parser(server.config.tool_parser)
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
                    {"token": server.decode([t]), "logprob": lp, "bytes": list(server.decode([t]).encode()),
                     "top_logprobs": []}
                    for t, lp in zip(generation.output_ids, generation.output_logprobs, strict=True)
                ]}  # fmt: skip
            choices.append(choice)
            _add_usage(usage, prompt_ids, generation)
        completion = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                      "model": server.model_name, "choices": choices, "usage": usage,
                      "metadata": {"weight_version": server.version_text()}}  # fmt: skip
        if body.get("stream"):
            return await self._chat_stream(request, completion)
        return json_response(completion)

    async def _chat_stream(self, request: web.Request, completion: dict[str, Any]) -> web.StreamResponse:
        """A finished completion sent as ``chat.completion.chunk`` events: the role, the content,
        the tool calls, then the finish reason (the text is not streamed token by token)."""
        response = await sse_response(request)
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
        ends a generation that asks for more than fits). As in SGLang, the model's EOS ids end it
        too, unless ``ignore_eos`` (which turns off every stop token)."""
        n = body.get("n") or 1
        if not isinstance(n, int) or n < 1:
            raise BadRequest(f"n: expected a positive integer, got {n!r}")
        stops = body.get("stop") or []
        stops = [stops] if isinstance(stops, str) else stops
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise BadRequest("stop: expected a string or a list of strings")
        stops = [s for s in stops if s]
        extra = body.get("stop_token_ids") or []
        if not isinstance(extra, list) or not all(type(t) is int for t in extra):
            raise BadRequest("stop_token_ids: expected a list of token ids")
        ignore_eos = body.get("ignore_eos") or False
        if not isinstance(ignore_eos, bool):
            raise BadRequest(f"ignore_eos: expected true or false, got {ignore_eos!r}")
        stop_ids = [] if ignore_eos else sorted({*stop_token_ids, *extra, *self.server.eos_token_ids})
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or default_max_tokens
        try:
            sampling = SamplingParams(
                max_new_tokens=int(max_tokens),
                temperature=float(body.get("temperature", 1.0) if body.get("temperature") is not None else 1.0),
                top_p=float(body.get("top_p") or 1.0),
                top_k=int(body.get("top_k") or -1),
                stop_token_ids=stop_ids,
                seed=body.get("seed"),
            )
        except (TypeError, ValueError) as exc:
            raise BadRequest(str(exc)) from None
        return sampling, n, stops


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
