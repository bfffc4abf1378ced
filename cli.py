"""The ``rallyrl`` command line: parse, call, print.

Every command that has settings reads them into its config tree (``rollout/config.py``,
``trainer/config.py``): defaults, then ``--config FILE`` (YAML), then the flags given, then
``--set a.b=VALUE``. A flag not given leaves the file's value. ``rallyrl config --show`` prints the
resolved tree. The work itself is in ``rollout.api``, ``trainer.grpo``, ``trainer.evaluation``
and ``trainer.sft``.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import orjson
import typer

from data.console import console
from data.console import fail as _fail

app = typer.Typer(
    name="rallyrl",
    help="Multi-turn, tool-calling rollouts and RL for language-model agents.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)

CONFIG_HELP = "YAML file of config fields (`rallyrl config --show` lists them); flags override it."
SET_HELP = "Override any field, e.g. --set rollout.tool_timeout_s=5 (repeatable; the value is YAML)."
AGENT_HELP = "Agent entry point, module:function or file.py:function, run through the agent gateway."
ENGINE_SERVER_HELP = 'What serves --engine-url: "sglang" (or `rallyrl serve`), "vllm", or "auto" (ask it; default).'
COMMANDS = ("rollout", "train", "eval", "serve", "sft", "gateway")


@contextlib.contextmanager
def _errors_for_people():
    """Bad input (config, records, tools, templates, engines) -> one line and exit 2, no stack trace."""
    from rollout.engines.base import EngineError

    try:
        yield
    except (ValueError, EngineError) as exc:  # ConfigError, RecordError, SetupError, ... are ValueErrors
        raise _fail(str(exc)) from None


def _config_class(command: str) -> type:
    if command in ("rollout", "serve", "gateway"):
        from rollout.config import GatewayJobConfig, RolloutJobConfig, ServeConfig

        return {"rollout": RolloutJobConfig, "serve": ServeConfig, "gateway": GatewayJobConfig}[command]
    from trainer.config import EvalConfig, GRPOConfig, SFTConfig

    return {"train": GRPOConfig, "eval": EvalConfig, "sft": SFTConfig}[command]


def _given(command: str, path: Path | None, flags: dict[str, Any], sets: list[str] | None) -> dict[str, Any]:
    """What the YAML file, the flags given (dotted names) and --set say, in that order of precedence."""
    from data.config_tree import given_values

    flags = {key: str(value) if isinstance(value, Path) else value for key, value in flags.items()}
    return given_values(_config_class(command), path, flags, sets)


def _load(command: str, path: Path | None, flags: dict[str, Any], sets: list[str] | None) -> Any:
    """The command's config: defaults < the YAML file < flags given < --set."""
    from data.config_tree import build

    return build(_config_class(command), _given(command, path, flags, sets))


@app.command("config")
def config_command(
    show: bool = typer.Option(False, "--show", help="Print the resolved config tree as YAML."),
    command: str = typer.Option("train", help=f"Whose tree: {', '.join(COMMANDS)}."),
    config: Path = typer.Option(None, help=CONFIG_HELP),
    set_: list[str] = typer.Option(None, "--set", help=SET_HELP),
    comments: bool = typer.Option(True, help="Document each field in a comment above it."),
) -> None:
    """Print a command's settings: every field, its value and what it does (YAML, reusable as --config)."""
    from data.config_tree import to_yaml

    if command not in COMMANDS:
        raise _fail(f"--command must be one of {', '.join(COMMANDS)}, got {command!r}")
    with _errors_for_people():
        tree = _load(command, config, {}, set_)
    if not show:
        raise _fail("nothing to do: give --show")
    typer.echo(to_yaml(tree, comments=comments), nl=False)


