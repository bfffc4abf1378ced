"""A client of one SGLang server's native HTTP API (or of ``rallyrl serve``, which speaks it).

One keep-alive connection pool per engine (``server_http.py``), created and closed by ``async with``,
sized for thousands of requests in flight. ``generate`` posts token ids to
``/generate`` and reads output ids, logprobs, finish reason and weight version.

Failures: connection errors, timeouts and HTTP 408 / 429 / 5xx are retried with exponential
backoff and full jitter (``rollout/retry.py``); anything else (a 400, a malformed response)
fails at once. Each attempt has its own wire rid (``rid#attempt``), so a retry never collides
with a request the server may still be running; a timed-out attempt is aborted on the server
before the next.

Weight updates: a generation aborted by the server that this client did not abort itself
(``/pause_generation`` or ``/update_weights_from_disk`` with ``abort_all_requests``) is
resumed: the tokens so far are kept and generation continues from them with the remaining
budget, and every token records the weight version that produced it.

Adapters (LoRA, ``rollout/engines/server_adapters.py``): ``/load_lora_adapter`` under a new name
per version, named by each request's ``lora_path``, ``/unload_lora_adapter`` once unused, and
``/update_weight_version``, all under one pause. Weights in memory (broadcast, tensor):
``rollout/engines/sglang_weights.py``; the HTTP plumbing this client shares with vLLM's:
``rollout/engines/server_http.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import yarl

from rollout.engines.base import EngineError, Generation, SamplingParams
from rollout.engines.config import SGLangHTTPConfig
from rollout.engines.server_adapters import AdapterSupport, pause_and_continue, sglang_adapter_support
from rollout.engines.server_http import (
    RetryableError,
    ServerHTTPClient,
    ServerUnavailableError,
)
from rollout.engines.sglang_protocol import (
    generate_payload,
    generate_resuming,
    parse_generation,
    parse_weight_version,
    resumable,
    settled,
)
from rollout.retry import call_with_retries

if TYPE_CHECKING:
    import torch

    from rollout.engines.config import WeightSyncConfig
    from rollout.engines.weight_plan import ServerWeights
    from rollout.engines.weight_push import Receiver


class SGLangHTTPEngine(ServerHTTPClient):
    """The Engine protocol over one SGLang-compatible server at ``url``."""

    def __init__(self, url: str, config: SGLangHTTPConfig | None = None):
        super().__init__(url, config)
        self._wire_rids: dict[str, str] = {}  # our rid -> the wire rid of its attempt in flight
        self._aborted: set[str] = set()  # rids aborted through this client (not resumed)
        self._active: set[str] = set()  # rids inside generate (in flight or between retries)
        self._attempts = 0

    # ----- generation ----------------------------------------------------------------------

    async def generate(self, input_ids: list[int], sampling: SamplingParams, rid: str) -> Generation:
        """Continue ``input_ids``; resumed across server-side aborts (weight updates)."""
        self._aborted.discard(rid)
        self._active.add(rid)
        self.in_flight += 1
        try:
            part = await self._generate_once(input_ids, sampling, rid)
            if resumable(part, rid, self._aborted):
                generation = await generate_resuming(
                    lambda ids, budget: self._generate_once(ids, budget, rid),
                    input_ids, sampling, self._aborted, rid, self.config.max_resumes, first=part,
                )  # fmt: skip
            else:
                generation = settled(part, sampling)
            self.weight_version = max(self.weight_version, generation.weight_version)
            return generation
        finally:
            self.in_flight -= 1
            self._aborted.discard(rid)
            self._active.discard(rid)

    async def _generate_once(self, input_ids: list[int], sampling: SamplingParams, rid: str) -> Generation:
        """One /generate call, retried on transient failures (the retry loop only after a first failure)."""
        try:
            return await self._attempt(input_ids, sampling, rid)
        except RetryableError as exc:
            return await self._retried(input_ids, sampling, rid, exc)

    async def _retried(
        self, input_ids: list[int], sampling: SamplingParams, rid: str, first: RetryableError
    ) -> Generation:
        """The retries after a first attempt that failed with ``first``, with their backoff."""
        try:
            if self.config.max_retries <= 0:
                raise first
            await asyncio.sleep(self._backoff.delay(0))
            return await call_with_retries(
                lambda: self._attempt(input_ids, sampling, rid),
                retries=self.config.max_retries - 1, backoff=self._backoff, retry_on=(RetryableError,), first_retry=1,
            )  # fmt: skip
        except RetryableError as exc:
            attempts = self.config.max_retries + 1
            raise ServerUnavailableError(f"{self.url}: request {rid} failed after {attempts} attempts: {exc}") from exc

    async def _attempt(self, input_ids: list[int], sampling: SamplingParams, rid: str) -> Generation:
        if rid in self._aborted:  # aborted while waiting to retry
            return Generation([], [], "abort", self.weight_version)
        self._attempts += 1
        wire_rid = f"{rid}#{self._attempts}"
        self._wire_rids[rid] = wire_rid
        try:
            payload = generate_payload(input_ids, sampling, wire_rid)
            with self.adapter_in_use() as adapter:
                if adapter is not None:
                    payload["lora_path"] = adapter
                body = await self._request("POST", "/generate", payload, self.config.timeout_s)
            return parse_generation(body, f"{self.url} request {rid}", self.weight_version)
        except RetryableError as exc:
            if isinstance(exc.__cause__, asyncio.TimeoutError):  # (a connect timeout is a WireError)
                await self._abort_quietly(wire_rid)  # the server may still be running it
            raise
        finally:
            if self._wire_rids.get(rid) == wire_rid:
                del self._wire_rids[rid]

    # ----- control endpoints -------------------------------------------------------------------

    async def abort(self, rid: str | None = None) -> None:
        """Abort one request (its generate returns finish "abort" and is not resumed), or all."""
        if rid is None:
            self._aborted.update(self._active)
            await self._control("POST", "/abort_request", {"rid": "", "abort_all": True})
            return
        self._aborted.add(rid)
        wire_rid = self._wire_rids.get(rid)
        if wire_rid is not None:
            await self._control("POST", "/abort_request", {"rid": wire_rid, "abort_all": False})

    async def _abort_quietly(self, wire_rid: str) -> None:
        with contextlib.suppress(EngineError):
            await self._request("POST", "/abort_request", {"rid": wire_rid, "abort_all": False}, 5.0)

    async def health_generate(self) -> bool:
        """True when the server can generate a token (``/health_generate``)."""
        try:
            await self._request("GET", "/health_generate", None, self.config.control_timeout_s)
            return True
        except EngineError:
            return False

    async def get_model_info(self) -> dict[str, Any]:
        return await self._control("GET", "/get_model_info")

    async def get_server_info(self) -> dict[str, Any]:
        return await self._control("GET", "/get_server_info")

    async def get_weight_version(self) -> int | None:
        """The server's weight version as ``/get_model_info`` reports it (None: never updated)."""
        return parse_weight_version((await self.get_model_info()).get("weight_version"))

    async def flush_cache(self) -> None:
        await self._control("POST", "/flush_cache")

    async def pause_generation(self, mode: str = "abort") -> None:
        """Stop generating: in-flight requests are aborted (and resumed by their clients once
        generation continues); new ones wait."""
        await self._control("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self._control("POST", "/continue_generation", {})

    async def update_weights_from_disk(self, model_path: str, weight_version: int) -> int:
        """Load the weights saved at ``model_path`` (a model directory the server can read)."""
        body = await self._control(
            "POST",
            "/update_weights_from_disk",
            {"model_path": str(model_path), "weight_version": str(weight_version), "abort_all_requests": False},
        )
        if isinstance(body, dict) and body.get("success") is False:
            raise EngineError(f"{self.url}/update_weights_from_disk {model_path}: {body.get('message')}")
        self.weight_version = weight_version
        return weight_version

    async def sync_weights_from_disk(self, model_path: str, weight_version: int) -> int:
        """pause -> update_weights_from_disk -> continue; generation continues even if the update fails."""
        async with self._paused():
            return await self.update_weights_from_disk(model_path, weight_version)

    # ----- LoRA adapters (rollout/engines/server_adapters.py) -----------------------------------

    def _paused(self) -> contextlib.AbstractAsyncContextManager[None]:
        return pause_and_continue(self)

    async def adapter_support(self, rank: int, modules: Sequence[str]) -> AdapterSupport:
        return sglang_adapter_support(self.url, await self.get_server_info(), rank, modules)

    async def _load_adapter(self, name: str, path: str) -> None:
        await self._adapter_call("/load_lora_adapter", {"lora_name": name, "lora_path": path})

    async def _unload_adapter(self, name: str) -> None:
        await self._adapter_call("/unload_lora_adapter", {"lora_name": name})

    async def _adapter_call(self, path: str, payload: dict[str, Any]) -> None:
        try:
            body = await self._control("POST", path, payload)
        except ServerUnavailableError:
            raise
        except EngineError as exc:  # SGLang answers a refusal with HTTP 400 and its reason
            raise EngineError(f"{self.url}{path} {payload}: {exc}") from None
        if isinstance(body, dict) and body.get("success") is False:
            raise EngineError(f"{self.url}{path} {payload}: {body.get('error_message')}")

    async def _name_weight_version(self, weight_version: int) -> None:
        await self._control("POST", "/update_weight_version",
                            {"new_version": str(weight_version), "abort_all_requests": False})  # fmt: skip

    async def release_memory_occupation(self) -> None:
        """Free the server's GPU memory (weights and KV cache) while the trainer needs it."""
        await self._control("POST", "/release_memory_occupation", {})

    async def resume_memory_occupation(self) -> None:
        await self._control("POST", "/resume_memory_occupation", {})

    # ----- weights in memory (rollout/engines/sglang_weights.py) -------------------------------------

    async def weight_support(self) -> ServerWeights:
        """What this server can take (broadcast, tensor), its device, dtype and model."""
        from rollout.engines.sglang_weights import sglang_weight_support
        from rollout.engines.weight_group import is_local_host

        return await sglang_weight_support(self, is_local_host(yarl.URL(self.url).host or ""))

    def weight_receiver(self, transport: str, server: ServerWeights, config: WeightSyncConfig,
                        device: torch.device, dtype: torch.dtype, aliases: dict[str, str]) -> Receiver:  # fmt: skip
        """The receiving end of ``transport`` for this server (``device``: where the trainer's weights are)."""
        import torch

        from rollout.engines.sglang_weights import SGLangBroadcast, SGLangTensor
        from rollout.engines.weight_plan import backend_for

        if transport == "broadcast":
            backend = backend_for(server, config, device)
            return SGLangBroadcast(self, server, dtype, backend, config.master_address, config.timeout_s)
        where = device if server.device.startswith("cuda") and device.type == "cuda" else torch.device("cpu")
        return SGLangTensor(self, server, dtype, where, config.timeout_s)

    async def update_weights(self, state_dict: dict[str, Any], weight_version: int | None = None) -> int:
        raise EngineError(
            f"{self.url}: a server takes weights through a pool's push_weights (broadcast, tensor or disk) "
            "or sync_weights_from_disk(path, version)"
        )
