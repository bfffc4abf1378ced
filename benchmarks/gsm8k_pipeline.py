"""GSM8K preparation and evaluation end to end, on made-up records in the official format.

    python -m benchmarks.gsm8k_pipeline [--records 1000] [--dir runs/gsm8k-pipeline]

Writes ``--records`` made-up GSM8K rows (``question``, ``answer`` ending in ``#### N``), runs
``rallyrl data gsm8k`` on them and ``rallyrl eval --data`` on the result against the embedded
model, and prints each step's wall time and the evaluation's figures. (The embedded model was
trained on bare arithmetic, not word problems: its accuracy here says nothing about GSM8K; the
point is that the real data path runs.) Each step has ``--timeout-s`` (1800) to finish.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import orjson

from data.gsm8k import make_gsm8k_like
from rollout.serve.processes import stop_on_sigterm

TIMEOUT_S = 1800.0
"""Deadline of each step (a ``rallyrl`` command)."""


def timed(command: list[str], timeout_s: float = TIMEOUT_S) -> float:
    """Seconds ``command`` took; CalledProcessError when it fails, TimeoutExpired (it is killed) past ``timeout_s``."""
    started = time.monotonic()
    subprocess.run(command, check=True, timeout=timeout_s)
    return time.monotonic() - started


@stop_on_sigterm()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=1000)
    parser.add_argument("--dir", type=Path, default=Path("runs/gsm8k-pipeline"))
    parser.add_argument("--timeout-s", type=float, default=TIMEOUT_S, help="deadline of each step")
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    raw, records = args.dir / "gsm8k_like.jsonl", args.dir / "gsm8k_records.jsonl"
    report_md, report_json = args.dir / "eval.md", args.dir / "eval.json"
    make_gsm8k_like(args.records, seed=0, path=raw)
    rallyrl = [sys.executable, "-m", "cli"]
    prepare_s = timed([*rallyrl, "data", "gsm8k", "--input", str(raw), "--output", str(records)], args.timeout_s)
    eval_s = timed([*rallyrl, "eval", "--data", str(records), "--report", str(report_md), "--json", str(report_json),
                    "--no-progress"], args.timeout_s)  # fmt: skip
    report = orjson.loads(report_json.read_bytes())
    print(f"data gsm8k: {args.records} rows -> {records} in {prepare_s:.1f} s")
    print(f"eval: {report['prompts']} prompts in {eval_s:.1f} s; greedy accuracy {report['accuracy']:.3f}; "
          + ", ".join(f"pass@{k} {v:.3f}" for k, v in report["pass_at_k"].items()))  # fmt: skip
    print(f"report: {report_md}")


if __name__ == "__main__":
    main()