@app.command()
def rollout(
    config: Path = typer.Option(None, help=CONFIG_HELP),
    set_: list[str] = typer.Option(None, "--set", help=SET_HELP),
    task: str = typer.Option(None, help="Synthetic task to generate prompts for (default: calc)."),
    data: Path = typer.Option(None, help="Dataset file (.jsonl, .json or .parquet; rallyrl or verl layout)."),
    num_prompts: int = typer.Option(None, help="Prompts to use (default: 64 for a task, all for --data)."),
    samples_per_prompt: int = typer.Option(None, "-n", "--samples-per-prompt", "--samples", help="Samples per prompt."),
    model: Path = typer.Option(None, help="Model directory (default: embedded); with --engine-url, its tokenizer."),
    tools: Path = typer.Option(None, help="Tool config (YAML or JSON); default: the calculator."),
    interactions: Path = typer.Option(None, help="Interaction config (verl's interaction YAML): the user's turns."),
    agent: str = typer.Option(None, help=AGENT_HELP),
    out: Path = typer.Option(None, help="Output JSONL, one trajectory per line (default: rollouts.jsonl)."),
    max_concurrency: int = typer.Option(None, help="Requests in flight at once."),
    max_turns: int = typer.Option(None, help="Most assistant turns per request."),
    max_new_tokens: int = typer.Option(None, help="Most tokens per assistant turn."),
    max_response_tokens: int = typer.Option(None, help="Most tokens after the prompt, over all turns."),
    max_model_len: int = typer.Option(None, help="Most tokens per conversation."),
    temperature: float = typer.Option(None, help="Sampling temperature (0 = greedy)."),
    top_p: float = typer.Option(None, help="Nucleus sampling cut."),
    top_k: int = typer.Option(None, help="Top-k cut (-1: none)."),
    tool_parser: str = typer.Option(None, help="Tool-call parser, SGLang's names (qwen25, qwen3_coder, llama3, ...)."),
    reasoning_parser: str = typer.Option(None, help="Reasoning parser, SGLang's names (none, qwen3, ...)."),
    seed: int = typer.Option(None, help="Seed of the task's prompts and of the engine's sampling."),
    device: str = typer.Option(None, help='Embedded engine device: "auto", "cpu" or "cuda".'),
    engine_url: list[str] = typer.Option(None, help="SGLang, vLLM or `rallyrl serve` server URL; repeat for a pool."),
    engine_server: str = typer.Option(None, help=ENGINE_SERVER_HELP),
    engine: str = typer.Option(None, help='In-process engine: "local" (embedded) or "sglang" (CUDA).'),
    resume: bool = typer.Option(None, "--resume", help="Keep the trajectories in --out; run only the missing ones."),
    reward: str = typer.Option(None, help='Reward by data_source, e.g. "openai/gsm8k=math+0.1*format,default=math".'),
    judge_url: str = typer.Option(None, help="OpenAI-compatible URL of a judge model, for the 'judge' reward."),
    judge_concurrency: int = typer.Option(None, help="Most judge calls in flight at once."),
    threads: int = typer.Option(None, help="torch intra-op threads."),
    progress: bool = typer.Option(None, "--progress/--no-progress", help="Show a progress bar."),
) -> None:
    """Roll out prompts with tool calls through the embedded engine, SGLang servers or in-process
    SGLang, and write trajectories to JSONL as they finish. Ctrl-C keeps every finished one;
    the same command with --resume runs the rest."""
    flags = {
        "task": task, "data": data, "num_prompts": num_prompts, "samples_per_prompt": samples_per_prompt,
        "model": model, "tools": tools, "interactions": interactions, "agent": agent, "out": out, "seed": seed,
        "resume": resume,
        "reward": reward,
        "threads": threads, "progress": progress, "rollout.max_concurrency": max_concurrency,
        "rollout.max_turns": max_turns, "rollout.max_new_tokens": max_new_tokens,
        "rollout.max_response_tokens": max_response_tokens, "rollout.max_model_len": max_model_len,
        "rollout.temperature": temperature, "rollout.top_p": top_p, "rollout.top_k": top_k,
        "rollout.tool_parser": tool_parser, "rollout.reasoning_parser": reasoning_parser,
        "engine.local.device": device, "engine.urls": engine_url or None,
        "engine.server": engine_server, "engine.kind": engine, "judge.url": judge_url,
        "judge.max_concurrency": judge_concurrency,
    }  # fmt: skip
    from rollout.api import load_prompts, rollout_summary
    from rollout.output_file import count_lines, finished_pairs, output_lock

    with _errors_for_people():
        job = _load("rollout", config, flags, set_)
        records = load_prompts(job)
    out_path = Path(job.out)
    stack = contextlib.ExitStack()
    try:
        with _errors_for_people():
            stack.enter_context(output_lock(out_path))  # held until the command ends
            done = finished_pairs(out_path, len(records), job.samples_per_prompt) if job.resume else set()
            summary, ran = asyncio.run(rollout_summary(job, records, skip=done, console=console))
    except KeyboardInterrupt:
        total = len(records) * job.samples_per_prompt
        finished = count_lines(out_path)
        console.print(f"interrupted: {finished} of {total} trajectories finished and are in {out_path}; "
                      f"{total - finished} were cut. The same command with --resume runs those.",
                      highlight=False)  # fmt: skip
        raise typer.Exit(code=130) from None
    finally:
        stack.close()
    console.print(summary.table())
    if job.resume:
        console.print(f"resumed: {len(done)} trajectories were already in {out_path}; added {ran}")
    else:
        console.print(f"wrote {ran} trajectories to {out_path}")


