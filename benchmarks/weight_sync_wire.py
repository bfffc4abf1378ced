"""The floor of a weight broadcast on this machine (gloo on loopback to a bare receiver, no server), and
the report of ``benchmarks/weight_sync.py``."""

from __future__ import annotations

import statistics
import time
from typing import Any

from rich.console import Console
from rich.table import Table


def _receive(port: int, buckets: list[list[int]], rounds: int) -> None:
    import torch
    import torch.distributed as dist

    from rollout.engines.weight_group import destroy_weight_group, init_weight_group

    group = init_weight_group("gloo", "127.0.0.1", port, 2, 1, "rallyrl-floor", 300)
    for _ in range(rounds):
        for sizes in buckets:  # a fresh buffer per tensor, as SGLang receives a bucket tensor by tensor
            works = [dist.broadcast(torch.empty(size, dtype=torch.uint8), src=0, group=group, async_op=True)
                     for size in sizes]  # fmt: skip
            for work in works:
                work.wait()
        dist.barrier(group=group)
    destroy_weight_group(group)


def gloo_floor(buckets: list[list[int]], rounds: int = 3) -> float:
    """Median seconds to broadcast ``buckets`` (each the byte sizes of its tensors, sent one by one as
    the gloo path sends them) over gloo on loopback to another process that only receives them (each
    round ends when the receiver has everything)."""
    import multiprocessing

    import torch
    import torch.distributed as dist

    from rollout.engines.weight_group import destroy_weight_group, free_port, init_weight_group

    port = free_port()
    receiver = multiprocessing.get_context("spawn").Process(target=_receive, args=(port, buckets, rounds + 1))
    receiver.start()
    try:
        group = init_weight_group("gloo", "127.0.0.1", port, 2, 0, "rallyrl-floor", 300)
        tensors = [[torch.ones(size, dtype=torch.uint8) for size in sizes] for sizes in buckets]
        times = []
        for _ in range(rounds + 1):  # the first round warms both sides up
            started = time.perf_counter()
            for bucket in tensors:
                for work in [dist.broadcast(t, src=0, group=group, async_op=True) for t in bucket]:
                    work.wait()
            dist.barrier(group=group)
            times.append(time.perf_counter() - started)
        destroy_weight_group(group)
    finally:
        receiver.join(timeout=60)
        if receiver.is_alive():
            receiver.kill()
    return statistics.median(times[1:])


def _fanout_receive(port: int, world: int, rank: int, name: str, sizes: list[int], rounds: int) -> None:
    import torch
    import torch.distributed as dist

    from rollout.engines.weight_group import destroy_weight_group, init_weight_group

    group = init_weight_group("gloo", "127.0.0.1", port, world, rank, name, 300)
    for _ in range(rounds):
        for size in sizes:
            dist.broadcast(torch.empty(size, dtype=torch.uint8), src=0, group=group)
        dist.barrier(group=group)
    destroy_weight_group(group)


def gloo_fanout(sizes: list[int], rounds: int = 3) -> dict[str, float]:
    """Median seconds to broadcast buckets of ``sizes`` bytes to two receiver processes on loopback:
    in one group of three (the trainer and both), or in two groups of two (one per server, the way
    rallyrl makes them), both groups' broadcasts side by side."""
    import multiprocessing

    import torch
    import torch.distributed as dist

    from rollout.engines.weight_group import destroy_weight_group, free_port, init_weight_group

    context = multiprocessing.get_context("spawn")
    buffers = [torch.ones(size, dtype=torch.uint8) for size in sizes]
    results = {}
    for layout in ("one group of three", "two groups of two"):
        ports = [free_port()] if layout.startswith("one") else [free_port(), free_port()]
        world = 3 if len(ports) == 1 else 2
        names = [f"rallyrl-fanout-{i}" for i in range(len(ports))]
        receivers = [context.Process(target=_fanout_receive, args=(ports[0], 3, rank, names[0], sizes, rounds + 1))
                     for rank in (1, 2)] if len(ports) == 1 else [
            context.Process(target=_fanout_receive, args=(port, 2, 1, name, sizes, rounds + 1))
            for port, name in zip(ports, names, strict=True)]  # fmt: skip
        for receiver in receivers:
            receiver.start()
        try:
            groups = [init_weight_group("gloo", "127.0.0.1", port, world, 0, name, 300)
                      for port, name in zip(ports, names, strict=True)]  # fmt: skip
            times = []
            for _ in range(rounds + 1):
                started = time.perf_counter()
                for buffer in buffers:
                    for work in [dist.broadcast(buffer, src=0, group=g, async_op=True) for g in groups]:
                        work.wait()
                for group in groups:
                    dist.barrier(group=group)
                times.append(time.perf_counter() - started)
            results[layout] = statistics.median(times[1:])
            for group in groups:
                destroy_weight_group(group)
        finally:
            for receiver in receivers:
                receiver.join(timeout=60)
                if receiver.is_alive():
                    receiver.kill()
    return results


