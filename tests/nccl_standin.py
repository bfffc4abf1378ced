"""A stand-in for NCCL between two GPUs, for the weight push's NCCL path on a CPU
(``rollout/engines/weight_collectives.py`` is the seam it replaces).

It behaves as NCCL does where that matters to the push:

- the communicator is made lazily, in the first collective, and making it is itself a collective:
  the trainer's first ``broadcast`` returns only once the server side has entered it (as
  ``ncclCommInitRank`` does), so a trainer that issues it before the server's HTTP call has gone out
  waits for ever (here: ``cap_s``, then an error saying so);
- a broadcast is done only when the server side has received it; one to a server that died never
  ends, until the group is destroyed (aborted), which fails it;
- ``bucket_ready`` may be told to block (``block_fill_at``), as ``torch.cuda.synchronize`` does behind a
  broadcast stuck on a dead peer.

``StandInServer`` is the server's side: an SGLang client double whose weight calls enter the
collectives the trainer issues and keep what they receive.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import Any

import torch

from rollout.engines.weight_buckets import WeightSpec, bucket_views
from rollout.engines.weight_collectives import Collectives
from rollout.engines.weight_plan import ServerWeights


class Work:
    """One broadcast under way: done once the server side took it; failed by an abort."""

    def __init__(self, payload: Any):
        self.payload = payload
        self.done = threading.Event()
        self.error: str | None = None

    def is_completed(self) -> bool:
        return self.done.is_set()

    def wait(self) -> None:
        if self.error is not None:
            raise RuntimeError(self.error)


class Group:
    def __init__(self, name: str):
        self.name = name
        self.communicator = False  # made in the first collective (no device_id)
        self.server_entered = threading.Event()
        self.sent: queue.SimpleQueue[Work] = queue.SimpleQueue()
        self.aborted = False
        self.pending: list[Work] = []


class LazyNCCL(Collectives):
    """NCCL as the push meets it, on the CPU (see the module docstring)."""

    def __init__(self, cap_s: float = 10.0):
        self.cap_s = cap_s
        self.groups: dict[str, Group] = {}
        self.made = threading.Event()
        self.block_fill_at: int | None = None  # the fill of this bucket (0-based) never becomes ready
        self.fills = 0
        self.loop_thread: int | None = None  # where a collective must never be issued

    def device(self, backend: str) -> torch.device:
        return torch.device("cpu")

    def open_group(self, backend: str, address: str, listen: Any, world_size: int, group_name: str,
                   timeout_s: float) -> Group:  # fmt: skip
        listen.close()
        group = self.groups[group_name] = Group(group_name)
        self.made.set()
        return group

    def broadcast(self, payload: Any, group: Group) -> Work:
        if threading.get_ident() == self.loop_thread:
            raise RuntimeError("stand-in NCCL: a collective issued on the event loop's thread")
        if group.aborted:
            raise RuntimeError(f"stand-in NCCL: group {group.name} was aborted")
        if not group.communicator:  # ncclCommInitRank: every rank must enter
            if not group.server_entered.wait(self.cap_s):
                raise RuntimeError(f"stand-in NCCL: the server never entered the first collective of {group.name} "
                                   f"within {self.cap_s:g} s; the trainer's thread was blocked all along")  # fmt: skip
            group.communicator = True
        work = Work(payload)
        group.pending.append(work)
        group.sent.put(work)
        return work

    def bucket_ready(self, device: torch.device) -> None:
        index, self.fills = self.fills, self.fills + 1
        if index == self.block_fill_at:
            threading.Event().wait(self.cap_s * 3)  # (a synchronize behind a stuck kernel: longer than any deadline)

    def destroy(self, group: Group) -> None:
        group.aborted = True
        for work in group.pending:
            if not work.done.is_set():
                work.error = "NCCL communicator was aborted"
                work.done.set()


class StandInServer:
    """An SGLang server's weight routes over ``LazyNCCL``; ``die_at`` (a bucket index): from that bucket
    on it never answers and receives nothing (as a server that died)."""

    def __init__(self, url: str, nccl: LazyNCCL, die_at: int | None = None, kind: str = "SGLang 0.5.23"):
        self.url = url
        self.nccl = nccl
        self.die_at = die_at
        self.kind = kind
        self.joins: list[dict[str, Any]] = []
        self.weight_version = 0
        self.received: dict[str, torch.Tensor] = {}
        self.calls: list[str] = []
        self.version: str | None = None

    def support(self) -> ServerWeights:
        return ServerWeights(url=self.url, kind=self.kind, device="cuda", dtype=torch.float32, local=False,
                             broadcast=None, tensor=None, model_config=None)  # fmt: skip

    async def get_server_info(self) -> dict[str, Any]:
        return {"version": "0.5.23", "device": "cuda", "tp_size": 1}

    async def weight_call(self, path: str, payload: Any, timeout_s: float) -> Any:
        self.calls.append(path)
        if path == "/init_weights_update_group":
            self.joins.append(payload)
        if path != "/update_weights_from_distributed":
            return {"success": True, "message": "Success"}
        group = self.nccl.groups[payload["group_name"]]
        index = sum(call == path for call in self.calls) - 1
        if index == self.die_at or (self.die_at is not None and index > self.die_at):
            group.server_entered.set()
            await asyncio.sleep(3600)
        group.server_entered.set()  # this rank enters the collective (its communicator, then the broadcast)
        work = await asyncio.to_thread(group.sent.get, True, 30)
        specs = [WeightSpec(n, getattr(torch, d), tuple(s))
                 for n, d, s in zip(payload["names"], payload["dtypes"], payload["shapes"], strict=True)]  # fmt: skip
        views = bucket_views(work.payload, specs) if isinstance(work.payload, torch.Tensor) else work.payload
        self.received.update({name: tensor.clone() for name, tensor in views})
        work.done.set()
        if payload.get("weight_version") is not None:
            self.version = payload["weight_version"]
        return {"success": True, "message": "Succeeded to update parameter online."}


class StandInVLLM:
    """A vLLM server with rallyrl's worker extension over ``LazyNCCL``: one ``rallyrl_receive_weights`` call
    takes every bucket, entering each broadcast in turn."""

    def __init__(self, url: str, nccl: LazyNCCL):
        self.url = url
        self.nccl = nccl
        self.weight_version = 0
        self.received: dict[str, torch.Tensor] = {}
        self.version: str | None = None

    def support(self) -> ServerWeights:
        return ServerWeights(url=self.url, kind="vLLM 0.32.0", device="cuda", dtype=torch.float32, local=False,
                             broadcast=None, tensor=None, model_config=None)  # fmt: skip

    async def get(self, path: str) -> Any:
        return {}

    async def flush_cache(self) -> None:
        return None

    async def weight_call(self, path: str, payload: dict[str, Any], timeout_s: float) -> Any:
        if path == "/update_weight_version":
            self.version = payload["new_version"]
        if path != "/collective_rpc" or payload["method"] != "rallyrl_receive_weights":
            return {"results": [{}]}
        kwargs = payload["kwargs"]
        group = self.nccl.groups[kwargs["group_name"]]
        for bucket in kwargs["buckets"]:
            group.server_entered.set()
            work = await asyncio.to_thread(group.sent.get, True, 30)
            specs = [WeightSpec(n, getattr(torch, d), tuple(s))
                     for n, d, s in zip(bucket["names"], bucket["dtypes"], bucket["shapes"], strict=True)]  # fmt: skip
            self.received.update({name: tensor.clone() for name, tensor in bucket_views(work.payload, specs)})
            work.done.set()
        return {"results": [{"loaded": len(kwargs["buckets"])}]}
