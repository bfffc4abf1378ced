"""Which transport each server's weight syncs take (``rollout/engines/weight_plan.py``), and the check
that a server's model takes the trainer's weights, before the first rollout."""

from __future__ import annotations

import json

import pytest
import torch

from data.tiny_model import EMBEDDED_MODEL
from rollout.engines.config import WeightSyncConfig
from rollout.engines.weight_buckets import WeightSpec
from rollout.engines.weight_plan import (
    ServerWeights,
    WeightSyncError,
    backend_for,
    check_shapes,
    choose_transport,
    expected_specs,
    sglang_dtype,
)

CPU, GPU = torch.device("cpu"), torch.device("cuda")
EMBEDDED_CONFIG = json.loads((EMBEDDED_MODEL / "config.json").read_text())


def server(device: str = "cpu", local: bool = True, broadcast: str | None = None, tensor: str | None = None,
           model_config: dict | None = None) -> ServerWeights:  # fmt: skip
    return ServerWeights("http://h:1", "SGLang 0.5.23", device, torch.float32, local, broadcast, tensor, model_config)


@pytest.mark.parametrize(
    ("support", "trainer", "expected"),
    [
        (server("cuda"), GPU, "tensor"),  # one GPU machine: CUDA IPC, nothing copied between processes
        (server("cuda", local=False), GPU, "broadcast"),
        (server("cpu"), CPU, "broadcast"),  # by value through HTTP is slower than gloo on loopback
        (server("cuda"), CPU, "broadcast"),
        (server("cpu", broadcast="no extension"), CPU, "disk"),
    ],
)
def test_auto_takes_cuda_ipc_then_a_broadcast_then_disk(support, trainer, expected):
    assert choose_transport(support, WeightSyncConfig(), trainer) == expected


@pytest.mark.parametrize(
    ("transport", "support", "message"),
    [
        ("broadcast", server(broadcast="restart it with --worker-extension-cls X"), "--worker-extension-cls X"),
        ("tensor", server(local=False), "is not on this machine"),
        ("tensor", server(tensor="vLLM takes a broadcast"), "vLLM takes a broadcast"),
    ],
)
def test_a_transport_the_server_cannot_take_is_an_error_naming_the_fix(transport, support, message):
    with pytest.raises(WeightSyncError, match=message) as error:
        choose_transport(support, WeightSyncConfig(transport=transport), CPU)
    assert "(or set weight_sync.transport: auto)" in str(error.value)


def test_asked_for_disk_or_tensor_it_gets_it_where_it_can():
    assert choose_transport(server(), WeightSyncConfig(transport="disk"), CPU) == "disk"
    assert choose_transport(server(), WeightSyncConfig(transport="tensor"), CPU) == "tensor"


def test_the_broadcast_backend_is_nccl_between_gpus_and_gloo_otherwise():
    assert backend_for(server("cuda"), WeightSyncConfig(), GPU) == "nccl"
    assert backend_for(server("cuda"), WeightSyncConfig(), CPU) == "gloo"
    assert backend_for(server("cpu"), WeightSyncConfig(), GPU) == "gloo"
    assert backend_for(server("cuda"), WeightSyncConfig(backend="gloo"), GPU) == "gloo"


def embedded_specs() -> list[WeightSpec]:
    return [WeightSpec(n, torch.float32, s) for n, s in expected_specs(EMBEDDED_CONFIG).items()]


def test_a_tied_head_is_expected_once_under_the_embeddings_name():
    shapes = expected_specs(EMBEDDED_CONFIG)
    assert "lm_head.weight" not in shapes and shapes["model.embed_tokens.weight"] == (105, 256)
    untied = expected_specs({**EMBEDDED_CONFIG, "tie_word_embeddings": False})
    assert untied["lm_head.weight"] == (105, 256)


def test_the_same_model_passes_and_a_server_whose_config_is_unknown_is_not_checked_here():
    check_shapes(embedded_specs(), server(model_config=EMBEDDED_CONFIG))
    check_shapes([WeightSpec("anything", torch.float32, (1,))], server(model_config=None))


