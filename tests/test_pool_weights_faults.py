"""A pool's weights when things go wrong on the trainer's side (``rollout/engines/pool_sync.py``,
``trainer/weight_source.py``): a server brought back while an optimizer step wants the weights, a
sharded (FSDP) trainer whose full weights exist only during a sync, a bucket the trainer cannot fill,
a check of the health loop that raises, and a model too large for a server's limits, refused at plan
time. The servers are doubles of a server client; ``tests/test_weight_sync_serve.py`` runs real ones."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from data.tiny_model import EMBEDDED_MODEL
from rollout.engines.base import EngineError
from rollout.engines.config import WeightSyncConfig
from rollout.engines.pool import EnginePool, PoolConfig, _Server
from rollout.engines.pool_sync import PoolWeights
from rollout.engines.sglang_weights import sglang_weight_support
from rollout.engines.weight_buckets import Bucket, WeightSpec
from rollout.engines.weight_plan import ServerWeights, WeightSyncError, check_limits
from rollout.engines.weight_push import Receiver, Tensors
from rollout.tokens import load_tokenizer
from trainer.weight_source import PolicyWeights, _Plain


class Gloo(Receiver):
    """Takes each bucket's tensors from the trainer's own memory, as a gloo broadcast does: read only
    once ``proceed`` is set after ``entered`` (the broadcast still under way)."""

    transport = "broadcast"
    flat = False

    def __init__(self, engine: Engine):
        super().__init__(engine.url, torch.float32, torch.device("cpu"), 5.0)
        self.engine = engine
        self.entered = asyncio.Event()
        self.proceed = asyncio.Event()
        self.proceed.set()
        self.received: dict[str, torch.Tensor] = {}
        self.calls: list[str] = []

    async def begin(self, version: int, buckets: Sequence[Bucket]) -> None:
        self.calls.append("begin")

    async def send(self, bucket: Bucket, payload: Any, count: int, version: int) -> None:
        assert isinstance(payload, Tensors)
        self.entered.set()
        await self.proceed.wait()
        self.received.update({name: tensor.clone() for name, tensor in payload})

    async def end(self, version: int) -> None:
        self.engine.version = version


class Engine:
    """A server client double: one update at a time (as vLLM's client holds a lock from pause to
    continue), its version, its weight support."""

    def __init__(self, url: str, support: ServerWeights | None = None):
        self.url = url
        self.version = 0
        self.lock = asyncio.Lock()
        self.continued: list[bool] = []
        self.support = support or ServerWeights(url=url, kind="rallyrl serve", device="cpu", dtype=torch.float32,
                                                local=True, broadcast=None, tensor=None, model_config=None)  # fmt: skip
        self.receiver = Gloo(self)

    async def weight_support(self) -> ServerWeights:
        return self.support

    def weight_receiver(self, *args: Any) -> Receiver:
        return self.receiver

    async def pause_for_update(self) -> None:
        async with asyncio.timeout(5):  # (a lock left held by the last update would hang here)
            await self.lock.acquire()

    async def continue_after_update(self, complete: bool) -> None:
        self.continued.append(complete)
        self.lock.release()

    async def get_weight_version(self) -> int:
        return self.version

    async def health(self) -> bool:
        return True


@pytest.fixture(scope="module")
def embedded() -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL, dtype=torch.float32).eval()


@pytest.fixture
def model(embedded) -> torch.nn.Module:
    import copy

    return copy.deepcopy(embedded)


def out_server(url: str = "http://back") -> _Server:
    server = _Server(0, Engine(url))  # type: ignore[arg-type]
    return server


async def planned(pool: PoolWeights, server: _Server, weights: Any, version: int) -> None:
    await pool.plan([server], WeightSyncConfig(bucket_mb=1), weights, torch.device("cpu"))
    assert await pool.push([server], weights, version, lambda s, reason: None) == {server.url: version}
    server.healthy, server.sync.version = False, None  # out, and back: it may have restarted


async def test_a_server_brought_back_holds_the_weights_so_no_optimizer_step_changes_them_under_the_push(
    model, tmp_path
):
    """Finding 9, by a fixed interleaving: the push has begun sending the trainer's own tensors when
    the trainer's next optimizer step is asked for; the step waits for the push to end."""
    weights = PolicyWeights.of_model(model, load_tokenizer(EMBEDDED_MODEL), tmp_path / "weights")
    pool, server = PoolWeights(), out_server()
    weights.version = 1
    await planned(pool, server, weights, 1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    receiver = server.engine.receiver
    receiver.entered.clear()
    receiver.proceed.clear()
    order: list[str] = []

    async def optimizer_step() -> None:
        async with weights.changing():
            order.append("step")
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.add_(1.0)

    back = asyncio.ensure_future(pool.bring_back(server))
    await receiver.entered.wait()
    step = asyncio.ensure_future(optimizer_step())
    for _ in range(20):  # (the step gets every chance to run now)
        await asyncio.sleep(0.01)
    order.append("push still under way")
    receiver.proceed.set()
    assert await back and (await step) is None
    assert order == ["push still under way", "step"]
    assert all(torch.equal(receiver.received[k], before[k]) for k in receiver.received)
    assert weights.version is None  # (until the sync names the new one)


class Sharded(_Plain):
    """A policy whose full weights are gathered only for a sync, as under FSDP (``policy.Policy``)."""

    sharded = True


async def test_under_fsdp_a_server_that_comes_back_waits_for_the_next_sync_and_that_sync_takes_it(model, tmp_path):
    """Finding 7: between syncs a sharded trainer has no full weights to push (its parameters are
    shards), so a server back then is synced by the next push, which takes it although it is out."""
    weights = PolicyWeights(Sharded(model), load_tokenizer(EMBEDDED_MODEL), tmp_path / "weights")
    pool, server = PoolWeights(), out_server()
    weights.gather()
    weights.version = 1
    await planned(pool, server, weights, 1)
    weights.release()
    receiver = server.engine.receiver
    receiver.calls.clear()
    assert not await pool.bring_back(server)
    assert server.sync.waiting and receiver.calls == []  # nothing read from the shards
    weights.gather()
    weights.version = 2
    assert await pool.push([server], weights, 2, lambda s, reason: None) == {server.url: 2}
    weights.release()
    assert not server.sync.waiting and await pool.bring_back(server)


class Unreadable(PolicyWeights):
    """Weights one of which cannot be read (a DTensor shard, an OOM copying it)."""

    def tensor(self, name: str) -> torch.Tensor:
        if name.endswith("layers.0.mlp.up_proj.weight"):
            raise TypeError("aten.copy_.default: got mixed torch.Tensor and DTensor")
        return super().tensor(name)


async def test_a_bucket_the_trainer_cannot_fill_fails_the_servers_named_and_leaves_none_locked(model, tmp_path):
    """Finding 7: the error no longer escapes the push (a server left paused, the vLLM client's lock
    held): each server fails naming the bucket, and the next update of the same client goes through."""
    weights = Unreadable.of_model(model, load_tokenizer(EMBEDDED_MODEL), tmp_path / "weights")
    pool = PoolWeights()
    servers = [_Server(0, Engine("http://a")), _Server(1, Engine("http://b"))]  # type: ignore[arg-type]
    await pool.plan(servers, WeightSyncConfig(bucket_mb=1), weights, torch.device("cpu"))
    with pytest.raises(EngineError, match="failed on every server") as raised:
        await pool.push(servers, weights, 1, lambda s, reason: None)
    assert "filling bucket" in str(raised.value) and "got mixed torch.Tensor and DTensor" in str(raised.value)
    assert [s.engine.continued for s in servers] == [[False], [False]]  # (kept paused: half updated)
    weights.tensor = PolicyWeights.tensor.__get__(weights)  # type: ignore[method-assign]
    assert await pool.push(servers, weights, 2, lambda s, reason: None) == {"http://a": 2, "http://b": 2}


async def test_the_health_loop_goes_on_after_a_check_raises():
    pool = EnginePool(["http://a"], PoolConfig(health_interval_s=0.01))
    pool.servers = [_Server(0, Engine("http://a"))]  # type: ignore[arg-type]
    checks = 0

    async def check(server: Any) -> None:
        nonlocal checks
        checks += 1
        if checks == 1:
            raise TypeError("a bug of ours")

    pool._check = check  # type: ignore[method-assign]
    loop = asyncio.ensure_future(pool._health_loop())
    for _ in range(500):
        await asyncio.sleep(0.01)
        if checks >= 3:
            break
    loop.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await loop
    assert checks >= 3


def server(**limits: int) -> ServerWeights:
    return ServerWeights(url="http://s", kind="rallyrl serve", device="cpu", dtype=torch.bfloat16, local=True,
                         broadcast=None, tensor=None, model_config=None, **limits)  # fmt: skip


def test_a_tensor_over_a_servers_limit_is_refused_at_plan_time_naming_it():
    """Finding 10: once, before the first step, instead of a failure at every step."""
    specs = [WeightSpec("model.embed_tokens.weight", torch.float32, (1024, 1024)), WeightSpec("b", torch.float32, (4,))]
    check_limits(specs, server(max_bucket_bytes=2 * 2**20), "broadcast", 2**20)  # bfloat16 on the server: 2 MiB
    with pytest.raises(WeightSyncError, match=r"at most 1 MiB per broadcast bucket, and model.embed_tokens.weight "
                                              r"alone is 2 MiB: use weight_sync.transport disk"):  # fmt: skip
        check_limits(specs, server(max_bucket_bytes=2**20), "broadcast", 2**20)
    with pytest.raises(WeightSyncError, match=r"weight_sync.bucket_mb 8 is over it \(set it to 4 or less\)"):
        check_limits(specs, server(max_bucket_bytes=4 * 2**20), "broadcast", 8 * 2**20)
    with pytest.raises(WeightSyncError, match=r"per tensor body: weight_sync.bucket_mb 8 is over it"):
        check_limits(specs, server(max_body_bytes=8 * 2**20), "tensor", 8 * 2**20)  # (base64: 4/3 of the bytes)
    check_limits(specs, server(), "tensor", 2**40)  # (no limit stated: SGLang, vLLM)


async def test_the_plan_reads_rallyrl_serves_limits_and_refuses_before_the_first_push(model, tmp_path):
    class Client:
        url, weight_version = "http://s", 0

        async def get_server_info(self) -> dict[str, Any]:
            return {"version": "rallyrl 0.1.0", "device": "cpu", "dtype": "float32", "model_path": "/nowhere",
                    "weight_limits": {"max_bucket_bytes": 2**16, "max_tensor_body_bytes": 2**30}}  # fmt: skip

    support = await sglang_weight_support(Client(), local=True)  # type: ignore[arg-type]
    assert (support.max_bucket_bytes, support.max_body_bytes) == (2**16, 2**30)
    weights = PolicyWeights.of_model(model, load_tokenizer(EMBEDDED_MODEL), tmp_path / "weights")
    pool, one = PoolWeights(), _Server(0, Engine("http://s", support))  # type: ignore[arg-type]
    with pytest.raises(WeightSyncError, match=r"at most 0 MiB per broadcast bucket, and model\.embed_tokens\.weight"):
        await pool.plan([one], WeightSyncConfig(transport="broadcast"), weights, torch.device("cpu"))


async def test_a_server_whose_push_failed_midway_loads_the_saved_weights_at_once(model, tmp_path):
    """Finding 6, against a real rallyrl serve on loopback: the failed push ends its session on the
    server (which keeps its half-new weights from serving), so the documented fallback, a load of the
    saved weights, is answered at once; on the code before it waited behind the open session."""
    from rollout.engines.local import LocalEngine, LocalEngineConfig
    from tests.conftest import serving

    weights = PolicyWeights.of_model(model, load_tokenizer(EMBEDDED_MODEL), tmp_path / "weights")
    engine = LocalEngine.from_pretrained(EMBEDDED_MODEL, LocalEngineConfig(max_batch_size=4))
    async with engine, serving(engine) as url, EnginePool([url], PoolConfig(health_interval_s=3600)) as pool:
        await pool.plan_weight_sync(WeightSyncConfig(transport="tensor", bucket_mb=1, timeout_s=10), weights,
                                    torch.device("cpu"))  # fmt: skip
        (one,) = pool.servers
        receiver = one.sync.receiver
        send = receiver.send

        async def reset_at_the_second_bucket(bucket: Bucket, payload: Any, count: int, version: int) -> None:
            if bucket.index == 1:
                raise EngineError("connection reset by peer")
            await send(bucket, payload, count, version)

        receiver.send = reset_at_the_second_bucket  # type: ignore[method-assign]
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.mul_(1.01)
        weights.version = 1
        with pytest.raises(EngineError, match=r"bucket 2/.*connection reset by peer"):
            await pool.push_weights(weights, 1)
        assert not one.healthy
        async with asyncio.timeout(60):  # (the fallback: its own push fails again, then the saved weights)
            assert await pool.weights.bring_back(one)
        assert await one.engine.get_weight_version() == 1
        assert torch.equal(engine.model.state_dict()["model.norm.weight"], model.state_dict()["model.norm.weight"])


async def test_a_failure_of_the_trainers_own_goes_up_and_leaves_no_server_locked(model, tmp_path):
    """Finding 7: the trainer's own failure (here its weights unreadable as a whole) is the run's
    error, as a full disk is; each paused server is let go (kept paused: it may be half updated)."""
    weights = PolicyWeights.of_model(model, load_tokenizer(EMBEDDED_MODEL), tmp_path / "weights")
    pool, one = PoolWeights(), _Server(0, Engine("http://a"))  # type: ignore[arg-type]
    await pool.plan([one], WeightSyncConfig(bucket_mb=1), weights, torch.device("cpu"))

    def unreadable() -> list[WeightSpec]:
        raise MemoryError("out of memory reading the weights")

    weights.specs = unreadable  # type: ignore[method-assign]
    with pytest.raises(MemoryError):
        await pool.push([one], weights, 1, lambda s, reason: None)
    assert one.engine.continued == [False] and not one.engine.lock.locked()
