"""Where ``rallyrl gateway`` puts finished sessions: appended to a JSONL file as each finishes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from rollout.request import AsyncRolloutRequest


def write_sessions(path: str | Path) -> tuple[Callable[[AsyncRolloutRequest], None], Callable[[], None]]:
    """An ``on_finish`` that appends each finished session to a JSONL file, and its closer."""
    import orjson

    from rollout.output_file import open_output

    file = open_output(path, append=True, what="session", after_full="sessions finished from now on are lost")
    assert file is not None

    def write(request: AsyncRolloutRequest) -> None:
        file.write(orjson.dumps(request.to_record()) + b"\n")

    return write, file.close
