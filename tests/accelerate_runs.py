"""`accelerate launch` for the multi-process trainer tests, each launch on a port of its own.

torchrun's rendezvous listens on 29500 unless told otherwise: two launches at once (the DDP and the
FSDP tests on two pytest workers) then fail with EADDRINUSE, as one CI run did.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from rollout.serve.processes import free_port


def launch(spread: list[str], script: Path, args: list[str], cwd: Path, timeout_s: float = 400) -> None:
    """Run ``script`` under ``accelerate launch`` with ``spread`` (the process layout flags); fail the
    test with the end of its stderr when it exits non-zero."""
    accelerate = shutil.which("accelerate")
    if accelerate is None:
        pytest.fail("the accelerate command is not installed")
    command = [accelerate, "launch", *spread, "--num_machines", "1", "--main_process_port", str(free_port()),
               "--mixed_precision", "no", "--dynamo_backend", "no", str(script), *args]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(script.parents[1])}
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
