"""The output JSONL of a rollout: one writer at a time, and what an interrupted run finished."""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path

import orjson

from data.files import atomic_write_bytes
from data.line_files import LineAppender


class OutputError(ValueError):
    """An output file that cannot be written or resumed; the message names it."""


@contextlib.contextmanager
def output_lock(out: Path) -> Iterator[None]:
    """One rollout at a time writes ``out``: a second one (say, a --resume while the first still
    runs) would interleave their lines."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            message = f"another rallyrl rollout is writing {out}; wait for it or choose another --out"
            raise OutputError(message) from None
        try:
            yield
        finally:
            Path(handle.name).unlink(missing_ok=True)


RESUME_AFTER_FULL = "free some space and run the same command with --resume"


def open_output(path: str | Path | None, append: bool = False, what: str = "trajectory",
                after_full: str = RESUME_AFTER_FULL) -> LineAppender | None:  # fmt: skip
    """The JSONL file trajectories are appended to as they finish (``data/line_files.py``), or None."""
    if path is None:
        return None
    return LineAppender(path, append, what, after_full)


def read_finished(path: str | Path) -> set[tuple[int, int]]:
    """The (prompt_index, sample_index) pairs of the trajectories in a rollout JSONL, to resume it.

    Each trajectory is one line written whole, so only a kill in the middle of a write leaves a
    broken line, and it is the last one, without its newline: it is dropped from the file
    (rewritten atomically). A broken line anywhere else is an error naming it.
    """
    path = Path(path)
    raw = path.read_bytes()
    complete = raw[: raw.rfind(b"\n") + 1]
    finished: set[tuple[int, int]] = set()
    for number, line in enumerate(complete.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = orjson.loads(line)
            finished.add((int(record["prompt_index"]), int(record["sample_index"])))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            raise ValueError(f"{path} line {number}: not a trajectory, so the run cannot resume from it") from None
    if len(complete) < len(raw):
        atomic_write_bytes(path, complete)
    return finished


def finished_pairs(out: Path, prompts: int, samples_per_prompt: int) -> set[tuple[int, int]]:
    """(prompt, sample) pairs finished by an earlier run of the same command (--resume)."""
    if not out.exists():
        return set()
    done = read_finished(out)
    outside = sorted((p, s) for p, s in done if p >= prompts or s >= samples_per_prompt)
    if outside:
        raise OutputError(
            f"--resume: {out} holds trajectories for (prompt, sample) {outside[0]} outside this run's "
            f"{prompts} prompts x {samples_per_prompt} samples; resume with the options of the run that wrote it"
        )
    return done


def count_lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except OSError:
        return 0
