"""The collectives of a weight broadcast on the trainer's side, behind one seam (``active``).

Each call here may block its thread for as long as a peer makes it: making a group waits for every
rank; an NCCL group's first collective makes its communicator first (lazily on every side, as SGLang
makes its own: ``weight_group.py``), which waits for every rank too; an NCCL broadcast whose peer
died never ends (NCCL has no deadline of its own). So the push (``weight_push.py``) never calls them
on the event loop's thread: each receiver issues its collectives on a daemon thread of its own
(``daemon_threads.py``), and every wait for one is under the sync's deadline. A receiver that fails
has its group destroyed (an NCCL group aborted first).

``active`` is what the push calls. The real one is torch's; a test replaces it with a stand-in that
behaves as NCCL does on a GPU (``tests/nccl_standin.py``: a first collective that returns only once
the server side has entered it, a broadcast to a dead peer that never ends), so that the NCCL path
is exercised on a CPU.
"""

from __future__ import annotations

import socket
from typing import Any

import torch


class Collectives:
    """torch.distributed's collectives, as the weight push uses them."""

    def device(self, backend: str) -> torch.device:
        """Where buckets must be for ``backend``: the GPU for NCCL, the CPU for gloo."""
        if backend != "nccl":
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cuda")

    def open_group(self, backend: str, address: str, listen: socket.socket, world_size: int, group_name: str,
                   timeout_s: float) -> Any:  # fmt: skip
        """Open the group as rank 0, its store on ``listen`` (blocks until every rank has joined)."""
        from rollout.engines.weight_group import init_weight_group

        port = listen.getsockname()[1]
        return init_weight_group(backend, address, port, world_size, 0, group_name, timeout_s, listen=listen)

    def broadcast(self, payload: torch.Tensor | list[tuple[str, torch.Tensor]], group: Any) -> Any:
        """Issue the broadcast of a flat bucket, or of a bucket's tensors one by one, from rank 0
        (``async_op``); returns what ``collective_done`` polls."""
        import torch.distributed as dist

        if isinstance(payload, torch.Tensor):
            return dist.broadcast(payload, src=0, group=group, async_op=True)
        return AllDone([dist.broadcast(tensor, src=0, group=group, async_op=True) for _, tensor in payload])

    def bucket_ready(self, device: torch.device) -> None:
        """Wait until the bucket just filled on this thread is in ``device``'s memory: on a GPU, the
        copies on this thread's stream only (``torch.cuda.synchronize`` would also wait for every
        broadcast under way, one to a dead peer included, for ever)."""
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()

    def destroy(self, group: Any) -> None:
        """Leave ``group`` (an NCCL group aborted first, which ends a broadcast still waiting on a peer)."""
        from rollout.engines.weight_group import destroy_weight_group

        destroy_weight_group(group)


class AllDone:
    """Several collectives (``async_op=True``) waited on as one: done when every one is."""

    def __init__(self, works: list[Any]):
        self.works = works

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)

    def wait(self) -> None:
        for work in self.works:
            work.wait()


active = Collectives()
"""The collectives the push makes (a test sets a stand-in here)."""
