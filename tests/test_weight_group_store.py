"""The trainer's side of a weight group (``rollout/engines/weight_group.py``): its rendezvous store
listens on the address it names and nowhere else (torch's own store binds every interface), and a
real gloo group made through it carries a broadcast to a peer in another process."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
import torch.distributed as dist

from rollout.engines.daemon_threads import DaemonThreads
from rollout.engines.weight_group import destroy_weight_group
from rollout.engines.weight_push import open_group


def listening(port: int) -> set[str]:
    """The local addresses listening on TCP ``port`` (from /proc/net/tcp and tcp6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:
                found.add(address)
    return found


PEER = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    from rollout.engines.weight_group import init_weight_group, destroy_weight_group
    group = init_weight_group("gloo", "127.0.0.1", int(sys.argv[1]), 2, 1, sys.argv[2], 60)
    tensor = torch.zeros(4)
    dist.broadcast(tensor, src=0, group=group)
    print(tensor.tolist())
    destroy_weight_group(group)
""")


async def test_the_trainers_store_listens_only_on_the_address_it_names_and_the_group_works():
    """Finding 4: on the code before, the store made for 127.0.0.1 listened on [::] as well."""
    seen: dict[str, set[str]] = {}
    peers: list[subprocess.Popen] = []

    async def join(address: str, port: int, name: str) -> None:
        for _ in range(200):  # until the store is up (the rendezvous runs on a thread of its own)
            await asyncio.sleep(0.05)
            if listening(port):
                break
        await asyncio.sleep(0.3)  # (any second listener would be there by now)
        seen["listening"] = listening(port)
        peers.append(subprocess.Popen([sys.executable, "-c", PEER, str(port), name], stdout=subprocess.PIPE, text=True))

    async def leave(name: str) -> None:
        return None

    group, _ = await open_group("http://127.0.0.1:1", "gloo", "127.0.0.1", 1, 60, join, leave,
                                   DaemonThreads(1, "test-open"))  # fmt: skip
    try:
        assert seen["listening"] == {"0100007F"}  # 127.0.0.1, and no [::]
        await asyncio.to_thread(dist.broadcast, torch.arange(4.0), 0, group)
        out, _ = await asyncio.to_thread(peers[0].communicate, timeout=60)
        assert out.strip() == "[0.0, 1.0, 2.0, 3.0]"
    finally:
        destroy_weight_group(group)
        for peer in peers:
            peer.kill()
