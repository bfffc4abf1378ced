"""rallyrl against TRL: GRPO on the same task from the same model, at equal CPU-seconds.

    python benchmarks/versus_trl.py [--budget-cpu-s 300] [--seeds 1 2 3] [--lrs 2e-4 5e-4]
        [--eval-prompts 300] [--out /tmp/versus_trl] [--json PATH] [--plot PATH] [--skip-install]

Both trainers start from the same model directory: the embedded model (``data/assets/tiny-calc``,
the default of ``rallyrl train``; no SFT on top), copied to ``OUT/model``. The task is rallyrl's calc
task (``rallyrl train``'s default): the training records of each seed (``make_calc_records(N, seed)``,
in the order ``rallyrl train`` draws them; TRL's dataset unshuffled), the calculator as the one tool,
the same reward (``data.rewards.score_answer`` of the last assistant message). Settings matched:
16 prompts x 8 samples per step, one optimizer step per rollout, AdamW with the same learning rate
and warmup, KL off, clipping 0.2 / 0.28, token-mean loss (rallyrl ``loss_aggregation: token-mean``,
TRL ``loss_type: dapo``), group-scaled advantages, temperature 1, at most 3 assistant turns of 96
tokens; rallyrl without group filtering (so its steps do the same work as TRL's) and with its
default rollout correction, ``token-tis`` (cap 2; its engine is a copy of the policy, so the weights
are about 1); TRL generates with the policy itself (transformers ``generate``), so it has none.

``rallyrl train`` runs as it is (the CLI); TRL's ``GRPOTrainer`` runs from ``versus_trl_runner.py``
in a virtualenv this script makes (``.venvs/trl``: trl 1.16.0 on torch 2.13.0 CPU, transformers
5.25.0, pinned; kept while its pins hold). TRL 1.16 cannot take this model's tool calls as it is:
the runner's docstring says what it lacks and what the runner does instead (``TRL_LACKS`` below).

Each run is one process at ``--threads`` threads, stopped once it has used ``--budget-cpu-s``
CPU-seconds (user+system, its children included: ``versus_trl_runs.py``). One evaluator that
imports neither trainer (``versus_trl_eval.py``: greedy, the calculator executed, the answer graded)
scores the start and, for each run, the last checkpoint within each of ``--eval-points`` evenly
spaced CPU marks on ``--eval-prompts`` held-out prompts (``rallyrl eval``'s set, seed 12345). Each
trainer's learning rate is the one of ``--lrs`` with the best held-out accuracy at the budget on the
first seed; then every seed runs at it. Prints a table per trainer and the ratio of CPU per step;
writes the figures as JSON and the accuracy-against-CPU-seconds curves as a PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from transformers import AutoTokenizer

from benchmarks.versus_trl_eval import EvalSettings, HeldOutEvaluator, held_out_records
from benchmarks.versus_trl_report import print_report, summarise, write_plot
from benchmarks.versus_trl_runs import Run, eval_points, prune_checkpoints, run_budgeted, step_costs
from data.embedded import EMBEDDED_MODEL
from data.synthetic import make_calc_records
from tools.calculator import CalculatorTool

REPO = Path(__file__).resolve().parent.parent
RALLYRL_KEYS = {"sampled_tokens": "rollout/generated_tokens", "reward_mean": "rollout/reward_mean"}
TRL_KEYS = {"sampled_tokens": "sampled_tokens", "reward_mean": "reward_mean"}
"""Where each step line holds the figures a run keeps: rallyrl's metrics.jsonl, the runner's steps.jsonl."""
TRL_PINS = (
    "trl==1.16.0",
    "torch==2.13.0",
    "transformers==5.25.0",
    "math-verify==0.9.0",
    "fastjsonschema==2.22.3",
    "jsonschema==4.26.0",
)
"""The TRL virtualenv: trl and the CPU torch (``torch==2.13.0`` resolves to the CPU build here; an
unpinned torch pulls CUDA), the project's transformers, and what the calc task's code imports."""
TRL_LACKS = [
    "a chat template that renders an assistant message's structured tool_calls: the embedded model's "
    "writes the call in the content as generated; the runner adds that branch in memory (prompts unchanged)",
    "a tool-call parser for templates it does not know (add_response_schema): the runner sets TRL's own Qwen3 "
    "response template, which reads the same <tool_call>{json}</tool_call>",
    "tools given by their JSON schema: a tool is a function whose schema comes from its docstring, which must "
    "describe every argument, so the calculator's schema would change every prompt; the runner's function "
    "carries the calculator's exact schema",
]
MATCHED = {  # the same values on both sides (rallyrl's --set, the runner's spec)
    "prompts_per_step": 16,
    "samples_per_prompt": 8,
    "eps_low": 0.2,
    "eps_high": 0.28,
    "max_turns": 3,
    "max_new_tokens": 96,
}
TRL_MAX_COMPLETION_LENGTH = 512
"""TRL's bound on a whole completion (turns, tool results): above what 3 turns of 96 tokens reach."""