@pytest.mark.parametrize(
    ("theirs", "message"),
    [
        ({"hidden_size": 128}, r"model.embed_tokens.weight is \[105, 128\] there and \[105, 256\] in the trainer"),
        ({"num_hidden_layers": 3}, r"it has no parameter model.layers.3.self_attn.q_proj.weight \(the trainer.s is \["),
        ({"num_hidden_layers": 5}, "the trainer has no model.layers.4.input_layernorm.weight .* and 11 more"),
        ({"tie_word_embeddings": False}, r"the trainer has no lm_head.weight \(shape \[105, 256\] there\)"),
    ],
)
def test_a_server_model_of_another_shape_is_refused_naming_the_parameter(theirs, message):
    config = {key: value for key, value in EMBEDDED_CONFIG.items() if key != "layer_types"}
    with pytest.raises(WeightSyncError, match=message):
        check_shapes(embedded_specs(), server(model_config={**config, **theirs}))


def test_a_server_config_this_transformers_cannot_build_is_not_checked_here(caplog):
    check_shapes(embedded_specs(), server(model_config={"model_type": "no-such-architecture"}))
    assert "cannot check" in caplog.text


def test_sglangs_dtype_auto_is_decided_as_sglang_decides_it():
    assert sglang_dtype("float32", None) == torch.float32
    assert sglang_dtype("auto", {"model_type": "qwen2", "torch_dtype": "bfloat16"}) == torch.bfloat16
    assert sglang_dtype("auto", {"model_type": "qwen2", "dtype": "float32"}) == torch.float16
    assert sglang_dtype("auto", {"model_type": "gemma2", "dtype": "float32"}) == torch.bfloat16
    assert sglang_dtype("auto", None) is None


def test_weight_sync_settings_are_checked():
    with pytest.raises(ValueError, match="bucket_mb must be >= 1"):
        WeightSyncConfig(bucket_mb=0)
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        WeightSyncConfig(timeout_s=0)
    assert WeightSyncConfig(bucket_mb=2).bucket_bytes == 2 * 2**20


async def test_a_vllm_server_without_the_worker_extension_syncs_through_disk_and_says_how_to_broadcast():
    from rollout.engines.vllm_http import VLLMHTTPEngine
    from tests.test_vllm_http import FakeVLLM

    for dev, fix in ((True, "runs without rallyrl's worker extension"), (False, "VLLM_SERVER_DEV_MODE=1")):
        fake = FakeVLLM(dev=dev)
        async with fake.running() as url, VLLMHTTPEngine(url) as engine:
            support = await engine.weight_support()
        assert fix in support.broadcast
        assert "--worker-extension-cls rollout.engines.vllm_worker.WeightReceiver" in support.broadcast
        assert choose_transport(support, WeightSyncConfig(), CPU) == "disk"
        with pytest.raises(WeightSyncError, match="worker-extension-cls"):
            choose_transport(support, WeightSyncConfig(transport="broadcast"), CPU)


async def test_a_vllm_server_with_the_worker_extension_takes_a_broadcast_and_its_workers_give_its_model():
    from rollout.engines.vllm_http import VLLMHTTPEngine
    from tests.test_vllm_http import FakeVLLM

    fake = FakeVLLM()
    parallel = {"tensor_parallel_size": 2, "pipeline_parallel_size": 1, "data_parallel_size": 1,
                "worker_extension_cls": "rollout.engines.vllm_worker.WeightReceiver"}  # fmt: skip
    fake.control["/server_info"] = lambda body: {"vllm_config": {
        "model_config": {"dtype": "torch.bfloat16"}, "device_config": {"device": "cuda"}, "parallel_config": parallel}}
    fake.control["/collective_rpc"] = lambda body: {"results": [{"hf_config": EMBEDDED_CONFIG}] * 2}
    async with fake.running() as url, VLLMHTTPEngine(url) as engine:
        support = await engine.weight_support()
    assert support.broadcast is None and support.world_size == 2  # (the trainer, then two workers)
    assert (support.device, support.dtype, support.model_config) == ("cuda", torch.bfloat16, EMBEDDED_CONFIG)
    assert support.kind == "vLLM 0.32.0" and support.tensor is not None
    assert choose_transport(support, WeightSyncConfig(), GPU) == "broadcast"  # (no tensors into vLLM)
