"""SGLang's in-process offline engine (``sglang.Engine``) behind the Engine protocol.

SGLang is an optional extra (``pip install 'rallyrl[sglang]'``, a CUDA machine): it is imported
only when an engine is built, and a missing install is an EngineError that says so.

API followed: sgl-project/sglang main (0.5.x line; engine.py at commit 001067ff), read in
python/sglang/srt/entrypoints/engine.py (``Engine(**server_args)``, ``async_generate(input_ids=,
sampling_params=, return_logprob=, rid=)``, ``shutdown()``), python/sglang/srt/managers/io_struct.py
(``UpdateWeightsFromTensorReqInput`` with ``weight_version``, ``Release/ResumeMemoryOccupationReqInput(tags)``)
and python/sglang/srt/managers/tokenizer_communicator_mixin.py. Older releases work too: an
``async_generate`` without ``rid`` (releases before about 0.5) is replaced by the ``GenerateReqInput``
it would build, and request fields a release lacks (``weight_version``, ``tags``) are left out.

Control calls await ``engine.tokenizer_manager`` directly. ``Engine``'s own
``update_weights_from_tensor``, ``flush_cache`` and ``release/resume_memory_occupation`` are
``self.loop.run_until_complete(self.tokenizer_manager.<call>(...))``: inside a running event loop
they fail ("This event loop is already running"), and from a worker thread they would drive the
tokenizer manager from a second loop. So this adapter awaits the same coroutines on the running
loop, as ``async_generate`` does; tensor serialization and ``shutdown`` (which kills the engine's
processes and waits for them) run in a thread.

Weight updates: ``update_weights`` aborts the generations in flight (``abort_on_update``), and
SGLang loads the new tensors once they have left the engine (inside a ``begin_weight_update`` /
``end_weight_update`` session on releases that have one, 0.5.2x: without it the load is
refused). Each aborted generation is resumed from its tokens so far with the rest of its budget,
so no SGLang call mixes weights, and every token records the version that produced it. A
generation aborted through ``abort`` returns finish "abort" and is not resumed.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from pathlib import Path
from types import ModuleType
from typing import Any

from rollout.engines.base import EngineError, Generation, SamplingParams
from rollout.engines.config import SGLangEngineConfig
from rollout.engines.sglang_protocol import (
    generate_resuming,
    parse_generation,
    parse_weight_version,
    sampling_params_payload,
)

MISSING_SGLANG = "the in-process SGLang engine needs SGLang: pip install 'rallyrl[sglang]' (a CUDA machine)"


def import_sglang(module: str = "sglang") -> ModuleType:
    """``module`` of SGLang, or an EngineError that says how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise EngineError(f"{MISSING_SGLANG} (import {module}: {exc})") from exc


