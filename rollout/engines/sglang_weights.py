"""Weights into an SGLang server (or ``rallyrl serve``, which speaks the same API) in memory.

What the server offers (SGLang 0.5.23, ``sglang/srt/entrypoints/http_server.py``):

- broadcast: ``POST /init_weights_update_group {master_address, master_port, rank_offset, world_size,
  group_name, backend}`` once, answered when the group is made (the trainer joins as rank 0 at the
  same time); then per sync ``POST /begin_weight_update``, per bucket ``POST
  /update_weights_from_distributed {names, dtypes, shapes, group_name, flush_cache, weight_version,
  load_format: "flattened_bucket"}`` answered once the server has received the bucket the trainer
  broadcasts meanwhile and loaded it, and ``POST /end_weight_update``. Since 0.5.2x the updates are
  refused outside a begin/end session.
- tensor: the same session, per bucket ``POST /update_weights_from_tensor {serialized_named_tensors,
  load_format, flush_cache, weight_version}`` (``tensor_payload.py``).

The server records a ``weight_version`` as soon as an update that names it has loaded, so only the
last bucket names it (and flushes the cache); generation is paused by the caller for the whole sync,
and the caller reads the version back from ``/get_model_info`` after ``end``. After a failure, ``abandon``
leaves the group and ends the session (its half-loaded weights must not serve: rallyrl serve ends
such a session as a failure and refuses to continue, and the caller does not ask SGLang to; ending
it lets a load from disk through); the next sync makes a new group and pushes every bucket. The
trainer's collectives go on a daemon thread of the receiver's, never the event loop's
(``weight_collectives.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from rollout.engines import weight_collectives
from rollout.engines.base import EngineError
from rollout.engines.daemon_threads import DaemonThreads
from rollout.engines.tensor_payload import payload_chunks, pickle_named_tensors
from rollout.engines.weight_buckets import Bucket, bucket_views
from rollout.engines.weight_plan import ServerWeights, sglang_dtype
from rollout.engines.weight_push import QUICK_S, Receiver, Tensors, destroy_group, open_group, side_by_side


class SGLangClient(Protocol):
    """What the receivers use of an SGLang client (``sglang_http.SGLangHTTPEngine``)."""

    url: str
    weight_version: int

    async def get_server_info(self) -> dict[str, Any]: ...

    async def weight_call(self, path: str, payload: dict[str, Any] | Iterable[bytes], timeout_s: float) -> Any: ...


RALLYRL_SERVE = "rallyrl"
"""How ``rallyrl serve`` begins its ``/get_server_info`` ``version``."""
SERVE_JOIN_MAX_S = 300.0
"""The longest join deadline (``timeout_s``) rallyrl serve takes."""


async def sglang_weight_support(client: SGLangClient, local: bool) -> ServerWeights:
    """What an SGLang server (or ``rallyrl serve``) can take, from its ``/get_server_info`` and its model's
    ``config.json`` (read where the server's ``model_path`` is a directory here)."""
    info = await client.get_server_info()
    version = str(info.get("version", ""))
    ours = version.startswith(RALLYRL_SERVE)
    kind = "rallyrl serve" if ours else f"SGLang {version}".strip()
    model_config = _read_config(info.get("model_path"))
    tp, pp, dp = (int(info.get(key) or 1) for key in ("tp_size", "pp_size", "dp_size"))
    broadcast = None
    if pp > 1 or dp > 1:
        broadcast = (f"{client.url} runs {pp} pipeline stages and {dp} data-parallel replicas: SGLang's weight "
                     "groups take tensor parallel workers only")  # fmt: skip
    limits = info.get("weight_limits") if ours and isinstance(info.get("weight_limits"), dict) else {}
    return ServerWeights(
        url=client.url, kind=kind, device=str(info.get("device") or "cuda"), local=local,
        dtype=sglang_dtype(info.get("dtype"), model_config), broadcast=broadcast, tensor=None,
        model_config=model_config, world_size=tp, max_bucket_bytes=_limit(limits, "max_bucket_bytes"),
        max_body_bytes=_limit(limits, "max_tensor_body_bytes"),
    )  # fmt: skip


def _limit(limits: dict[str, Any], key: str) -> int | None:
    value = limits.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _read_config(model_path: object) -> dict[str, Any] | None:
    import json

    try:
        return json.loads((Path(str(model_path)) / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return None


class SGLangSession(Receiver):
    """The begin/end session both transports share."""

    def __init__(self, client: SGLangClient, server: ServerWeights, dtype: torch.dtype, device: torch.device,
                 timeout_s: float):  # fmt: skip
        super().__init__(client.url, dtype, device, timeout_s)
        self.client = client
        self.server = server

    async def _call(self, path: str, payload: Any) -> Any:
        return await self.client.weight_call(path, payload, self.timeout_s)

    async def begin(self, version: int, buckets: Sequence[Bucket]) -> None:
        try:
            await self._call("/begin_weight_update", {})
        except EngineError as exc:  # a session a trainer left open (it died, or a push failed): end it first
            if "already open" not in str(exc):
                raise
            with contextlib.suppress(EngineError):  # (rallyrl serve ends a partial session as a failure)
                await self._call("/end_weight_update", {})
            await self._call("/begin_weight_update", {})

    def _fields(self, bucket: Bucket, count: int, version: int) -> dict[str, Any]:
        last = bucket.index == count - 1
        return {"flush_cache": last, "abort_all_requests": False, "weight_version": str(version) if last else None}

    async def end(self, version: int) -> None:
        await self._call("/end_weight_update", {})
        self.client.weight_version = version

    async def abandon(self) -> None:
        """End the session on the server (best effort, quickly: it may not answer). Its weights may be
        partly new, so it must not serve them: the pool leaves it paused (and rallyrl serve refuses to
        continue until a whole update), and a load from disk, which an open session would hold up, can
        make them whole again. The next ``begin`` opens a new session and pushes everything."""
        with contextlib.suppress(EngineError, TimeoutError):
            await self.client.weight_call("/end_weight_update", {}, min(self.timeout_s, QUICK_S))


class SGLangBroadcast(SGLangSession):
    """Buckets broadcast from the trainer (rank 0) to the server's workers (ranks 1..tp). The trainer's
    collectives go on a daemon thread of this receiver's (``weight_collectives.py`` says why)."""

    transport = "broadcast"

    def __init__(self, client: SGLangClient, server: ServerWeights, dtype: torch.dtype, backend: str,
                 master_address: str | None, timeout_s: float):  # fmt: skip
        super().__init__(client, server, dtype, weight_collectives.active.device(backend), timeout_s)
        self.flat = backend == "nccl"  # gloo: each tensor from the trainer's memory (SGLang's per-tensor format)
        self.backend = backend
        self.master_address = master_address
        self.group: Any = None
        self.group_name = ""
        self.threads: DaemonThreads | None = None

    def describe(self) -> str:
        return f"broadcast ({self.backend})"

    async def begin(self, version: int, buckets: Sequence[Bucket]) -> None:
        if self.group is None:
            await self._join()
        await super().begin(version, buckets)

    async def _join(self) -> None:
        """Make the group: the server's call and the trainer's side of the rendezvous, side by side."""
        ours = self.server.kind == "rallyrl serve"  # (SGLang's join takes no deadline: torch's 30 minutes)

        async def join(address: str, port: int, name: str) -> Any:
            return await self._call("/init_weights_update_group", {
                "master_address": address, "master_port": port, "rank_offset": 1,
                "world_size": 1 + self.server.world_size, "group_name": name, "backend": self.backend,
                **({"timeout_s": min(self.timeout_s, SERVE_JOIN_MAX_S)} if ours else {}),
            })  # fmt: skip

        async def leave(name: str) -> Any:
            return await self.client.weight_call("/destroy_weights_update_group", {"group_name": name}, QUICK_S)

        if self.threads is not None:  # (a join that failed before)
            self.threads.shutdown()
        self.threads = DaemonThreads(1, "rallyrl-weight-broadcast")
        self.group, self.group_name = await open_group(
            self.url, self.backend, self.master_address, self.server.world_size, self.timeout_s, join, leave,
            self.threads,
        )  # fmt: skip

    async def send(self, bucket: Bucket, payload: torch.Tensor | Tensors, count: int, version: int) -> None:
        """The bucket's call first, its broadcast issued beside it; return with the call's answer (the
        next bucket's call goes only then: the server must take the calls, and so the broadcasts, in
        order)."""
        assert self.threads is not None, "begin first"
        body = {**bucket.payload(), "group_name": self.group_name, **self._fields(bucket, count, version)}
        if self.flat:
            body["load_format"] = "flattened_bucket"
        call = asyncio.ensure_future(self._call("/update_weights_from_distributed", body))
        issue = self.threads.run(weight_collectives.active.broadcast, payload, self.group)
        await side_by_side(call, issue, self.url)

    async def abandon(self) -> None:
        """Leave the group on both sides (the server's side best effort: it may not answer; an NCCL
        group aborted on ours, which ends a broadcast still waiting for it), then end the session."""
        if self.group is not None:
            group, self.group = self.group, None
            with contextlib.suppress(EngineError, TimeoutError):
                body = {"group_name": self.group_name}
                await self.client.weight_call("/destroy_weights_update_group", body, min(self.timeout_s, QUICK_S))
            await destroy_group(group)
        if self.threads is not None:  # (a thread stuck in a collective stays behind, a daemon)
            self.threads.shutdown()
            self.threads = None
        await super().abandon()


class SGLangTensor(SGLangSession):
    """Buckets handed over on this machine: CUDA IPC handles on a GPU, the bytes themselves on a CPU."""

    transport = "tensor"

    def __init__(self, client: SGLangClient, server: ServerWeights, dtype: torch.dtype, device: torch.device,
                 timeout_s: float):  # fmt: skip
        super().__init__(client, server, dtype, device, timeout_s)
        self.flat = device.type == "cuda"  # one IPC handle per bucket; by value, the tensors themselves

    def describe(self) -> str:
        return "tensor (CUDA IPC)" if self.device.type == "cuda" else "tensor (by value)"

    async def send(self, bucket: Bucket, payload: torch.Tensor | Tensors, count: int, version: int) -> None:
        named = bucket_views(payload, bucket.specs) if isinstance(payload, torch.Tensor) else payload
        pickled = await asyncio.to_thread(pickle_named_tensors, named)
        fields = {"load_format": None, **self._fields(bucket, count, version)}
        chunks = payload_chunks(pickled, self.server.world_size, fields)
        await self.client.weight_call("/update_weights_from_tensor", chunks, self.timeout_s)
