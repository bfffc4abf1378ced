"""What one weight sync writes and costs with LoRA, against full fine-tuning, on the CPU.

    python benchmarks/lora_sync.py [--shapes embedded qwen2.5-0.5b] [--rank 16] [--repeats 3] [--json FILE]

For each model (the embedded model, and a Qwen2.5-0.5B-shaped model with random weights built in
code: nothing downloads), with a rank-``--rank`` adapter on every linear layer:

- full: the model directory a server loads through ``/update_weights_from_disk`` (``save_weights``
  of ``trainer/weight_files.py``), bytes on disk and seconds;
- adapter: the adapter directory in peft's format (what a server's LoRA endpoint loads), bytes and
  seconds;
- merge: seconds to compute the merged full weights (what an in-process engine, or a server
  without adapter support, gets) and to load them into an engine's copy of the model;
- the in-process engine's two forms, per step: merged weights (the sync above, then decoding at the
  base model's speed) or LoRA layers kept in the engine's copy (a sync copies the adapter's tensors;
  every forward pays the adapter's matmuls): seconds per sync, per decoded token (greedy, a batch of
  ``--batch`` prompts with a KV cache) and the decoded tokens per step above which merging wins.

Prints a table; asserts nothing. Each figure is the median of ``--repeats``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and p.suffix == ".safetensors")


def timed(function, repeats: int) -> tuple[float, object]:
    seconds, result = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        result = function()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds), result


def measure(shape: str, rank: int, repeats: int, batch: int, decode_tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from data.tiny_model import EMBEDDED_MODEL
    from rollout.tokens import load_tokenizer
    from trainer.config import LoRAConfig
    from trainer.lora import apply_lora, lora_layers, merged_state_dict, save_adapter
    from trainer.policy_model import load_lm
    from trainer.weight_files import save_weights

    tokenizer = load_tokenizer(EMBEDDED_MODEL)
    if shape == "embedded":
        lm, base_dir = load_lm(EMBEDDED_MODEL), EMBEDDED_MODEL
    else:  # Qwen2.5-0.5B's published config, random weights
        config = Qwen2Config(vocab_size=151_936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                             num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
        lm = Qwen2ForCausalLM(config)
        base_dir = Path(tempfile.mkdtemp(prefix="rallyrl-base-config-"))  # what the adapter's config names:
        config.save_pretrained(base_dir)  # peft reads the base's vocabulary size from it
    peft = apply_lora(lm, LoRAConfig(rank=rank, alpha=2.0 * rank))
    for layer in lora_layers(lm).values():  # a trained adapter, not the zero one
        torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.01)
    parameters = sum(p.numel() for n, p in lm.named_parameters() if "lora_" not in n)
    adapter_parameters = sum(p.numel() for n, p in lm.named_parameters() if "lora_" in n)
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        merge_s, merged = timed(lambda: merged_state_dict(lm), repeats)
        engine = AutoModelForCausalLM.from_config(lm.config, dtype=torch.float32)
        load_s, _ = timed(lambda: engine.load_state_dict(merged), repeats)
        versions = iter(range(1, 1000))
        # (a copy each time: transformers 5's save_pretrained empties the state dict it is given)
        full_s, full_dir = timed(
            lambda: save_weights(lm, tokenizer, work / "weights", next(versions), dict(merged)), repeats
        )
        counter = iter(range(1000))

        def adapter() -> Path:
            directory = work / f"adapter-{next(counter)}"
            directory.mkdir()
            save_adapter(peft, directory, base_dir)
            return directory

        adapter_s, adapter_dir = timed(adapter, repeats)
        forms = engine_forms(lm, peft, engine, merged, repeats, batch, decode_tokens)
        return {**forms,
            "shape": shape, "rank": rank, "parameters": parameters, "adapter_parameters": adapter_parameters,
            "full_bytes": directory_bytes(full_dir), "full_s": full_s,
            "adapter_bytes": directory_bytes(adapter_dir), "adapter_s": adapter_s,
            "merge_s": merge_s, "engine_load_s": load_s,
        }  # fmt: skip


def engine_forms(lm, peft, engine, merged: dict, repeats: int, batch: int, tokens: int) -> dict:
    """Sync and decode seconds of an in-process engine holding merged weights (``engine``) or LoRA
    layers (a copy of ``lm`` with its adapter, synced by copying the adapter's tensors)."""
    import copy

    import torch

    layered = copy.deepcopy(lm).eval()
    adapter = {n: p.detach().clone() for n, p in lm.named_parameters() if "lora_" in n}
    targets = dict(layered.named_parameters())

    @torch.no_grad()
    def copy_adapter() -> None:
        for name, value in adapter.items():
            targets[name].copy_(value)

    @torch.no_grad()
    def decode(model) -> float:
        """Seconds per decoded token: ``tokens`` greedy steps of a batch, KV cache on."""
        ids = torch.randint(3, min(lm.config.vocab_size, 100), (batch, 32), generator=torch.Generator().manual_seed(0))
        started = time.perf_counter()
        out = model(input_ids=ids, use_cache=True)
        cache, last = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(tokens - 1):
            out = model(input_ids=last, past_key_values=cache, use_cache=True)
            cache, last = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        return (time.perf_counter() - started) / tokens

    engine.eval()
    layers_sync_s, _ = timed(copy_adapter, repeats)
    merged_token_s = statistics.median(decode(engine) for _ in range(repeats))
    layers_token_s = statistics.median(decode(layered) for _ in range(repeats))
    return {"batch": batch, "decode_tokens": tokens, "layers_sync_s": layers_sync_s,
            "merged_token_s": merged_token_s, "layers_token_s": layers_token_s}  # fmt: skip


def break_even(r: dict) -> str:
    """Decoded tokens (forward passes) per step above which merged weights cost less than LoRA layers."""
    extra_per_token = r["layers_token_s"] - r["merged_token_s"]
    extra_sync = r["merge_s"] + r["engine_load_s"] - r["layers_sync_s"]
    if extra_per_token <= 0:
        return "never"
    return f"{max(extra_sync, 0.0) / extra_per_token:,.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shapes", nargs="+", default=["embedded", "qwen2.5-0.5b"], choices=["embedded", "qwen2.5-0.5b"]
    )
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8, help="prompts decoded together (the engine forms)")
    parser.add_argument("--decode-tokens", type=int, default=32, help="greedy steps timed (the engine forms)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    import torch
    from rich.console import Console
    from rich.table import Table

    torch.set_num_threads(2)
    results = [measure(shape, args.rank, args.repeats, args.batch, args.decode_tokens) for shape in args.shapes]
    table = Table(title=f"one weight sync, LoRA rank {args.rank} on every linear layer (CPU, median of {args.repeats})")
    for column in ("model", "parameters", "adapter", "full: bytes, s", "adapter: bytes, s", "bytes ratio",
                   "merge s", "engine load s"):  # fmt: skip
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(
            r["shape"], f"{r['parameters']:,}", f"{r['adapter_parameters']:,}",
            f"{r['full_bytes'] / 2**20:,.1f} MiB, {r['full_s']:.3f}",
            f"{r['adapter_bytes'] / 2**20:,.2f} MiB, {r['adapter_s']:.3f}",
            f"{r['adapter_bytes'] / r['full_bytes']:.2%}", f"{r['merge_s']:.3f}", f"{r['engine_load_s']:.3f}",
        )  # fmt: skip
    Console(width=160).print(table)
    forms = Table(title=f"the in-process engine: merged weights or LoRA layers (batch {args.batch}, "
                        f"{args.decode_tokens} greedy tokens)")  # fmt: skip
    for column in ("model", "merged: sync s", "layers: sync s", "merged: ms/token", "layers: ms/token",
                   "merging wins above (forwards/step)"):  # fmt: skip
        forms.add_column(column, justify="right")
    for r in results:
        forms.add_row(
            r["shape"], f"{r['merge_s'] + r['engine_load_s']:.3f}", f"{r['layers_sync_s']:.4f}",
            f"{1000 * r['merged_token_s']:.2f}", f"{1000 * r['layers_token_s']:.2f}", break_even(r),
        )  # fmt: skip
    Console(width=160).print(forms)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
