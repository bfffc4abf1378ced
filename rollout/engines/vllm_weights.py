"""Weights into a vLLM server in memory: a broadcast to rallyrl's worker extension (``vllm_worker.py``).

vLLM 0.32 has no gloo weight transfer, so the server runs rallyrl's extension (``--worker-extension-cls
rollout.engines.vllm_worker.WeightReceiver``, development endpoints on) and the trainer drives it
through ``/collective_rpc``:

1. once: ``rallyrl_join_weight_group`` on every worker while the trainer opens the group as rank 0;
2. per sync (the server paused by the caller): one ``rallyrl_receive_weights`` call naming every
   bucket, answered when all are loaded, while the trainer broadcasts them one after another (over
   gloo each tensor from the trainer's own memory, over NCCL each bucket flattened);
3. ``/reset_prefix_cache`` and ``/update_weight_version`` (the caller reads it back from ``/weight_info``).

A tied LM head travels once, under the embeddings' name; the extension loads it under both names on
a CPU (vLLM's CPU backend keeps a packed copy of the head).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from rollout.engines import weight_collectives
from rollout.engines.base import EngineError
from rollout.engines.daemon_threads import DaemonThreads
from rollout.engines.launch import VLLM_EXTENSION
from rollout.engines.weight_buckets import DTYPES, Bucket
from rollout.engines.weight_plan import ServerWeights
from rollout.engines.weight_push import QUICK_S, Receiver, Tensors, destroy_group, open_group, side_by_side


class VLLMClient(Protocol):
    """What the receiver uses of a vLLM client (``vllm_http.VLLMHTTPEngine``)."""

    url: str
    weight_version: int

    async def get(self, path: str) -> Any: ...

    async def flush_cache(self) -> None: ...

    async def weight_call(self, path: str, payload: dict[str, Any], timeout_s: float) -> Any: ...


async def vllm_weight_support(client: VLLMClient, local: bool) -> ServerWeights:
    """What a vLLM server can take, from its ``/server_info`` and (with the extension) its workers."""
    try:
        info = await client.get("/server_info?config_format=json")
    except EngineError:
        info = None
    config = (info or {}).get("vllm_config") or {}
    parallel = config.get("parallel_config") or {}
    model = config.get("model_config") or {}
    device = str((config.get("device_config") or {}).get("device") or "cuda")
    world = int(parallel.get("tensor_parallel_size") or 1) * int(parallel.get("pipeline_parallel_size") or 1)
    flag = f"restart it with --worker-extension-cls {VLLM_EXTENSION} (rallyrl importable in vLLM's environment)"
    model_config: dict[str, Any] | None = None
    if info is None:
        broadcast = f"{client.url} serves no development endpoints: restart it with VLLM_SERVER_DEV_MODE=1 and {flag}"
    elif parallel.get("worker_extension_cls") != VLLM_EXTENSION:
        broadcast = f"{client.url} runs without rallyrl's worker extension: {flag}"
    elif int(parallel.get("data_parallel_size") or 1) > 1:
        broadcast = f"{client.url} runs data-parallel replicas: give each replica's URL instead"
    else:
        broadcast = None
        answers = await client.weight_call("/collective_rpc", {"method": "rallyrl_model_config"}, 60.0)
        model_config = answers["results"][0]["hf_config"]
    return ServerWeights(
        url=client.url, kind=f"vLLM {await _version(client)}".strip(), device=device, local=local,
        dtype=DTYPES.get(str(model.get("dtype", "")).removeprefix("torch.")), broadcast=broadcast,
        tensor=f"{client.url}: rallyrl hands tensors to SGLang and rallyrl serve (vLLM takes a broadcast "
        "through rallyrl's worker extension)",
        model_config=model_config, world_size=world,
    )  # fmt: skip


async def _version(client: VLLMClient) -> str:
    try:
        answer = await client.get("/version")
    except EngineError:
        return ""
    return str(answer.get("version", "")) if isinstance(answer, dict) else ""


class VLLMBroadcast(Receiver):
    """Buckets broadcast to the workers of one vLLM server (ranks 1..N of its group)."""

    transport = "broadcast"

    def __init__(self, client: VLLMClient, server: ServerWeights, dtype: torch.dtype, backend: str,
                 master_address: str | None, timeout_s: float, aliases: dict[str, str]):  # fmt: skip
        super().__init__(client.url, dtype, weight_collectives.active.device(backend), timeout_s)
        self.flat = backend == "nccl"  # gloo: each tensor from the trainer's memory
        self.client = client
        self.server = server
        self.backend = backend
        self.master_address = master_address
        self.aliases = aliases
        self.group: Any = None
        self.group_name = ""
        self._load: asyncio.Future[Any] | None = None
        self.threads: DaemonThreads | None = None  # where the trainer's collectives are issued

    def describe(self) -> str:
        return f"broadcast ({self.backend}, worker extension)"

    async def _rpc(self, method: str, deadline_s: float, **kwargs: Any) -> Any:
        """``method`` of rallyrl's extension on every worker, answered within ``deadline_s``."""
        body = {"method": method, "kwargs": kwargs, "timeout": deadline_s}
        return await self.client.weight_call("/collective_rpc", body, deadline_s + 5)

    async def _join(self) -> None:
        """Make the group: every worker joins (``/collective_rpc``) while the trainer opens it."""

        async def join(address: str, port: int, name: str) -> Any:
            return await self._rpc(
                "rallyrl_join_weight_group", self.timeout_s, master_address=address, master_port=port,
                rank_offset=1, world_size=1 + self.server.world_size, group_name=name, backend=self.backend,
                timeout_s=self.timeout_s,
            )  # fmt: skip

        async def leave(name: str) -> Any:
            return await self._rpc("rallyrl_leave_weight_group", QUICK_S, group_name=name)

        if self.threads is not None:  # (a join that failed before)
            self.threads.shutdown()
        self.threads = DaemonThreads(1, "rallyrl-weight-broadcast")
        self.group, self.group_name = await open_group(
            self.url, self.backend, self.master_address, self.server.world_size, self.timeout_s, join, leave,
            self.threads,
        )  # fmt: skip

    async def begin(self, version: int, buckets: Sequence[Bucket]) -> None:
        if self.group is None:
            await self._join()
        total = self.timeout_s * (len(buckets) + 1)
        self._load = asyncio.ensure_future(self._rpc(
            "rallyrl_receive_weights", total, group_name=self.group_name,
            buckets=[{**bucket.payload(), "flat": self.flat} for bucket in buckets], aliases=self.aliases,
        ))  # fmt: skip

    async def send(self, bucket: Bucket, payload: torch.Tensor | Tensors, count: int, version: int) -> None:
        assert self._load is not None and self.threads is not None, "begin first"
        issue = self.threads.run(weight_collectives.active.broadcast, payload, self.group)
        await side_by_side(self._load, issue, self.url, wait_for_call=False)

    async def end(self, version: int) -> None:
        assert self._load is not None, "begin first"
        load, self._load = self._load, None
        await load
        await self.client.flush_cache()
        await self.client.weight_call("/update_weight_version", {"new_version": str(version)}, self.timeout_s)
        self.client.weight_version = version

    async def abandon(self) -> None:
        if self._load is not None:
            self._load.cancel()
            self._load = None
        if self.group is not None:
            group, self.group = self.group, None
            with contextlib.suppress(EngineError, TimeoutError):  # (best effort: it may not answer)
                await self._rpc("rallyrl_leave_weight_group", min(self.timeout_s, QUICK_S), group_name=self.group_name)
            await destroy_group(group)  # (an NCCL group aborted: a broadcast waiting for the server ends)
        if self.threads is not None:  # (a thread stuck in a collective stays behind, a daemon)
            self.threads.shutdown()
            self.threads = None
