"""Memory and speed of the GRPO update at a real model's size: chunked logprobs (with and without
gradient checkpointing) against the unchunked computation, in one run.

    python benchmarks/trainer_memory.py                    # the rows of this machine (CPU or CUDA)
    python benchmarks/trainer_memory.py --rows cpu         # CPU rows (a real vocabulary, small body)
    python benchmarks/trainer_memory.py --rows cuda --json out.json
    python benchmarks/trainer_memory.py --row 'qwen2.5-1.5b,4x16384,8192,chunked+ckpt'
    python benchmarks/trainer_memory.py --rows default     # the config as a user gets it, against the best
    python benchmarks/trainer_memory.py --rows cpu-default --memory-limit-gib 3

Each row is one model shape (Qwen2.5-0.5B / 1.5B / 7B configs built in code with random weights,
nothing downloads; on CPU one with Qwen2.5's vocabulary of 151,936 and a body of hidden size 64 and
2 layers), a step's trajectories (sequences x tokens: a quarter prompt, then assistant, tool output
and assistant again, so half the tokens are trained), the micro-batch token budget, and how
logprobs are computed: ``unchunked`` (every position's logits at once, the computation before
chunking), ``chunked`` or ``chunked+ckpt`` (with gradient checkpointing), or ``lora+ckpt`` (a
rank-64 LoRA adapter on every linear layer, the base frozen in bf16 on CUDA), or ``default``: the
config as a user gets it (``GRPOConfig()``: ``micro_batch_tokens: auto``, checkpointing decided by the
probe, no sequence cap; its budget column is ``auto``, and its row says what auto decided; its first,
untimed update runs the probe). For each default row the table gives its tokens/s over the best
other row of the same shape and step in the run, and its peak as a share of the card. It runs
``Policy.update`` as ``rallyrl train`` does (float32 master weights, bf16 autocast on CUDA, AdamW)
in a process of its own, so that its peak memory is its own: peak RSS on CPU,
``torch.cuda.max_memory_allocated`` on CUDA (AdamW state included). Model-FLOPs utilisation (CUDA):
6 x parameters + 6 x layers x hidden x sequence length FLOPs per token (no recomputation counted),
over the card's dense bf16 peak. Prints a table; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

SHAPES = {  # Qwen2.5's published configs (vocabulary 151,936); "cpu-small" keeps the vocabulary only
    "cpu-small": dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, tie_word_embeddings=False),
}  # fmt: skip
VOCABULARY = 151_936
MODES = ("unchunked", "chunked", "chunked+ckpt", "lora+ckpt", "default")
LORA_RANK = 64
"""``lora+ckpt``: a LoRA adapter of this rank (alpha 2 x rank) on every linear layer, chunked logprobs
and checkpointing; the frozen base in bf16 on CUDA (float32 on CPU), the adapter in float32."""
ROWS = {
    "cpu": [
        "cpu-small,1x4096,32768,unchunked",
        "cpu-small,1x4096,32768,chunked",
        "cpu-small,1x32768,32768,chunked",
    ],
    "cuda": [
        "qwen2.5-0.5b,64x1024,8192,unchunked",
        "qwen2.5-0.5b,64x1024,8192,chunked",
        "qwen2.5-0.5b,64x1024,8192,chunked+ckpt",
        "qwen2.5-0.5b,64x1024,32768,chunked+ckpt",
        "qwen2.5-1.5b,64x1024,8192,unchunked",
        "qwen2.5-1.5b,64x1024,8192,chunked",
        "qwen2.5-1.5b,64x1024,8192,chunked+ckpt",
        "qwen2.5-1.5b,4x16384,8192,chunked+ckpt",
    ],
    "default": [  # issue 39's table: the defaults against the best setting measured on an H200
        "qwen2.5-0.5b,64x1024,auto,default",
        "qwen2.5-0.5b,64x1024,32768,chunked+ckpt",
        "qwen2.5-0.5b,64x1024,32768,chunked",
        "qwen2.5-0.5b,4x16384,auto,default",
        "qwen2.5-0.5b,4x16384,16384,chunked",
        "qwen2.5-0.5b,4x16384,16384,chunked+ckpt",
        "qwen2.5-1.5b,64x1024,auto,default",
        "qwen2.5-1.5b,64x1024,8192,chunked",
        "qwen2.5-1.5b,64x1024,32768,chunked+ckpt",
        "qwen2.5-1.5b,4x16384,auto,default",
        "qwen2.5-1.5b,4x16384,16384,chunked",
        "qwen2.5-1.5b,4x16384,16384,chunked+ckpt",
    ],
    "cpu-default": [  # with --memory-limit-gib (else auto keeps 8,192 on the CPU)
        "cpu-small,1x32768,auto,default",
        "cpu-small,1x32768,32768,chunked",
        "cpu-small,64x512,auto,default",
        "cpu-small,64x512,32768,chunked",
        "cpu-small,64x512,8192,chunked",
    ],
}
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12}
"""Dense bf16 tensor-core peaks (FLOP/s) of cards by name, for the utilisation column."""


@dataclass(frozen=True)
class Row:
    shape: str
    sequences: int
    tokens: int
    micro_batch_tokens: int | None
    """None: ``auto`` (the default mode)."""
    mode: str

    @classmethod
    def parse(cls, text: str) -> Row:
        try:
            shape, step, budget, mode = (part.strip() for part in text.split(","))
            sequences, tokens = (int(n) for n in step.split("x"))
            row = cls(shape, sequences, tokens, None if budget == "auto" else int(budget), mode)
        except ValueError:
            raise SystemExit(f"--row {text!r}: expected SHAPE,SEQUENCESxTOKENS,MICRO_BATCH_TOKENS,MODE") from None
        if shape not in SHAPES or mode not in MODES:
            raise SystemExit(f"--row {text!r}: shape one of {sorted(SHAPES)}, mode one of {MODES}")
        if (mode == "default") != (row.micro_batch_tokens is None):
            raise SystemExit(f"--row {text!r}: the default mode's budget is auto, and only its")
        return row

    @property
    def step(self) -> tuple[str, int, int]:
        return self.shape, self.sequences, self.tokens

    @property
    def budget(self) -> str:
        return "auto" if self.micro_batch_tokens is None else str(self.micro_batch_tokens)

    def __str__(self) -> str:
        return f"{self.shape},{self.sequences}x{self.tokens},{self.budget},{self.mode}"


def trajectories(row: Row, seed: int = 0) -> list:
    """``row.sequences`` samples of ``row.tokens`` random ids: a quarter prompt, then assistant, tool
    output and assistant in equal parts (the assistant parts trained), advantages of both signs."""
    import torch

    from trainer.batch import Sample

    generator = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(row.sequences):
        ids = torch.randint(0, VOCABULARY, (row.tokens,), generator=generator).tolist()
        quarter = row.tokens // 4
        mask = [0] * quarter + [1] * quarter + [0] * quarter + [1] * (row.tokens - 3 * quarter)
        samples.append(Sample(ids, mask, [-2.0 * m for m in mask], advantage=1.0 if i % 2 else -1.0, group_id=i // 8))
    return samples


def measure(row: Row, repeats: int, chunk_tokens: int = 1024, memory_limit_gib: float | None = None) -> dict:
    """One row, in this process: build, one warm-up update, ``repeats`` timed updates."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trainer.config import GRPOConfig, LoRAConfig
    from trainer.distributed import make_accelerator
    from trainer.memory_budget import RssMeter
    from trainer.policy import Policy

    cuda = torch.cuda.is_available()
    accelerator = make_accelerator()  # GRPOTrainer's
    config = Qwen2Config(vocab_size=VOCABULARY, max_position_embeddings=32768, **SHAPES[row.shape])
    lora = None
    if row.mode == "lora+ckpt":
        lora = LoRAConfig(rank=LORA_RANK, alpha=2.0 * LORA_RANK, base_dtype="bfloat16" if cuda else "float32")
    torch.set_default_dtype(torch.bfloat16 if lora is not None and cuda else torch.float32)  # (no fp32 copy first)
    with torch.device(accelerator.device):
        lm = Qwen2ForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    if row.mode == "default":  # as a user gets it (packing: null pads with sdpa, as the rows below)
        train = GRPOConfig(progress=False, memory_limit_gib=memory_limit_gib)
    else:
        train = GRPOConfig(
            micro_batch_size=row.sequences, micro_batch_tokens=row.micro_batch_tokens, progress=False,
            logprob_chunk_tokens=0 if row.mode == "unchunked" else chunk_tokens,
            gradient_checkpointing=row.mode.endswith("+ckpt"), packing=False, lora=lora,
        )  # fmt: skip
    policy = Policy(train, accelerator, lm, pad_id=0)
    samples = trajectories(row)
    parameters = sum(p.numel() for p in lm.parameters())
    seconds = []
    for i in range(repeats + 1):
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        policy.update(samples)
        if cuda:
            torch.cuda.synchronize()
        if i:  # the first is the warm-up
            seconds.append(time.perf_counter() - started)
    tokens = row.sequences * row.tokens
    result = {"row": str(row), "parameters": parameters, "seconds": seconds, "tokens": tokens}
    if row.mode == "default":  # what it decided, and how long its probe took
        result["budget"] = policy.micro_batch_tokens
        result["checkpointing"] = policy.checkpointing
        result["probe_s"] = policy.budget.probe_s if policy.budget is not None else 0.0
    if lora is not None:
        result["trainable"] = sum(p.numel() for p in lm.parameters() if p.requires_grad)
    if cuda:
        result["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        result["card_gib"] = torch.cuda.get_device_properties(0).total_memory / 2**30
        name = torch.cuda.get_device_name()
        result["device"] = name
        peak = next((flops for card, flops in PEAK_BF16.items() if card in name), None)
        if peak and seconds and lora is None:  # (LoRA computes no weight gradients of the base: not 6 x P)
            shape = SHAPES[row.shape]
            per_token = 6 * parameters + 6 * shape["num_hidden_layers"] * shape["hidden_size"] * row.tokens
            result["mfu"] = per_token * tokens / statistics.median(seconds) / peak
    else:
        result["peak_gib"] = RssMeter().peak() / 2**30  # VmHWM: this process's own peak RSS
        result["device"] = f"CPU, {torch.get_num_threads()} threads"
    return result


def run_row(row: Row, repeats: int, timeout: float, chunk_tokens: int = 1024,
            memory_limit_gib: float | None = None) -> dict:  # fmt: skip
    """``measure`` in a child process; an out-of-memory or a crash becomes the row's note."""
    command = [sys.executable, __file__, "--measure", str(row), "--repeats", str(repeats),
               "--chunk-tokens", str(chunk_tokens)]  # fmt: skip
    if memory_limit_gib is not None:
        command += ["--memory-limit-gib", str(memory_limit_gib)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"row": str(row), "note": f"over {timeout:.0f} s"}
    if done.returncode == 0:
        return json.loads(done.stdout.strip().splitlines()[-1])
    tail = done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]
    if "OutOfMemory" in done.stderr or done.returncode in (-9, 137):
        return {"row": str(row), "note": "out of memory: " + tail[0][:120]}
    return {"row": str(row), "note": tail[0][:200]}


