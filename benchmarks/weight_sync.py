"""Seconds per weight sync and bytes written to disk, by transport, into every server on this machine.

    python -m benchmarks.weight_sync [--models embedded qwen2.5-0.5b] [--servers serve sglang vllm]
        [--transports disk broadcast tensor] [--repeats 3] [--bucket-mb 512] [--device cpu|cuda] [--profile]
        [--json FILE]

For each model (the embedded model; a Qwen2.5-0.5B-shaped model with random weights built in code,
vocabulary 151,936, 494 M parameters, 1.98 GB in float32 with the tied head once: nothing downloads)
and each server (``rallyrl serve``, real SGLang 0.5.23, real vLLM 0.32 with rallyrl's worker
extension, each started from the model's directory in float32 on the CPU), every transport the
server takes is timed as a training run uses it: ``EnginePool.push_weights`` (pause -> the weights
-> the version read back -> continue; ``rollout/engines/pool_sync.py``), ``--repeats`` times, each
a new version. Reported per row: seconds per sync (median and range), the bytes this process wrote
(``/proc/self/io`` ``write_bytes``: a disk sync saves the model each time), the logprob gap of the
server's greedy tokens against the trainer's forward pass after the last sync (a check that the
weights arrived whole), and the sync's ratio to the disk sync of the same server.

What bounds each (the profile printed under the table, per model; ``benchmarks/weight_sync_wire.py``):
``wire``, the same buckets
broadcast over gloo on loopback, tensor by tensor as the gloo path sends them, to a bare receiver
process that allocates each tensor as SGLang does, with no server around it: the floor of a
broadcast on this machine; ``fill``, the trainer copying every bucket into a flat buffer alone (the
NCCL and CUDA IPC paths do; the gloo path sends each tensor from the trainer's own memory); ``save``,
writing the model directory (the trainer's half of a disk sync, timed apart in each disk sync). A
broadcast well above ``wire`` spends the rest in the server (receiving, loading, its answer). For the
larger model also the same bytes to two bare receivers, in one group of three against two groups of
two (rallyrl makes one group per server).

``--profile``: one more broadcast sync per server with py-spy sampling the server's processes, and the
functions they spent it in (the engine's own load, or the wait for the wire).

``--device cuda`` (a GPU machine): the trainer's weights on the GPU and ``rallyrl serve`` on the same GPU
in float32 (the only server then): ``tensor`` goes by CUDA IPC (the server maps the trainer's buckets),
``broadcast`` by gloo through the CPU (NCCL refuses two ranks on one GPU), ``disk`` as on the CPU.

Asserts nothing; a server whose virtualenv is missing is skipped with the command that installs it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rollout.serve.processes import stop_on_sigterm

QWEN_05B = {"vocab_size": 151_936, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
            "num_attention_heads": 14, "num_key_value_heads": 2, "tie_word_embeddings": True,
            "max_position_embeddings": 4096}  # fmt: skip
"""Qwen2.5-0.5B's published shape (a shorter context: the servers here run 2,048 tokens)."""


def written_bytes() -> int:
    """Bytes this process has caused to be written to storage (``/proc/self/io``)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    return 0


def model_dir(name: str, work: Path) -> Path:
    """The model's directory: the shipped embedded model, or a random Qwen2.5-0.5B shape saved once."""
    from data.tiny_model import EMBEDDED_MODEL

    if name == "embedded":
        return EMBEDDED_MODEL
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rollout.tokens import load_tokenizer

    directory = work / name
    torch.manual_seed(0)
    config = Qwen2Config(**QWEN_05B, eos_token_id=2, bos_token_id=0, pad_token_id=0)
    Qwen2ForCausalLM(config).save_pretrained(directory)
    load_tokenizer(EMBEDDED_MODEL).save_pretrained(directory)  # (token ids in and out: any tokenizer does)
    return directory


@contextlib.contextmanager
def server(kind: str, directory: Path, logs: Path, device: str) -> Iterator[Any]:
    """One server of ``directory``: ``rallyrl serve`` (kind "serve", on ``device``) or a real engine."""
    from rollout.engines.launch import engine_server
    from rollout.serve.processes import serve_processes

    logs.mkdir(parents=True, exist_ok=True)
    if kind == "serve":
        flags = ("--device", device, "--set", "engine.dtype=float32", "--threads", str(min(os.cpu_count() or 2, 8)),
                 "--weights-dir", str(logs.parent))  # (the disk syncs' model directories are written there)
        with serve_processes(directory, logs, 1, *flags) as (process,):
            yield process
    else:
        with engine_server(kind, directory, logs) as process:
            yield process


async def time_syncs(url: str, weights: Any, transport: str, bucket_mb: int, repeats: int,
                     first_version: int, spy_on: int | None = None) -> dict[str, Any]:  # fmt: skip
    """``repeats`` syncs of ``weights`` into ``url`` by ``transport``: seconds and bytes written each."""
    from rollout.engines.config import WeightSyncConfig
    from rollout.engines.pool import EnginePool, PoolConfig
    from trainer.weight_check import logprob_gap

    backend = "gloo" if weights.device.type == "cuda" else "auto"  # (one GPU: no NCCL between two of its ranks)
    config = WeightSyncConfig(transport=transport, bucket_mb=bucket_mb, timeout_s=600, backend=backend)  # type: ignore[arg-type]
    async with EnginePool([url], PoolConfig(health_interval_s=5.0), "auto") as pool:
        (said,) = await pool.plan_weight_sync(config, weights, weights.device)
        seconds, written, saves = [], [], []
        for version in range(first_version, first_version + repeats):
            weights.version = version
            before, started = written_bytes(), time.perf_counter()
            if transport == "disk":  # (the push saves it; timed apart here: the trainer's half)
                await weights.saved(version)
                saves.append(time.perf_counter() - started)
            versions = await pool.push_weights(weights, version)
            seconds.append(time.perf_counter() - started)
            written.append(written_bytes() - before)
            assert versions == {url: version}, versions
        gap = await logprob_gap(pool, weights.policy.language_model(), weights.tokenizer, f"bench-{transport}")
        spied = await spy(pool, weights, first_version + repeats, spy_on) if spy_on is not None else None
    return {"said": said, "seconds": seconds, "written_bytes": written, "logprob_gap": gap,
            "save_s": statistics.median(saves) if saves else None, "server_profile": spied}  # fmt: skip