def install_trl_venv(venv: Path, console: Console) -> Path:
    """``venv`` with ``TRL_PINS`` installed (made anew unless its stamp says it has them); its python."""
    stamp, python = venv / ".rallyrl-installed", venv / "bin" / "python"
    if stamp.exists() and stamp.read_text().strip() == " ".join(TRL_PINS) and python.exists():
        console.print(f"TRL virtualenv {venv}: already at {', '.join(TRL_PINS[:3])}")
        return python
    uv = shutil.which("uv")
    if uv is None:
        raise SystemExit("uv not found: pip install -e '.[dev]' (or pip install uv), then run again")
    console.print(f"TRL virtualenv {venv}: installing {' '.join(TRL_PINS)} (about 30 s, 1.5 GB)")
    env = {**os.environ, **uv_sources()}
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([uv, "venv", "--quiet", "--python", sys.executable, str(venv)], env=env, check=True)
    subprocess.run(
        [uv, "pip", "install", "--quiet", "--compile-bytecode", "--python", str(python), *TRL_PINS], env=env, check=True
    )
    stamp.write_text(" ".join(TRL_PINS) + "\n")
    return python


def uv_sources() -> dict[str, str]:
    """The variables that give uv pip's package sources on this machine (``.ci/uv_env.py``)."""
    printed = subprocess.run(
        [sys.executable, str(REPO / ".ci" / "uv_env.py")], capture_output=True, text=True, check=True
    ).stdout
    pairs = (shlex.split(line.removeprefix("export "))[0].split("=", 1) for line in printed.splitlines() if line)
    return dict(pairs)


def thread_env(threads: int) -> dict[str, str]:
    count = str(threads)
    return {
        **os.environ,
        "OMP_NUM_THREADS": count,
        "MKL_NUM_THREADS": count,
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
    }


