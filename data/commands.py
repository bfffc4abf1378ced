"""``rallyrl data gsm8k|math`` (official files -> records), ``rallyrl data prep`` (a task's records -> a
file) and ``rallyrl new-model``."""

from __future__ import annotations

from pathlib import Path

import typer

from data.console import console
from data.console import fail as _fail

data_app = typer.Typer(help="Prepare datasets: official GSM8K and MATH files, or a task's prompts -> rallyrl records.",
                       no_args_is_help=True)  # fmt: skip
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


@data_app.command("prep")
def data_prep(
    task: str = typer.Argument(..., help='A task: calc, "reasoning_gym:basic_arithmetic=2,chain_sum", textarena:...'),
    output: Path = typer.Option(..., "--output", "--out", "-o", help=_DATA_OUTPUT_HELP),
    num: int = typer.Option(64, help="Records to write."),
    seed: int = typer.Option(0, help="Seed of the task's prompts (the same as --seed of rollout, train and eval)."),
    layout: str = typer.Option("native", help='"native" (rallyrl) or "verl" (reward_model, extra_info).'),
) -> None:
    """Write a task's records to a file, which --data reads back as the same prompts with the same rewards."""
    from data.schema import RecordError, save_records
    from data.synthetic import make_task

    if layout not in ("native", "verl"):
        raise _fail(f"--layout must be native or verl, got {layout!r}")
    if num < 1:
        raise _fail(f"--num must be at least 1, got {num}")
    try:
        records = make_task(task, num, seed)
        save_records(records, output, layout=layout)  # type: ignore[arg-type]
    except (RecordError, ValueError) as exc:
        raise _fail(str(exc) if isinstance(exc, RecordError) else f"task: {exc}") from None
    console.print(f"wrote {len(records)} records of {task} (seed {seed}) to {output}", highlight=False)


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


def export_model(
    adapter: Path = typer.Option(..., "--merge", help="A LoRA adapter directory (final/ or checkpoints/step-N/)."),
    out: Path = typer.Argument(..., help="Where to write the merged model directory."),
    dtype: str = typer.Option("float32", help="Weights' dtype in the merged model: float32, bfloat16 or float16."),
) -> None:
    """Merge a LoRA adapter into its base model (named in its adapter_config.json) and write a plain
    model directory that SGLang, vLLM and every rallyrl command load as is."""
    from rollout.engines.adapter_dirs import AdapterError, export_merged, is_adapter_dir

    if dtype not in ("float32", "bfloat16", "float16"):
        raise _fail(f"--dtype must be float32, bfloat16 or float16, got {dtype!r}")
    if not is_adapter_dir(adapter):
        raise _fail(f"--merge {adapter}: not a LoRA adapter directory (no adapter_config.json)")
    import torch

    from data.disk_space import DiskFull

    try:
        path = export_merged(adapter, out, getattr(torch, dtype))
    except DiskFull as exc:
        raise _fail(str(exc), 1) from None
    except AdapterError as exc:
        raise _fail(f"--merge {adapter}: {exc}") from None
    except OSError as exc:
        raise _fail(f"{out}: {exc.strerror or exc}") from None
    console.print(f"wrote the merged model to {path}")
