"""The ``rallyrl`` command line."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import orjson
import typer
from rich.console import Console

app = typer.Typer(
    name="rallyrl",
    help="Multi-turn, tool-calling rollouts and RL for language-model agents.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
console = Console(stderr=True, soft_wrap=True)


class UserError(Exception):
    """Bad input from the command line: printed without a stack trace, exit code 2."""


def _fail(message: str) -> typer.Exit:
    from rich.markup import escape

    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False)
    return typer.Exit(code=2)


def _resolve_model(model: Path | None) -> Path:
    if model is not None:
        if not (model / "config.json").is_file():
            raise UserError(f"--model {model}: not a Hugging Face model directory (no config.json)")
        return model
    from data.tiny_model import EMBEDDED_MODEL

    if (EMBEDDED_MODEL / "config.json").is_file():
        return EMBEDDED_MODEL
    raise UserError(
        f"no embedded model at {EMBEDDED_MODEL} (`rallyrl sft --recipe tiny-calc --export {EMBEDDED_MODEL}` "
        "rebuilds it); or pass --model DIR (a local Hugging Face causal-LM directory)"
    )


@app.command()
def rollout(
    task: str = typer.Option(None, help="Synthetic task to generate prompts for (default: calc)."),
    data: Path = typer.Option(None, help="Dataset file (.jsonl, .json or .parquet; rallyrl or verl layout)."),
    num_prompts: int = typer.Option(None, help="Prompts to use (default: 64 for a task, all for --data)."),
    samples: int = typer.Option(1, "-n", "--samples", help="Samples per prompt."),
    model: Path = typer.Option(None, help="Local Hugging Face model directory (default: the embedded model)."),
    tools: Path = typer.Option(None, help="Tool config (YAML or JSON); default: the calculator."),
    out: Path = typer.Option(Path("rollouts.jsonl"), help="Output JSONL, one trajectory per line."),
    max_concurrency: int = typer.Option(64, help="Requests in flight at once."),
    max_turns: int = typer.Option(8, help="Most assistant turns per request."),
    max_new_tokens: int = typer.Option(256, help="Most tokens per assistant turn."),
    max_model_len: int = typer.Option(2048, help="Most tokens per conversation."),
    temperature: float = typer.Option(1.0, help="Sampling temperature (0 = greedy)."),
    top_p: float = typer.Option(1.0, help="Nucleus sampling cut."),
    seed: int = typer.Option(0, help="Seed for the task's prompts and for sampling."),
    device: str = typer.Option("auto", help='"auto", "cpu" or "cuda".'),
    engine_url: list[str] = typer.Option(
        None, help="SGLang (or `rallyrl serve`) server URL; repeat for a pool. --model then names the tokenizer."
    ),
    engine: str = typer.Option("local", help='"local" (embedded) or "sglang" (in-process SGLang, CUDA).'),
    resume: bool = typer.Option(False, help="Keep the trajectories already in --out; run only the missing ones."),
    reward: str = typer.Option(
        None, help='Reward by data_source, e.g. "openai/gsm8k=math+0.1*format,default=math" (data/reward_fns.py).'
    ),
    judge_url: str = typer.Option(None, help="OpenAI-compatible URL of a judge model, for the 'judge' reward."),
    judge_concurrency: int = typer.Option(16, help="Most judge calls in flight at once."),
    progress: bool = typer.Option(True, help="Show a progress bar."),
) -> None:
    """Roll out prompts with tool calls through the embedded engine, SGLang servers or in-process
    SGLang, and write trajectories to JSONL as they finish. Ctrl-C keeps every finished one;
    the same command with --resume runs the rest."""
    from data.schema import RecordError
    from rollout.engines.base import EngineError
    from rollout.tokens import TemplateError
    from tools.registry import ToolConfigError

    stack = contextlib.ExitStack()
    try:
        if task is not None and data is not None:
            raise UserError("give --task or --data, not both")
        if engine not in ("local", "sglang"):
            raise UserError(f"--engine must be local or sglang, got {engine!r}")
        model_dir = _resolve_model(model)
        records = _load_prompts(task, data, num_prompts, seed)
        from rollout.loop import RolloutConfig  # heavy imports only when the command runs

        config = RolloutConfig(
            max_turns=max_turns,
            max_new_tokens=max_new_tokens,
            max_model_len=max_model_len,
            temperature=temperature,
            top_p=top_p,
        )
        stack.enter_context(_output_lock(out))  # held until the command ends
        done = _already_done(out, len(records), samples) if resume else set()
        result = asyncio.run(
            _rollout(
                model_dir,
                records,
                engine_urls=engine_url or [],
                engine_kind=engine,
                samples=samples,
                tools_path=tools,
                config=config,
                out_path=out,
                max_concurrency=max_concurrency,
                seed=seed,
                device=device,
                progress=progress,
                skip=done,
                reward_spec=reward,
                judge_url=judge_url,
                judge_concurrency=judge_concurrency,
            )
        )
    except (UserError, RecordError, ToolConfigError, TemplateError, EngineError) as exc:
        raise _fail(str(exc)) from None
    except ValueError as exc:  # a setting out of range (RolloutConfig, SamplingParams)
        raise _fail(f"bad option: {exc}") from None
    except KeyboardInterrupt:
        total = len(records) * samples
        finished = _count_lines(out)
        console.print(
            f"interrupted: {finished} of {total} trajectories finished and are in {out}; "
            f"{total - finished} were cut. The same command with --resume runs those.",
            highlight=False,
        )
        raise typer.Exit(code=130) from None
    finally:
        stack.close()
    console.print(result.summary.table())
    if resume:
        console.print(f"resumed: {len(done)} trajectories were already in {out}; added {len(result.requests)}")
    else:
        console.print(f"wrote {len(result.requests)} trajectories to {out}")


@contextlib.contextmanager
def _output_lock(out: Path):
    """One rollout at a time writes ``out``: a second one (say, a --resume while the first still
    runs) would interleave their lines."""
    import fcntl

    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"another rallyrl rollout is writing {out}; wait for it or choose another --out") from None
        try:
            yield
        finally:
            Path(handle.name).unlink(missing_ok=True)


def _already_done(out: Path, prompts: int, samples: int) -> set[tuple[int, int]]:
    """(prompt, sample) pairs finished by an earlier run of the same command (--resume)."""
    from rollout.runner import read_finished

    if not out.exists():
        return set()
    done = read_finished(out)
    outside = sorted((p, s) for p, s in done if p >= prompts or s >= samples)
    if outside:
        raise UserError(
            f"--resume: {out} holds trajectories for (prompt, sample) {outside[0]} outside this run's "
            f"{prompts} prompts x {samples} samples; resume with the options of the run that wrote it"
        )
    return done


def _count_lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except OSError:
        return 0


async def _rollout(
    model_dir: Path,
    records,
    *,
    engine_urls: list[str],
    engine_kind: str,
    samples: int,
    tools_path: Path | None,
    config,
    out_path: Path,
    max_concurrency: int,
    seed: int,
    device: str,
    progress: bool,
    skip: set[tuple[int, int]],
    reward_spec: str | None = None,
    judge_url: str | None = None,
    judge_concurrency: int = 16,
):
    """Engine + chat tokenizer + tools + rewards (+ judge) + runner, wired for one rollout."""
    from data.reward_fns import reward_for_records
    from rollout.judge import Judge, JudgeConfig
    from rollout.loop import default_reward
    from rollout.runner import RolloutRunner
    from rollout.tokens import ChatTokenizer, load_tokenizer
    from tools.registry import DEFAULT_TOOLS, build_tools, load_tools

    tools = load_tools(tools_path) if tools_path else build_tools(DEFAULT_TOOLS)
    tokenizer = load_tokenizer(model_dir)
    chat = ChatTokenizer(tokenizer, [tool.schema for tool in tools.values()])
    judge = Judge(judge_url, JudgeConfig(max_concurrency=judge_concurrency)) if judge_url else None
    if judge is not None and not (reward_spec and "judge" in reward_spec):
        raise UserError("--judge-url needs a --reward that uses it, e.g. --reward judge or 'math+0.5*judge'")
    try:
        reward_fn = reward_for_records(reward_spec, {"judge": judge.reward} if judge else None) if reward_spec else None
    except (KeyError, ValueError) as exc:
        raise UserError(f"--reward: {exc}") from None
    async with contextlib.AsyncExitStack() as stack:
        if judge is not None:
            await stack.enter_async_context(judge)
        engine = await stack.enter_async_context(
            _open_engine(model_dir, engine_urls, engine_kind, max_concurrency, config.max_model_len, device, seed)
        )
        runner = RolloutRunner(
            engine, chat, tools, config, max_concurrency=max_concurrency, progress=progress, console=console,
            reward_fn=reward_fn or default_reward,
        )  # fmt: skip
        return await runner.run(records, samples, out_path, skip=skip, append=bool(skip))


def _open_engine(model_dir: Path, engine_urls: list[str], kind: str, max_batch_size: int, max_model_len: int,
                 device: str, seed: int):  # fmt: skip
    """The engine of a command, not yet entered: servers (--engine-url), in-process SGLang or embedded."""
    if engine_urls:
        from rollout.engines.pool import connect

        try:
            return connect(engine_urls)
        except ValueError as exc:
            raise UserError(f"--engine-url: {exc}") from None
    if kind == "sglang":
        from rollout.engines.sglang_engine import SGLangEngine

        return SGLangEngine.from_pretrained(str(model_dir))
    from rollout.engines.local import LocalEngine, LocalEngineConfig

    config = LocalEngineConfig(max_batch_size=max(1, max_batch_size), max_model_len=max_model_len, device=device,
                               seed=seed)  # fmt: skip
    return LocalEngine.from_pretrained(model_dir, config)


def _load_prompts(task: str | None, data: Path | None, num_prompts: int | None, seed: int):
    from data.schema import load_records
    from data.synthetic import make_task

    if num_prompts is not None and num_prompts < 1:
        raise UserError(f"--num-prompts must be >= 1, got {num_prompts}")
    if data is not None:
        records = load_records(data)
        if not records:
            raise UserError(f"{data}: no records")
        return records[:num_prompts] if num_prompts else records
    try:
        return make_task(task or "calc", num_prompts or 64, seed)
    except ValueError as exc:  # unknown task name
        raise UserError(f"--task: {exc}") from None


@app.command()
def train(
    config: Path = typer.Option(None, help="YAML file of GRPOConfig fields (trainer/config.py)."),
    steps: int = typer.Option(None, help="GRPO steps."),
    out: Path = typer.Option(None, help="Run directory (metrics.jsonl, checkpoints/, final/, curves.png)."),
    resume: bool = typer.Option(False, help="Continue from the last checkpoint in --out."),
    model: Path = typer.Option(None, help="Model directory to start from (default: the embedded model)."),
    task: str = typer.Option(None, help="Synthetic task (default: calc)."),
    data: Path = typer.Option(None, help="Dataset file instead of a task."),
    prompts_per_step: int = typer.Option(None, help="Prompts (groups) per step."),
    samples_per_prompt: int = typer.Option(None, "-n", "--samples-per-prompt", help="Samples per prompt."),
    lr: float = typer.Option(None, help="Learning rate."),
    seed: int = typer.Option(None, help="Seed."),
    progress: bool = typer.Option(None, help="Show a progress bar of the steps."),
    engine_url: list[str] = typer.Option(
        None, help="Roll out on this SGLang (or `rallyrl serve`) server; repeat for several. Weights sync via disk."
    ),
) -> None:
    """Train with GRPO: rollout, rewards, advantages, update, weight sync, log; checkpoints as it goes."""
    from data.schema import RecordError
    from rollout.engines.base import EngineError
    from trainer.config import load_config
    from trainer.grpo import train as run_train

    overrides = {
        "steps": steps,
        "out": str(out) if out else None,
        "model": str(model) if model else None,
        "task": task,
        "data": str(data) if data else None,
        "prompts_per_step": prompts_per_step,
        "samples_per_prompt": samples_per_prompt,
        "lr": lr,
        "seed": seed,
        "progress": progress,
        "engine_urls": engine_url or None,
    }
    try:
        grpo_config = load_config(config, overrides)
        history = run_train(grpo_config, resume=resume)
    except (RecordError, ValueError, EngineError) as exc:
        raise _fail(str(exc)) from None
    if history:
        last = history[-1]
        console.print(f"done: step {last['step']}, accuracy {last['accuracy']:.3f}; model in {grpo_config.out}/final")


@app.command()
def sft(
    out: Path = typer.Option(Path("runs/sft"), help="Output directory: step-N/ checkpoints and sft_log.jsonl."),
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
    progress: bool = typer.Option(True, help="Show a progress bar."),
) -> None:
    """Supervised fine-tuning on conversations or trajectories, loss on assistant tokens only.
    `--recipe tiny-calc --export data/assets/tiny-calc` rebuilds the embedded model."""
    from data.schema import RecordError
    from trainer.sft import SFTConfig, run_recipe, run_sft

    given = {
        "out": str(out),
        "model": str(model) if model else None,
        "data": str(data) if data else None,
        "min_reward": min_reward,
        "num_examples": num_examples,
        "steps": steps,
        "batch_size": batch_size,
        "lr": lr,
        "eval_every": eval_every,
        "eval_prompts": eval_prompts,
        "seed": seed,
        "device": device,
        "stop_accuracy": stop_accuracy,
        "export": str(export) if export else None,
        "progress": progress,
    }
    try:
        if recipe is not None:
            settings = {k: v for k, v in given.items() if v is not None and k not in ("out", "export")}
            history = run_recipe(recipe, out, export, console, **settings)
        else:
            history = run_sft(SFTConfig(**{k: v for k, v in given.items() if v is not None}), console=console)
    except (RecordError, ValueError) as exc:
        raise _fail(str(exc)) from None
    evals = [h for h in history if h.get("accuracy") is not None]
    if evals:
        best = max(evals, key=lambda h: h["accuracy"])
        console.print(f"best held-out accuracy {best['accuracy']:.3f} at step {best['step']}; checkpoints in {out}")


@app.command("eval")
def evaluate(
    model: Path = typer.Option(None, help="Model directory (default: the embedded model)."),
    task: str = typer.Option(None, help="Synthetic task (default: calc)."),
    data: Path = typer.Option(None, help="Dataset file instead of a task."),
    num_prompts: int = typer.Option(None, help="Prompts (default: 300 for a task, all for --data)."),
    seed: int = typer.Option(12345, help="Seed of the task's prompts (keep it apart from training seeds)."),
    samples: int = typer.Option(4, "-n", "--samples", help="Samples per prompt for pass@k."),
    tools: Path = typer.Option(None, help="Tool config (YAML or JSON); default: the calculator."),
    max_turns: int = typer.Option(3, help="Most assistant turns per request."),
    max_new_tokens: int = typer.Option(96, help="Most tokens per assistant turn."),
    json_out: Path = typer.Option(None, "--json", help="Write the report as JSON here."),
    report_md: Path = typer.Option(
        None, "--report", help="Write a Markdown report here (overall, per data_source, example failures)."
    ),
    progress: bool = typer.Option(True, help="Show progress bars."),
) -> None:
    """Greedy accuracy and unbiased pass@k of a model on a task or dataset, overall and per data_source."""
    from data.schema import RecordError
    from rollout.engines.base import EngineError
    from rollout.tokens import TemplateError
    from tools.registry import ToolConfigError

    try:
        if task is not None and data is not None:
            raise UserError("give --task or --data, not both")
        if samples < 1:
            raise UserError(f"-n must be >= 1, got {samples}")
        model_dir = _resolve_model(model)
        records = _load_prompts(task, data, num_prompts or (None if data else 300), seed)
        report = asyncio.run(_local_eval(model_dir, records, samples, tools, max_turns, max_new_tokens, progress))
    except (UserError, RecordError, ToolConfigError, TemplateError, EngineError) as exc:
        raise _fail(str(exc)) from None
    from trainer.evaluation import breakdown_table, write_markdown_report

    accuracy = "-" if report["accuracy"] is None else f"{report['accuracy']:.3f}"  # None: nothing graded
    console.print(
        f"{model_dir}: greedy accuracy {accuracy} on {report['prompts']} prompts; "
        + ", ".join(f"pass@{k} {v:.3f}" for k, v in report["pass_at_k"].items())
    )
    console.print(breakdown_table(report))
    if json_out is not None:
        tmp = json_out.with_name(json_out.name + ".tmp")
        tmp.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
        tmp.replace(json_out)
    if report_md is not None:
        prompts = data or f"task {task or 'calc'} (seed {seed})"
        try:
            write_markdown_report(report, report_md, {"model": model_dir, "prompts": prompts, "samples": samples})
        except OSError as exc:
            raise _fail(f"--report {report_md}: {exc.strerror or exc}") from None
        console.print(f"wrote the report to {report_md}", highlight=False)


async def _local_eval(model_dir, records, samples, tools_path, max_turns, max_new_tokens, progress):
    from rollout.engines.local import LocalEngine, LocalEngineConfig
    from rollout.loop import RolloutConfig
    from rollout.tokens import ChatTokenizer, load_tokenizer
    from tools.registry import DEFAULT_TOOLS, build_tools, load_tools
    from trainer.evaluation import evaluate as run_eval

    tools = load_tools(tools_path) if tools_path else build_tools(DEFAULT_TOOLS)
    chat = ChatTokenizer(load_tokenizer(model_dir), [tool.schema for tool in tools.values()])
    config = RolloutConfig(max_turns=max_turns, max_new_tokens=max_new_tokens, temperature=1.0)
    async with LocalEngine.from_pretrained(model_dir, LocalEngineConfig(max_batch_size=256)) as engine:
        return await run_eval(engine, chat, tools, records, config, samples=samples, progress=progress)


@app.command()
def serve(
    model: Path = typer.Option(None, help="Model directory to serve (default: the embedded model)."),
    host: str = typer.Option("127.0.0.1", help="Interface to bind (loopback by default)."),
    port: int = typer.Option(30000, help="Port (0: pick a free one and print it)."),
    max_batch_size: int = typer.Option(256, help="Most sequences decoded together."),
    max_model_len: int = typer.Option(None, help="Context limit (default: the model's)."),
    device: str = typer.Option("auto", help='"auto", "cpu" or "cuda".'),
    seed: int = typer.Option(0, help="Seed of the sampling generator."),
    served_model_name: str = typer.Option(None, help="Model name in the OpenAI API."),
    tool_parser: str = typer.Option("qwen25", help="Tool-call parser of /v1/chat/completions."),
    api_key: str = typer.Option(None, help="Require 'Authorization: Bearer KEY'."),
    fault_error_rate: float = typer.Option(0.0, help="Testing: share of /generate calls answered HTTP 500."),
    fault_hang_rate: float = typer.Option(
        0.0, help="Testing: share of /generate calls held open unanswered (until the client gives up)."
    ),
    fault_drop_rate: float = typer.Option(
        0.0, help="Testing: share of /generate calls whose connection is reset mid-response."
    ),
    fault_seed: int = typer.Option(0, help="Seed of the fault draws (the same calls fail in every run)."),
) -> None:
    """Serve a model with the embedded engine behind SGLang's HTTP API (and OpenAI's).
    The --fault-* options make a share of /generate calls fail, to test clients (GET /fault_stats counts them)."""
    from rollout.faults import FaultConfig
    from rollout.parsers import get_parser

    try:
        model_dir = _resolve_model(model)
        get_parser(tool_parser)
        if not 0 <= port < 65536:
            raise UserError(f"--port must be in 0..65535, got {port}")
        rates = {"--fault-error-rate": fault_error_rate, "--fault-hang-rate": fault_hang_rate,
                 "--fault-drop-rate": fault_drop_rate}  # fmt: skip
        for flag, rate in rates.items():
            if not 0 <= rate <= 1:
                raise UserError(f"{flag} must be a share of /generate calls in [0, 1], got {rate:g}")
        if sum(rates.values()) > 1 + 1e-9:
            raise UserError(f"--fault-error-rate + --fault-hang-rate + --fault-drop-rate must be <= 1 (each call "
                            f"meets at most one fault), got {sum(rates.values()):g}")  # fmt: skip
        faults = None
        if any(rates.values()):
            faults = FaultConfig(error_rate=fault_error_rate, hang_rate=fault_hang_rate, drop_rate=fault_drop_rate,
                                 seed=fault_seed)  # fmt: skip
        asyncio.run(
            _serve(model_dir, host, port, max_batch_size, max_model_len, device, seed, served_model_name,
                   tool_parser, api_key, faults)
        )  # fmt: skip
    except (UserError, ValueError) as exc:
        raise _fail(str(exc)) from None
    except OSError as exc:  # the port is taken, the address cannot be bound
        raise _fail(f"cannot serve on {host}:{port}: {exc.strerror or exc}") from None
    except KeyboardInterrupt:
        console.print("server stopped")


async def _serve(model_dir, host, port, max_batch_size, max_model_len, device, seed, served_model_name,
                 tool_parser, api_key, faults=None) -> None:  # fmt: skip
    from rollout.engines.local import LocalEngine, LocalEngineConfig
    from rollout.server import ServeConfig, serve
    from rollout.tokens import load_tokenizer

    config = ServeConfig(
        model_path=str(model_dir.resolve()), host=host, port=port, served_model_name=served_model_name,
        tool_parser=tool_parser, api_key=api_key, max_batch_size=max_batch_size, faults=faults,
    )  # fmt: skip
    engine_config = LocalEngineConfig(
        max_batch_size=max_batch_size, max_model_len=max_model_len, device=device, seed=seed
    )
    ready = asyncio.Event()
    async with LocalEngine.from_pretrained(model_dir, engine_config) as engine:
        task = asyncio.create_task(serve(engine, load_tokenizer(model_dir), config, ready))
        await asyncio.wait([task, asyncio.create_task(ready.wait())], return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()  # raises the bind error
        console.print(f"serving {model_dir} on http://{host}:{config.port}", highlight=False)
        if faults is not None:
            console.print(f"injecting faults into /generate: {faults.error_rate:.1%} errors, {faults.hang_rate:.1%} "
                          f"hangs, {faults.drop_rate:.1%} drops (seed {faults.seed})", highlight=False)  # fmt: skip
        await task


@app.command()
def bench(
    workload: str = typer.Option("all", help="W1, W2, W3 or all (benchmarks/workloads.py)."),
    quick: bool = typer.Option(False, "--quick", help="Smaller workloads: all three in under a minute."),
    json_out: Path = typer.Option(None, "--json", help="Write the figures as JSON here."),
    plot: Path = typer.Option(None, help="Write the request timelines as a PNG here."),
) -> None:
    """Tool-call concurrency: rallyrl vs an exact bound and a batch-level baseline, against a
    simulated SGLang server (Markdown table, JSON, timeline PNG)."""
    from benchmarks.tool_concurrency import run_benchmark, workloads_named
    from benchmarks.workloads import WORKLOADS

    if workload != "all" and workload not in WORKLOADS:
        raise _fail(f"--workload must be one of {', '.join(WORKLOADS)} or all, got {workload!r}")
    names = list(WORKLOADS) if workload == "all" else [workload]
    run_benchmark(workloads_named(names, quick), json_out, plot, console)


@app.command("new-model")
def new_model(
    directory: Path = typer.Argument(..., help="Where to write the model and tokenizer."),
    hidden_size: int = typer.Option(128, help="Hidden size."),
    layers: int = typer.Option(4, help="Decoder layers."),
    heads: int = typer.Option(4, help="Attention heads."),
    kv_heads: int = typer.Option(2, help="Key/value heads."),
    intermediate_size: int = typer.Option(384, help="MLP size."),
    seed: int = typer.Option(0, help="Initialisation seed."),
) -> None:
    """Write a randomly initialised tiny Qwen2 model with the character tokenizer (no download)."""
    from data.tiny_model import TinyModelConfig, save_tiny_model

    config = TinyModelConfig(
        hidden_size=hidden_size,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        intermediate_size=intermediate_size,
        seed=seed,
    )
    path = save_tiny_model(directory, config)
    console.print(f"wrote a random tiny Qwen2 model to {path}")


@app.command("check")
def check(file: Path = typer.Argument(..., help="A rollout JSONL file.")) -> None:
    """Validate every trajectory line of a rollout JSONL file."""
    from rollout.request import validate_trajectory

    try:
        lines = file.read_bytes().splitlines()
    except OSError as exc:
        raise _fail(f"{file}: {exc.strerror}") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            validate_trajectory(orjson.loads(line))
        except (orjson.JSONDecodeError, ValueError) as exc:
            raise _fail(f"{file} line {number}: {exc}") from None
    console.print(f"{file}: {sum(1 for line in lines if line.strip())} valid trajectories")


@app.command("export")
def export_command(
    file: Path = typer.Argument(..., help="A rollout JSONL file."),
    out: Path = typer.Option(None, help="Parquet file to write (default: FILE with the suffix .parquet)."),
    batch_size: int = typer.Option(1024, help="Trajectories converted (and held in memory) at a time."),
) -> None:
    """Rollout JSONL -> parquet, one row per trajectory (schema: rollout/export.py), streamed in
    batches and written atomically: a bad line is an error naming it, and nothing is written."""
    from rollout.export import ExportError, export_parquet

    out = out or file.with_suffix(".parquet")
    try:
        count = export_parquet(file, out, batch_size=batch_size)
    except (ExportError, ValueError) as exc:
        raise _fail(str(exc)) from None
    except OSError as exc:  # the output cannot be written
        raise _fail(f"--out {out}: {exc.strerror or exc}") from None
    console.print(f"wrote {count} trajectories to {out}", highlight=False)


@app.command("show")
def show_command(
    file: Path = typer.Argument(..., help="A rollout JSONL file or its parquet export."),
    index: int = typer.Option(None, help="Which trajectory, 0-based in file order (default: the first)."),
    model: Path = typer.Option(None, help="Model or tokenizer directory: decode the token spans to text."),
) -> None:
    """Pretty-print one trajectory: header, every turn with its tool calls, and the token view
    (which spans of response_ids are trained on, loss_mask 1, and which are context)."""
    from rich.console import Console

    from rollout.show import ShowError, load_trajectory, render

    try:
        tokenizer = None
        if model is not None:
            from rollout.tokens import load_tokenizer

            try:
                tokenizer = load_tokenizer(model)
            except (OSError, ValueError) as exc:
                raise UserError(f"--model {model}: cannot load a tokenizer ({exc})") from None
        located = load_trajectory(file, 0 if index is None else index)
    except (UserError, ShowError) as exc:
        raise _fail(str(exc)) from None
    Console().print(render(located, file, tokenizer))


data_app = typer.Typer(help="Prepare datasets: official GSM8K and MATH files -> rallyrl records.",
                       no_args_is_help=True)  # fmt: skip
app.add_typer(data_app, name="data")
_DATA_INPUT_HELP = "Source file (.jsonl, .json or .parquet) or a directory of .json/.jsonl files."
_DATA_OUTPUT_HELP = "Records file to write (.jsonl, .json or .parquet), atomically."


@data_app.command("gsm8k")
def data_gsm8k(
    input_path: Path = typer.Option(..., "--input", "-i", help=_DATA_INPUT_HELP),
    output: Path = typer.Option(..., "--output", "-o", help=_DATA_OUTPUT_HELP),
    split: str = typer.Option(None, help="Split name for extra.split (default: from the path, else train)."),
    limit: int = typer.Option(None, help="Convert only the first N rows."),
    layout: str = typer.Option("native", help='"native" (rallyrl) or "verl" (reward_model, extra_info).'),
) -> None:
    """Official GSM8K (question, answer ending in '#### N') -> records with the answer_check tool's kwargs."""
    from data.gsm8k import prepare_gsm8k
    from data.schema import RecordError

    try:
        result = prepare_gsm8k(input_path, output, split=split, limit=limit, layout=layout)
    except (RecordError, ValueError) as exc:
        raise _fail(str(exc)) from None
    console.print(result.summary(), highlight=False)


@data_app.command("math")
def data_math(
    input_path: Path = typer.Option(..., "--input", "-i", help=_DATA_INPUT_HELP),
    output: Path = typer.Option(..., "--output", "-o", help=_DATA_OUTPUT_HELP),
    split: str = typer.Option(None, help="Split name for extra.split (default: from the path, else train)."),
    limit: int = typer.Option(None, help="Convert only the first N rows."),
    strict: bool = typer.Option(False, help="A row without a \\boxed{} answer is an error instead of skipped."),
    data_source: str = typer.Option(None, help="data_source of all records (default: the row's, else hendrycks/math)."),
    layout: str = typer.Option("native", help='"native" (rallyrl) or "verl" (reward_model, extra_info).'),
) -> None:
    """MATH (problem, solution with \\boxed{answer}) -> records; the last box is the ground truth."""
    from data.math_data import prepare_math
    from data.schema import RecordError

    try:
        result = prepare_math(input_path, output, split=split, limit=limit, strict=strict, data_source=data_source,
                              layout=layout)  # fmt: skip
    except (RecordError, ValueError) as exc:
        raise _fail(str(exc)) from None
    console.print(result.summary(), highlight=False)


if __name__ == "__main__":
    app()
