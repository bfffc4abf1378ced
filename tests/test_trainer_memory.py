"""A real vocabulary on the CPU: one GRPO update of a long trajectory through a model with Qwen2.5's
151,936-token vocabulary stays below the size of a single float32 copy of its logits, which the
unchunked computation made several of (the smaller case of ``benchmarks/trainer_memory.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARK = Path(__file__).parents[1] / "benchmarks" / "trainer_memory.py"
VOCABULARY = 151_936


@pytest.mark.slow
def test_an_update_on_a_real_vocabulary_holds_less_than_one_copy_of_its_logits():
    tokens = 3072  # half of them trained: 1,536 positions through the LM head
    one_copy_gib = tokens * VOCABULARY * 4 / 2**30  # 1.74 GiB: the unchunked path held several
    command = [sys.executable, str(BENCHMARK), "--measure", f"cpu-small,1x{tokens},{tokens},chunked",
               "--repeats", "0", "--chunk-tokens", "256"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(BENCHMARK.parents[1]), "OMP_NUM_THREADS": "2"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["peak_gib"] < 0.9 * one_copy_gib, result  # the whole process: Python, torch, model, AdamW


def test_the_default_rows_budget_is_auto_and_their_ratio_is_against_the_best_other_row_of_their_step():
    from benchmarks.trainer_memory import Row, versus_best

    row = Row.parse("qwen2.5-0.5b,64x1024,auto,default")
    assert row.micro_batch_tokens is None and str(row) == "qwen2.5-0.5b,64x1024,auto,default"
    for bad in ("qwen2.5-0.5b,64x1024,auto,chunked", "qwen2.5-0.5b,64x1024,8192,default"):
        with pytest.raises(SystemExit, match="default mode's budget is auto"):
            Row.parse(bad)
    results = [
        {"row": "qwen2.5-0.5b,64x1024,auto,default", "tokens": 65536, "seconds": [1.0, 1.0]},
        {"row": "qwen2.5-0.5b,64x1024,32768,chunked", "tokens": 65536, "seconds": [0.8]},
        {"row": "qwen2.5-0.5b,64x1024,8192,chunked", "tokens": 65536, "seconds": [2.0]},
        {"row": "qwen2.5-0.5b,4x16384,16384,chunked", "tokens": 65536, "seconds": [0.1]},  # another step
        {"row": "qwen2.5-0.5b,64x1024,16384,chunked", "note": "out of memory"},
    ]
    assert versus_best(results[0], results) == "0.80x"