def tokens_per_s(result: dict) -> float:
    return result["tokens"] / statistics.median(result["seconds"]) if result.get("seconds") else float("nan")


def versus_best(result: dict, results: list[dict]) -> str:
    """A default row's tokens/s over the best other row of its shape and step in this run."""
    step = Row.parse(result["row"]).step
    others = [tokens_per_s(r) for r in results
              if r is not result and "seconds" in r and Row.parse(r["row"]).step == step]  # fmt: skip
    return f"{tokens_per_s(result) / max(others):.2f}x" if others else "-"


def print_table(results: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    device = next((r["device"] for r in results if "device" in r), "?")
    table = Table(title=f"GRPO update (Policy.update), {device}")
    for column in ("shape", "tokens in the step", "micro_batch_tokens", "logprobs", "update s (min-max)",
                   "tokens/s", "peak", "MFU", "default / best"):  # fmt: skip
        table.add_column(column, justify="right")
    for result in results:
        row = Row.parse(result["row"])
        budget = f"{row.micro_batch_tokens:,}" if row.micro_batch_tokens is not None else "auto"
        if "budget" in result:
            budget = f"auto: {result['budget']:,}, ckpt {'on' if result['checkpointing'] else 'off'}"
        cells = [row.shape, f"{row.sequences} x {row.tokens:,}", budget, row.mode]
        if "note" in result:
            table.add_row(*cells, result["note"], "-", "-", "-", "-")
            continue
        seconds = result["seconds"] or [float("nan")]
        median = statistics.median(seconds)
        memory = f"{result['peak_gib']:.1f} GiB RSS" if device.startswith("CPU") else f"{result['peak_gib']:.1f} GiB"
        if "card_gib" in result:
            memory += f" ({result['peak_gib'] / result['card_gib']:.0%})"
        mfu = f"{result['mfu']:.1%}" if "mfu" in result else "-"
        ratio = versus_best(result, results) if row.mode == "default" else "-"
        table.add_row(*cells, f"{median:.2f} ({min(seconds):.2f}-{max(seconds):.2f})",
                      f"{tokens_per_s(result):,.0f}", memory, mfu, ratio)  # fmt: skip
    Console(width=180).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", choices=sorted(ROWS), help="a preset (default: cuda where CUDA is, else cpu)")
    parser.add_argument("--row", action="append", default=[], help="SHAPE,SEQUENCESxTOKENS,BUDGET,MODE (repeatable)")
    parser.add_argument("--repeats", type=int, default=3, help="timed updates per row, after one warm-up")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per row")
    parser.add_argument("--chunk-tokens", type=int, default=1024, help="logprob_chunk_tokens of the chunked rows")
    parser.add_argument("--memory-limit-gib", type=float, help="the default rows' memory_limit_gib (auto on the CPU)")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # a child process: one row
    args = parser.parse_args()
    if args.measure:
        import torch

        if not torch.cuda.is_available():
            torch.set_num_threads(min(2, os.cpu_count() or 1))
        print(json.dumps(measure(Row.parse(args.measure), args.repeats, args.chunk_tokens, args.memory_limit_gib)))
        return
    rows = [Row.parse(text) for text in args.row]
    if not rows:
        import torch

        rows = [Row.parse(text) for text in ROWS[args.rows or ("cuda" if torch.cuda.is_available() else "cpu")]]
    from rollout.serve.processes import stop_on_sigterm

    results = []
    with stop_on_sigterm():  # (a row's child process is killed on SIGTERM as on Ctrl-C)
        for row in rows:
            results.append(run_row(row, args.repeats, args.timeout, args.chunk_tokens, args.memory_limit_gib))
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    print_table(results)
    if args.json:
        with open(args.json, "w") as file:
            json.dump(results, file, indent=1)


if __name__ == "__main__":
    main()