@app.command()
def train(
    config: Path = typer.Option(None, help=CONFIG_HELP),
    set_: list[str] = typer.Option(None, "--set", help=SET_HELP),
    steps: int = typer.Option(None, help="GRPO steps."),
    out: Path = typer.Option(None, help="Run directory (metrics.jsonl, checkpoints/, final/, curves.png)."),
    resume: bool = typer.Option(False, help="Continue from the last checkpoint in --out."),
    model: Path = typer.Option(None, help="Model directory to start from (default: the embedded model)."),
    task: str = typer.Option(None, help="Synthetic task (default: calc)."),
    data: Path = typer.Option(None, help="Dataset file instead of a task."),
    agent: str = typer.Option(None, help=AGENT_HELP),
    prompts_per_step: int = typer.Option(None, help="Prompts (groups) per step."),
    samples_per_prompt: int = typer.Option(None, "-n", "--samples-per-prompt", help="Samples per prompt."),
    lr: float = typer.Option(None, help="Learning rate."),
    seed: int = typer.Option(None, help="Seed."),
    reward: str = typer.Option(None, help='Reward by data_source, e.g. "math+0.1*format" or "judge".'),
    judge_url: str = typer.Option(None, help="OpenAI-compatible URL of a judge model, for the 'judge' reward."),
    engine_url: list[str] = typer.Option(
        None, help="Roll out on this SGLang, vLLM or `rallyrl serve` server; repeat for several. Weights sync via disk."
    ),
    engine_server: str = typer.Option(None, help=ENGINE_SERVER_HELP),
    threads: int = typer.Option(None, help="torch intra-op threads."),
    progress: bool = typer.Option(None, "--progress/--no-progress", help="Show a progress bar of the steps."),
    async_rl: bool = typer.Option(
        None, "--async/--sync", help="Overlap rollout and training (async_rl), or step by step (default)."
    ),
    max_staleness: int = typer.Option(None, help="Async: the most policy versions a trained token may lag."),
) -> None:
    """Train with GRPO: rollout, rewards, advantages, update, weight sync, log; checkpoints as it goes."""
    flags = {
        "steps": steps, "out": out, "model": model, "task": task, "data": data, "agent": agent,
        "prompts_per_step": prompts_per_step,
        "samples_per_prompt": samples_per_prompt, "lr": lr, "seed": seed, "reward": reward, "judge.url": judge_url,
        "engine.urls": engine_url or None, "engine.server": engine_server, "threads": threads, "progress": progress,
        "async_rl": async_rl, "max_staleness": max_staleness,
    }  # fmt: skip
    from trainer.grpo import train as run_train

    with _errors_for_people():
        grpo_config = _load("train", config, flags, set_)
        history = run_train(grpo_config, resume=resume)
    if history:
        last = history[-1]
        console.print(f"done: step {last['step']}, rollout/accuracy {last['rollout/accuracy']:.3f}; "
                      f"model in {grpo_config.out}/final")  # fmt: skip


