"""Local-engine throughput: tokens/s at 1, 16 and 64 concurrent requests versus sequential
``model.generate`` calls on the same requests (same prompts, same output lengths).

    python benchmarks/local_engine.py [--requests 64] [--new-tokens 64] [--sequential 16]

Prompts are calc problems rendered with the chat template and the calculator schema, as a
rollout sends them. Every request generates exactly ``--new-tokens`` tokens (no stop token),
so the rates compare like with like. Prints a table; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM

from data.synthetic import make_calc_records
from data.tiny_model import EMBEDDED_MODEL
from rollout.engines.base import SamplingParams
from rollout.engines.local import LocalEngine, LocalEngineConfig
from rollout.tokens import ChatTokenizer, load_tokenizer
from tools.calculator import CalculatorTool


def sequential_rate(model, prompts: list[list[int]], new_tokens: int) -> float:
    """Tokens/s of one ``model.generate`` call after another (sampling, KV cache on)."""
    started = time.perf_counter()
    with torch.inference_mode():
        for prompt in prompts:
            model.generate(
                torch.tensor([prompt]),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=True,
                pad_token_id=0,
            )
    return len(prompts) * new_tokens / (time.perf_counter() - started)


async def engine_rate(
    model, prompts: list[list[int]], new_tokens: int, concurrency: int, prefix_cache: bool
) -> tuple[float, int, float]:
    """Tokens/s of the local engine with ``concurrency`` requests in flight; also its peak batch
    and the share of prompt tokens served from the prefix cache."""
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=1.0)
    semaphore = asyncio.Semaphore(concurrency)
    config = LocalEngineConfig(max_batch_size=max(concurrency, 1), prefix_cache_mb=512 if prefix_cache else 0)
    async with LocalEngine(model, config) as engine:

        async def one(i: int) -> int:
            async with semaphore:
                return len((await engine.generate(prompts[i], sampling, f"r{i}")).output_ids)

        started = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(i) for i in range(len(prompts)))))
        rate = tokens / (time.perf_counter() - started)
        stats = engine.stats
        return rate, stats.peak_batch, stats.cached_tokens / (stats.cached_tokens + stats.prefill_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64, help="requests per engine run")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per request")
    parser.add_argument("--sequential", type=int, default=16, help="requests in the sequential baseline")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--model", default=str(EMBEDDED_MODEL), help="model directory (default: the embedded one)")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True, dtype=torch.float32).eval()
    chat = ChatTokenizer(tokenizer, [CalculatorTool().schema])
    prompts = [chat.prompt_ids(record.prompt) for record in make_calc_records(args.requests, seed=0)]
    params = sum(p.numel() for p in model.parameters())
    console = Console(width=120)
    console.print(
        f"{args.model} ({params / 1e6:.2f} M parameters), {len(prompts)} requests, "
        f"prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, {args.new_tokens} new tokens each, "
        f"{torch.get_num_threads()} threads"
    )

    baseline = sequential_rate(model, prompts[: args.sequential], args.new_tokens)
    table = Table(title="local engine throughput")
    for column in ("mode", "concurrent requests", "peak batch", "prompt tokens cached", "tokens/s", "vs sequential"):
        table.add_column(column, justify="right")
    table.add_row("model.generate, one at a time", "1", "1", "-", f"{baseline:,.0f}", "1.00x")
    runs = [(c, True) for c in args.concurrency] + [(max(args.concurrency), False)]
    for concurrency, prefix_cache in runs:
        rate, peak, cached = asyncio.run(engine_rate(model, prompts, args.new_tokens, concurrency, prefix_cache))
        mode = "LocalEngine" if prefix_cache else "LocalEngine, prefix cache off"
        table.add_row(mode, str(concurrency), str(peak), f"{cached:.0%}", f"{rate:,.0f}", f"{rate / baseline:.2f}x")
    console.print(table)


if __name__ == "__main__":
    main()
