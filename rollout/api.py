"""The typed Python entry point of ``rallyrl rollout``, and the setup pieces that it, the trainer,
the evaluator and SFT share (one place for each).

```python
from rollout.api import rollout
from rollout.config import RolloutJobConfig

result = asyncio.run(rollout(RolloutJobConfig(num_prompts=8, samples_per_prompt=4)))
print(result.summary.accuracy)
```

The CLI parses flags into the same config trees and calls these functions; nothing here prints
except progress bars.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from data.reward_fns import RewardFn
from data.schema import Record
from rollout.config import GatewayConfig, GatewayJobConfig, JudgeConfig, PromptsConfig, RolloutConfig, RolloutJobConfig
from rollout.engines.adapter_dirs import AdapterError, is_adapter_dir, merged_model_dir
from rollout.engines.base import Engine
from rollout.engines.config import EngineConfig

if TYPE_CHECKING:
    from rich.console import Console

    from rollout.gateway.agents import AgentDriver
    from rollout.runner import RolloutResult, RolloutSummary
    from rollout.tokens import ChatTokenizer
    from rollout.users.judge import Judge
    from tools.base import BaseTool


class SetupError(ValueError):
    """A setting that names something unusable (a model directory, a task, a data file)."""


def resolve_model(model: str | Path | None) -> Path:
    """The model directory to use: ``model``, or the embedded model. Any directory with a
    ``config.json`` is one, training checkpoints (``out/checkpoints/step-N``) and ``out/final`` included;
    a LoRA adapter directory gives its base model with the adapter merged (``rollout/engines/adapter_dirs.py``)."""
    if model is None:
        from data.embedded import EMBEDDED_MODEL

        if (EMBEDDED_MODEL / "config.json").is_file():
            return EMBEDDED_MODEL
        raise SetupError(
            f"no embedded model at {EMBEDDED_MODEL} (`rallyrl sft --recipe tiny-calc --export {EMBEDDED_MODEL}` "
            "rebuilds it); or give a model directory (a local Hugging Face causal-LM directory)"
        )
    path = Path(model)
    if is_adapter_dir(path):  # a LoRA adapter (peft's format): its base with the adapter merged in
        try:
            return merged_model_dir(path)
        except AdapterError as exc:
            raise SetupError(f"model {path}: {exc}") from None
    if (path / "config.json").is_file():
        return path
    if (path / "metrics.jsonl").is_file() or (path / "checkpoints").is_dir():
        raise SetupError(f"model {path}: a training run directory; give its final/ or checkpoints/step-N/")
    if not path.exists():
        raise SetupError(f"model {path}: no such directory")
    raise SetupError(f"model {path}: not a Hugging Face model directory (no config.json)")


def set_threads(threads: int | None) -> None:
    """torch intra-op threads, when the config sets them."""
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


def load_prompts(config: PromptsConfig, default_count: int = 64) -> list[Record]:
    """The records of ``config.data`` (the first ``num_prompts``), or generated task prompts."""
    from data.schema import load_records
    from data.synthetic import make_task

    if config.data is not None:
        records = load_records(config.data)
        if not records:
            raise SetupError(f"{config.data}: no records")
        return records[: config.num_prompts] if config.num_prompts else records
    try:
        return make_task(config.task or "calc", config.num_prompts or default_count, config.seed)
    except ValueError as exc:  # an unknown task name
        raise SetupError(f"task: {exc}") from None


def setup_tools(
    tools_path: str | Path | None, tokenizer: Any, task: str | None = None, content_special_tokens: str = "text"
) -> tuple[dict[str, BaseTool], ChatTokenizer]:
    """The tools of a tool config (default: the calculator) and the chat tokenizer that renders
    their schemas into every prompt (``RolloutConfig.content_special_tokens``)."""
    tools = load_tool_config(tools_path, task)
    return tools, tools_chat(tools, tokenizer, content_special_tokens)


def load_tool_config(tools_path: str | Path | None, task: str | None = None) -> dict[str, BaseTool]:
    """The tools of a tool config, by name (default: the calculator; none for a step-environment task,
    whose moves go to the environment). Needs no tokenizer, so a bad tool config fails before transformers
    and torch load."""
    from data.env_tasks import is_env_task
    from tools.registry import DEFAULT_TOOLS, build_tools, load_tools

    if tools_path:
        return load_tools(tools_path)
    return {} if task is not None and is_env_task(task) else build_tools(DEFAULT_TOOLS)


def tools_chat(tools: dict[str, BaseTool], tokenizer: Any, content_special_tokens: str = "text") -> ChatTokenizer:
    """The chat tokenizer that renders the schemas of ``tools`` into every prompt."""
    from rollout.tokens import ChatTokenizer

    return ChatTokenizer(tokenizer, [tool.schema for tool in tools.values()], content_special_tokens)


def setup_interactions(path: str | Path | None, task: str | None = None) -> dict[str, Any]:
    """The interactions of an interaction config (verl's ``interaction:`` list), by name; none without one.
    A step-environment task (``textarena:GuessTheNumber-v0``) adds the environment interaction its records name."""
    from data.env_tasks import ENV_INTERACTION, is_env_task

    interactions: dict[str, Any] = {}
    if path is not None:
        from rollout.users.interactions import load_interactions

        interactions = load_interactions(path)
    if task is not None and is_env_task(task) and ENV_INTERACTION not in interactions:
        from rollout.envs.interaction import EnvironmentInteraction

        try:
            interactions[ENV_INTERACTION] = EnvironmentInteraction({"name": ENV_INTERACTION, "env": task})
        except (ImportError, ValueError) as exc:  # a missing extra names its pip command
            raise SetupError(f"task {task}: {exc}") from None
    return interactions


async def enter_interactions(stack: contextlib.AsyncExitStack, interactions: dict[str, Any]) -> None:
    """Open the interactions that are async context managers (a simulated user's connections) on ``stack``."""
    from rollout.envs.step import EnvError

    for interaction in interactions.values():
        if hasattr(interaction, "__aenter__") and hasattr(interaction, "__aexit__"):
            try:
                await stack.enter_async_context(interaction)
            except EnvError as exc:  # an environment's start check: one line, as bad input is
                raise SetupError(str(exc)) from None


def make_judge(config: JudgeConfig) -> Judge | None:
    """The judge of ``config.url`` (enter it with ``async with``), or None without a URL."""
    if not config.url:
        return None
    from rollout.users.judge import Judge

    return Judge(config.url, config)


def make_reward(spec: str | None, judge: Judge | None = None) -> RewardFn:
    """The reward of a spec (``data/reward_fns.py``) with the judge's reward as ``judge``; the
    default (graded answer, else the tools' rewards) without a spec."""
    from data.reward_fns import reward_for_records
    from rollout.loop import default_reward

    if spec is None:
        return default_reward
    try:
        return reward_for_records(spec, {"judge": judge.reward} if judge is not None else None)
    except (KeyError, ValueError) as exc:
        raise SetupError(f"reward: {exc}") from None


def open_engine(config: EngineConfig, model_dir: Path, *, max_model_len: int | None = None, seed: int = 0,
                model: Any = None, pooled: bool = False) -> Any:  # fmt: skip
    """The engine of ``config``, not yet entered (``async with`` it, and use what entering returns):
    servers (behind a pool even when one, with ``pooled``: a training run's), in-process SGLang or the
    embedded engine (on ``model`` when given, a module already loaded, else ``model_dir``)."""
    import dataclasses

    if config.urls:  # SGLang or vLLM servers; with server "auto", asked which on entry
        from rollout.engines.pool import open_servers

        return open_servers(config.urls, config.server, config.http, config.pool, pooled=pooled)
    if config.kind == "sglang":
        from rollout.engines.sglang_engine import SGLangEngine

        sglang = config.sglang
        if not sglang.model_path:
            sglang = dataclasses.replace(sglang, model_path=str(model_dir))
        return SGLangEngine.from_config(sglang)
    from rollout.engines.local import LocalEngine

    local = config.local
    if local.max_model_len is None and max_model_len is not None:
        local = dataclasses.replace(local, max_model_len=max_model_len)
    if local.seed is None:
        local = dataclasses.replace(local, seed=seed)
    if model is not None:
        return LocalEngine(model, local)
    return LocalEngine.from_pretrained(model_dir, local)


class RolloutCommand(Protocol):
    """A command config that rolls out: ``RolloutJobConfig``, ``EvalConfig``, ``GRPOConfig``."""

    model: str | None
    tools: str | None
    interactions: str | None
    agent: str | None
    gateway: GatewayConfig
    reward: str | None
    seed: int
    rollout: RolloutConfig
    engine: EngineConfig
    judge: JudgeConfig


@dataclass
class Session:
    """What a rollout needs, opened together by ``rollout_session``."""

    engine: Engine
    chat: ChatTokenizer
    tools: dict[str, BaseTool]
    reward_fn: RewardFn
    interactions: dict[str, Any]
    agent: AgentDriver | None = None


@contextlib.asynccontextmanager
async def agent_gateway(config: RolloutCommand, engine: Engine, tokenizer: Any, reward_fn: RewardFn,
                        model_dir: Path) -> AsyncIterator[AgentDriver | None]:  # fmt: skip
    """With ``config.agent``: the gateway in front of ``engine``, serving on loopback while the
    context is open, and the driver that runs the agent through it; else None."""
    if not config.agent:
        yield None
        return
    from rollout.gateway import Gateway
    from rollout.gateway.agents import AgentDriver, load_agent

    agent = load_agent(config.agent)
    async with Gateway(engine, tokenizer, config.gateway, config.rollout, reward_fn=reward_fn,
                       model_name=model_dir.name) as gateway:  # fmt: skip
        driver = AgentDriver(gateway, agent, config.gateway.agent_timeout_s)
        try:
            yield driver
        finally:
            driver.close()


@contextlib.asynccontextmanager
async def rollout_session(config: RolloutCommand) -> AsyncIterator[Session]:
    """Model directory, tokenizer, tools, judge, reward and engine of one command, opened and
    closed together."""
    model_dir = resolve_model(config.model)
    task = getattr(config, "task", None)
    tools = load_tool_config(config.tools, task)  # what can be wrong with the user's files fails first, in a second
    interactions = setup_interactions(config.interactions, task)
    if config.agent:
        from rollout.gateway.agents import load_agent

        load_agent(config.agent)  # a bad entry point fails before the engine starts
    from rollout.tokens import load_tokenizer  # transformers and torch: seconds

    tokenizer = load_tokenizer(model_dir)
    chat = tools_chat(tools, tokenizer, config.rollout.content_special_tokens)
    judge = make_judge(config.judge)
    reward_fn = make_reward(config.reward, judge)
    async with contextlib.AsyncExitStack() as stack:
        from tools.registry import close_tools

        stack.callback(close_tools, tools)  # last, after the engine: the Ray actors of executor: ray tools
        if judge is not None:
            await stack.enter_async_context(judge)
        await enter_interactions(stack, interactions)
        engine = open_engine(config.engine, model_dir, max_model_len=config.rollout.max_model_len, seed=config.seed)
        engine = await stack.enter_async_context(engine)
        agent = await stack.enter_async_context(agent_gateway(config, engine, tokenizer, reward_fn, model_dir))
        yield Session(engine, chat, tools, reward_fn, interactions, agent)


async def rollout(
    config: RolloutJobConfig,
    records: list[Record] | None = None,
    *,
    skip: Collection[tuple[int, int]] = (),
    console: Console | None = None,
) -> RolloutResult:
    """``rallyrl rollout``: every record ``samples_per_prompt`` times through the engine, each
    trajectory written to ``config.out`` as it finishes. ``skip`` holds (prompt, sample) pairs
    already in ``out`` (``--resume``); they are not run again and ``out`` is appended to."""
    set_threads(config.threads)
    records = load_prompts(config) if records is None else records
    async with rollout_session(config) as s:
        from rollout.runner import RolloutRunner

        runner = RolloutRunner(s.engine, s.chat, s.tools, config.rollout, reward_fn=s.reward_fn,
                               progress=config.progress, console=console, interactions=s.interactions,
                               agent=s.agent)  # fmt: skip
        return await runner.run(records, config.samples_per_prompt, config.out, skip=skip, append=bool(skip))


async def rollout_summary(
    config: RolloutJobConfig,
    records: list[Record] | None = None,
    *,
    skip: Collection[tuple[int, int]] = (),
    console: Console | None = None,
) -> tuple[RolloutSummary, int, str | None]:
    """``rollout`` for a caller that needs only the aggregates (the CLI, through ``asyncio.run``):
    the summary, how many trajectories were run and the first error among them (None: none); the
    trajectories themselves are in ``config.out``. (A result that holds them all, handed back
    through ``asyncio.run``, has its whole repr built twice on the way out, when the SIGINT handler
    is put back: 0.17 s each at 1,024 requests.)"""
    result = await rollout(config, records, skip=skip, console=console)
    first_error = next((f"record {r.prompt_index} (sample {r.sample_index}): {r.error}"
                        for r in result.requests if r.error), None)  # fmt: skip
    return result.summary, len(result.requests), first_error


async def serve_gateway(config: GatewayJobConfig, console: Console | None = None) -> None:
    """``rallyrl gateway``: the gateway in front of the configured engine until cancelled; each finished
    session is appended to ``config.out`` as it finishes (sessions still open at exit are ended as aborted
    and written too)."""
    from rollout.gateway import Gateway, write_sessions
    from rollout.tokens import load_tokenizer

    set_threads(config.threads)
    model_dir = resolve_model(config.model)
    tokenizer = load_tokenizer(model_dir)
    judge = make_judge(config.judge)
    reward_fn = make_reward(config.reward, judge)
    write, close = write_sessions(config.out)
    try:
        async with contextlib.AsyncExitStack() as stack:
            if judge is not None:
                await stack.enter_async_context(judge)
            engine = open_engine(config.engine, model_dir, max_model_len=config.rollout.max_model_len,
                                 seed=config.seed)  # fmt: skip
            engine = await stack.enter_async_context(engine)
            gateway = Gateway(engine, tokenizer, config.gateway, config.rollout, reward_fn=reward_fn,
                              model_name=model_dir.name, on_finish=write, freeze_heap=True)  # fmt: skip
            await stack.enter_async_context(gateway)
            if console is not None:
                console.print(f"agent gateway for {model_dir} on {gateway.url} (POST /sessions opens a session; "
                              f"finished sessions go to {config.out})", highlight=False)  # fmt: skip
            stop = asyncio.Event()
            with contextlib.suppress(NotImplementedError, RuntimeError):  # SIGTERM ends it as Ctrl-C does
                asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
            await stop.wait()
    finally:
        close()
