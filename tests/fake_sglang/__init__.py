"""A stand-in for the ``sglang`` package, to test ``rollout.engines.sglang_engine`` without a GPU.

``install(monkeypatch)`` puts fake ``sglang``, ``sglang.srt.managers.io_struct`` and
``sglang.srt.utils`` modules in ``sys.modules``. The fake ``Engine`` records how it was built and
every call, and answers each generation with the next of its ``steps`` in SGLang's real response
shape. Its tokenizer manager behaves like SGLang's where the adapter depends on it: an abort ends
the request it names, and a weight update waits for the generations in flight to leave the
engine while new ones wait for the update (SGLang's writer-preferring model_update_lock).
"""

from __future__ import annotations

import asyncio
import inspect
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

Response = dict[str, Any]
Step = Callable[["Engine", dict[str, Any]], "Response | Awaitable[Response]"]


# ----- sglang.srt.managers.io_struct and sglang.srt.utils --------------------------------------


@dataclass
class GenerateReqInput:
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] | None = None
    return_logprob: bool | None = None
    rid: str | None = None


@dataclass
class UpdateWeightsFromTensorReqInput:
    serialized_named_tensors: list[Any]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


@dataclass
class ReleaseMemoryOccupationReqInput:
    tags: list[str] | None = None


@dataclass
class ResumeMemoryOccupationReqInput:
    tags: list[str] | None = None


@dataclass
class FlushCacheReqOutput:
    success: bool


class MultiprocessingSerializer:
    """Keeps the object (the real one pickles tensors into shared memory / CUDA IPC handles)."""

    @staticmethod
    def serialize(obj: Any) -> tuple[str, Any]:
        return ("serialized", obj)


# ----- responses ---------------------------------------------------------------------------------


def response(
    output_ids: list[int],
    finish: str = "stop",
    *,
    rid: str | None = "",
    weight_version: str | None = "default",
    logprob: float = -0.5,
    **meta: Any,
) -> Response:
    """What ``Engine.async_generate(..., return_logprob=True)`` returns for one request."""
    if finish == "stop":
        finish_reason: dict[str, Any] = {"type": "stop", "matched": output_ids[-1] if output_ids else None}
    elif finish == "length":
        finish_reason = {"type": "length", "length": len(output_ids)}
    else:
        finish_reason = {"type": "abort", "message": "Abort request."}
    meta_info: dict[str, Any] = {
        "id": rid,
        "finish_reason": finish_reason,
        "output_token_logprobs": [[logprob - 0.01 * i, token, None] for i, token in enumerate(output_ids)],
        "completion_tokens": len(output_ids),
        **meta,
    }
    if weight_version is not None:
        meta_info["weight_version"] = weight_version
    return {"text": "", "output_ids": list(output_ids), "meta_info": meta_info}


def answer(output_ids: list[int], finish: str = "stop", **meta: Any) -> Step:
    """A step that answers at once, stamped with the engine's current weight version."""

    def step(engine: Engine, call: dict[str, Any]) -> Response:
        version = engine.tokenizer_manager.weight_version
        return response(output_ids, finish, rid=call["rid"], weight_version=version, **meta)

    return step


def answer_when_aborted(output_ids: list[int]) -> Step:
    """A step that generates ``output_ids`` and keeps going until an abort reaches it."""

    async def step(engine: Engine, call: dict[str, Any]) -> Response:
        await engine.tokenizer_manager.until_aborted(call["rid"])
        version = engine.tokenizer_manager.weight_version
        return response(output_ids, "abort", rid=call["rid"], weight_version=version)

    return step


def fail(exc: Exception) -> Step:
    def step(engine: Engine, call: dict[str, Any]) -> Response:
        raise exc

    return step


def fail_when_aborted(exc: Exception) -> Step:
    """Releases that raise on an aborted non-streaming request instead of returning it."""

    async def step(engine: Engine, call: dict[str, Any]) -> Response:
        await engine.tokenizer_manager.until_aborted(call["rid"])
        raise exc

    return step


# ----- sglang.Engine -----------------------------------------------------------------------------


