"""What a ``python`` tool call costs: wall time per call as a rollout makes them, and the CPU the
trainer's process spends on one call's output.

    python benchmarks/python_tool.py [--calls 48] [--rounds 3] [--json FILE]
    python benchmarks/python_tool.py --tools-root OTHER_CHECKOUT   # the same, with another tools/

Each round runs ``--calls`` calls of a few ordinary programs (a print, a loop, an import of json
and fractions, a traceback) through one ``PythonTool`` with its default config (``max_concurrent``
4, as a rollout runs them), and reports the median wall time per call (``metrics["wall_s"]``: from
its start to the end of its cleanup, not its wait for a slot) and calls per second; then a
program that writes one byte at a time for 3 s, and the CPU seconds (user + system, every thread)
this process spent on that call. ``--tools-root`` imports ``tools`` from another checkout, for an A/B
against an older sandbox in the same session.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import sys
import time

from rollout.serve.processes import stop_on_sigterm

PROGRAMS = [
    "print('hello')",
    "print(sum(i * i for i in range(200000)))",
    "import json, fractions\nprint(json.dumps(str(fractions.Fraction(3, 7) ** 5)))",
    "def f(n):\n    return 1 / n\nprint(f(0))",
]
ONE_BYTE_AT_A_TIME = """
import os, time
end = time.monotonic() + 3
while time.monotonic() < end:
    os.write(1, b"x")
    time.sleep(0.0001)
"""


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def one_round(tool, calls: int) -> dict[str, float]:
    async def timed(code: str) -> float:
        response = await tool.execute("bench", {"code": code})
        assert response.metrics["sandbox"], response.text
        return response.metrics["wall_s"]  # from the call's start to its cleanup, its turn in the queue excluded

    started = time.perf_counter()
    walls = await asyncio.gather(*(timed(PROGRAMS[i % len(PROGRAMS)]) for i in range(calls)))
    elapsed = time.perf_counter() - started
    before = cpu_s()
    response = await tool.execute("bench", {"code": ONE_BYTE_AT_A_TIME})
    trickle_cpu = cpu_s() - before
    return {
        "median_call_s": statistics.median(walls),
        "calls_per_s": calls / elapsed,
        "trickle_cpu_s": trickle_cpu,
        "trickle_bytes": response.metrics["output_bytes"],
    }


async def main_async(args: argparse.Namespace) -> list[dict[str, float]]:
    from tools.python_sandbox import PythonTool

    tool = PythonTool({"timeout_s": 10, "max_output_chars": 100_000})
    await tool.execute("warm-up", {"code": "pass"})
    print(f"sandbox: {tool.sandbox}", flush=True)
    rounds = []
    for number in range(1, args.rounds + 1):
        result = await one_round(tool, args.calls)
        rounds.append(result)
        print(
            f"round {number}: {result['median_call_s'] * 1000:.0f} ms per call (median of {args.calls}), "
            f"{result['calls_per_s']:.1f} calls/s; one-byte writer: {result['trickle_cpu_s']:.3f} CPU-s "
            f"in this process for {result['trickle_bytes']} bytes",
            flush=True,
        )
    return rounds


@stop_on_sigterm()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tools-root", help="import the tools package from this checkout instead")
    parser.add_argument("--json", help="write the rounds here")
    args = parser.parse_args()
    if args.tools_root:
        sys.path.insert(0, args.tools_root)
    rounds = asyncio.run(main_async(args))
    for key in ("median_call_s", "calls_per_s", "trickle_cpu_s"):
        values = [r[key] for r in rounds]
        print(f"{key}: {min(values):.3f} .. {max(values):.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rounds, f, indent=1)


if __name__ == "__main__":
    main()
