"""Real SGLang and vLLM servers for the ``real_engines`` tests (``python -m pytest -m real_engines``).

The engines live in virtualenvs of their own (``.ci/install_engines``). Where one is missing its
tests skip, saying how to install it, unless ``RALLYRL_REQUIRE_ENGINES=1`` (CI sets it): then they
fail. Each kind has one server of the embedded model for the whole session (``sglang_url``,
``vllm_url``) whose weights no test changes. The SGLang tests that change a server's weights share
``sglang_scratch_url``, handed to each of them reset to the embedded model (starting an SGLang
server costs a minute of CPU; loading the tiny model's weights into a running one a second).
Servers write their logs under the session's temporary directory.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from data.tiny_model import EMBEDDED_MODEL
from rollout.engines.launch import (
    EngineKind,
    EngineNotInstalled,
    engine_python,
    engine_server,
    start_engine,
    wait_ready,
)
from rollout.serve.processes import ServeProcess

HERE = Path(__file__).resolve().parent


SERVER_FIXTURES = {
    "sglang": {"sglang_url", "_sglang_scratch", "sglang_scratch_url", "sglang", "second_sglang"},
    "vllm": {"vllm_url", "own_vllm_url", "lora_vllm_url"},
}
"""The session's servers of each kind, by the fixtures that start them."""


def server_kind(item: pytest.Item) -> str | None:
    """The kind of server ``item`` runs against (by its fixtures or its ``server`` parameter), if any."""
    callspec = getattr(item, "callspec", None)
    if callspec is not None and callspec.params.get("server") in SERVER_FIXTURES:
        return callspec.params["server"]
    names = set(getattr(item, "fixturenames", ()))
    return next((kind for kind, fixtures in SERVER_FIXTURES.items() if names & fixtures), None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark these tests ``real_engines`` and, for ``pytest -n 2 --dist loadgroup`` (CI), keep the tests
    of one kind of server on one worker, so that each session server starts once."""
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.real_engines)
            kind = server_kind(item)
            if kind is not None:
                item.add_marker(pytest.mark.xdist_group(kind))


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


SGLANG_FLAGS = ("--tool-call-parser", "hermes", "--context-length", "4096")
"""The scratch SGLang server's flags: the embedded model's tool-call parser and whole context, as
``rallyrl serve`` has them and the conformance recordings were made (``tests/fixtures/record_sglang.py``
``SERVER_FLAGS``)."""


@pytest.fixture(scope="session")
def sglang_url(engine_logs) -> Iterator[str]:
    """A real SGLang server of the embedded model, shared by the session (do not change its weights),
    with the Prometheus counters the router test reads (they add timings to each answer's meta_info,
    so the conformance tests use the scratch server)."""
    require_engine("sglang")
    with engine_server("sglang", EMBEDDED_MODEL, engine_logs, "--enable-metrics") as server:
        yield server.url


@pytest.fixture(scope="session")
def _sglang_scratch(engine_logs) -> Iterator[str]:
    require_engine("sglang")
    with engine_server("sglang", EMBEDDED_MODEL, engine_logs, *SGLANG_FLAGS) as server:
        yield server.url


def reset_sglang(url: str) -> None:
    """Generation continued, the embedded model's weights loaded and the weight version ``default``:
    the server as it started."""
    with httpx.Client(base_url=url, timeout=120) as client:
        client.post("/continue_generation", json={}).raise_for_status()
        body = {"model_path": str(EMBEDDED_MODEL), "weight_version": "default", "abort_all_requests": True}
        answer = client.post("/update_weights_from_disk", json=body)
        answer.raise_for_status()
        assert answer.json().get("success"), answer.text
        assert client.get("/get_model_info").json()["weight_version"] == "default"


@pytest.fixture
def sglang_scratch_url(_sglang_scratch) -> str:
    """A real SGLang server of the embedded model whose weights the test may change: shared by the
    session, reset to the embedded model before each test."""
    reset_sglang(_sglang_scratch)
    return _sglang_scratch


class RestartableServer:
    """A real server that a test may kill and start again at the same URL (``restart``)."""

    def __init__(self, kind: EngineKind, log_dir: Path, *flags: str):
        self.kind, self.log_dir, self.flags = kind, log_dir, flags
        self.process: ServeProcess = start_engine(kind, EMBEDDED_MODEL, log_dir, None, *flags)
        wait_ready(self.process)
        self.url = self.process.url

    def restart(self) -> None:
        """Kill it (SIGKILL, as a crash) and start it again on the same port, from its checkpoint."""
        self.process.kill()
        port = int(self.url.rsplit(":", 1)[1])
        self.process = start_engine(self.kind, EMBEDDED_MODEL, self.log_dir, port, *self.flags)
        wait_ready(self.process)


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
