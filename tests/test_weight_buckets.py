"""Weights in flattened buckets (``rollout/engines/weight_buckets.py``) and the wire format of
``/update_weights_from_tensor`` (``rollout/engines/tensor_payload.py``)."""

from __future__ import annotations

import base64
import os
import pickle

import orjson
import pytest
import torch

from rollout.engines.tensor_payload import TensorPayloadError, load_named_tensors, payload_chunks, pickle_named_tensors
from rollout.engines.weight_buckets import (
    WeightSpec,
    bucket_views,
    fill_bucket,
    plan_buckets,
    read_bucket_specs,
)


def spec(name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> WeightSpec:
    return WeightSpec(name, dtype, shape)


def test_buckets_hold_one_dtype_each_and_no_more_than_the_limit_in_the_models_order():
    specs = [spec("a", (4,)), spec("b", (8,), torch.bfloat16), spec("c", (4,)), spec("d", (2,)), spec("e", (8,))]
    plan = plan_buckets(specs, bucket_bytes=32)  # 32 bytes: eight float32 values
    assert [[s.name for s in bucket.specs] for bucket in plan] == [["a", "c"], ["d"], ["e"], ["b"]]
    assert [bucket.index for bucket in plan] == [0, 1, 2, 3]
    assert all(len({s.dtype for s in bucket.specs}) == 1 for bucket in plan)
    assert all(bucket.nbytes <= 32 for bucket in plan)


def test_a_tensor_larger_than_a_bucket_travels_alone():
    plan = plan_buckets([spec("small", (2,)), spec("huge", (100,)), spec("tail", (2,))], bucket_bytes=16)
    assert [[s.name for s in b.specs] for b in plan] == [["small"], ["huge"], ["tail"]]
    assert plan[1].nbytes == 400


def test_a_filled_bucket_cuts_back_into_the_same_tensors_converted_to_its_dtype():
    tensors = {"w": torch.randn(3, 5), "b": torch.randn(7), "n": torch.randn(2, 2, 2)}
    (bucket,) = plan_buckets([spec(n, tuple(t.shape), torch.bfloat16) for n, t in tensors.items()], 2**20)
    flat = fill_bucket(torch.empty(2**20, dtype=torch.uint8), bucket, tensors.__getitem__)
    assert flat.numel() == bucket.nbytes == sum(t.numel() * 2 for t in tensors.values())
    for name, view in bucket_views(flat, bucket.specs):
        assert view.dtype == torch.bfloat16 and torch.equal(view, tensors[name].to(torch.bfloat16))
    assert bucket.payload() == {"names": ["w", "b", "n"], "dtypes": ["bfloat16"] * 3,
                                "shapes": [[3, 5], [7], [2, 2, 2]]}  # fmt: skip


def test_filling_a_bucket_refuses_a_tensor_of_another_shape():
    (bucket,) = plan_buckets([spec("w", (3,))], 1024)
    with pytest.raises(ValueError, match=r"w: shape \(4,\) is not the planned \(3,\)"):
        fill_bucket(torch.empty(1024, dtype=torch.uint8), bucket, lambda name: torch.zeros(4))


@pytest.mark.parametrize(
    ("names", "dtypes", "shapes", "limit", "message"),
    [
        (["a"], ["float32", "float32"], [[1], [1]], None, "non-empty lists of one length"),
        (["a"], ["float12"], [[1]], None, r"dtypes\[0\] \(a\): unknown dtype 'float12'"),
        (["a"], ["float32"], [[-1]], None, r"shapes\[0\] \(a\) must be a list of sizes"),
        (["a", "b"], ["bfloat16", "float32"], [[1], [1]], None, "b would start at byte 2, not aligned"),
        (["a"], ["float32"], [[1024, 1024]], 2**20, "4.0 MiB in one bucket is over this server's 1 MiB limit"),
        ("a", ["float32"], [[1]], None, "must be lists"),
    ],
)
def test_a_bucket_description_that_does_not_add_up_is_refused_naming_the_field(names, dtypes, shapes, limit, message):
    with pytest.raises(ValueError, match=message):
        read_bucket_specs(names, dtypes, shapes, "update", limit)


def test_a_tensor_payload_goes_by_value_and_comes_back_equal():
    named = [("w", torch.randn(4, 3)), ("h", torch.randn(5).to(torch.bfloat16))]
    fields = {"load_format": None, "flush_cache": True, "weight_version": "3"}
    body = orjson.loads(b"".join(payload_chunks(pickle_named_tensors(named), 2, fields)))
    assert {k: body[k] for k in fields} == fields and len(body["serialized_named_tensors"]) == 2
    loaded = load_named_tensors(body["serialized_named_tensors"][1], "payload")
    assert [n for n, _ in loaded] == ["w", "h"]
    assert all(torch.equal(a, b) and a.dtype == b.dtype for (_, a), (_, b) in zip(loaded, named, strict=True))


def test_views_of_one_bucket_are_pickled_each_with_its_own_bytes_only():
    flat = torch.zeros(4096, dtype=torch.uint8)
    views = [("a", flat[:64].view(torch.float32)), ("b", flat[64:128].view(torch.float32))]
    assert len(pickle_named_tensors(views)) < 2048  # not the whole 4 KiB storage per view


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (base64.b64encode(pickle.dumps([("w", Evil())])).decode(), "may not name posix.system"),
        ("not base64!", "not valid base64"),
        (base64.b64encode(b"\x80\x04garbage").decode(), "not a pickled list of named tensors"),
        (base64.b64encode(pickle.dumps({"w": 1})).decode(), "expected a list of"),
        (7, "expected a base64 string"),
    ],
)
def test_a_payload_that_is_not_named_tensors_is_refused_without_running_anything(payload, message):
    with pytest.raises(TensorPayloadError, match=message):
        load_named_tensors(payload, "serialized_named_tensors[0]")