class SGLangEngine:
    """The Engine protocol over one ``sglang.Engine`` in this process."""

    def __init__(self, engine: Any, config: SGLangEngineConfig | None = None):
        self.engine = engine
        self.config = config or SGLangEngineConfig()
        server_args = getattr(engine, "server_args", None)
        self.weight_version = parse_weight_version(getattr(server_args, "weight_version", None)) or 0
        self.in_flight = 0
        self._open = False
        self._closed = False
        self._takes_rid = _accepts(engine.async_generate, "rid")
        self._segments = 0  # SGLang calls made, numbering their rids
        self._wire_rids: dict[str, str] = {}  # our rid -> the rid of its current SGLang call
        self._aborted: set[str] = set()  # our rids aborted through ``abort`` (not resumed)
        self._aborted_wire: set[str] = set()  # SGLang rids an abort was sent for
        self._update_lock = asyncio.Lock()

    @classmethod
    def from_config(cls, config: SGLangEngineConfig) -> SGLangEngine:
        """Start ``sglang.Engine(model_path=..., **server_args)``. Blocks while SGLang loads the model:
        build it at start-up, in the main thread (older SGLang installs signal handlers)."""
        if not config.model_path:
            raise ValueError("SGLangEngineConfig.model_path is required")
        sglang = import_sglang()
        try:
            engine = sglang.Engine(model_path=config.model_path, **config.server_args)
        except Exception as exc:  # a bad server arg, a model it cannot load, no GPU memory
            raise EngineError(f"SGLang could not start {config.model_path}: {type(exc).__name__}: {exc}") from exc
        return cls(engine, config)

    @classmethod
    def from_pretrained(cls, model_path: str | Path, **server_args: Any) -> SGLangEngine:
        """``from_config`` with default settings; ``server_args`` go to ``sglang.Engine``."""
        return cls.from_config(SGLangEngineConfig(model_path=str(model_path), server_args=server_args))

    def __repr__(self) -> str:
        return f"SGLangEngine({self.config.model_path!r})"

    async def __aenter__(self) -> SGLangEngine:
        if self._closed:
            raise EngineError(f"{self!r} was shut down; build a new one")
        self._open = True
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()

    async def shutdown(self) -> None:
        """Abort what is in flight and stop SGLang's processes (in a thread: it waits for them)."""
        if self._closed:
            return
        self._open, self._closed = False, True
        if self._wire_rids:
            self._aborted.update(self._wire_rids)
            self._abort_all()
        await asyncio.to_thread(self.engine.shutdown)

    def _require_open(self) -> None:
        if not self._open:
            raise EngineError(f"{self!r} is not open: use it inside 'async with engine:'")

    # ----- generation ----------------------------------------------------------------------

    async def generate(self, input_ids: list[int], sampling: SamplingParams, rid: str) -> Generation:
        """Continue ``input_ids``; resumed across aborts caused by weight updates."""
        self._require_open()
        if not input_ids:
            raise EngineError(f"request {rid}: empty input_ids")
        self._aborted.discard(rid)
        self.in_flight += 1
        try:
            return await generate_resuming(
                lambda ids, budget: self._generate_once(ids, budget, rid),
                input_ids, sampling, self._aborted, rid, self.config.max_resumes,
            )  # fmt: skip
        finally:
            self.in_flight -= 1
            self._wire_rids.pop(rid, None)
            self._aborted.discard(rid)

    async def _generate_once(self, input_ids: list[int], sampling: SamplingParams, rid: str) -> Generation:
        """One SGLang call, under its own rid (``rid#n``)."""
        where = f"SGLang engine, request {rid}"
        if rid in self._aborted:  # aborted between two calls
            return Generation([], [], "abort", self.weight_version)
        self._segments += 1
        wire_rid = f"{rid}#{self._segments}"
        self._wire_rids[rid] = wire_rid
        try:
            response = await self._submit(input_ids, sampling_params_payload(sampling), wire_rid)
        except asyncio.CancelledError:
            self._abort_wire(wire_rid)  # stop spending compute on it
            raise
        except Exception as exc:
            if wire_rid in self._aborted_wire:  # releases that raise on an aborted request
                return Generation([], [], "abort", self.weight_version)
            raise EngineError(f"{where}: {type(exc).__name__}: {exc}") from exc
        finally:
            self._aborted_wire.discard(wire_rid)
        generation = parse_generation(response, where, self.weight_version)
        if generation.output_weight_versions is None:
            count = len(generation.output_ids)
            generation.output_weight_versions = span_weight_versions(generation.meta, count, generation.weight_version)
        return generation

    async def _submit(self, input_ids: list[int], sampling_params: dict[str, Any], wire_rid: str) -> Any:
        if self._takes_rid:
            return await self.engine.async_generate(
                input_ids=input_ids, sampling_params=sampling_params, return_logprob=True, rid=wire_rid
            )
        # before 0.5 async_generate took no rid; this is the request it builds, with one
        io_struct = import_sglang("sglang.srt.managers.io_struct")
        request = io_struct.GenerateReqInput(
            input_ids=input_ids, sampling_params=sampling_params, return_logprob=True, rid=wire_rid
        )
        return await self.engine.tokenizer_manager.generate_request(request, None).__anext__()

    # ----- control ---------------------------------------------------------------------------

    async def abort(self, rid: str | None = None) -> None:
        """Abort one request (its generate returns finish "abort" and is not resumed), or all."""
        if rid is None:
            self._aborted.update(self._wire_rids)
            self._abort_all()
        elif rid in self._wire_rids:
            self._aborted.add(rid)
            self._abort_wire(self._wire_rids[rid])

    def _abort_wire(self, wire_rid: str) -> None:
        self._aborted_wire.add(wire_rid)
        self.engine.tokenizer_manager.abort_request(rid=wire_rid)  # a message to the scheduler: not blocking

    def _abort_all(self) -> None:
        self._aborted_wire.update(self._wire_rids.values())
        self.engine.tokenizer_manager.abort_request(rid="", abort_all=True)

    async def update_weights(self, state_dict: dict[str, Any], weight_version: int | None = None) -> int:
        """Load ``state_dict`` (parameter name -> tensor) into the engine; returns the new weight version.
        Generations in flight are aborted first and resumed on the new weights (``abort_on_update``)."""
        self._require_open()
        version = self.weight_version + 1 if weight_version is None else weight_version
        io_struct = import_sglang("sglang.srt.managers.io_struct")
        serializer = import_sglang("sglang.srt.utils").MultiprocessingSerializer
        named_tensors = list(state_dict.items())
        tp_size = getattr(self.engine.server_args, "tp_size", 1)  # one payload per tensor-parallel rank
        payloads = await asyncio.to_thread(lambda: [serializer.serialize(named_tensors) for _ in range(tp_size)])
        request = _request(
            io_struct.UpdateWeightsFromTensorReqInput,
            serialized_named_tensors=payloads,
            flush_cache=True,
            weight_version=str(version),
        )
        manager = self.engine.tokenizer_manager
        async with self._update_lock:
            if self.config.abort_on_update and self._wire_rids:
                self._abort_all()
            if hasattr(manager, "begin_weight_update"):  # 0.5.2x: loads only inside a weight-update session
                await _checked(manager.begin_weight_update(io_struct.BeginWeightUpdateReqInput(), None), self)
                try:
                    success, message = await manager.update_weights_from_tensor(request, None)
                finally:
                    await _checked(manager.end_weight_update(io_struct.EndWeightUpdateReqInput(), None), self)
            else:
                success, message = await manager.update_weights_from_tensor(request, None)
        if not success:
            raise EngineError(f"{self!r}: update_weights_from_tensor failed: {message}")
        self.weight_version = version
        return version

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Free the engine's GPU memory (weights and KV cache) while the trainer needs it; SGLang must
        have been started with ``enable_memory_saver=True``."""
        io_struct = import_sglang("sglang.srt.managers.io_struct")
        request = _request(io_struct.ReleaseMemoryOccupationReqInput, tags=tags)
        await self.engine.tokenizer_manager.release_memory_occupation(request, None)

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Take the memory back after ``release_memory_occupation``."""
        io_struct = import_sglang("sglang.srt.managers.io_struct")
        request = _request(io_struct.ResumeMemoryOccupationReqInput, tags=tags)
        await self.engine.tokenizer_manager.resume_memory_occupation(request, None)

    async def flush_cache(self) -> None:
        """Drop the prefix cache; EngineError when SGLang refused (requests were running), as a
        server's ``/flush_cache`` answers 400 then."""
        result = self.engine.tokenizer_manager.flush_cache()
        if inspect.isawaitable(result):  # a coroutine since 0.4.4
            result = await result
        if not getattr(result, "success", True):
            raise EngineError(f"{self!r}: SGLang did not flush its cache (requests were running); flush when idle")

    async def health(self) -> bool:
        """True between ``async with`` and shutdown (SGLang's processes are not probed)."""
        return self._open