@app.command()
def sft(
    config: Path = typer.Option(None, help=CONFIG_HELP),
    set_: list[str] = typer.Option(None, "--set", help=SET_HELP),
    out: Path = typer.Option(None, help="Output directory: step-N/ checkpoints and sft_log.jsonl (default: runs/sft)."),
    model: Path = typer.Option(None, help="Model directory to start from (default: a fresh tiny Qwen2)."),
    data: Path = typer.Option(None, help="Conversations or rollout trajectories (JSONL); default: calc traces."),
    min_reward: float = typer.Option(None, help="Trajectory data: keep those with at least this reward."),
    num_examples: int = typer.Option(None, help="Examples to use (0 = all of --data)."),
    steps: int = typer.Option(None, help="Optimizer steps."),
    batch_size: int = typer.Option(None, help="Examples per step."),
    lr: float = typer.Option(None, help="Peak learning rate."),
    eval_every: int = typer.Option(None, help="Evaluate and checkpoint every N steps."),
    eval_prompts: int = typer.Option(None, help="Held-out calc problems per evaluation (0 = none)."),
    seed: int = typer.Option(None, help="Seed of initialisation, data order and generated traces."),
    device: str = typer.Option(None, help='"cpu" or "auto".'),
    recipe: str = typer.Option(None, help="Run a staged recipe (tiny-calc: the embedded model's)."),
    stop_accuracy: float = typer.Option(None, help="Stop once held-out accuracy reaches this."),
    export: Path = typer.Option(None, help="Copy the last checkpoint here (data/assets/tiny-calc rebuilds it)."),
    threads: int = typer.Option(None, help="torch intra-op threads."),
    progress: bool = typer.Option(None, "--progress/--no-progress", help="Show a progress bar."),
) -> None:
    """Supervised fine-tuning on conversations or trajectories, loss on assistant tokens only.
    `--recipe tiny-calc --export data/assets/tiny-calc` rebuilds the embedded model."""
    from data.config_tree import build
    from trainer.sft import SFTConfig, run_recipe, run_sft

    flags = {
        "out": out, "model": model, "data": data, "min_reward": min_reward, "num_examples": num_examples,
        "steps": steps, "batch_size": batch_size, "lr": lr, "eval_every": eval_every, "eval_prompts": eval_prompts,
        "seed": seed, "device": device, "stop_accuracy": stop_accuracy, "export": export, "threads": threads,
        "progress": progress,
    }  # fmt: skip
    with _errors_for_people():
        given = _given("sft", config, flags, set_)
        sft_config = build(SFTConfig, given)  # checks every setting, recipe or not
        if recipe is not None:  # the settings given apply to every stage; the stages set the rest
            settings = {k: v for k, v in given.items() if k not in ("out", "export")}
            history = run_recipe(recipe, sft_config.out, sft_config.export, console, **settings)
        else:
            history = run_sft(sft_config, console=console)
    evals = [h for h in history if h.get("accuracy") is not None]
    if evals:
        best = max(evals, key=lambda h: h["accuracy"])
        console.print(f"best held-out accuracy {best['accuracy']:.3f} at step {best['step']}; "
                      f"checkpoints in {sft_config.out}")  # fmt: skip


