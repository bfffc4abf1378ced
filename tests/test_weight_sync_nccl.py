"""The NCCL path of a weight push, on a CPU: the collectives replaced by a stand-in that behaves as
NCCL between two GPUs does (``tests/nccl_standin.py``: a lazily made communicator whose first
collective returns only once the server has entered it, a broadcast to a dead peer that never ends,
a device synchronize stuck behind it). The real receivers (``SGLangBroadcast``, ``VLLMBroadcast``),
the real push (``push_buckets``), the trainer's real weights; the servers are doubles that enter the
stand-in's collectives as a server's ranks would. Gloo into real servers:
``tests/test_weight_sync_serve.py``, ``tests/real_engines/``."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from data.tiny_model import EMBEDDED_MODEL
from rollout.engines import weight_collectives
from rollout.engines.sglang_weights import SGLangBroadcast
from rollout.engines.vllm_weights import VLLMBroadcast
from rollout.engines.weight_push import open_group, push_buckets
from rollout.tokens import load_tokenizer
from tests.nccl_standin import LazyNCCL, StandInServer, StandInVLLM
from trainer.weight_source import PolicyWeights

BUCKET = 2**20


@pytest.fixture(scope="module")
def embedded() -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL, dtype=torch.float32).eval()


@pytest.fixture
def weights(embedded, tmp_path) -> PolicyWeights:
    return PolicyWeights.of_model(embedded, load_tokenizer(EMBEDDED_MODEL), tmp_path / "weights")


@pytest.fixture
def nccl(monkeypatch) -> LazyNCCL:
    standin = LazyNCCL(cap_s=10)
    standin.loop_thread = threading.get_ident()  # (pytest-asyncio runs the test's loop on this thread)
    monkeypatch.setattr(weight_collectives, "active", standin)
    return standin


def expected(embedded: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in embedded.state_dict().items() if k != "lm_head.weight"}  # (tied: sent once)


def sglang(server: StandInServer, timeout_s: float) -> SGLangBroadcast:
    return SGLangBroadcast(server, server.support(), torch.float32, "nccl", "127.0.0.1", timeout_s)  # type: ignore[arg-type]


async def test_the_first_sync_over_nccl_reaches_the_server_and_never_holds_the_event_loop(nccl, weights, embedded):
    """Finding 1: the server's call went out first, the collective off the loop's thread; on the code
    before, the first broadcast blocked the loop until the stand-in's cap (the call never left)."""
    server = StandInServer("http://gpu-server:30000", nccl)
    receiver = sglang(server, timeout_s=30)
    assert receiver.flat and receiver.describe() == "broadcast (nccl)"
    ticks = 0

    async def heartbeat() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    beating = asyncio.ensure_future(heartbeat())
    try:
        failed = await push_buckets([receiver], weights, 1, BUCKET, timeout_s=30)
    finally:
        beating.cancel()
    assert failed == {}
    want = expected(embedded)
    assert set(server.received) == set(want) and all(torch.equal(server.received[k], v) for k, v in want.items())
    assert server.version == "1" and ticks > 0
    assert server.calls[0] == "/init_weights_update_group" and server.calls[-1] == "/end_weight_update"


async def test_vllms_first_sync_over_nccl_reaches_its_workers(nccl, weights, embedded):
    server = StandInVLLM("http://vllm:8000", nccl)
    receiver = VLLMBroadcast(server, server.support(), torch.float32, "nccl", "127.0.0.1", 30, {})  # type: ignore[arg-type]
    assert await push_buckets([receiver], weights, 4, BUCKET, timeout_s=30) == {}
    want = expected(embedded)
    assert set(server.received) == set(want) and all(torch.equal(server.received[k], v) for k, v in want.items())
    assert server.version == "4"


