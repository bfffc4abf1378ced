"""The process group a weight broadcast travels in: the trainer as rank 0, a server's workers after it.

SGLang makes its side of the group with its own ``init_custom_process_group`` (a TCP rendezvous, then
a store prefixed by the group's name, then a group that is not torch's default one), so the trainer's
side must make it the same way: a plain ``torch.distributed.init_process_group`` reads other store
keys and waits forever. ``init_weight_group`` does what SGLang does, with torch's own pieces; rallyrl
serve and rallyrl's vLLM worker extension join with it too. Rank 0 (the trainer) serves the
rendezvous store on ``master_address:master_port``: loopback for servers on the same machine, else
the trainer's address on the route to the server (``address_towards``). ``backend`` is passed to
torch: gloo on a CPU, NCCL between GPUs. Torch only (the vLLM worker extension imports it).
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from datetime import timedelta
from typing import Any

import torch.distributed as dist


def init_weight_group(backend: str, master_address: str, master_port: int, world_size: int, rank: int,
                      group_name: str, timeout_s: float) -> Any:  # fmt: skip
    """Join (rank 0: open) the group ``group_name`` of ``world_size`` ranks, as SGLang's
    ``init_custom_process_group`` does; every collective in it fails after ``timeout_s``."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    if not group_name:
        raise ValueError("a weight group needs a name")
    timeout = timedelta(seconds=timeout_s)
    url = f"tcp://{_host_in_url(master_address)}:{master_port}"
    store, rank, world_size = next(rendezvous(url, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), PrefixStore(group_name, store), group_name=group_name,
        backend_options=None, timeout=timeout,
    )  # fmt: skip
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def destroy_weight_group(group: Any) -> None:
    """Forget ``group`` (its connections close); quiet when it is already gone."""
    with contextlib.suppress(ValueError, RuntimeError, KeyError):
        dist.destroy_process_group(group)


def _host_in_url(address: str) -> str:
    return f"[{address}]" if ":" in address and not address.startswith("[") else address


def free_port(address: str = "127.0.0.1") -> int:
    """A TCP port free on ``address`` now (another process may take it before it is bound)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family) as probe:
        probe.bind((address, 0))
        return probe.getsockname()[1]


def address_towards(host: str) -> str:
    """This machine's address on the route to ``host``: loopback for a server on loopback, else the
    source address the kernel picks for a UDP socket aimed at it (nothing is sent)."""
    try:
        if ipaddress.ip_address(host).is_loopback:
            return host
    except ValueError:
        if host == "localhost":
            return "127.0.0.1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return probe.getsockname()[0]


def is_local_host(host: str) -> bool:
    """Whether ``host`` (a URL's host) is this machine: loopback, its name, or one of its addresses."""
    if host in ("localhost", socket.gethostname()):
        return True
    try:
        address = ipaddress.ip_address(socket.gethostbyname(host))
    except (OSError, ValueError):
        return False
    if address.is_loopback:
        return True
    try:
        mine = {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        mine = set()
    return str(address) in mine or str(address) == address_towards(str(address))
