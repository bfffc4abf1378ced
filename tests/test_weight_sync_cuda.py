"""Weights by CUDA IPC into ``rallyrl serve`` on the trainer's GPU (``tensor`` on one machine and one GPU:
the server maps the trainer's buckets, nothing is copied between processes). Needs a CUDA GPU: skipped
elsewhere (CI has none); run on a lent GPU with ``python -m pytest -q tests/test_weight_sync_cuda.py``."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from data.tiny_model import EMBEDDED_MODEL
from rollout.engines.config import WeightSyncConfig
from rollout.engines.pool import EnginePool, PoolConfig
from rollout.serve.processes import serve_processes
from rollout.tokens import load_tokenizer
from tests.conftest import step_weights
from trainer.weight_check import logprob_gap
from trainer.weight_source import PolicyWeights

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a CUDA GPU")



@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_tensor_by_cuda_ipc_into_rallyrl_serve_on_the_same_gpu(tmp_path, dtype):
    model = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL, dtype=torch.float32).cuda().eval()
    tokenizer = load_tokenizer(EMBEDDED_MODEL)
    weights = PolicyWeights.of_model(model, tokenizer, tmp_path / "weights")
    flags = ("--device", "cuda", "--set", f"engine.dtype={dtype}")
    with serve_processes(EMBEDDED_MODEL, tmp_path, 1, *flags) as (server,):
        async with EnginePool([server.url], PoolConfig()) as pool:
            (said,) = await pool.plan_weight_sync(WeightSyncConfig(bucket_mb=2), weights, torch.device("cuda"))
            assert said == f"weight sync: tensor (CUDA IPC) into {server.url} (rallyrl serve, cuda, {dtype})"
            for version in (1, 2):
                before = copy.deepcopy(model)
                step_weights(model, weights, version)
                assert await pool.push_weights(weights, version) == {server.url: version}
                gap = await logprob_gap(pool, model, tokenizer, f"ipc-{version}")
                if dtype == "float32":
                    assert gap < 1e-4, gap
                else:  # the server rounds the new weights (and computes) in bfloat16: nearer them than the old
                    stale = await logprob_gap(pool, before, tokenizer, f"stale-{version}")
                    assert gap < stale / 2, (gap, stale)
    assert not (tmp_path / "weights").exists()
