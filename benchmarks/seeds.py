"""Seeds: does `rallyrl train` hold across seeds and at twice its learning rate? The table of
docs/training.md ("Seeds").

    python -m benchmarks.seeds --task calc --lrs 1e-4 2e-4 --seeds 1 2 3 4 5       # 10 runs of 40 steps
    python -m benchmarks.seeds --task rg --lrs 1e-4 2e-4 --steps 12 --parallel 2
    python -m benchmarks.seeds --summarize runs/seeds                               # the table of runs made

Each run is the real command, in a process of its own (one torch thread): ``rallyrl train --seed S --lr L``
with every other setting at its default, then ``rallyrl eval`` of its final model on the task's held-out
prompts (greedy; 300 prompts). ``calc`` is the default task; ``rg`` is reasoning-gym's basic_arithmetic
shaped like it (the task of docs/data.md#reasoning-gym, held out with seed 12345). Runs already made in
``--out`` are kept, not run again. Per task and learning rate the table gives the held-out accuracy at the
end (mean, min, max over the seeds), the worst step's malformed-call share of any seed, and the runs the
collapse warning fired in. Prints a table; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

TASKS = {
    "calc": ([], []),
    "rg": (
        ["--task", "reasoning_gym:basic_arithmetic(min_terms=2,max_terms=3,min_digits=3,max_digits=4,"
         "operators=('+','-','*'),allow_parentheses=False,allow_negation=False);prompt=calc"],
        ["--seed", "12345", "--num-prompts", "300", "-n", "1"],
    ),
}  # fmt: skip
"""A task's ``--task`` arguments (train and eval), and eval's own (its held-out prompts)."""


def run_one(out: Path, task: str, lr: str, seed: int, steps: int | None, timeout: float) -> Path:
    """Train and evaluate one seed into ``out/TASK_LR_SEED``; kept where its evaluation exists."""
    name = out / f"{task}_{lr}_{seed}"
    report = out / f"{name.name}.eval.json"  # (not with_suffix: a rate such as 2.5e-4 holds a dot)
    if report.exists():
        return name
    task_args, eval_args = TASKS[task]
    train = ["rallyrl", "train", *task_args, "--lr", lr, "--seed", str(seed), "--threads", "1", "--no-progress",
             "--out", str(name), "--set", "checkpoint_every=0"]  # fmt: skip
    if steps:
        train += ["--steps", str(steps)]
    evaluate = ["rallyrl", "eval", "--model", str(name / "final"), *task_args, *eval_args, "--threads", "1",
                "--no-progress", "--json", str(report)]  # fmt: skip
    with (out / f"{name.name}.log").open("w") as log:
        for command in (train, evaluate):
            subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, check=True)
    return name


def summarize(out: Path) -> list[dict]:
    """One row per task and learning rate of the runs under ``out`` that were evaluated."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for report in sorted(out.glob("*.eval.json")):
        task, lr, seed = report.name.removesuffix(".eval.json").split("_")
        steps = [json.loads(line) for line in (out / report.name.removesuffix(".eval.json") / "metrics.jsonl")
                 .read_text().splitlines()]  # fmt: skip
        groups.setdefault((task, lr), []).append({
            "seed": int(seed), "accuracy": json.loads(report.read_text())["accuracy"], "steps": len(steps),
            "malformed": max(s.get("rollout/malformed_call_share", 0.0) for s in steps),
            "warned": any(s.get("train/collapse_warning") for s in steps),
        })  # fmt: skip
    rows = []
    for (task, lr), runs in sorted(groups.items()):
        accuracies = [r["accuracy"] for r in runs]
        rows.append({
            "task": task, "lr": lr, "seeds": sorted(r["seed"] for r in runs),
            "steps": sorted({r["steps"] for r in runs}),
            "mean": statistics.mean(accuracies), "min": min(accuracies), "max": max(accuracies),
            "worst_malformed": max(r["malformed"] for r in runs), "warned": sum(r["warned"] for r in runs),
        })  # fmt: skip
    return rows


def print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="rallyrl train across seeds: held-out greedy accuracy at the end")
    for column in ("task", "lr", "seeds", "steps", "mean", "min", "max", "worst malformed-call share", "warned"):
        table.add_column(column)
    for r in rows:
        table.add_row(r["task"], r["lr"], ",".join(map(str, r["seeds"])), ",".join(map(str, r["steps"])),
                      f"{r['mean']:.1%}", f"{r['min']:.1%}", f"{r['max']:.1%}", f"{r['worst_malformed']:.1%}",
                      f"{r['warned']}/{len(r['seeds'])}")  # fmt: skip
    Console(width=140).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="calc")
    parser.add_argument("--lrs", nargs="+", default=["1e-4", "2e-4"], help="learning rates (as rallyrl reads them)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3, 4, 5])
    parser.add_argument("--steps", type=int, help="default: rallyrl train's")
    parser.add_argument("--parallel", type=int, default=1, help="runs at once (one thread each)")
    parser.add_argument("--timeout", type=float, default=4 * 3600, help="seconds per command")
    parser.add_argument("--out", default="runs/seeds")
    parser.add_argument("--summarize", help="only the table of the runs in this directory")
    parser.add_argument("--json", help="also write the table's rows here")
    args = parser.parse_args()
    out = Path(args.summarize or args.out)
    if not args.summarize:
        out.mkdir(parents=True, exist_ok=True)
        jobs = [(args.task, lr, seed) for lr in args.lrs for seed in args.seeds]
        with ThreadPoolExecutor(args.parallel) as pool:
            list(pool.map(lambda job: run_one(out, *job, args.steps, args.timeout), jobs))
    rows = summarize(out)
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
