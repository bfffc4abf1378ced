"""Trainer throughput: tokens/s of the GRPO update phase and peak memory, at 32 and 128
sequences per step, on the embedded tiny-calc model with calc-shaped trajectories, with each
micro-batch's shared prompt run once (``share_prompt_prefix``, the default) and without.

    python benchmarks/trainer_throughput.py [--sequences 32 128] [--micro-batch 16] [--repeats 3]

Each sequence is a real calc prompt (rendered with the calculator schema) plus a two-turn
response shaped like the embedded model's (tool call, tool result, boxed answer), with the
loss mask on the assistant tokens; 8 samples per prompt, as a GRPO group. The update is
``GRPOTrainer.update``: forward, clipped surrogate, backward over micro-batches, clip, AdamW step.
The two settings alternate, update by update, on the same trainer (the weights move a little each
update; the work does not), and each row gives both and their ratio, by the process's CPU seconds.
Prints a table; asserts nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import resource
import statistics
import tempfile
import time

import torch
from rich.console import Console
from rich.table import Table

from data.synthetic import make_calc_records
from data.tiny_model import EMBEDDED_MODEL
from rollout.request import AsyncRolloutRequest
from trainer.batch import trajectory_sample
from trainer.config import GRPOConfig
from trainer.grpo import GRPOTrainer


def calc_trajectories(trainer: GRPOTrainer, count: int, seed: int) -> list[AsyncRolloutRequest]:
    """Requests shaped like finished calc rollouts: prompt, call, tool result, answer."""
    chat, rng = trainer.chat, random.Random(seed)
    requests = []
    for i, record in enumerate(make_calc_records(count, seed=seed)):
        request = AsyncRolloutRequest(f"b{i}", i // 8, i % 8, [dict(m) for m in record.prompt])
        request.prompt_ids = chat.prompt_ids(record.prompt)
        expression = record.extra["expression"]
        call = chat.encode(
            f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}</tool_call>'
        )
        call = [*call, chat.turn_close_ids[0]]
        request.append_generated(call, [-0.5] * len(call), 0)
        request.append_context(
            chat.assistant_close_ids(call) + chat.delta_ids([{"role": "tool", "content": "1234567"}])
        )
        answer = [*chat.encode(f"\\boxed{{{record.ground_truth}}}"), chat.turn_close_ids[0]]
        request.append_generated(answer, [-0.5] * len(answer), 0)
        request.rewards.final = float(rng.random() < 0.5)
        requests.append(request)
    return requests


def timed_updates(trainer: GRPOTrainer, samples: list, repeats: int) -> dict[bool, list[float]]:
    """CPU seconds of ``repeats`` updates with the prompt shared and as many without, alternating."""
    seconds: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(repeats):
        for share in (True, False):
            trainer.policy.config = dataclasses.replace(trainer.policy.config, share_prompt_prefix=share)
            started = time.process_time()
            trainer.update(samples)
            seconds[share].append(time.process_time() - started)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--micro-batch", type=int, default=None, help="sequences per micro-batch (default: none, "
                        "the token budget alone, as rallyrl train)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3, help="updates timed per size and setting (after a warm-up)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default=str(EMBEDDED_MODEL), help="model directory (default: the embedded one)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        config = GRPOConfig(model=args.model, out=f"{tmp}/run", micro_batch_size=args.micro_batch, progress=False)
        trainer = GRPOTrainer(config)
        params = sum(p.numel() for p in trainer.model.parameters())
        title = f"GRPO update phase, {args.model} ({params / 1e6:.2f} M parameters), {args.threads} threads"
        table = Table(title=title)
        columns = ("sequences/step", "tokens/sequence", "shared prefix", "update CPU s, shared", "not shared",
                   "shared / not", "tokens/s, shared", "peak RSS")  # fmt: skip
        for column in columns:
            table.add_column(column, justify="right")
        for count in args.sequences:
            requests = calc_trajectories(trainer, count, seed=count)
            samples = [trajectory_sample(r, 1.0 if r.rewards.final else -1.0) for r in requests]
            tokens = sum(len(s.input_ids) for s in samples)
            trainer.policy.config = dataclasses.replace(trainer.policy.config, share_prompt_prefix=True)
            shared = [b.shared_prefix for b in trainer.policy.batches(samples)]
            trainer.update(samples)  # warm-up
            seconds = timed_updates(trainer, samples, args.repeats)
            on, off = (statistics.median(seconds[share]) for share in (True, False))
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            if torch.cuda.is_available():
                peak_text = f"{torch.cuda.max_memory_allocated() / 2**20:,.0f} MiB GPU"
            else:
                peak_text = f"{peak:,.0f} MiB"
            table.add_row(
                str(count), f"{tokens / count:.0f}", f"{min(shared)}-{max(shared)} x {len(shared)}", f"{on:.2f}",
                f"{off:.2f}", f"{on / off:.2f}x", f"{tokens / on:,.0f}", peak_text,
            )  # fmt: skip
        Console(width=140).print(table)
        Console(width=140).print(
            "shared prefix: tokens run once per micro-batch (min-max x micro-batches); CPU s: medians of "
            f"{args.repeats}; tokens/s counts every token of the sequences (prompts included) per CPU second."
        )


if __name__ == "__main__":
    main()
