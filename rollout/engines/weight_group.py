"""The process group a weight broadcast travels in: the trainer as rank 0, a server's workers after it.

SGLang makes its side of the group with its own ``init_custom_process_group`` (a TCP rendezvous, then
a store prefixed by the group's name, then a group that is not torch's default one), so the trainer's
side must make it the same way: a plain ``torch.distributed.init_process_group`` reads other store
keys and waits forever. ``init_weight_group`` does what SGLang does, with torch's own pieces; rallyrl
serve and rallyrl's vLLM worker extension join with it too. Rank 0 (the trainer) serves the
rendezvous store on ``master_address:master_port`` and nowhere else (``bind_store``): loopback for
servers on the same machine, else the trainer's address on the route to the server
(``address_towards``). ``backend`` is passed to torch: gloo on a CPU, NCCL between GPUs. An NCCL
communicator is made lazily, in the group's first collective, on every side: SGLang makes its side
so (no ``device_id``), and ranks must agree (a rank that made it with the group would wait there for
the others' first collective, which comes only after the group is made). So the first collective
blocks its caller until every rank has entered it: never call it on an event loop's thread. Torch
only (the vLLM worker extension imports it).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
from datetime import timedelta
from typing import Any

import torch.distributed as dist


def init_weight_group(backend: str, master_address: str, master_port: int, world_size: int, rank: int,
                      group_name: str, timeout_s: float, listen: socket.socket | None = None) -> Any:  # fmt: skip
    """Join (rank 0: open) the group ``group_name`` of ``world_size`` ranks, as SGLang's
    ``init_custom_process_group`` does; every collective in it fails after ``timeout_s``.

    Rank 0 serves the rendezvous store on ``listen`` (``bind_store``: a socket bound to the address
    it names, so that the store listens nowhere else; torch's own binds every interface). An NCCL
    communicator is made in the first collective (the module docstring says why)."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    if not group_name:
        raise ValueError("a weight group needs a name")
    timeout = timedelta(seconds=timeout_s)
    if rank == 0 and listen is not None:
        store = _store_on(listen, master_address, world_size, timeout)
    else:
        url = f"tcp://{_host_in_url(master_address)}:{master_port}"
        store, rank, world_size = next(rendezvous(url, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), PrefixStore(group_name, store), group_name=group_name,
        backend_options=None, timeout=timeout,
    )  # fmt: skip
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def bind_store(address: str) -> socket.socket:
    """A listening socket on ``address`` (a free port) for rank 0's rendezvous store: the store listens
    there and nowhere else. ``init_weight_group(listen=...)`` takes it over."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((address, 0))
        listener.listen(128)
    except OSError:
        listener.close()
        raise
    return listener


def _store_on(listen: socket.socket, address: str, world_size: int, timeout: timedelta) -> Any:
    """Rank 0's store, serving on the already bound ``listen`` (its descriptor goes to the store)."""
    from torch.distributed import TCPStore

    port = listen.getsockname()[1]
    fd = listen.detach()  # the store's from now on (libuv closes it with the store)
    try:
        return TCPStore(address, port, world_size, True, timeout, wait_for_workers=True, master_listen_fd=fd,
                        use_libuv=True)  # fmt: skip
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise


def destroy_weight_group(group: Any) -> None:
    """Forget ``group`` (its connections close); quiet when it is already gone. An NCCL group is
    aborted first: a broadcast still waiting on a peer that died would otherwise never end."""
    with contextlib.suppress(ValueError, RuntimeError, KeyError, AttributeError):
        if dist.get_backend(group) == "nccl":
            group.abort()
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
