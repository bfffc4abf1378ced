"""SGLang's routes of weights in memory, in ``rallyrl serve``: a trainer pushes its weights by broadcast
or by tensor, as it does into SGLang (``rollout/engines/sglang_weights.py`` is the client). What each
route takes, and from whom (the guard, ``guard.py``, has checked the host, origin, key and length first):

- ``/init_weights_update_group`` joins the trainer's process group (``weight_group.py``: SGLang's way,
  gloo or NCCL) as rank ``rank_offset``; ``/destroy_weights_update_group`` leaves it. The trainer is
  rank 0 (it hosts the group's store and sends), so ``rank_offset`` is at least 1 and ``world_size``
  more than it, by at most ``MAX_GROUP_RANKS`` (several servers may share a group, as in SGLang).
  ``master_address`` is an IP address or localhost: loopback for a server bound to loopback; loopback
  or one of ``ServeConfig.weight_peers`` (``--weight-peer``) for one bound elsewhere. ``timeout_s``
  (rallyrl's; SGLang has none) is the group's deadline, at most ``WEIGHT_TIMEOUT_S``. A rendezvous
  cannot be cancelled, so joins wait on threads of their own (never those that parse bodies or load
  from disk), at most ``MAX_PENDING_JOINS`` at once: another is answered 503 at once.
- ``/begin_weight_update`` opens a session once it holds the update lock (a load from disk under way
  ends first; new requests wait and the ones in flight finish: the trainer has paused generation,
  aborting them). Inside it, each ``/update_weights_from_distributed`` receives one broadcast
  (``flattened_bucket``, or tensor by tensor) and each ``/update_weights_from_tensor`` one payload
  (``tensor_payload.py``: by value, or CUDA IPC handles on the same GPU), and loads it in place; the
  one that names ``weight_version`` makes it the version served. Outside a session both are refused
  before their body is read; at most ``MAX_TENSOR_BODIES`` tensor bodies are read at once. Unlike
  SGLang, a broadcast bucket is answered once received (and checked), and loads while the next one
  travels; the bucket that names the version, and ``/end_weight_update``, answer once all have loaded.
- ``/end_weight_update`` closes the session, and succeeds when the weights served are whole: the bucket
  naming ``weight_version`` loaded after the others (or nothing loaded). Otherwise it answers
  ``success: false``, and half-updated weights never serve: ``/continue_generation`` is refused (SGLang
  would continue) and requests wait until whole weights load (a session that ends whole, or
  ``/update_weights_from_disk``). While a session is open ``/update_weights_from_disk`` is refused at
  once (the session holds the update lock), and a new ``/begin_weight_update`` too, as in SGLang.

Each receive has a deadline (``WEIGHT_TIMEOUT_S``); a bucket's tensors are checked against the model
(``check_state_dict``) before anything loads, so a mismatch answers 400 naming the parameter.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Awaitable
from concurrent.futures import Future
from typing import Any

import torch
from aiohttp import web

from rollout.engines.base import EngineError, FlushesCache
from rollout.engines.daemon_threads import DaemonThreads, run_once
from rollout.engines.local_model import check_state_dict
from rollout.engines.tensor_payload import TensorPayloadError, load_named_tensors
from rollout.engines.weight_buckets import bucket_views, read_bucket_specs
from rollout.engines.weight_collectives import AllDone
from rollout.engines.weight_group import destroy_weight_group, init_weight_group
from rollout.engines.weight_push import CollectiveError, collective_done
from rollout.serve.admission import Busy
from rollout.serve.guard import is_loopback
from rollout.serve.http import BadRequest, json_body, json_response
from rollout.serve.state import ServerState

WEIGHT_TIMEOUT_S = 300.0
"""Deadline of joining a group (the most a join's ``timeout_s`` may ask) and of receiving one bucket."""
MAX_WEIGHT_BODY = 2 * 2**30
"""Largest ``/update_weights_from_tensor`` body (a bucket's base64); other routes keep the server's limit."""
MAX_BUCKET_BYTES = 8 * 2**30
"""Largest broadcast bucket this server allocates for."""
MAX_GROUP_RANKS = 4096
"""Most ranks a group may have after ``rank_offset`` (this server's and those of servers sharing it)."""
MAX_PENDING_JOINS = 2
"""Group joins waited for at once, each on a thread of its own until its trainer joins or its deadline."""
MAX_TENSOR_BODIES = 2
"""``/update_weights_from_tensor`` bodies read and decoded at once; another is refused before it is read."""
PARTIAL = ("this server will not generate until whole weights load (a session whose last bucket names "
           "weight_version, or /update_weights_from_disk)")  # fmt: skip


class WeightRoutes:
    """The weight-update routes of one ``ServerState``, and the session they share (its open flag is the
    server's, ``weight_session_open``, which ``/update_weights_from_disk`` reads too)."""

    def __init__(self, server: ServerState):
        self.server = server
        self.groups: dict[str, Any] = {}
        self.joining: set[str] = set()  # group names whose join is under way
        self.receiving: dict[str, DaemonThreads] = {}  # each group's thread, where its receives are issued
        self.joins = DaemonThreads(MAX_PENDING_JOINS, "weight-join")
        self.decoders = DaemonThreads(MAX_TENSOR_BODIES, "weight-decode")
        self.tensor_bodies = 0  # /update_weights_from_tensor calls being read, decoded or loaded
        self.peers = [ipaddress.ip_network(peer, strict=False) for peer in server.config.weight_peers]
        self._begin_lock = asyncio.Lock()
        self.loading: list[asyncio.Future[str]] = []  # buckets loading, or loaded and not yet waited for
        self.loads = 0  # buckets that began loading in this session
        self.version_loaded = False  # the bucket naming weight_version loaded, and none began after it

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
        if name in self.joining:
            raise BadRequest(f"group_name: {name!r} is being joined; wait for that join to end")
        address, port, rank, world = self._trainer(body)
        timeout_s = _timeout(body)
        if self.joins.busy >= MAX_PENDING_JOINS:
            overdue = self.joins.busy - len(self.joining)
            stuck = (f"; {overdue} of them past their deadline (torch's rendezvous may wait without end on an "
                     "address that took the connection and never answered: restart the server if this lasts)"
                     if overdue > 0 else "")  # fmt: skip
            return _answer(False, f"{self.joins.busy} weight-group joins are pending, the most this server waits for "
                           "at once: retry when one ends (when its trainer joins, or at its timeout_s)" + stuck,
                           status=503)  # fmt: skip
        join = self.joins.submit(init_weight_group, backend, address, port, world, rank, name, timeout_s)
        self.joining.add(name)
        try:
            group = await asyncio.wait_for(asyncio.wrap_future(join), timeout_s)
        except (RuntimeError, ValueError, TimeoutError, OSError) as exc:
            join.add_done_callback(_destroy_if_made)  # (a rendezvous that ends after its wait: nobody's group)
            return _answer(False, f"Failed to initialize custom process group: {exc or 'timed out'}.")
        except BaseException:
            join.add_done_callback(_destroy_if_made)
            raise
        finally:
            self.joining.discard(name)
        self.groups[name] = group
        self.receiving[name] = DaemonThreads(1, "weight-receive")
        return _answer(True, "Succeeded to initialize custom process group.")

    def _trainer(self, body: dict[str, Any]) -> tuple[str, int, int, int]:
        """The trainer's address and port, and the group's ranks, checked (module docstring)."""
        address = _field(body, "master_address", str)
        port, rank, world = (_field(body, key, int) for key in ("master_port", "rank_offset", "world_size"))
        if rank < 1:
            raise BadRequest(f"rank_offset: {rank} would make this server the group's rank 0, the trainer's (it "
                             "hosts the group's store and sends the weights): a server's ranks start at 1")  # fmt: skip
        if not rank < world <= rank + MAX_GROUP_RANKS:
            raise BadRequest(f"world_size: expected more than rank_offset ({rank}) and at most rank_offset + "
                             f"{MAX_GROUP_RANKS}, got {world}")  # fmt: skip
        if not 1 <= port <= 65535:
            raise BadRequest(f"master_port: expected a TCP port in 1..65535, got {port}")
        try:
            ip = ipaddress.ip_address("127.0.0.1" if address == "localhost" else address.strip("[]"))
        except ValueError:
            raise BadRequest(f"master_address: expected an IP address or localhost, got {address!r}") from None
        host = self.server.config.host
        if ip.is_loopback:
            return address, port, rank, world
        if is_loopback(host):
            raise BadRequest(f"master_address: {address} is not loopback, and this server is bound to loopback "
                             f"({host}): it takes weights from this machine only; to take them from {address}, start "
                             f"the server with --host on an outside interface and --weight-peer {address}")  # fmt: skip
        if not any(ip in peer for peer in self.peers):
            peers = ", ".join(self.server.config.weight_peers) or "none"
            raise BadRequest(f"master_address: {address} is not one of this server's weight peers ({peers}): to "
                             f"take weights from it, start the server with --weight-peer {address}")  # fmt: skip
        return address, port, rank, world

    async def destroy_group(self, request: web.Request) -> web.Response:
        name = _field(await json_body(request), "group_name", str, "weight_update_group")
        group = self.groups.pop(name, None)
        if group is None:
            return _answer(False, "The group to be destroyed does not exist.")
        self.receiving.pop(name).shutdown()  # (a receive stuck on a dead trainer stays behind, a daemon)
        await run_once("weight-destroy", destroy_weight_group, group)  # (an NCCL abort may wait: not on the loop)
        return _answer(True, "Succeeded to destroy custom process group.")

    # ----- the session ---------------------------------------------------------------------------

    async def begin(self, request: web.Request) -> web.Response:
        """Open the session once it holds the update lock: until then, buckets are refused."""
        server = self.server
        async with self._begin_lock:
            if server.weight_session_open:
                return _answer(False, "a weight-update session is already open; call end_weight_update() first")
            server.weight_session_beginning = True
            try:
                await server.hold_for_weights()
            finally:
                server.weight_session_beginning = False
            server.weight_session_open = True
            self.loads, self.version_loaded = 0, False
        return _answer(True, "Success")

    async def end(self, request: web.Request) -> web.Response:
        if not self.server.weight_session_open:
            return _answer(False, "no weight-update session is open; call begin_weight_update() first")
        self.server.weight_session_open = False  # no bucket begins loading from now on
        return await asyncio.shield(self._close())  # (a client that hangs up does not leave the lock held)

    async def _close(self) -> web.Response:
        """Wait for the buckets loading, release the update lock; success when the weights are whole."""
        server = self.server
        failure = await self._loaded()
        if failure is None and self.version_loaded:
            server.weights_half_updated = False
        server.release_after_weights()  # (requests still wait while the weights are half updated)
        if failure is not None:
            return _answer(False, f"{failure}; the weights are partial: {PARTIAL}")
        if server.weights_half_updated:
            why = ("buckets loaded, and the one naming weight_version did not load after them" if self.loads
                   else "an earlier session left them so")  # fmt: skip
            return _answer(False, f"the weights are partial ({why}): {PARTIAL}")
        return _answer(True, "Success")

    async def _loaded(self) -> str | None:
        """Wait for the buckets loading (they go on if this wait is cancelled); the first failure, or None."""
        loading = list(self.loading)
        results = await asyncio.shield(asyncio.gather(*loading, return_exceptions=True))
        self.loading = [task for task in self.loading if task not in loading]
        return next((f"a bucket did not load: {r}" for r in results if isinstance(r, Exception)), None)

    def _require_session(self, route: str) -> None:
        if not self.server.weight_session_open:
            raise BadRequest(f"{route} must run between begin_weight_update() and end_weight_update()")

    async def from_distributed(self, request: web.Request) -> web.Response:
        self._require_session("update_weights_from_distributed")
        body = await json_body(request)
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
        # received first, checked after: the group stays in step with the trainer. Issued on the group's own
        # thread: an NCCL group's first collective waits there for the trainer to enter it (weight_group.py)
        await _completed(self.receiving[name].run(_receive, buffers, group), WEIGHT_TIMEOUT_S)
        if flattened:
            named = bucket_views(buffers[0], specs)
        else:
            named = [(spec.name, buffer) for spec, buffer in zip(specs, buffers, strict=True)]
        self._check(named)
        route = "update_weights_from_distributed"
        if body.get("weight_version") is None:  # load while the next bucket travels; end reports a failure
            self._start_load(route, named, body)
            return _answer(True, "Succeeded to receive the parameters; they load meanwhile.")
        message = await self._load_last(route, named, body)
        return _answer(True, "Succeeded to update parameter online." + message)

    async def from_tensor(self, request: web.Request) -> web.Response:
        self._require_session("update_weights_from_tensor")
        if self.tensor_bodies >= MAX_TENSOR_BODIES:
            raise Busy(f"{self.tensor_bodies} update_weights_from_tensor bodies are being read, the most this server "
                       "takes at once: send the buckets one after another")  # fmt: skip
        self.tensor_bodies += 1
        try:
            body = await json_body(request, limit=MAX_WEIGHT_BODY)
            payloads = body.get("serialized_named_tensors")
            if not isinstance(payloads, list) or not payloads:
                raise BadRequest("serialized_named_tensors: expected a list of payloads, one per rank", "schema")
            if body.get("load_format") not in (None, "direct"):
                fmt = body["load_format"]
                raise BadRequest(f"load_format: rallyrl serve reads lists of named tensors (null), not {fmt!r}")
            try:
                named = await self.decoders.run(load_named_tensors, payloads[0], "serialized_named_tensors[0]")
            except TensorPayloadError as exc:
                raise BadRequest(str(exc)) from None
            self._check(named)
            route = "update_weights_from_tensor"
            if body.get("weight_version") is None:
                message = await asyncio.shield(self._start_load(route, named, body))
            else:
                message = await self._load_last(route, named, body)
        finally:
            self.tensor_bodies -= 1
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

    def _start_load(self, route: str, named: list[tuple[str, torch.Tensor]], body: dict[str, Any]
                    ) -> asyncio.Future[str]:  # fmt: skip
        """Load ``named`` in the background if the session is still open (``end`` waits for the loads it
        finds; a client that hangs up does not stop one)."""
        self._require_session(route)
        task = asyncio.ensure_future(self._load(named, body))
        self.loading.append(task)
        return task

    async def _load_last(self, route: str, named: list[tuple[str, torch.Tensor]], body: dict[str, Any]) -> str:
        """Load the bucket that names ``weight_version``, once every bucket before it has loaded."""
        failure = await self._loaded()
        if failure is not None:
            raise BadRequest(failure)
        return await asyncio.shield(self._start_load(route, named, body))

    async def _load(self, named: list[tuple[str, torch.Tensor]], body: dict[str, Any]) -> str:
        """Load ``named`` in place; the version it names, if any, becomes the one served."""
        server, engine = self.server, self.server.engine
        requested = body.get("weight_version")
        version = server.next_version(requested) if requested is not None else engine.weight_version  # type: ignore[attr-defined]
        self.loads += 1
        ticket, self.version_loaded = self.loads, False
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
        self.version_loaded = self.loads == ticket  # whole unless a bucket began loading after this one
        server.name_version(version, requested)
        return f" Weight version updated to {server.version_text()}."

    def _device(self) -> torch.device:
        return torch.device(getattr(self.server.engine, "device", "cpu"))


def _receive(buffers: list[torch.Tensor], group: Any) -> AllDone:
    """Issue the receive of each buffer from the group's rank 0 (``async_op``)."""
    return AllDone([torch.distributed.broadcast(buffer, src=0, group=group, async_op=True) for buffer in buffers])


async def _completed(issue: Awaitable[Any], timeout_s: float) -> None:
    """Wait for a collective being issued (``issue``) and done, without holding the event loop; its
    failure or ``timeout_s`` is a 400."""
    try:
        async with asyncio.timeout(timeout_s):
            await collective_done(await issue)
    except TimeoutError:
        raise BadRequest(f"the broadcast did not arrive within {timeout_s:g} s") from None
    except (CollectiveError, RuntimeError) as exc:  # (RuntimeError: issuing it failed, the group is broken)
        raise BadRequest(f"Failed to receive weights: {exc}") from None


def _destroy_if_made(join: Future[Any]) -> None:
    if not join.cancelled() and join.exception() is None:
        destroy_weight_group(join.result())


def _field(body: dict[str, Any], name: str, kind: type, default: Any = ...) -> Any:
    value = body.get(name, default)
    if value is ...:
        raise BadRequest(f"{name}: required", "schema")
    if not isinstance(value, kind) or isinstance(value, bool):
        raise BadRequest(f"{name}: expected {kind.__name__}, got {value!r}", "schema")
    return value


def _timeout(body: dict[str, Any]) -> float:
    """The group's deadline: ``timeout_s`` (rallyrl's field), in (0, WEIGHT_TIMEOUT_S]."""
    value = body.get("timeout_s", WEIGHT_TIMEOUT_S)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= WEIGHT_TIMEOUT_S:
        raise BadRequest(f"timeout_s: expected seconds in (0, {WEIGHT_TIMEOUT_S:g}], got {value!r}")
    return float(value)


def _answer(success: bool, message: str, status: int | None = None) -> web.Response:
    """SGLang's ``{success, message}``: 200, or 400 (503 with ``Retry-After``: busy, retry later)."""
    response = json_response({"success": success, "message": message}, status=status or (200 if success else 400))
    if response.status == 503:
        response.headers["Retry-After"] = "5"
    return response
