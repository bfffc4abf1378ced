"""benchmarks/trainer_throughput.py: a tiny run times the update with the shared prompt and without."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "trainer_throughput.py"


def test_a_tiny_run_times_both_settings_and_the_micro_batches_share_the_calc_prompt():
    done = subprocess.run([sys.executable, str(SCRIPT), "--sequences", "16", "--repeats", "1", "--threads", "1"],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    row = next(line for line in done.stdout.splitlines() if re.match(r"│\s+16 │", line))
    cells = [cell.strip() for cell in row.strip("│").split("│")]
    shared, on, off, ratio = cells[2], float(cells[3]), float(cells[4]), float(cells[5].rstrip("x"))
    low = int(shared.split("-")[0])
    assert low > 300  # the system prompt and the calculator's schema, at least
    assert on > 0 and off > 0 and abs(ratio - on / off) < 0.02  # (each printed to 0.01)