def top_frames(raw: str, count: int = 6) -> list[tuple[float, str]]:
    """The functions a ``py-spy record -f raw`` capture spent most samples in (their own time), as
    (share, "function (file)")."""
    import collections

    leaves: collections.Counter[str] = collections.Counter()
    for line in raw.splitlines():
        if " " not in line.strip():
            continue
        stack, samples = line.rsplit(" ", 1)
        leaf = stack.split(";")[-1]
        name, _, where = leaf.partition(" (")
        leaves[f"{name} ({where.split(':')[0].rsplit('/', 2)[-2:][-1] if where else '?'})"] += int(samples)
    total = sum(leaves.values()) or 1
    return [(samples / total, frame) for frame, samples in leaves.most_common(count)]


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def print_report(rows: list[dict[str, Any]]) -> None:
    """One table per model: seconds per sync (a disk sync's save apart), MiB written, the logprob gap,
    the ratio to disk; then what bounds it."""
    console = Console(width=120)
    for model in dict.fromkeys(row["model"] for row in rows):
        mine = [row for row in rows if row["model"] == model]
        size = mine[0]["bytes"]
        table = Table(title=f"{model}: {size / 2**20:,.0f} MiB per sync, median (min-max) of {len(mine[0]['seconds'])}")
        for column in ("server", "transport", "s / sync", "of it: save", "MiB written", "logprob gap", "/ disk"):
            table.add_column(column, justify="left" if column in ("server", "transport") else "right")
        disk = {row["server"]: statistics.median(row["seconds"]) for row in mine if row["transport"] == "disk"}
        for row in mine:
            median = statistics.median(row["seconds"])
            ratio = f"{median / disk[row['server']]:.2f}x" if row["server"] in disk else "-"
            save = "-" if row.get("save_s") is None else f"{row['save_s']:.3f}"
            table.add_row(row["server"], row["transport"], spread(row["seconds"]), save,
                          f"{statistics.median(row['written_bytes']) / 2**20:,.0f}", f"{row['logprob_gap']:.1e}",
                          ratio)  # fmt: skip
        console.print(table)
        prof = mine[0]["profile"]
        console.print(
            f"  what bounds it: {prof['buckets']} bucket(s); gloo on loopback to a bare receiver takes "
            f"{prof['wire_s']:.3f} s for them ({size / prof['wire_s'] / 2**30:.2f} GiB/s: the floor of a broadcast "
            f"here); filling them flat (NCCL, CUDA IPC) takes {prof['fill_s']:.3f} s",
            highlight=False,
        )
        for row in mine:
            if row.get("server_profile"):
                frames = "; ".join(f"{share:.0%} {frame}" for share, frame in row["server_profile"])
                where = f"{row['server']} during one {row['transport']} sync (py-spy)"
                console.print(f"  {where}: {frames}", highlight=False)
        if prof.get("fanout"):
            layouts = ", ".join(f"{name} {seconds:.3f} s" for name, seconds in prof["fanout"].items())
            console.print(f"  the same bytes to two servers over gloo: {layouts}", highlight=False)
