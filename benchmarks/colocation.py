"""Colocation in ``rallyrl train``: the update's peak memory with the embedded engine released for it
(``colocate: true``) against the engine kept (``colocate: false``), in one run of this script.

    python benchmarks/colocation.py                      # CPU: a real vocabulary, a medium body
    python benchmarks/colocation.py --shape qwen2.5-0.5b  # CUDA: Qwen2.5-0.5B's shape
    python benchmarks/colocation.py --repeats 3 --json out.json

It saves a model directory of the shape with random weights (Qwen2.5's vocabulary of 151,936; the
embedded model's character tokenizer, so prompts are short; nothing downloads), then runs the real
command, ``rallyrl train --model DIR --steps N`` (the calc task, the embedded engine on the trainer's
device), once per setting and repeat, in processes of their own, alternating. From each run's
metrics.jsonl it reads ``train/peak_memory_gib`` (the update's peak: ``torch.cuda.max_memory_allocated``
on CUDA, the process's peak RSS on the CPU), ``colocate/released_gib`` and the seconds of release and
resume. Steps after the first are compared (the first builds what later steps reuse). Prints a table;
asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.trainer_memory import SHAPES as MEMORY_SHAPES

SHAPES = {
    "cpu-medium": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=2, num_attention_heads=8,
                       num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-0.5b": MEMORY_SHAPES["qwen2.5-0.5b"],
}  # fmt: skip
VOCABULARY = 151_936


def save_model(shape: str, directory: Path) -> Path:
    """A Qwen2 model directory of ``shape`` with random weights and the embedded model's tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    from data.tiny_model import EMBEDDED_MODEL

    hf_logging.disable_progress_bar()
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCABULARY, max_position_embeddings=4096, **SHAPES[shape])
    Qwen2ForCausalLM(config).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(Path(EMBEDDED_MODEL) / name, directory / name)
    return directory


def train(model: Path, out: Path, colocate: bool, steps: int, timeout: float) -> list[dict]:
    """``rallyrl train`` with ``colocate`` set; the metrics of each step."""
    command = ["rallyrl", "train", "--model", str(model), "--out", str(out), "--steps", str(steps),
               "--prompts-per-step", "8", "-n", "4", "--no-progress",
               "--set", f"colocate={str(colocate).lower()}", "--set", "filter_groups=false",
               "--set", "checkpoint_every=0", "--set", "rollout.max_new_tokens=64"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None, help="default: 0.5B on CUDA, else cpu-medium")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2, help="runs per setting")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    import torch

    shape = args.shape or ("qwen2.5-0.5b" if torch.cuda.is_available() else "cpu-medium")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    rows: dict[bool, list[dict]] = {True: [], False: []}
    with tempfile.TemporaryDirectory(prefix="rallyrl-colocation-") as work:
        model = save_model(shape, Path(work) / "model")
        for repeat in range(args.repeats):
            for colocate in (False, True):
                out = Path(work) / f"run-{colocate}-{repeat}"
                rows[colocate] += train(model, out, colocate, args.steps, args.timeout)[1:]
                print(json.dumps({"colocate": colocate, "repeat": repeat,
                                  "peak_gib": [m["train/peak_memory_gib"] for m in rows[colocate]]}),
                      file=sys.stderr, flush=True)  # fmt: skip
    report(shape, device, rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"shape": shape, "device": device,
                                               "rows": {str(k): v for k, v in rows.items()}}, indent=1))  # fmt: skip


def report(shape: str, device: str, rows: dict[bool, list[dict]]) -> None:
    from rich.console import Console
    from rich.table import Table

    memory = "GiB RSS" if device == "CPU" else "GiB GPU"
    table = Table(title=f"rallyrl train, {shape}, {device}: the update's peak, engine kept vs released")
    for column in ("colocate", "steps", f"update peak, {memory} (min-max)", "engine released, GiB", "release s",
                   "resume s", "update s"):  # fmt: skip
        table.add_column(column, justify="right")
    peaks = {}
    for colocate, metrics in rows.items():
        peak = [m["train/peak_memory_gib"] for m in metrics]
        peaks[colocate] = statistics.median(peak)

        def cell(key: str, metrics: list[dict] = metrics) -> str:
            values = [m[key] for m in metrics if key in m]
            return f"{statistics.median(values):.2f}" if values else "-"

        table.add_row(str(colocate).lower(), str(len(metrics)),
                      f"{peaks[colocate]:.2f} ({min(peak):.2f}-{max(peak):.2f})", cell("colocate/released_gib"),
                      cell("colocate/release_s"), cell("colocate/resume_s"), cell("time/update_s"))  # fmt: skip
    console = Console(width=160)
    console.print(table)
    console.print(f"update peak with the engine released / kept: {peaks[True] / peaks[False]:.2f}x "
                  f"({peaks[False] - peaks[True]:.2f} GiB less)")  # fmt: skip


if __name__ == "__main__":
    main()