class TokenizerManager:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.weight_version = "default"
        self.aborts: list[tuple[str, bool]] = []  # (rid, abort_all), in order
        self.weight_updates: list[UpdateWeightsFromTensorReqInput] = []
        self.update_result = (True, "Succeeded to update model weights.")
        self.memory_requests: list[tuple[str, list[str] | None]] = []
        self.events: list[str] = []  # releases, resumes and weight updates, in order ("release:all", ...)
        self.flushes = 0
        self.flush_success = True
        self.running = 0
        self.updating = False

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.aborts.append((rid, abort_all))

    async def until_aborted(self, rid: str) -> None:
        while not any(abort_all or aborted == rid for aborted, abort_all in self.aborts):
            await asyncio.sleep(0.001)

    async def update_weights_from_tensor(self, obj: UpdateWeightsFromTensorReqInput, request: Any = None):
        self.updating = True
        try:
            while self.running:
                await asyncio.sleep(0.001)
            self.weight_updates.append(obj)
            self.events.append("update_weights")
            if self.update_result[0] and obj.weight_version is not None:
                self.weight_version = obj.weight_version
            return self.update_result
        finally:
            self.updating = False

    async def release_memory_occupation(self, obj: ReleaseMemoryOccupationReqInput, request: Any = None) -> None:
        # SGLang asserts the scheduler is idle (weight_updater.release_memory_occupation)
        assert not self.running, "release_memory_occupation should be called only when server is idle."
        self.memory_requests.append(("release", obj.tags))
        self.events.append("release:" + ",".join(obj.tags or ["all"]))

    async def resume_memory_occupation(self, obj: ResumeMemoryOccupationReqInput, request: Any = None) -> None:
        self.memory_requests.append(("resume", obj.tags))
        self.events.append("resume:" + ",".join(obj.tags or ["all"]))

    async def flush_cache(self) -> FlushCacheReqOutput:
        self.flushes += 1
        return FlushCacheReqOutput(self.flush_success)

    async def generate_request(self, obj: GenerateReqInput, request: Any = None) -> AsyncIterator[Response]:
        call = {
            "input_ids": obj.input_ids,
            "sampling_params": obj.sampling_params,
            "return_logprob": obj.return_logprob,
            "rid": obj.rid,
        }
        yield await self.engine.run(call)


class Engine:
    """``sglang.Engine``: built with server args, answers generations from ``steps``."""

    def __init__(self, **kwargs: Any):
        self.kwargs = kwargs
        self.server_args = SimpleNamespace(tp_size=kwargs.get("tp_size", 1), weight_version="default")
        self.tokenizer_manager = TokenizerManager(self)
        self.steps: list[Step] = [answer([11, 12])]
        self.generate_calls: list[dict[str, Any]] = []
        self.shutdown_threads: list[threading.Thread] = []

    async def async_generate(
        self,
        prompt: str | None = None,
        sampling_params: dict[str, Any] | None = None,
        input_ids: list[int] | None = None,
        return_logprob: bool = False,
        stream: bool = False,
        rid: str | None = None,
    ) -> Response:
        return await self.run(
            {"input_ids": input_ids, "sampling_params": sampling_params, "return_logprob": return_logprob, "rid": rid}
        )

    async def run(self, call: dict[str, Any]) -> Response:
        """The i-th call answers with ``steps[i]`` (the last step repeats)."""
        manager = self.tokenizer_manager
        while manager.updating:
            await asyncio.sleep(0.001)
        self.generate_calls.append(call)
        step = self.steps[min(len(self.generate_calls) - 1, len(self.steps) - 1)]
        manager.running += 1
        try:
            result = step(self, call)
            return await result if inspect.isawaitable(result) else result
        finally:
            manager.running -= 1

    def shutdown(self) -> None:
        self.shutdown_threads.append(threading.current_thread())


class EngineWithoutRid(Engine):
    """``sglang.Engine`` of releases before 0.5, whose ``async_generate`` takes no rid."""

    async def async_generate(  # type: ignore[override]
        self,
        prompt: str | None = None,
        sampling_params: dict[str, Any] | None = None,
        input_ids: list[int] | None = None,
        return_logprob: bool = False,
        stream: bool = False,
    ) -> Response:
        raise AssertionError("the adapter must pass a rid, so it cannot use this async_generate")


def install(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``import sglang`` (and the submodules the adapter imports) find this fake."""
    modules = {
        name: ModuleType(name)
        for name in ("sglang", "sglang.srt", "sglang.srt.managers", "sglang.srt.managers.io_struct", "sglang.srt.utils")
    }
    modules["sglang"].Engine = Engine  # type: ignore[attr-defined]
    io_struct = modules["sglang.srt.managers.io_struct"]
    for cls in (
        GenerateReqInput,
        UpdateWeightsFromTensorReqInput,
        ReleaseMemoryOccupationReqInput,
        ResumeMemoryOccupationReqInput,
        FlushCacheReqOutput,
    ):
        setattr(io_struct, cls.__name__, cls)
    modules["sglang.srt.utils"].MultiprocessingSerializer = MultiprocessingSerializer  # type: ignore[attr-defined]
    for name, module in modules.items():
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(modules[parent], child, module)
        monkeypatch.setitem(sys.modules, name, module)