async def spy(pool: Any, weights: Any, version: int, pid: int) -> list[tuple[float, str]]:
    """One more sync with py-spy sampling the server's processes (``pid``'s and its children): where
    the server spent that sync."""
    import subprocess

    from benchmarks.waits import stop_process
    from benchmarks.weight_sync_wire import top_frames

    with tempfile.NamedTemporaryFile(suffix=".txt") as out:
        command = ["py-spy", "record", "--subprocesses", "--nonblocking", "-r", "200", "-f", "raw", "-o", out.name,
                   "-p", str(pid)]  # fmt: skip
        recorder = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            await asyncio.sleep(1.0)  # (py-spy attaching)
            weights.version = version
            await pool.push_weights(weights, version)
            recorder.send_signal(2)  # (py-spy writes its file on SIGINT)
            await asyncio.to_thread(recorder.wait, 30)
        finally:
            stop_process(recorder)
        return top_frames(Path(out.name).read_text())


def profile(weights: Any, bucket_mb: int, fanout_too: bool) -> dict[str, Any]:
    """The buckets over gloo to a bare receiver (the floor of a broadcast); the trainer filling every
    bucket flat alone (what NCCL and CUDA IPC buckets cost it); with ``fanout_too``, the buckets to two
    receivers in one group of three against two groups of two."""
    import torch

    from benchmarks.weight_sync_wire import gloo_fanout, gloo_floor
    from rollout.engines.weight_buckets import fill_bucket, plan_buckets

    plan = plan_buckets(weights.specs(), bucket_mb * 2**20)
    buffer = torch.empty(max(b.nbytes for b in plan), dtype=torch.uint8)
    started = time.perf_counter()
    for bucket in plan:
        fill_bucket(buffer, bucket, weights.tensor)
    fill = time.perf_counter() - started
    wire = gloo_floor([[spec.nbytes for spec in bucket.specs] for bucket in plan])
    fanout = gloo_fanout([bucket.nbytes for bucket in plan]) if fanout_too else {}
    return {"buckets": len(plan), "fill_s": fill, "wire_s": wire, "fanout": fanout}


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.weight_sync_wire import print_report
    from rollout.engines.launch import EngineNotInstalled, engine_python
    from rollout.tokens import load_tokenizer
    from trainer.weight_source import PolicyWeights

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rallyrl-weight-sync-") as tmp:
        work = Path(tmp)
        for name in args.models:
            directory = model_dir(name, work)
            lm = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).to(args.device).eval()
            weights = PolicyWeights.of_model(lm, load_tokenizer(directory), work / f"{name}-weights")
            size = sum(spec.nbytes for spec in weights.specs())
            parameters = sum(p.numel() for p in lm.parameters()) / 1e6
            print(f"\n{name}: {parameters:.1f} M parameters, {size / 2**20:,.0f} MiB sent per sync "
                  f"({len(weights.specs())} tensors)", flush=True)  # fmt: skip
            prof = profile(weights, args.bucket_mb, fanout_too=name != "embedded")
            version = 1
            for kind in args.servers:
                if kind != "serve":
                    try:
                        engine_python(kind)
                    except EngineNotInstalled as error:
                        print(f"  {kind}: skipped ({error})")
                        continue
                transports = [t for t in args.transports if not (kind == "vllm" and t == "tensor")]
                with server(kind, directory, work / "logs", args.device) as process:
                    for transport in transports:
                        spy_on = process.process.pid if args.profile and transport == "broadcast" else None
                        result = asyncio.run(time_syncs(process.url, weights, transport, args.bucket_mb,
                                                        args.repeats, version, spy_on))  # fmt: skip
                        version += args.repeats + 1
                        row = {"model": name, "server": kind, "transport": transport, "bytes": size, **result,
                               "profile": prof, "device": args.device}  # fmt: skip
                        rows.append(row)
                        print(f"  {kind:6} {transport:9} {statistics.median(result['seconds']):7.3f} s/sync "
                              f"({', '.join(f'{s:.3f}' for s in result['seconds'])}), wrote "
                              f"{statistics.median(result['written_bytes']) / 2**20:,.0f} MiB, "
                              f"logprob gap {result['logprob_gap']:.1e}", flush=True)  # fmt: skip
    print_report(rows)
    return rows


@stop_on_sigterm()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["embedded", "qwen2.5-0.5b"],
                        choices=["embedded", "qwen2.5-0.5b"])  # fmt: skip
    kinds = ["serve", "sglang", "vllm"]
    parser.add_argument("--servers", nargs="+", default=kinds, choices=kinds)
    parser.add_argument("--transports", nargs="+", default=["disk", "broadcast", "tensor"],
                        choices=["disk", "broadcast", "tensor"])  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--profile", action="store_true",
                        help="Sample each server with py-spy during one more broadcast sync (pip install py-spy).")
    parser.add_argument("--json", type=Path, help="Write the rows here.")
    args = parser.parse_args()
    if args.device == "cuda":
        args.servers = ["serve"]
    print(f"load average at start: {os.getloadavg()}")
    rows = run(args)
    print(f"load average at end: {os.getloadavg()}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
