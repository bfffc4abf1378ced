"""A weight push (``rollout/engines/weight_push.py``) as receivers see it, and the trainer's weights as
a push reads them (``trainer/weight_source.py``). Receivers here are doubles that record what they
get; ``tests/test_weight_sync_serve.py`` pushes into real ``rallyrl serve`` processes."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from data.tiny_model import EMBEDDED_MODEL
from rollout.engines.weight_buckets import Bucket, bucket_views
from rollout.engines.weight_push import Receiver, Tensors, push_buckets
from rollout.tokens import load_tokenizer
from trainer.config import LoRAConfig
from trainer.lora import apply_lora, merged_state_dict
from trainer.weight_source import PolicyWeights, tied_aliases


class Recording(Receiver):
    """A receiver that keeps what it is sent; ``fail_at`` (a bucket index) raises there, ``hang_at`` hangs."""

    transport = "broadcast"

    def __init__(self, url: str, dtype: torch.dtype = torch.float32, fail_at: int | None = None,
                 hang_at: int | None = None):  # fmt: skip
        super().__init__(url, dtype, torch.device("cpu"), 5.0)
        self.fail_at, self.hang_at = fail_at, hang_at
        self.calls: list[str] = []
        self.received: dict[str, torch.Tensor] = {}
        self.buffers: set[int] = set()
        self.abandoned = False

    async def begin(self, version: int, buckets: Sequence[Bucket]) -> None:
        self.calls.append(f"begin {version} ({len(buckets)} buckets)")

    async def send(self, bucket: Bucket, payload: torch.Tensor | Tensors, count: int, version: int) -> None:
        if bucket.index == self.fail_at:
            raise RuntimeError("connection reset by peer")
        if bucket.index == self.hang_at:
            await asyncio.sleep(3600)
        if isinstance(payload, Tensors):
            self.buffers.update(tensor.data_ptr() for _, tensor in payload)
            self.received.update({name: tensor.clone() for name, tensor in payload})
        else:
            self.buffers.add(payload.data_ptr())
            self.received.update({name: view.clone() for name, view in bucket_views(payload, bucket.specs)})
        self.calls.append(f"bucket {bucket.index + 1}/{count}")
        await asyncio.sleep(0.01)  # (the next bucket fills meanwhile)

    async def end(self, version: int) -> None:
        self.calls.append(f"end {version}")

    async def abandon(self) -> None:
        self.abandoned = True


@pytest.fixture(scope="module")
def embedded() -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL, dtype=torch.float32).eval()


@pytest.fixture
def weights(embedded, tmp_path) -> PolicyWeights:
    return PolicyWeights.of_model(embedded, load_tokenizer(EMBEDDED_MODEL), tmp_path / "weights")


async def test_every_receiver_gets_every_tensor_once_in_its_dtype_and_the_trainer_holds_two_buckets(weights, embedded):
    fp32, bf16 = Recording("http://a"), Recording("http://b", torch.bfloat16)
    failed = await push_buckets([fp32, bf16], weights, 3, bucket_bytes=2**20, timeout_s=5)
    assert failed == {}
    expected = {k: v for k, v in embedded.state_dict().items() if k != "lm_head.weight"}  # tied: sent once
    for receiver in (fp32, bf16):
        assert set(receiver.received) == set(expected)
        assert all(torch.equal(receiver.received[k], v.to(receiver.dtype)) for k, v in expected.items())
        count = len([c for c in receiver.calls if c.startswith("bucket")])
        assert count > 2 and receiver.calls[0] == f"begin 3 ({count} buckets)" and receiver.calls[-1] == "end 3"
        assert len(receiver.buffers) == 2  # two buffers for all the buckets: one travels, the next fills


async def test_a_receiver_that_takes_tensors_gets_the_trainers_own_memory_where_the_dtype_matches(weights, embedded):
    same, other = Recording("http://same"), Recording("http://bf16", torch.bfloat16)
    same.flat = other.flat = False  # (the gloo path: each tensor sent as it is)
    assert await push_buckets([same, other], weights, 2, bucket_bytes=2**20, timeout_s=5) == {}
    params = {t.data_ptr() for t in embedded.state_dict().values()}
    assert same.buffers <= params  # nothing copied
    assert not other.buffers & params  # converted copies
    state = embedded.state_dict()
    assert all(torch.equal(other.received[k], state[k].to(torch.bfloat16)) for k in other.received)


async def test_a_receiver_that_fails_drops_out_named_with_its_bucket_and_the_others_go_on(weights):
    good, bad = Recording("http://good"), Recording("http://bad", fail_at=1)
    failed = await push_buckets([good, bad], weights, 1, bucket_bytes=2**20, timeout_s=5)
    assert list(failed) == [bad] and bad.abandoned and not good.abandoned
    assert failed[bad].startswith("http://bad: weight sync (broadcast), bucket 2/")
    assert failed[bad].endswith("MiB, float32): connection reset by peer")
    assert good.calls[-1] == "end 1" and "end 1" not in bad.calls


async def test_a_receiver_that_misses_its_deadline_is_named_and_nothing_waits_longer(weights):
    slow = Recording("http://slow", hang_at=0)
    started = asyncio.get_running_loop().time()
    failed = await push_buckets([slow], weights, 1, bucket_bytes=2**20, timeout_s=0.5)
    assert asyncio.get_running_loop().time() - started < 3
    assert "bucket 1/" in failed[slow] and failed[slow].endswith("no answer within 0.5 s")


def test_a_tied_head_travels_once_under_the_embeddings_name(embedded):
    assert tied_aliases(embedded) == {"lm_head.weight": "model.embed_tokens.weight"}
    untied = AutoModelForCausalLM.from_config(embedded.config.__class__(**{**embedded.config.to_dict(),
                                                                           "tie_word_embeddings": False}))  # fmt: skip
    assert tied_aliases(untied) == {}


def test_a_lora_policys_weights_are_merged_one_tensor_at_a_time_as_the_whole_merge_gives_them(tmp_path):
    lm = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL, dtype=torch.float32)
    peft = apply_lora(lm, LoRAConfig(rank=4))
    with torch.no_grad():
        for name, parameter in lm.named_parameters():
            if "lora_B" in name:
                parameter.normal_()  # (a fresh adapter's B is zero: nothing to merge)

    class LoRAPolicy:  # what PolicyWeights reads of trainer.policy.Policy
        sharded = False

        def __init__(self):
            self.peft = peft

        def language_model(self):
            return lm

        def state_dict(self):
            return merged_state_dict(lm)

    weights = PolicyWeights(LoRAPolicy(), None, tmp_path)
    whole = merged_state_dict(lm)
    names = [spec.name for spec in weights.specs()]
    assert names == [k for k in whole if k != "lm_head.weight"] and not any("lora" in n for n in names)
    assert all(torch.equal(weights.tensor(name), whole[name]) for name in names)
    assert not torch.equal(whole["model.layers.0.self_attn.q_proj.weight"],
                           lm.state_dict()["model.layers.0.self_attn.q_proj.base_layer.weight"])  # fmt: skip


async def test_the_weights_are_saved_once_per_version_for_the_servers_that_load_from_disk(weights):
    first = await weights.saved(1)
    again = await weights.saved(1)
    second = await weights.saved(2)
    assert first == again != second and Path(second).name == "v000002"
    assert (Path(second) / "model.safetensors").is_file() and (Path(second) / "tokenizer.json").is_file()