@app.command("eval")
def evaluate(
    config: Path = typer.Option(None, help=CONFIG_HELP),
    set_: list[str] = typer.Option(None, "--set", help=SET_HELP),
    model: Path = typer.Option(None, help="Model directory or checkpoint (default: the embedded model)."),
    task: str = typer.Option(None, help="Synthetic task (default: calc)."),
    data: Path = typer.Option(None, help="Dataset file instead of a task."),
    num_prompts: int = typer.Option(None, help="Prompts (default: 300 for a task, all for --data)."),
    seed: int = typer.Option(None, help="Seed of the task's prompts (default 12345, apart from training seeds)."),
    samples_per_prompt: int = typer.Option(
        None, "-n", "--samples-per-prompt", "--samples", help="Samples per prompt for pass@k (default 4)."
    ),
    tools: Path = typer.Option(None, help="Tool config (YAML or JSON); default: the calculator."),
    interactions: Path = typer.Option(None, help="Interaction config (verl's interaction YAML): the user's turns."),
    agent: str = typer.Option(None, help=AGENT_HELP),
    max_turns: int = typer.Option(None, help="Most assistant turns per request (default 3)."),
    max_new_tokens: int = typer.Option(None, help="Most tokens per assistant turn (default 96)."),
    engine_url: list[str] = typer.Option(None, help="Evaluate a model served here (SGLang, vLLM or `rallyrl serve`)."),
    engine_server: str = typer.Option(None, help=ENGINE_SERVER_HELP),
    json_out: Path = typer.Option(None, "--json", help="Write the report as JSON here."),
    report_md: Path = typer.Option(None, "--report", help="Write a Markdown report here."),
    threads: int = typer.Option(None, help="torch intra-op threads."),
    progress: bool = typer.Option(None, "--progress/--no-progress", help="Show progress bars."),
) -> None:
    """Greedy accuracy and unbiased pass@k of a model on a task or dataset, overall and per data_source."""
    flags = {
        "model": model, "task": task, "data": data, "num_prompts": num_prompts, "seed": seed,
        "samples_per_prompt": samples_per_prompt, "tools": tools, "interactions": interactions, "agent": agent,
        "rollout.max_turns": max_turns,
        "rollout.max_new_tokens": max_new_tokens, "engine.urls": engine_url or None, "json": json_out,
        "engine.server": engine_server, "report": report_md, "threads": threads, "progress": progress,
    }  # fmt: skip
    from data.files import atomic_write_bytes
    from rollout.api import resolve_model
    from trainer.evaluation import breakdown_table, run_eval, write_markdown_report

    with _errors_for_people():
        eval_config = _load("eval", config, flags, set_)
        model_dir = resolve_model(eval_config.model)
        report = asyncio.run(run_eval(eval_config))
    accuracy = "-" if report["accuracy"] is None else f"{report['accuracy']:.3f}"  # None: nothing graded
    console.print(
        f"{model_dir}: greedy accuracy {accuracy} on {report['prompts']} prompts; "
        + ", ".join(f"pass@{k} {v:.3f}" for k, v in report["pass_at_k"].items())
    )
    console.print(breakdown_table(report))
    try:
        if eval_config.json is not None:
            atomic_write_bytes(eval_config.json, orjson.dumps(report, option=orjson.OPT_INDENT_2))
        if eval_config.report is not None:
            prompts = eval_config.data or f"task {eval_config.task or 'calc'} (seed {eval_config.seed})"
            meta = {"model": model_dir, "prompts": prompts, "samples": eval_config.samples_per_prompt}
            write_markdown_report(report, eval_config.report, meta)
            console.print(f"wrote the report to {eval_config.report}", highlight=False)
    except OSError as exc:
        raise _fail(f"{exc.filename}: {exc.strerror or exc}") from None