async def test_a_server_that_dies_mid_broadcast_fails_alone_within_the_deadline_and_its_group_is_aborted(
    nccl, weights, embedded
):
    """Finding 2: its broadcast never ends (NCCL has no deadline); the push does not wait for it past
    the deadline, the other server gets everything, and the dead one's group is aborted, which ends
    the broadcast still waiting on it."""
    good, dead = StandInServer("http://good", nccl), StandInServer("http://dead", nccl, die_at=1)
    receivers = [sglang(good, 2), sglang(dead, 2)]
    started = asyncio.get_running_loop().time()
    failed = await push_buckets(receivers, weights, 1, BUCKET, timeout_s=2)
    assert asyncio.get_running_loop().time() - started < 20  # (the deadline, 2 s, and the leaving; no hang)
    assert list(failed) == [receivers[1]] and "bucket 2/" in failed[receivers[1]]
    assert failed[receivers[1]].endswith("no answer within 2 s")
    want = expected(embedded)
    assert all(torch.equal(good.received[k], v) for k, v in want.items()) and good.version == "1"
    (dead_group,) = [g for g in nccl.groups.values() if g.name != receivers[0].group_name]
    assert dead_group.aborted and all(work.is_completed() for work in dead_group.pending)
    assert receivers[1].group is None and "/end_weight_update" in dead.calls  # left, and its session ended


async def test_a_fill_that_never_becomes_ready_fails_the_push_within_the_deadline_not_the_trainer(nccl, weights):
    """Finding 2, the fill: a bucket's bytes waited for behind a stuck collective (a device-wide
    synchronize) is a wait under the deadline too."""
    nccl.block_fill_at = 1
    servers = [StandInServer("http://a", nccl), StandInServer("http://b", nccl)]
    receivers = [sglang(server, 2) for server in servers]
    started = asyncio.get_running_loop().time()
    failed = await push_buckets(receivers, weights, 1, BUCKET, timeout_s=2)
    assert asyncio.get_running_loop().time() - started < 20
    assert set(failed) == set(receivers)
    assert all("filling bucket 2/" in reason and reason.endswith("no bucket within 2 s") for reason in failed.values())


async def test_a_cancelled_group_opening_leaves_both_sides(nccl):
    """Finding 10: cancelled while the server's join hangs, the trainer's side is destroyed once made
    and the server is asked to leave."""
    left: list[str] = []
    joining = asyncio.Event()

    async def join(address: str, port: int, name: str) -> None:
        joining.set()
        await asyncio.sleep(3600)

    async def leave(name: str) -> None:
        left.append(name)

    from rollout.engines.daemon_threads import DaemonThreads

    opening = asyncio.ensure_future(open_group("http://s", "nccl", "127.0.0.1", 1, 30, join, leave,
                                               DaemonThreads(1, "test")))  # fmt: skip
    await joining.wait()
    await asyncio.to_thread(nccl.made.wait, 10)
    opening.cancel()
    with pytest.raises(asyncio.CancelledError):
        await opening
    (group,) = nccl.groups.values()
    for _ in range(200):  # (destroyed on a thread of its own)
        if group.aborted:
            break
        await asyncio.sleep(0.01)
    assert group.aborted and left == [group.name]


async def test_the_join_gives_rallyrl_serve_the_syncs_deadline_and_sglang_none(nccl, weights):
    """Finding 10: rallyrl serve's side of a join that fails ends at the sync's deadline (at most its
    300 s), not torch's 30 minutes; SGLang's join takes no deadline (its API has none)."""
    ours = StandInServer("http://serve", nccl, kind="rallyrl serve")
    theirs = StandInServer("http://sglang", nccl)
    receivers = [sglang(ours, 30), sglang(theirs, 30)]
    receivers[0].timeout_s = 900  # (above what rallyrl serve takes: capped)
    assert await push_buckets(receivers, weights, 1, BUCKET, timeout_s=30) == {}
    assert ours.joins[0]["timeout_s"] == 300 and "timeout_s" not in theirs.joins[0]
    assert ours.joins[0]["rank_offset"] == 1 and ours.joins[0]["world_size"] == 2
