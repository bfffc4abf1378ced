"""The OpenAI-compatible endpoints of ``rallyrl serve``, answered as SGLang 0.5.23 answers them:
``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions`` (tools rendered by the chat template
as the client sent them, tool calls parsed by rallyrl's parsers and returned as ``tool_calls``),
JSON or streamed, over the server's engine."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time
import uuid
from typing import TYPE_CHECKING, Any

from aiohttp import web

from rollout.engines.base import Generation, PartialGeneration, SamplingParams
from rollout.engines.sglang_protocol import OutputOptions, finish_reason_payload
from rollout.parsers import get_parser
from rollout.reasoning import get_reasoning_format
from rollout.serve.admission import (
    ENCODE_OFF_LOOP,
    check_chars,
    check_count,
    check_prompt_ids,
    check_samples,
    check_stops,
    encode_text,
)
from rollout.serve.generate import output_text, weight_version_spans
from rollout.serve.generation import GenerateItem
from rollout.serve.http import BadRequest, json_response, send_event, sse_response
from rollout.serve.openai_requests import (
    check_depth,
    check_not_implemented,
    request_body,
    sample_count,
    sampling_numbers,
    stop_strings,
    template_message,
)
from rollout.tokens import ChatTokenizer, TemplateError

if TYPE_CHECKING:
    from rollout.serve.state import ServerState


class OpenAIRoutes:
    """``/v1/...`` of one ``ServerState``: requests are rendered to token ids and generated through
    the server (so pauses and weight updates hold them as they hold ``/generate``)."""

    def __init__(self, server: ServerState):
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
                 "root": server.config.model, "parent": None, "max_model_len": server.context_length}  # fmt: skip
        return json_response({"object": "list", "data": [model]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """Text (or token id) prompts continued; ``n`` samples of each."""
        server = self.server
        body = await request_body(request)
        prompt = body.get("prompt")
        check_not_implemented(body)
        limit = server.config.limits.max_prompts
        if isinstance(prompt, str):
            prompts = [await encode_text(server, prompt, "prompt")]
        elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            check_count("prompt", len(prompt), limit, "max_prompts")
            prompts = [await encode_text(server, p, f"prompt[{i}]") for i, p in enumerate(prompt)]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, list) and all(type(t) is int for t in p)
                                                         for p in prompt):  # fmt: skip
            prompts = prompt
        else:
            raise BadRequest("prompt: expected a string, a list of strings, token ids or lists of token ids", "schema")
        if not all(prompts):
            raise BadRequest("prompt: an empty prompt (no tokens)")
        check_count("prompt", len(prompts), limit, "max_prompts")
        for ids in prompts:
            check_prompt_ids(server, ids, "prompt")
        n = sample_count(body)
        check_samples(server, len(prompts), n)
        check_stops(server, body.get("stop"), body.get("stop_token_ids"))
        options = OutputOptions(stop=tuple(stop_strings(body)))
        items = [self._item(ids, body, [], options, 16, "cmpl") for ids in prompts for _ in range(n)]
        reply = Reply(self, body, "text_completion", sum(len(ids) for ids in prompts))
        with server.pending.hold(len(items)):
            if body.get("stream"):
                return await reply.stream_completions(request, items)
            generations = await asyncio.gather(*(server.generate_item(item) for item in items))
        choices = [reply.text_choice(index, output_text(server.tokenizer, g, options), g)
                   for index, g in enumerate(generations)]  # fmt: skip
        return json_response(reply.answer(choices, generations))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """Chat with tools: the chat template renders ``messages`` and ``tools``; tool calls in the
        answer come back as ``message.tool_calls`` with ``finish_reason`` "tool_calls"."""
        server = self.server
        body = await request_body(request)
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise BadRequest("messages: required, a list of messages", "schema")
        if not messages:
            raise BadRequest("messages: empty")
        check_count("messages", len(messages), server.config.limits.max_prompts, "max_prompts")
        check_not_implemented(body)
        tools = body.get("tools") if body.get("tool_choice") != "none" else None
        tools = tools if isinstance(tools, list) and tools else None
        check_depth(tools, "tools")
        rendered = [template_message(m, i, server.config.tool_parser) for i, m in enumerate(messages)]
        chars = sum(len(m["content"]) for m in rendered) + len(json.dumps(tools or []))
        check_chars(server, chars, "messages and tools")  # before the template renders anything
        try:
            build = functools.partial(_chat_prompt, server.tokenizer, tools, rendered)
            chat, prompt_ids = build() if chars < ENCODE_OFF_LOOP else await asyncio.to_thread(build)
        except TemplateError as exc:
            raise BadRequest(f"messages: {exc}") from None
        # SGLang keeps special tokens in the text when tools are given or reasoning is parsed (the parsers read them)
        reasoning = get_reasoning_format(server.config.reasoning_parser)
        keep_special = tools is not None or reasoning is not None
        n = sample_count(body)
        check_samples(server, 1, n)
        check_stops(server, body.get("stop"), body.get("stop_token_ids"))
        options = OutputOptions(stop=tuple(stop_strings(body)), skip_special_tokens=not keep_special)
        items = [self._item(prompt_ids, body, chat.stop_token_ids, options, None, "chatcmpl") for _ in range(n)]
        parser = get_parser(server.config.tool_parser, tools) if tools else None
        reply = Reply(self, body, "chat.completion", len(prompt_ids), parser, reasoning)
        with server.pending.hold(len(items)):
            if body.get("stream"):
                return await reply.stream_chat(request, items)
            generations = await asyncio.gather(*(server.generate_item(item) for item in items))
        choices = []
        for index, generation in enumerate(generations):
            message, finish, matched = reply.message(generation, options)
            choice: dict[str, Any] = {"index": index, "message": message, "logprobs": None, "finish_reason": finish,
                                      "matched_stop": matched}  # fmt: skip
            if body.get("logprobs"):
                choice["logprobs"] = {"content": [
                    {"token": server.decode([t]), "bytes": list(server.decode([t]).encode()), "logprob": lp,
                     "top_logprobs": []}
                    for t, lp in zip(generation.output_ids, generation.output_logprobs, strict=True)
                ]}  # fmt: skip
            choices.append(choice)
        return json_response(reply.answer(choices, generations))

    def _item(self, prompt_ids: list[int], body: dict[str, Any], stop_token_ids: list[int], options: OutputOptions,
              default_max_tokens: int | None, prefix: str) -> GenerateItem:  # fmt: skip
        """One generation of an OpenAI request: SamplingParams from its fields (the prompt and
        ``max_tokens`` must fit the context, as in SGLang; no ``max_tokens`` in a chat runs to the
        end of the context). As in SGLang, the model's EOS ids end it too, unless ``ignore_eos``
        (which turns off every stop token)."""
        server, context = self.server, self.server.context_length
        extra = body.get("stop_token_ids") or []
        if not isinstance(extra, list) or not all(type(t) is int for t in extra):
            raise BadRequest("stop_token_ids: expected a list of token ids", "schema")
        ignore_eos = body.get("ignore_eos") or False
        if not isinstance(ignore_eos, bool):
            raise BadRequest(f"ignore_eos: expected true or false, got {ignore_eos!r}", "schema")
        stop_ids = [] if ignore_eos else sorted({*stop_token_ids, *extra, *server.eos_token_ids})
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)):
            raise BadRequest(f"max_tokens: expected an integer, got {max_tokens!r}", "schema")
        if context is not None and len(prompt_ids) >= context:
            raise BadRequest(f"the prompt has {len(prompt_ids)} tokens, the context holds {context}")
        if max_tokens is None:
            max_tokens = default_max_tokens or (context - len(prompt_ids) if context else 4096)
        if context is not None and len(prompt_ids) + max_tokens > context:
            raise BadRequest(f"max_tokens: {len(prompt_ids)} prompt tokens + {max_tokens} new tokens do not fit the "
                             f"context of {context} tokens")  # fmt: skip
        numbers = sampling_numbers(body)
        try:
            sampling = SamplingParams(
                max_new_tokens=max_tokens,
                temperature=1.0 if numbers["temperature"] is None else float(numbers["temperature"]),
                top_p=1.0 if numbers["top_p"] is None else float(numbers["top_p"]),
                top_k=-1 if numbers["top_k"] is None else numbers["top_k"],
                stop_token_ids=stop_ids,
                seed=numbers["seed"],
            )
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        return GenerateItem(prompt_ids, sampling, options, f"{prefix}-{uuid.uuid4().hex}", False)


class Reply:
    """The answer to one OpenAI request, whole or streamed: ids, the model's name, choices, usage
    and SGLang's ``metadata`` (the weight version of the first choice and its ``weight_versions``)."""

    def __init__(self, routes: OpenAIRoutes, body: dict[str, Any], kind: str, prompt_tokens: int,
                 parser: Any = None, reasoning: Any = None):  # fmt: skip
        self.server = routes.server
        self.reasoning = reasoning  # a ReasoningFormat: answers carry reasoning_content
        self.kind = kind
        self.chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else kind
        self.prompt_tokens = prompt_tokens
        self.parser = parser
        self.id = f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        model = body.get("model")  # echoed, as SGLang and OpenAI do
        self.model = model if isinstance(model, str) and model else self.server.model_name

    def answer(self, choices: list[dict[str, Any]], generations: list[Generation]) -> dict[str, Any]:
        completion_tokens = sum(len(g.output_ids) for g in generations)
        usage = {"prompt_tokens": self.prompt_tokens, "total_tokens": self.prompt_tokens + completion_tokens,
                 "completion_tokens": completion_tokens, "prompt_tokens_details": None, "reasoning_tokens": 0,
                 "completion_tokens_details": None}  # fmt: skip
        name = self.server.version_name
        metadata = {"weight_version": name(generations[0].weight_version),
                    "weight_versions": weight_version_spans(generations[0], name)}  # fmt: skip
        return {"id": self.id, "object": self.kind, "created": self.created, "model": self.model, "choices": choices,
                "usage": usage, "metadata": metadata}  # fmt: skip

    def text_choice(self, index: int, text: str, generation: Generation | None = None) -> dict[str, Any]:
        finish, matched = (None, None) if generation is None else (generation.finish_reason, _matched(generation))
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish, "matched_stop": matched}

    def message(self, generation: Generation, options: OutputOptions) -> tuple[dict[str, Any], str, Any]:
        """The assistant message of a chat generation (its tool calls parsed), its finish reason and
        ``matched_stop`` (null for a tool call, as SGLang has it)."""
        text = output_text(self.server.tokenizer, generation, options)
        message: dict[str, Any] = {"role": "assistant", "content": text, "reasoning_content": None}
        if self.reasoning is not None:
            split = self.reasoning.split(text)
            text = message["content"] = split.content
            message["reasoning_content"] = split.reasoning
        turn = self.parser(text) if self.parser else None
        calls = [call for call in turn.calls if call.error is None] if turn else []
        if not calls:
            return message, generation.finish_reason, _matched(generation)
        message["content"] = turn.content.strip()  # type: ignore[union-attr]
        message["tool_calls"] = [
            {"id": f"call_{uuid.uuid4().hex[:24]}", "index": i, "type": "function",
             "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}
            for i, call in enumerate(calls)
        ]  # fmt: skip
        return message, "tool_calls", None

    # ----- streaming ----------------------------------------------------------------------------

    def _chunk(self, choice: dict[str, Any], usage: bool = False) -> dict[str, Any]:
        """One SSE event; ``usage`` adds ``"usage": null``, as SGLang does on some of its chunks."""
        chunk = {"id": self.id, "object": self.chunk_kind, "created": self.created, "model": self.model,
                 "choices": [choice]}  # fmt: skip
        return {**chunk, "usage": None} if usage else chunk

    async def stream_completions(self, request: web.Request, items: list[GenerateItem]) -> web.StreamResponse:
        """SSE as SGLang sends it: a chunk per decode step with its new text, the last one with the
        finish reason; then ``[DONE]``."""
        response = await sse_response(request)
        sent = [""] * len(items)
        async with contextlib.aclosing(self.server.stream_generations(items)) as chunks:
            async for index, chunk in chunks:
                text = _visible(output_text(self.server.tokenizer, chunk, items[index].options), chunk, items[index])
                new, sent[index] = text[len(sent[index]) :], text
                choice = self.text_choice(index, new, chunk if isinstance(chunk, Generation) else None)
                await send_event(response, self._chunk(choice, usage=True))
        await send_event(response, "[DONE]")
        await response.write_eof()
        return response

    async def stream_chat(self, request: web.Request, items: list[GenerateItem]) -> web.StreamResponse:
        """SSE as SGLang sends it: the role first, then the new text of each decode step (with tools,
        the content and each tool call, its arguments whole, once the generation is done), then the
        finish reason; then ``[DONE]``."""
        response = await sse_response(request)
        for index in range(len(items)):
            await send_event(response, self._delta(index, {"reasoning_content": None, "role": "assistant",
                                                           "content": ""}))  # fmt: skip
        sent = [""] * len(items)
        async with contextlib.aclosing(self.server.stream_generations(items)) as chunks:
            async for index, chunk in chunks:
                if self.parser is not None or self.reasoning is not None:  # parsed from the whole text
                    if isinstance(chunk, Generation):
                        await self._send_parsed(response, index, chunk, items[index].options)
                    continue
                text = _visible(output_text(self.server.tokenizer, chunk, items[index].options), chunk, items[index])
                new, sent[index] = text[len(sent[index]) :], text
                if new:
                    await send_event(response, self._delta(index, {"reasoning_content": None, "content": new}))
                if isinstance(chunk, Generation):
                    await self._send_finish(response, index, chunk.finish_reason, _matched(chunk))
        await send_event(response, "[DONE]")
        await response.write_eof()
        return response

    async def _send_parsed(self, response: web.StreamResponse, index: int, generation: Generation,
                           options: OutputOptions) -> None:  # fmt: skip
        """A parsed chat generation as SGLang's tool-call parser streams it: the content, then each
        call's id and name, then its arguments."""
        message, finish, _ = self.message(generation, options)
        if message["reasoning_content"]:
            delta = {"role": None, "content": None, "reasoning_content": message["reasoning_content"]}
            await send_event(response, self._delta(index, delta, usage=True))
        if message["content"]:
            delta = {"role": None, "content": message["content"], "reasoning_content": None}
            await send_event(response, self._delta(index, delta, usage=True))
        for call in message.get("tool_calls") or []:
            function = call["function"]
            for part in ({"id": call["id"], "name": function["name"], "arguments": ""},
                         {"id": None, "name": None, "arguments": function["arguments"]}):  # fmt: skip
                delta = {"role": None, "content": None, "reasoning_content": None, "tool_calls": [
                    {"id": part["id"], "index": call["index"], "type": "function",
                     "function": {"name": part["name"], "arguments": part["arguments"]}}]}  # fmt: skip
                await send_event(response, self._delta(index, delta, usage=True))
        await self._send_finish(response, index, finish, _matched(generation))  # the stream names the stop token

    async def _send_finish(self, response: web.StreamResponse, index: int, finish: str, matched: Any) -> None:
        await send_event(response, self._delta(index, {"reasoning_content": None}, finish, matched))

    def _delta(self, index: int, delta: dict[str, Any], finish: str | None = None, matched: Any = None,
               usage: bool = False) -> dict[str, Any]:  # fmt: skip
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish, "matched_stop": matched}
        return self._chunk(choice, usage)


def _chat_prompt(tokenizer: Any, tools: list[Any] | None, messages: list[dict[str, Any]]
                 ) -> tuple[ChatTokenizer, list[int]]:  # fmt: skip
    """The chat tokenizer of ``tools`` and the prompt ids of ``messages`` (on a worker thread when long)."""
    chat = ChatTokenizer(tokenizer, tools)
    return chat, chat.prompt_ids(messages)


# ----- writing OpenAI answers ---------------------------------------------------------------------------


def _matched(generation: Generation) -> Any:
    """SGLang's ``matched_stop``: the stop token or string that ended the generation, else null."""
    return finish_reason_payload(generation).get("matched") if generation.finish_reason == "stop" else None


def _visible(text: str, chunk: Generation | PartialGeneration, item: GenerateItem) -> str:
    """The text of a running generation that may be sent: without its last characters that could
    still begin a stop string (a finished one is already cut at its stop string)."""
    hold = max((len(s) - 1 for s in item.options.stop), default=0)
    return text[: len(text) - hold] if hold and not isinstance(chunk, Generation) else text