@app.command()
def serve(
    config: Path = typer.Option(None, help=CONFIG_HELP),
    set_: list[str] = typer.Option(None, "--set", help=SET_HELP),
    model: Path = typer.Option(None, help="Model directory to serve (default: the embedded model)."),
    host: str = typer.Option(None, help="Interface to bind (default 127.0.0.1, loopback)."),
    port: int = typer.Option(None, help="Port (default 30000; 0: pick a free one and print it)."),
    max_batch_size: int = typer.Option(None, help="Most sequences decoded together (default 256)."),
    max_model_len: int = typer.Option(None, help="Context limit (default: the model's)."),
    device: str = typer.Option(None, help='"auto", "cpu" or "cuda".'),
    seed: int = typer.Option(None, help="Seed of the sampling generator."),
    served_model_name: str = typer.Option(None, help="Model name in the OpenAI API."),
    tool_parser: str = typer.Option(None, help="Tool-call parser of /v1/chat/completions (default qwen25)."),
    reasoning_parser: str = typer.Option(None, help="Reasoning parser of /v1/chat/completions (default none)."),
    api_key: str = typer.Option(None, help="Require 'Authorization: Bearer KEY'."),
    fault_error_rate: float = typer.Option(None, help="Testing: share of /generate calls answered HTTP 500."),
    fault_hang_rate: float = typer.Option(None, help="Testing: share of /generate calls held open unanswered."),
    fault_drop_rate: float = typer.Option(None, help="Testing: share of /generate calls reset mid-response."),
    fault_seed: int = typer.Option(None, help="Seed of the fault draws (the same calls fail in every run)."),
    threads: int = typer.Option(None, help="torch intra-op threads."),
) -> None:
    """Serve a model with the embedded engine behind SGLang's HTTP API (and OpenAI's).
    The --fault-* options make a share of /generate calls fail, to test clients (GET /fault_stats counts them)."""
    flags = {
        "model": model, "host": host, "port": port, "engine.max_batch_size": max_batch_size,
        "engine.max_model_len": max_model_len, "engine.device": device, "seed": seed,
        "served_model_name": served_model_name, "tool_parser": tool_parser,
        "reasoning_parser": reasoning_parser, "api_key": api_key,
        "faults.error_rate": fault_error_rate, "faults.hang_rate": fault_hang_rate,
        "faults.drop_rate": fault_drop_rate, "faults.seed": fault_seed, "threads": threads,
    }  # fmt: skip
    with _errors_for_people():
        serve_config = _load("serve", config, flags, set_)
    try:
        with _errors_for_people():
            asyncio.run(_serve(serve_config))
    except OSError as exc:  # the port is taken, the address cannot be bound
        raise _fail(f"cannot serve on {serve_config.host}:{serve_config.port}: {exc.strerror or exc}") from None
    except KeyboardInterrupt:
        console.print("server stopped")