def span_weight_versions(meta: dict[str, Any], count: int, default: int) -> list[int] | None:
    """Per-token versions from newer SGLang's ``meta_info.weight_versions`` spans
    (``[{"version": "3", "start": 0, "end": 5}, ...]`` over the output tokens), or None when there
    are none or they do not cover every token once. A version that is not a number ("default") is ``default``."""
    spans = meta.get("weight_versions")
    if not isinstance(spans, list) or not spans:
        return None
    versions: list[int] = []
    for span in spans:
        if not isinstance(span, dict) or span.get("start") != len(versions) or not isinstance(span.get("end"), int):
            return None
        version = parse_weight_version(span.get("version"))
        versions += [default if version is None else version] * (span["end"] - len(versions))
    return versions if len(versions) == count else None


async def _checked(call: Any, engine: SGLangEngine) -> None:
    """Await a control call answering (success, message); EngineError when it failed."""
    success, message = await call
    if not success:
        raise EngineError(f"{engine!r}: {message}")


def _request(cls: type, **fields: Any) -> Any:
    """An io_struct request; fields this SGLang release's class does not have are left out."""
    known = getattr(cls, "__dataclass_fields__", None) or getattr(cls, "__struct_fields__", None)
    return cls(**{name: value for name, value in fields.items() if known is None or name in known})


def _accepts(function: Any, name: str) -> bool:
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):  # no signature to read: assume the current API
        return True
    return name in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
