"""Optional engine abilities are protocols (``rollout/engines/base.py``) that every engine having one
declares with the same async signature; ``isinstance`` tells who has which."""

from __future__ import annotations

import inspect

import pytest

from rollout.engines.base import FlushesCache, LoadsWeightsFromDisk, PushesWeights, StreamsGenerations
from rollout.engines.local import LocalEngine
from rollout.engines.pool import EnginePool
from rollout.engines.sglang_engine import SGLangEngine
from rollout.engines.sglang_http import SGLangHTTPEngine
from rollout.engines.vllm_http import VLLMHTTPEngine

ABILITIES = {
    FlushesCache: ("flush_cache", [LocalEngine, SGLangHTTPEngine, VLLMHTTPEngine, EnginePool, SGLangEngine]),
    LoadsWeightsFromDisk: ("sync_weights_from_disk", [SGLangHTTPEngine, VLLMHTTPEngine, EnginePool]),
    StreamsGenerations: ("generate_stream", [LocalEngine]),
    PushesWeights: ("push_weights", [EnginePool]),
}
CASES = [(ability, method, engine) for ability, (method, engines) in ABILITIES.items() for engine in engines]


@pytest.mark.parametrize(("ability", "method", "engine"), CASES, ids=lambda x: getattr(x, "__name__", x))
def test_an_engine_declares_its_ability_with_the_protocols_signature(ability, method, engine):
    declared, implemented = getattr(ability, method), getattr(engine, method)
    assert inspect.signature(implemented) == inspect.signature(declared)
    if method == "generate_stream":
        assert inspect.isasyncgenfunction(implemented)
    else:
        assert inspect.iscoroutinefunction(implemented)


def test_isinstance_tells_servers_from_in_process_engines():
    client, pool = SGLangHTTPEngine("http://127.0.0.1:1"), EnginePool(["http://127.0.0.1:1", "http://127.0.0.1:2"])
    assert isinstance(client, LoadsWeightsFromDisk) and isinstance(pool, LoadsWeightsFromDisk)
    assert isinstance(client, FlushesCache) and not isinstance(client, StreamsGenerations)
    assert not isinstance(object(), FlushesCache)
    assert isinstance(pool, PushesWeights) and not isinstance(client, PushesWeights)
    for in_process in (LocalEngine, SGLangEngine):
        assert not hasattr(in_process, "sync_weights_from_disk")