async def _serve(config: Any) -> None:
    import dataclasses

    from rollout.api import resolve_model, set_threads
    from rollout.engines.local import LocalEngine
    from rollout.serve.app import serve
    from rollout.tokens import load_tokenizer

    set_threads(config.threads)
    model_dir = resolve_model(config.model)
    config = dataclasses.replace(config, model=str(model_dir.resolve()))
    engine_config = config.engine
    if engine_config.seed is None:
        engine_config = dataclasses.replace(engine_config, seed=config.seed)
    ready = asyncio.Event()
    async with LocalEngine.from_pretrained(model_dir, engine_config) as engine:
        task = asyncio.create_task(serve(engine, load_tokenizer(model_dir), config, ready))
        await asyncio.wait([task, asyncio.create_task(ready.wait())], return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()  # raises the bind error
        console.print(f"serving {model_dir} on http://{config.host}:{config.port}", highlight=False)
        faults = config.faults
        if faults is not None:
            console.print(f"injecting faults into /generate: {faults.error_rate:.1%} errors, {faults.hang_rate:.1%} "
                          f"hangs, {faults.drop_rate:.1%} drops (seed {faults.seed})", highlight=False)  # fmt: skip
        await task


@app.command()
def gateway(
    config: Path = typer.Option(None, help=CONFIG_HELP),
    set_: list[str] = typer.Option(None, "--set", help=SET_HELP),
    model: Path = typer.Option(None, help="Model directory (default: embedded); with --engine-url, its tokenizer."),
    host: str = typer.Option(None, help="Interface to bind (default 127.0.0.1, loopback)."),
    port: int = typer.Option(None, help="Port (default 8100; 0: pick a free one)."),
    out: Path = typer.Option(None, help="JSONL of finished sessions, one trajectory each (default: sessions.jsonl)."),
    sampling: str = typer.Option(None, help='"rollout": the config\'s sampling for every call (default); "request".'),
    max_sessions: int = typer.Option(None, help="Most sessions open at once (default 4096)."),
    max_turns: int = typer.Option(None, help="Most assistant turns per session."),
    max_new_tokens: int = typer.Option(None, help="Most tokens per answer."),
    max_model_len: int = typer.Option(None, help="Most tokens per conversation."),
    temperature: float = typer.Option(None, help="Sampling temperature (with --sampling rollout)."),
    reward: str = typer.Option(None, help="Reward of sessions none is posted for (data/reward_fns.py)."),
    engine_url: list[str] = typer.Option(None, help="SGLang, vLLM or `rallyrl serve` server URL; repeat for a pool."),
    engine_server: str = typer.Option(None, help=ENGINE_SERVER_HELP),
    device: str = typer.Option(None, help='Embedded engine device: "auto", "cpu" or "cuda".'),
    seed: int = typer.Option(None, help="Seed of the engine's sampling."),
    threads: int = typer.Option(None, help="torch intra-op threads."),
) -> None:
    """The agent gateway: an OpenAI-compatible endpoint that records each agent run (a session) token
    for token. POST /sessions opens one; its base URL goes to any OpenAI client; finished sessions
    are written to --out as trajectories (train on them, `rallyrl show` them)."""
    flags = {
        "model": model, "gateway.host": host, "gateway.port": port, "out": out, "gateway.sampling": sampling,
        "gateway.max_sessions": max_sessions, "rollout.max_turns": max_turns, "rollout.max_new_tokens": max_new_tokens,
        "rollout.max_model_len": max_model_len, "rollout.temperature": temperature, "reward": reward,
        "engine.urls": engine_url or None, "engine.server": engine_server, "engine.local.device": device,
        "seed": seed, "threads": threads,
    }  # fmt: skip
    from rollout.api import serve_gateway

    with _errors_for_people():
        gateway_config = _load("gateway", config, flags, set_)
    try:
        with _errors_for_people():
            asyncio.run(serve_gateway(gateway_config, console))
    except OSError as exc:
        raise _fail(f"cannot serve on {gateway_config.gateway.host}:{gateway_config.gateway.port}: "
                    f"{exc.strerror or exc}") from None  # fmt: skip
    except KeyboardInterrupt:
        console.print(f"gateway stopped; finished sessions are in {gateway_config.out}")


@app.command()
def bench(
    workload: str = typer.Option("all", help="W1, W2, W3 or all (benchmarks/workloads.py)."),
    quick: bool = typer.Option(False, "--quick", help="Smaller workloads: all three in under a minute."),
    json_out: Path = typer.Option(None, "--json", help="Write the figures as JSON here."),
    plot: Path = typer.Option(None, help="Write the request timelines as a PNG here."),
    rounds: int = typer.Option(
        None,
        help="Rounds of rallyrl and the bare client, alternately; the median round of each is reported "
        "(default 3, 1 with --quick).",
    ),
) -> None:
    """Tool-call concurrency: rallyrl vs an exact bound, a bare aiohttp client and a batch-level
    baseline, against a simulated SGLang server (Markdown table, JSON, timeline PNG)."""
    from benchmarks.tool_concurrency import default_rounds, run_benchmark, workloads_named
    from benchmarks.workloads import WORKLOADS

    if workload != "all" and workload not in WORKLOADS:
        raise _fail(f"--workload must be one of {', '.join(WORKLOADS)} or all, got {workload!r}")
    if rounds is not None and rounds < 1:
        raise _fail(f"--rounds must be at least 1, got {rounds}")
    names = list(WORKLOADS) if workload == "all" else [workload]
    run_benchmark(workloads_named(names, quick), json_out, plot, console, rounds or default_rounds(quick))


def _register_more_commands() -> None:
    """Commands on files and data, defined beside what they work on."""
    from data.commands import data_app, export_model, new_model
    from rollout.files.commands import check, export_command, show_command

    app.command("new-model")(new_model)
    app.command("export-model")(export_model)
    app.command("check")(check)
    app.command("export")(export_command)
    app.command("show")(show_command)
    app.add_typer(data_app, name="data")


_register_more_commands()

if __name__ == "__main__":
    app()
