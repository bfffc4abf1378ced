"""SGLang's routes of weights in memory, in ``rallyrl serve``: a trainer pushes its weights by broadcast
or by tensor, as it does into SGLang (``rollout/engines/sglang_weights.py`` is the client).

- ``/init_weights_update_group`` joins the trainer's process group (``weight_group.py``: SGLang's way,
  gloo or NCCL) as rank ``rank_offset``; ``/destroy_weights_update_group`` leaves it.
- ``/begin_weight_update`` opens a session: new requests wait and the ones in flight finish first (the
  trainer has paused generation, aborting them). Inside it, each ``/update_weights_from_distributed``
  receives one broadcast (``flattened_bucket``, or tensor by tensor) and each
  ``/update_weights_from_tensor`` one payload (``tensor_payload.py``: by value, or CUDA IPC handles on
  the same GPU), and loads it in place; the one that names ``weight_version`` makes it the version
  served. ``/end_weight_update`` closes the session. Unlike SGLang, a broadcast bucket is answered
  once received (and checked), and loads while the next one travels; the bucket that names the
  version, and ``/end_weight_update``, answer only when everything has loaded (or with the failure).
- Half-updated weights never serve: while a session holds part of its weights, ``/continue_generation``
  is refused (SGLang would continue) and requests keep waiting; a new ``/begin_weight_update`` from a
  trainer that took over is refused until the old session is ended, as in SGLang.

Each receive has a deadline (``WEIGHT_TIMEOUT_S``); a broadcast body's tensors are checked against
the model (``check_state_dict``) before anything loads, so a mismatch answers 400 naming the parameter.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch
from aiohttp import web

from rollout.engines.base import EngineError, FlushesCache
from rollout.engines.local_model import check_state_dict
from rollout.engines.tensor_payload import TensorPayloadError, load_named_tensors
from rollout.engines.weight_buckets import bucket_views, read_bucket_specs
from rollout.engines.weight_group import destroy_weight_group, init_weight_group
from rollout.engines.weight_push import AllDone, CollectiveError, collective_done
from rollout.serve.http import BadRequest, json_body, json_response
from rollout.serve.state import ServerState

WEIGHT_TIMEOUT_S = 300.0
"""Deadline of joining a group and of receiving one bucket."""
MAX_WEIGHT_BODY = 2 * 2**30
"""Largest ``/update_weights_from_tensor`` body (a bucket's base64); other routes keep the server's limit."""
MAX_BUCKET_BYTES = 8 * 2**30
"""Largest broadcast bucket this server allocates for."""


class WeightRoutes:
    """The weight-update routes of one ``ServerState``, and the session they share."""

    def __init__(self, server: ServerState):
        self.server = server
        self.groups: dict[str, Any] = {}
        self.session_open = False
        self.loading: list[asyncio.Task[str]] = []  # broadcast buckets received, loading in the background

    def routes(self) -> list[tuple[str, str, Any]]:
        return [
            ("POST", "/init_weights_update_group", self.init_group),
            ("POST", "/destroy_weights_update_group", self.destroy_group),
            ("POST", "/begin_weight_update", self.begin),
            ("POST", "/end_weight_update", self.end),
            ("POST", "/update_weights_from_distributed", self.from_distributed),
            ("POST", "/update_weights_from_tensor", self.from_tensor),
        ]

    # ----- groups --------------------------------------------------------------------------------

    async def init_group(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        name = _field(body, "group_name", str, "weight_update_group")
        backend = _field(body, "backend", str, "nccl")
        if backend not in ("gloo", "nccl"):
            raise BadRequest(f"backend: expected gloo or nccl, got {backend!r}")
        if backend == "nccl" and self._device().type != "cuda":
            raise BadRequest("backend: nccl needs a GPU engine; this one runs on the CPU (use gloo)")
        if name in self.groups:
            raise BadRequest(f"group_name: {name!r} exists; destroy it first")
        address = _field(body, "master_address", str)
        port, rank, world = (_field(body, key, int) for key in ("master_port", "rank_offset", "world_size"))
        join = asyncio.to_thread(init_weight_group, backend, address, port, world, rank, name, WEIGHT_TIMEOUT_S)
        try:
            group = await asyncio.wait_for(join, WEIGHT_TIMEOUT_S)
        except (RuntimeError, ValueError, TimeoutError, OSError) as exc:
            return _answer(False, f"Failed to initialize custom process group: {exc or 'timed out'}.")
        self.groups[name] = group
        return _answer(True, "Succeeded to initialize custom process group.")

    async def destroy_group(self, request: web.Request) -> web.Response:
        name = _field(await json_body(request), "group_name", str, "weight_update_group")
        group = self.groups.pop(name, None)
        if group is None:
            return _answer(False, "The group to be destroyed does not exist.")
        destroy_weight_group(group)
        return _answer(True, "Succeeded to destroy custom process group.")

    # ----- the session ---------------------------------------------------------------------------

    async def begin(self, request: web.Request) -> web.Response:
        if self.session_open:
            return _answer(False, "a weight-update session is already open; call end_weight_update() first")
        self.session_open = True
        await self.server.hold_for_weights()
        return _answer(True, "Success")

    async def end(self, request: web.Request) -> web.Response:
        if not self.session_open:
            return _answer(False, "no weight-update session is open; call begin_weight_update() first")
        failure = await self._loaded()
        self.session_open = False
        if failure is None:
            self.server.weights_half_updated = False
        self.server.release_after_weights()  # (requests still wait while the weights are half updated)
        return _answer(failure is None, failure or "Success")

    async def _loaded(self) -> str | None:
        """Wait for the buckets loading in the background; the first one's failure, or None."""
        loading, self.loading = self.loading, []
        results = await asyncio.gather(*loading, return_exceptions=True)
        return next((f"a bucket did not load: {r}" for r in results if isinstance(r, Exception)), None)

    def _require_session(self, route: str) -> None:
        if not self.session_open:
            raise BadRequest(f"{route} must run between begin_weight_update() and end_weight_update()")

    async def from_distributed(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        self._require_session("update_weights_from_distributed")
        name = _field(body, "group_name", str, "weight_update_group")
        group = self.groups.get(name)
        if group is None:
            raise BadRequest(f"group_name: no group {name!r}; call init_weights_update_group first")
        try:
            specs = read_bucket_specs(body.get("names"), body.get("dtypes"), body.get("shapes"),
                                      "update_weights_from_distributed", MAX_BUCKET_BYTES)  # fmt: skip
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        device = self._device() if torch.distributed.get_backend(group) == "nccl" else torch.device("cpu")
        flattened = body.get("load_format") == "flattened_bucket"
        if flattened:
            buffers = [torch.empty(sum(spec.nbytes for spec in specs), dtype=torch.uint8, device=device)]
        else:
            buffers = [torch.empty(spec.shape, dtype=spec.dtype, device=device) for spec in specs]
        # received first, checked after: the group stays in step with the trainer
        works = [torch.distributed.broadcast(buffer, src=0, group=group, async_op=True) for buffer in buffers]
        await _completed(AllDone(works), WEIGHT_TIMEOUT_S)
        if flattened:
            named = bucket_views(buffers[0], specs)
        else:
            named = [(spec.name, buffer) for spec, buffer in zip(specs, buffers, strict=True)]
        self._check(named)
        if body.get("weight_version") is None:  # load while the next bucket travels; end reports a failure
            self.loading.append(asyncio.ensure_future(self._load(named, body)))
            return _answer(True, "Succeeded to receive the parameters; they load meanwhile.")
        failure = await self._loaded()
        if failure is not None:
            raise BadRequest(failure)
        message = await self._load(named, body)
        return _answer(True, "Succeeded to update parameter online." + message)

    async def from_tensor(self, request: web.Request) -> web.Response:
        body = await json_body(request, limit=MAX_WEIGHT_BODY)
        self._require_session("update_weights_from_tensor")
        payloads = body.get("serialized_named_tensors")
        if not isinstance(payloads, list) or not payloads:
            raise BadRequest("serialized_named_tensors: expected a list of payloads, one per rank", "schema")
        if body.get("load_format") not in (None, "direct"):
            fmt = body["load_format"]
            raise BadRequest(f"load_format: rallyrl serve reads lists of named tensors (null), not {fmt!r}")
        try:
            named = await asyncio.to_thread(load_named_tensors, payloads[0], "serialized_named_tensors[0]")
        except TensorPayloadError as exc:
            raise BadRequest(str(exc)) from None
        self._check(named)
        message = await self._load(named, body)
        return _answer(True, "Success" + message)

    def _check(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """A name the model lacks, or a shape it does not have, is a 400 before anything loads."""
        model = getattr(self.server.engine, "model", None)
        if model is None:
            return
        try:
            check_state_dict(model, dict(named))
        except EngineError as exc:
            raise BadRequest(str(exc)) from None

    async def _load(self, named: list[tuple[str, torch.Tensor]], body: dict[str, Any]) -> str:
        """Load ``named`` in place; the version it names, if any, becomes the one served."""
        server, engine = self.server, self.server.engine
        requested = body.get("weight_version")
        version = server.next_version(requested) if requested is not None else engine.weight_version  # type: ignore[attr-defined]
        server.weights_half_updated = True
        try:
            await engine.update_weights(dict(named), weight_version=version)
        except EngineError as exc:
            raise BadRequest(f"the model did not take these weights: {exc}") from None
        if any(tensor.is_cuda for _, tensor in named):
            torch.cuda.synchronize()  # done reading the trainer's memory before it is told so
        if body.get("flush_cache", True) and isinstance(engine, FlushesCache):
            await engine.flush_cache()
        if requested is None:
            return ""
        server.name_version(version, requested)
        return f" Weight version updated to {server.version_text()}."

    def _device(self) -> torch.device:
        return torch.device(getattr(self.server.engine, "device", "cpu"))


async def _completed(work: Any, timeout_s: float) -> None:
    """Wait for a collective without holding the event loop; its failure or ``timeout_s`` is a 400."""
    try:
        async with asyncio.timeout(timeout_s):
            await collective_done(work)
    except TimeoutError:
        raise BadRequest(f"the broadcast did not arrive within {timeout_s:g} s") from None
    except CollectiveError as exc:
        raise BadRequest(f"Failed to receive weights: {exc}") from None


def _field(body: dict[str, Any], name: str, kind: type, default: Any = ...) -> Any:
    value = body.get(name, default)
    if value is ...:
        raise BadRequest(f"{name}: required", "schema")
    if not isinstance(value, kind) or isinstance(value, bool):
        raise BadRequest(f"{name}: expected {kind.__name__}, got {value!r}", "schema")
    return value


def _answer(success: bool, message: str) -> web.Response:
    return json_response({"success": success, "message": message}, status=200 if success else 400)