class Benchmark:
    def __init__(self, args: argparse.Namespace, console: Console):
        self.args, self.console = args, console
        self.out = Path(args.out)
        self.model_dir = self.out / "model"
        self.evaluator = HeldOutEvaluator(held_out_records(args.eval_prompts), EvalSettings())
        self.max_steps = max(10, int(args.budget_cpu_s))  # never reached: a step takes well over 1 CPU-second

    def prepare_model(self) -> None:
        if not (self.model_dir / "config.json").exists():
            shutil.copytree(EMBEDDED_MODEL, self.model_dir, dirs_exist_ok=True)

    def evaluate(self, model_dir: str | Path) -> dict[str, Any]:
        began = time.process_time()
        result = self.evaluator.evaluate(model_dir).to_dict()
        return {**result, "eval_cpu_s": time.process_time() - began}

    def run(self, trainer: str, seed: int, lr: float, phase: str) -> dict[str, Any]:
        directory = self.out / "runs" / f"{trainer}-seed{seed}-lr{lr:g}"
        shutil.rmtree(directory, ignore_errors=True)
        run = Run(trainer, seed, lr, self.args.budget_cpu_s)
        self.console.print(f"[bold]{phase}[/]: {trainer}, seed {seed}, lr {lr:g}, budget {run.budget_cpu_s:g} CPU-s")
        if trainer == "rallyrl":  # (its command, its step lines, and where each figure is in them)
            command, lines, keys = self.rallyrl_command(directory, seed, lr), "metrics.jsonl", RALLYRL_KEYS
        else:
            command, lines, keys = self.trl_command(directory, seed, lr), "steps.jsonl", TRL_KEYS
        run_budgeted(run, command, thread_env(self.args.threads), directory, lines, keys)
        points = eval_points(run, self.args.eval_points)
        curve = [{"step": 0, "cpu_s": 0.0, **self.start}]
        for checkpoint in points:
            curve.append({"step": checkpoint.step, "cpu_s": checkpoint.cpu_s, **self.evaluate(checkpoint.path)})
        prune_checkpoints(run, points)
        record = {**run.to_dict(), "phase": phase, "curve": curve, **step_costs(run)}
        last = curve[-1]
        self.console.print(
            f"  {len(run.steps)} steps in {run.cpu_s:.0f} CPU-s, "
            f"{record['cpu_s_per_step']:.1f} CPU-s/step; held-out {self.start['accuracy']:.3f} -> "
            f"{last['accuracy']:.3f} at {last['cpu_s']:.0f} CPU-s (step {last['step']})"
        )
        return record

    def rallyrl_command(self, directory: Path, seed: int, lr: float) -> list[str]:
        rallyrl = shutil.which("rallyrl")
        if rallyrl is None:
            raise SystemExit("the rallyrl command is not installed: pip install -e '.[dev]'")
        sets = {
            "filter_groups": "false",
            "kl_beta": 0.0,
            "loss_aggregation": "token-mean",
            "advantage_scale": "group",
            "rollout_correction.preset": "token-tis",
            "tis_cap": 2.0,
            "warmup_steps": self.args.warmup_steps,
            "weight_decay": 0.0,
            "max_grad_norm": 1.0,
            "ppo_epochs": 1,
            "eps_low": MATCHED["eps_low"],
            "eps_high": MATCHED["eps_high"],
            "rollout.max_turns": MATCHED["max_turns"],
            "rollout.max_new_tokens": MATCHED["max_new_tokens"],
            "rollout.temperature": 1.0,
            "rollout.top_p": 1.0,
            "checkpoint_every": self.args.rallyrl_checkpoint_every,
            "keep_checkpoints": 1_000_000,
        }
        return [
            rallyrl,
            "train",
            "--out",
            str(directory),
            "--model",
            str(self.model_dir),
            "--task",
            "calc",
            "--seed",
            str(seed),
            "--lr",
            repr(lr),
            "--steps",
            str(self.max_steps),
            "--threads",
            str(self.args.threads),
            "--no-progress",
            "--prompts-per-step",
            str(MATCHED["prompts_per_step"]),
            "-n",
            str(MATCHED["samples_per_prompt"]),
            *(item for key, value in sets.items() for item in ("--set", f"{key}={value}")),
        ]

    def trl_command(self, directory: Path, seed: int, lr: float) -> list[str]:
        directory.mkdir(parents=True, exist_ok=True)
        records = make_calc_records(MATCHED["prompts_per_step"] * self.max_steps, seed)
        with (directory / "records.jsonl").open("w") as file:
            for record in records:
                file.write(json.dumps({"prompt": record.prompt, "ground_truth": record.ground_truth}) + "\n")
        schema = CalculatorTool().schema
        tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        expected = tokenizer.apply_chat_template(
            records[0].prompt, tools=[schema], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        spec = {
            **MATCHED,
            "model_dir": str(self.model_dir),
            "out": str(directory),
            "seed": seed,
            "lr": lr,
            "records": str(directory / "records.jsonl"),
            "threads": self.args.threads,
            "warmup_steps": self.args.warmup_steps,
            "max_steps": self.max_steps,
            "max_completion_length": TRL_MAX_COMPLETION_LENGTH,
            "checkpoint_every": self.args.trl_checkpoint_every,
            "repo_root": str(REPO),
            "calculator_schema": schema,
            "expected_prompt_ids": list(expected),
        }
        (directory / "spec.json").write_text(json.dumps(spec, indent=1))
        return [str(self.trl_python), str(REPO / "benchmarks" / "versus_trl_runner.py"), str(directory / "spec.json")]

    def main(self) -> dict[str, Any]:
        args = self.args
        venv = Path(args.venv)
        if args.skip_install:
            self.trl_python = venv / "bin" / "python"
            if "trl" in args.trainers and not self.trl_python.exists():
                raise SystemExit(f"--skip-install, but {venv} has no python: run once without it")
        else:
            self.trl_python = install_trl_venv(venv, self.console)
        self.out.mkdir(parents=True, exist_ok=True)
        self.prepare_model()
        self.start = self.evaluate(self.model_dir)
        self.console.print(
            f"start (the embedded model): held-out accuracy {self.start['accuracy']:.3f} "
            f"on {self.start['prompts']} prompts"
        )
        runs, chosen = [], {}
        for trainer in args.trainers:
            sweep = [self.run(trainer, args.seeds[0], lr, "sweep") for lr in args.lrs]
            runs += sweep
            best = max(sweep, key=lambda r: (r["curve"][-1]["accuracy"], -args.lrs.index(r["lr"])))
            chosen[trainer] = best["lr"]
            self.console.print(f"{trainer}: lr {best['lr']:g} chosen (held-out at the budget, seed {args.seeds[0]})")
            for seed in args.seeds[1:]:
                runs.append(self.run(trainer, seed, chosen[trainer], "seeds"))
        results = {
            "settings": {
                **vars(args),
                **MATCHED,
                "trl_max_completion_length": TRL_MAX_COMPLETION_LENGTH,
                "start_model": "the embedded model (data/assets/tiny-calc), no SFT",
                "rallyrl_correction": "token-tis (cap 2)",
                "held_out_seed": 12345,
            },
            "versions": {"trl_pins": list(TRL_PINS), "torch": torch.__version__},
            "trl_lacks": TRL_LACKS,
            "start": self.start,
            "chosen_lr": chosen,
            "runs": runs,
        }
        results["summary"] = summarise(results)
        return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/versus_trl", help="work directory: the model, runs, checkpoints")
    parser.add_argument("--budget-cpu-s", type=float, default=300.0, help="CPU-seconds per run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="the first also picks the lr")
    parser.add_argument("--lrs", type=float, nargs="+", default=[2e-4, 5e-4], help="the sweep, the same for both")
    parser.add_argument("--eval-prompts", type=int, default=300, help="held-out prompts (rallyrl eval's, seed 12345)")
    parser.add_argument("--eval-points", type=int, default=4, help="CPU marks per run whose checkpoint is scored")
    parser.add_argument("--threads", type=int, default=1, help="torch and OpenMP threads of each trainer")
    parser.add_argument("--warmup-steps", type=int, default=5, help="linear lr warmup, the same for both")
    parser.add_argument("--rallyrl-checkpoint-every", type=int, default=2)
    parser.add_argument("--trl-checkpoint-every", type=int, default=1)
    parser.add_argument("--trainers", nargs="+", default=["rallyrl", "trl"], choices=["rallyrl", "trl"])
    parser.add_argument("--venv", default=str(REPO / ".venvs" / "trl"), help="the TRL virtualenv")
    parser.add_argument("--skip-install", action="store_true", help="use --venv as it is (it must exist)")
    parser.add_argument("--json", default=None, help="write every figure here (default OUT/versus_trl.json)")
    parser.add_argument("--plot", default=None, help="the curves PNG (default OUT/versus_trl.png)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)  # the evaluator's
    console = Console(width=170)
    results = Benchmark(args, console).main()
    json_path = Path(args.json or Path(args.out) / "versus_trl.json")
    plot_path = Path(args.plot or Path(args.out) / "versus_trl.png")
    json_path.write_text(json.dumps(results, indent=1, default=str))
    write_plot(results, plot_path)
    print_report(results, console)
    console.print(f"figures: {json_path}; curves: {plot_path}")
    return results


if __name__ == "__main__":
    main()
