"""Shared fixtures: the real character tokenizer, tiny real models, and a scripted engine double."""

from __future__ import annotations

import asyncio
import contextlib
import random
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from data.tiny_model import EMBEDDED_MODEL, TinyModelConfig, build_char_tokenizer, build_tiny_model, save_tiny_model
from rollout.engines.base import EngineError, Generation, SamplingParams
from rollout.tokens import ChatTokenizer
from tools.base import BaseTool, ToolError, ToolResponse, function_schema

torch.set_num_threads(2)

PROMPTLY_S = 30.0
"""The bound of a test that checks a kill or a refusal came at once, not at a later deadline: its
cause is checked from the answer's text, and wall time here is the machine's (another suite beside
this one turned 1 s into 5), so the bound only catches a kill that hung."""
TINY = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)


def run_cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    """Run the installed ``rallyrl`` command in a real subprocess; its output is captured as text."""
    path = shutil.which("rallyrl")
    if path is None:
        pytest.fail("the rallyrl command is not installed: run `pip install -e .[dev]`")
    return subprocess.run([path, *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="session")
def tiny_model(tokenizer):
    """A 2-layer random Qwen2 with peaked logits (so greedy choices are not near-ties)."""
    return build_tiny_model(tokenizer, TinyModelConfig(**{**TINY.__dict__, "initializer_range": 0.3}))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"), TINY)


class CountingTool(BaseTool):
    """A test tool: echoes ``text``; ``sleep`` seconds of latency; ``fail`` raises; counts lifecycles."""

    def __init__(self, config: dict[str, Any] | None = None, schema: dict[str, Any] | None = None):
        super().__init__(config, schema)
        self.created = 0
        self.released = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.fail_create = bool(self.config.get("fail_create"))

    @classmethod
    def default_schema(cls) -> dict[str, Any]:
        return function_schema(
            "echo",
            "Echo text back.",
            {
                "type": "object",
                "properties": {"text": {"type": "string"}, "sleep": {"type": "number"}, "fail": {"type": "boolean"}},
                "required": ["text"],
            },
        )

    async def create(self, instance_id: str | None = None, **create_kwargs: Any) -> str:
        if self.fail_create:
            raise ToolError("create refused")
        self.created += 1
        return await super().create(instance_id, **create_kwargs)

    async def execute(self, instance_id: str, parameters: dict[str, Any], **execute_kwargs: Any) -> ToolResponse:
        self.instance(instance_id)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(parameters.get("sleep", 0))
            if parameters.get("fail"):
                raise RuntimeError("boom")
            return ToolResponse(text=parameters["text"], reward=0.5)
        finally:
            self.in_flight -= 1

    async def calc_reward(self, instance_id: str, **calc_reward_kwargs: Any) -> float:
        return 0.25

    async def release(self, instance_id: str, **release_kwargs: Any) -> None:
        self.released += 1
        await super().release(instance_id, **release_kwargs)


@pytest.fixture
def tool() -> CountingTool:
    """A fresh counting tool per test."""
    return CountingTool()


@pytest.fixture
def chat(tokenizer, tool) -> ChatTokenizer:
    """The real chat tokenizer with ``tool``'s schema."""
    return ChatTokenizer(tokenizer, [tool.schema])


def call(name: str, **arguments: Any) -> str:
    """A Hermes tool-call block as a model would write it."""
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@dataclass
class ScriptedEngine:
    """Engine double: ``script(turn_index, prompt_text, rid)`` gives each turn's text.

    The text is tokenized with the real tokenizer and ended with ``<|im_end|>`` (finish "stop")
    unless it is longer than max_new_tokens (cut, finish "length"). Every returned token and
    logprob is kept in ``emitted[rid]`` so tests can check the loss mask against it.
    """

    chat: ChatTokenizer
    script: Callable[[int, str, str], str | Exception]
    delay: Callable[[str], float] = lambda rid: 0.0
    emitted: dict[str, list[int]] = field(default_factory=dict)
    turns: dict[str, int] = field(default_factory=dict)
    weight_version: int = 3

    async def generate(self, input_ids: list[int], sampling: SamplingParams, rid: str) -> Generation:
        turn = self.turns.get(rid, 0)
        self.turns[rid] = turn + 1
        await asyncio.sleep(self.delay(rid))
        text = self.script(turn, self.chat.decode(input_ids), rid)
        if isinstance(text, Exception):
            raise text
        ids = [*self.chat.encode(text), self.chat.turn_close_ids[0]]
        finish = "stop"
        if len(ids) > sampling.max_new_tokens:
            ids, finish = ids[: sampling.max_new_tokens], "length"
        self.emitted.setdefault(rid, []).extend(ids)
        logprobs = [-0.1 - 0.001 * i for i in range(len(ids))]
        return Generation(ids, logprobs, finish, self.weight_version)

    async def update_weights(self, state_dict: dict[str, Any], weight_version: int | None = None) -> int:
        raise EngineError("scripted engine has no weights")

    async def abort(self, rid: str | None = None) -> None:
        return None

    async def health(self) -> bool:
        return True


def random_delay(seed: int) -> Callable[[str], float]:
    rng = random.Random(seed)
    return lambda rid: rng.uniform(0, 0.02)


@contextlib.asynccontextmanager
async def serving(engine: Any, model_dir: Path = EMBEDDED_MODEL, port: int = 0) -> AsyncIterator[str]:
    """``rallyrl serve``'s HTTP server over ``engine`` in this event loop, on 127.0.0.1 (``port`` 0:
    a free one); yields its URL and stops it at exit."""
    from rollout.config import ServeConfig
    from rollout.serve.app import serve
    from rollout.tokens import load_tokenizer

    ready = asyncio.Event()
    config = ServeConfig(model=str(model_dir), port=port, weights_dirs=[tempfile.gettempdir()])
    task = asyncio.create_task(serve(engine, load_tokenizer(model_dir), config, ready))
    await asyncio.wait_for(ready.wait(), 30)
    try:
        yield f"http://127.0.0.1:{config.port}"
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.fixture
def one_thread():
    """One intra-op thread: on matrices as small as the tests' two only add synchronisation (ten
    times the time on a busy machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def step_weights(model: torch.nn.Module, weights: Any, version: int) -> None:
    """An optimizer step's worth of change to ``model``, and the version it makes (``weights``: the
    ``trainer.weight_source.PolicyWeights`` over it), for the weight sync tests."""
    generator = torch.Generator().manual_seed(version)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator).to(parameter.device) * 0.02)
    weights.version = version
