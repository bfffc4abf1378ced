"""What bypass saves: seconds per GRPO update with the old-logprob pass (``decoupled``, the default
``token-tis``) and without it (``bypass``: PPO's old logprobs are the engine's), on the embedded
tiny-calc model with calc-shaped trajectories.

    python -m benchmarks.rollout_correction [--sequences 32] [--ppo-epochs 1 2 4] [--repeats 3]

With ``ppo_epochs`` 1 the first pass's own logprobs are the old ones, so there is no pass to save;
above 1 decoupled runs one forward over the step's samples before the epochs and bypass does not.
The update is ``GRPOTrainer.update`` (forwards, loss, backward, clip, AdamW); the two presets take
turns, so a machine busy with other work slows both alike, and CPU seconds are printed beside wall
seconds. Prints a table; asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from rich.console import Console
from rich.table import Table

from benchmarks.trainer_throughput import calc_trajectories
from data.tiny_model import EMBEDDED_MODEL
from trainer.batch import trajectory_sample
from trainer.config import GRPOConfig
from trainer.grpo import GRPOTrainer
from trainer.rollout_correction_config import RolloutCorrection


def bypass_and_decoupled(model: str, out: str, ppo_epochs: int, sequences: int, micro_batch: int,
                         repeats: int) -> dict[str, tuple[float, float, int]]:  # fmt: skip
    """Per preset (``token-tis``: decoupled; ``bypass``): the median wall and CPU seconds of ``repeats``
    updates (after one warm-up each, the two presets taking turns) and the policy passes of one."""
    trainers, samples, passes = {}, None, {}
    for preset in ("token-tis", "bypass"):
        config = GRPOConfig(model=model, out=f"{out}/{preset}", micro_batch_size=micro_batch, progress=False,
                            ppo_epochs=ppo_epochs, rollout_correction=RolloutCorrection(preset=preset))  # fmt: skip
        trainer = trainers[preset] = GRPOTrainer(config)
        if samples is None:
            requests = calc_trajectories(trainer, sequences, seed=sequences)
            samples = [trajectory_sample(r, 1.0 if r.rewards.final else -1.0) for r in requests]
        passes[preset] = count_passes(trainer)
        trainer.update(samples)  # warm-up
    per_update = {preset: len(counted) for preset, counted in passes.items()}
    times: dict[str, list[tuple[float, float]]] = {preset: [] for preset in trainers}
    for _ in range(repeats):
        for preset, trainer in trainers.items():
            wall, cpu = time.perf_counter(), time.process_time()
            trainer.update(samples)
            times[preset].append((time.perf_counter() - wall, time.process_time() - cpu))
    return {preset: (statistics.median(t[0] for t in runs), statistics.median(t[1] for t in runs), per_update[preset])
            for preset, runs in times.items()}  # fmt: skip


def count_passes(trainer: GRPOTrainer) -> list[int]:
    """A list that grows by one at each logprob pass of the policy over a micro-batch."""
    passes: list[int] = []
    logprobs = trainer.policy.logprobs

    def counted(batch, model=None, with_entropy=False):
        passes.extend([1] if model is None else [])
        return logprobs(batch, model, with_entropy)

    trainer.policy.logprobs = counted
    return passes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--ppo-epochs", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=3, help="updates timed per setting (after one warm-up)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default=str(EMBEDDED_MODEL), help="model directory (default: the embedded one)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    console = Console()
    table = Table(title=f"GRPO update, {args.sequences} sequences, {args.model}, {args.threads} threads")
    for column in ("ppo_epochs", "decoupled s (cpu s)", "passes", "bypass s (cpu s)", "passes", "saved (cpu)"):
        table.add_column(column, justify="right")
    with tempfile.TemporaryDirectory() as tmp:
        for epochs in args.ppo_epochs:
            runs = bypass_and_decoupled(args.model, f"{tmp}/{epochs}", epochs, args.sequences, args.micro_batch,
                                        args.repeats)  # fmt: skip
            (wall_d, cpu_d, passes_d), (wall_b, cpu_b, passes_b) = runs["token-tis"], runs["bypass"]
            row = (str(epochs), f"{wall_d:.2f} ({cpu_d:.2f})", str(passes_d), f"{wall_b:.2f} ({cpu_b:.2f})",
                   str(passes_b), f"{1 - wall_b / wall_d:.1%} ({1 - cpu_b / cpu_d:.1%})")  # fmt: skip
            console.print(" | ".join(row))
            table.add_row(*row)
    console.print(table)


if __name__ == "__main__":
    main()
