"""Commands on a small disk of their own (``tests/test_disk_full.py``): a tmpfs mounted in a private mount
namespace (``unshare --mount``), so nothing outside sees it and it goes when the run ends.

``on_small_disk(tmp_path, steps)`` runs this file as a script in such a namespace. The steps: ``{"mount":
"200k"}``, ``{"grow": "20m"}`` (the space freed), ``{"cli": [...]}`` (``python -m cli ...`` in the disk,
``{url}`` replaced by the server's), ``{"serve": true}`` (one ``rallyrl serve`` of the embedded model,
loading weights from the disk), ``{"python": "..."}`` (code run in the disk). What each step printed
and its exit code, the disk's files and the lines of its JSONL files come back as JSON."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def can_mount_small_disk(where: Path) -> bool:
    """Whether this machine lets the tests mount a tmpfs in a mount namespace of their own."""
    if shutil.which("unshare") is None:
        return False
    where.mkdir(parents=True, exist_ok=True)
    command = ["unshare", "--mount", "--propagation", "private", "mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs",
               str(where)]  # fmt: skip
    return subprocess.run(command, capture_output=True, timeout=30).returncode == 0


def on_small_disk(tmp_path: Path, steps: list[dict[str, Any]], timeout: int = 900) -> dict[str, Any]:
    """Run ``steps`` (module docstring) on a small disk at ``tmp_path/disk``; what they did."""
    spec, result = tmp_path / "steps.json", tmp_path / "result.json"
    spec.write_text(json.dumps({"disk": str(tmp_path / "disk"), "logs": str(tmp_path / "logs"), "steps": steps,
                                "result": str(result)}))  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, __file__, str(spec)],
                          capture_output=True, text=True, timeout=timeout, env=env)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(result.read_text())


# ----- in the namespace ------------------------------------------------------------------------------------------


def _jsonl(path: Path) -> dict[str, Any]:
    raw = path.read_bytes()
    lines = [json.loads(line) for line in raw.splitlines() if line.strip()]
    return {"lines": lines, "whole": raw.endswith(b"\n") or not raw}


def _facts(disk: Path) -> dict[str, Any]:
    files = sorted(str(p.relative_to(disk)) for p in disk.rglob("*"))
    return {"files": files, "jsonl": {name: _jsonl(disk / name) for name in files if name.endswith(".jsonl")}}


def _run(command: list[str], disk: Path) -> dict[str, Any]:
    """One command in the disk: its exit code, the end of what it printed, the disk's files after it."""
    run = subprocess.run(command, cwd=disk, capture_output=True, text=True, timeout=600)
    return {"rc": run.returncode, "out": run.stdout[-4000:], "err": run.stderr[-4000:], "facts": _facts(disk)}


def main(spec_file: str) -> None:
    spec = json.loads(Path(spec_file).read_text())
    disk, logs = Path(spec["disk"]), Path(spec["logs"])
    disk.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    done: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        url = ""
        for step in spec["steps"]:
            if "mount" in step:
                subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={step['mount']}", "tmpfs", str(disk)], check=True)
            elif "grow" in step:
                subprocess.run(["mount", "-o", f"remount,size={step['grow']}", str(disk)], check=True)
            elif "serve" in step:
                from data.tiny_model import EMBEDDED_MODEL
                from rollout.serve.processes import serve_processes

                (server,) = stack.enter_context(serve_processes(EMBEDDED_MODEL, logs, 1, "--weights-dir", str(disk)))
                url = server.url
            elif "cli" in step:
                done.append(_run([sys.executable, "-m", "cli", *(a.replace("{url}", url) for a in step["cli"])], disk))
            elif "python" in step:
                done.append(_run([sys.executable, "-c", step["python"]], disk))
        Path(spec["result"]).write_text(json.dumps({"runs": done, "facts": _facts(disk)}))


if __name__ == "__main__":
    main(sys.argv[1])
