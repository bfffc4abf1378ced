"""Real SGLang and vLLM servers for the ``real_engines`` tests (``python -m pytest -m real_engines``).

The engines live in virtualenvs of their own (``.ci/install_engines``). Where one is missing its
tests skip, saying how to install it, unless ``RALLYRL_REQUIRE_ENGINES=1`` (CI sets it): then they
fail. Each kind has one server of the embedded model for the whole session (``sglang_url``,
``vllm_url``); a test that changes a server's weights starts its own with ``engine_server``.
Servers write their logs under the session's temporary directory.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from data.tiny_model import EMBEDDED_MODEL
from rollout.engines.launch import EngineKind, EngineNotInstalled, engine_python, engine_server

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.real_engines)


def require_engine(kind: EngineKind) -> Path:
    """The interpreter of ``kind``'s virtualenv; skips the test when it is not installed (fails under CI)."""
    try:
        return engine_python(kind)
    except EngineNotInstalled as error:
        if os.environ.get("RALLYRL_REQUIRE_ENGINES") == "1":
            pytest.fail(str(error))
        pytest.skip(str(error))


@pytest.fixture(scope="session")
def engine_logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("engine-logs")


@pytest.fixture(scope="session")
def sglang_url(engine_logs) -> Iterator[str]:
    """A real SGLang server of the embedded model, shared by the session (do not change its weights)."""
    require_engine("sglang")
    with engine_server("sglang", EMBEDDED_MODEL, engine_logs) as server:
        yield server.url


@pytest.fixture(scope="session")
def vllm_url(engine_logs) -> Iterator[str]:
    """A real vLLM server of the embedded model, shared by the session (do not change its weights)."""
    require_engine("vllm")
    with engine_server("vllm", EMBEDDED_MODEL, engine_logs) as server:
        yield server.url


@pytest.fixture(scope="session")
def embedded_model() -> torch.nn.Module:
    """The embedded model in fp32 under transformers: the reference the engines are held to."""
    return AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL, dtype=torch.float32).eval()


def reference_logprobs(model: torch.nn.Module, ids: list[int], start: int = 1,
                       temperature: float = 1.0) -> torch.Tensor:  # fmt: skip
    """log_softmax(logits / temperature) of ``ids[start:]`` under ``model`` (temperature 0: 1)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, start - 1 : len(ids) - 1]
    logprobs = (logits / (temperature or 1.0)).log_softmax(-1)
    return logprobs.gather(1, torch.tensor(ids[start:])[:, None]).squeeze(1)
