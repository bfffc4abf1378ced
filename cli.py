"""The ``rallyrl`` command line: parse, call, print.

Every command that has settings reads them into its config tree (``rollout/config.py``,
``trainer/config.py``): defaults, then ``--config FILE`` (YAML), then the flags given, then
``--set a.b=VALUE``. A flag not given leaves the file's value. ``rallyrl config --show`` prints the
resolved tree. The work itself is in ``rollout.api``, ``trainer.grpo``, ``trainer.evaluation``
and ``trainer.sft``; the commands on files, data, ``serve`` and ``gateway`` are defined beside what
they run (``_register_more_commands``), the options they share in ``data/command_options.py``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import orjson
import typer

from data.command_options import AGENT_HELP, CONFIG_HELP, ENGINE_SERVER_HELP, SET_HELP, given_config, load_config
from data.command_options import errors_for_people as _errors_for_people
from data.console import console, stuck_exit
from data.console import fail as _fail
from rollout.event_loop import run as run_on_loop

app = typer.Typer(
    name="rallyrl",
    help="Multi-turn, tool-calling rollouts and RL for language-model agents.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)

LOG_WITH_HELP = (
    "Also log to Accelerate's trackers, offline under the run directory: tensorboard, wandb, "
    "trackio or mlflow (repeat for several; log_with)."
)
COMMANDS = ("rollout", "train", "eval", "serve", "sft", "gateway")


def _config_class(command: str) -> type:
    if command in ("rollout", "serve", "gateway"):
        from rollout.config import GatewayJobConfig, RolloutJobConfig, ServeConfig

        return {"rollout": RolloutJobConfig, "serve": ServeConfig, "gateway": GatewayJobConfig}[command]
    from trainer.config import EvalConfig, GRPOConfig, SFTConfig

    return {"train": GRPOConfig, "eval": EvalConfig, "sft": SFTConfig}[command]


def _given(command: str, path: Path | None, flags: dict[str, Any], sets: list[str] | None) -> dict[str, Any]:
    """What the YAML file, the flags given (dotted names) and --set say, in that order of precedence."""
    return given_config(_config_class(command), path, flags, sets)


def _load(command: str, path: Path | None, flags: dict[str, Any], sets: list[str] | None) -> Any:
    """The command's config: defaults < the YAML file < flags given < --set."""
    return load_config(_config_class(command), path, flags, sets)


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
    SGLang, and write trajectories to JSONL as they finish. Ctrl-C (exit 130) or SIGTERM (143) keeps
    every finished one; the same command with --resume runs the rest."""
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
    from trainer.preemption import sigterm_as_ctrl_c

    with _errors_for_people():
        job = _load("rollout", config, flags, set_)
        records = load_prompts(job)
    out_path = Path(job.out)
    stack = contextlib.ExitStack()
    terminated = stack.enter_context(sigterm_as_ctrl_c())  # a scheduler's SIGTERM keeps what Ctrl-C keeps
    try:
        with _errors_for_people():
            stack.enter_context(output_lock(out_path))  # held until the command ends
            done = finished_pairs(out_path, len(records), job.samples_per_prompt) if job.resume else set()
            summary, ran, first_error = run_on_loop(rollout_summary(job, records, skip=done, console=console),
                                                    job.event_loop)  # fmt: skip
    except KeyboardInterrupt:
        total = len(records) * job.samples_per_prompt
        finished = count_lines(out_path)
        console.print(f"interrupted: {finished} of {total} trajectories finished and are in {out_path}; "
                      f"{total - finished} were cut. The same command with --resume runs those.",
                      highlight=False)  # fmt: skip
        raise stuck_exit(terminated.exit_code) from None  # 130 (Ctrl-C) or 143 (SIGTERM)
    finally:
        stack.close()
    console.print(summary.table())
    if job.resume:
        console.print(f"resumed: {len(done)} trajectories were already in {out_path}; added {ran}")
    else:
        console.print(f"wrote {ran} trajectories to {out_path}")
    failed = ran and summary.error_rate >= job.fail_at_error_rate
    if failed:
        typer.echo(f"error: {summary.error_rate:.0%} of the trajectories ended in an error (fail_at_error_rate "
                   f"{job.fail_at_error_rate:g}); the first: {first_error}", err=True)  # fmt: skip
    if (end := stuck_exit(1 if failed else 0)) is not None:
        raise end


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
        None, help="Roll out on this SGLang, vLLM or `rallyrl serve` server; repeat for several."
    ),
    engine_server: str = typer.Option(None, help=ENGINE_SERVER_HELP),
    weight_sync: str = typer.Option(
        None, help="How --engine-url servers get each step's weights: auto, broadcast, tensor or disk (weight_sync)."
    ),
    threads: int = typer.Option(None, help="torch intra-op threads."),
    progress: bool = typer.Option(None, "--progress/--no-progress", help="Show a progress bar of the steps."),
    async_rl: bool = typer.Option(
        None, "--async/--sync", help="Overlap rollout and training (async_rl), or step by step (default)."
    ),
    max_staleness: int = typer.Option(None, help="Async: the most policy versions a trained token may lag."),
    colocate: bool = typer.Option(
        None, "--colocate/--no-colocate", help="Release the in-process engine's memory for each update (colocate)."
    ),
    checkpoint_on_signal: str = typer.Option(
        None, help="Also checkpoint and exit 75 on this signal, e.g. SIGUSR1 (SIGTERM and SIGINT always do)."
    ),
    log_with: list[str] = typer.Option(None, help=LOG_WITH_HELP),
) -> None:
    """Train with GRPO: rollout, rewards, advantages, update, weight sync, log; checkpoints as it goes.
    SIGTERM, SIGINT or --checkpoint-on-signal: a checkpoint at the next safe point, then exit 75."""
    flags = {
        "steps": steps, "out": out, "model": model, "task": task, "data": data, "agent": agent,
        "prompts_per_step": prompts_per_step,
        "samples_per_prompt": samples_per_prompt, "lr": lr, "seed": seed, "reward": reward, "judge.url": judge_url,
        "engine.urls": engine_url or None, "engine.server": engine_server, "weight_sync.transport": weight_sync,
        "threads": threads, "progress": progress, "async_rl": async_rl, "max_staleness": max_staleness,
        "colocate": colocate, "checkpoint_on_signal": checkpoint_on_signal, "log_with": log_with or None,
    }  # fmt: skip
    with _errors_for_people():
        grpo_config = _load("train", config, flags, set_)  # a bad setting fails before torch loads
        from trainer.grpo import train as run_train
        from trainer.preemption import PREEMPTED_EXIT_CODE, Preempted

        try:
            history = run_train(grpo_config, resume=resume)
        except Preempted as stop:  # its checkpoint written: 75 (EX_TEMPFAIL) for a scheduler's requeue
            if stop.is_main:
                console.print(str(stop), highlight=False)
            raise stuck_exit(PREEMPTED_EXIT_CODE) from None
    if history:
        last = history[-1]
        console.print(f"done: step {last['step']}, rollout/accuracy {last['rollout/accuracy']:.3f}; "
                      f"model in {grpo_config.out}/final")  # fmt: skip
    if (end := stuck_exit()) is not None:
        raise end


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
    log_with: list[str] = typer.Option(None, help=LOG_WITH_HELP),
) -> None:
    """Supervised fine-tuning on conversations or trajectories, loss on assistant tokens only.
    `--recipe tiny-calc --export data/assets/tiny-calc` rebuilds the embedded model."""
    from data.config_tree import build
    from trainer.config import SFTConfig

    flags = {
        "out": out, "model": model, "data": data, "min_reward": min_reward, "num_examples": num_examples,
        "steps": steps, "batch_size": batch_size, "lr": lr, "eval_every": eval_every, "eval_prompts": eval_prompts,
        "seed": seed, "device": device, "stop_accuracy": stop_accuracy, "export": export, "threads": threads,
        "progress": progress, "log_with": log_with or None,
    }  # fmt: skip
    with _errors_for_people():
        given = _given("sft", config, flags, set_)
        sft_config = build(SFTConfig, given)  # checks every setting, recipe or not, before torch loads
        from trainer.sft import run_recipe, run_sft

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

    with _errors_for_people():
        eval_config = _load("eval", config, flags, set_)
        model_dir = resolve_model(eval_config.model)  # a bad setting or model fails before torch loads
        from trainer.evaluation import breakdown_table, run_eval, write_markdown_report

        report = run_on_loop(run_eval(eval_config), eval_config.event_loop)
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
    if (end := stuck_exit()) is not None:
        raise end


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
    from rollout.files.commands import check, export_command
    from rollout.gateway.command import gateway_command
    from rollout.serve.command import serve_command
    from trainer.metrics_show import show_command  # trajectories, and a run's metrics.jsonl

    app.command("new-model")(new_model)
    app.command("export-model")(export_model)
    app.command("check")(check)
    app.command("export")(export_command)
    app.command("show")(show_command)
    app.command("serve")(serve_command)
    app.command("gateway")(gateway_command)
    app.add_typer(data_app, name="data")


_register_more_commands()

if __name__ == "__main__":
    app()
