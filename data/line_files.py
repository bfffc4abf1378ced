"""Files appended one whole line at a time (trajectories, sessions, metrics): each line is one
``write`` to a file opened ``O_APPEND``, so a kill leaves at most a torn last line (which the readers
drop), and a line the disk cannot hold is taken back (the file cut to its last whole line) before
``DiskFull`` says so (``data/disk_space.py``)."""

from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType

from data.disk_space import FULL_ERRNOS, DiskFull, free_bytes


class LineAppender:
    """Whole lines appended to ``path`` (replaced first unless ``append``). ``what``: what one line
    holds, and ``after_full``: what to do after a full disk, both for the error."""

    def __init__(self, path: str | Path, append: bool = True, what: str = "line", after_full: str = ""):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (0 if append else os.O_TRUNC) | os.O_CLOEXEC
        self._fd: int | None = os.open(self.path, flags, 0o644)
        self.what, self.after_full = what, after_full
        self.lines = 0  # written by this appender

    def write(self, line: bytes) -> None:
        """Append ``line`` (ending in a newline) whole, or not at all (DiskFull)."""
        assert self._fd is not None, f"{self.path} is closed"
        start = os.lseek(self._fd, 0, os.SEEK_END)
        view = memoryview(line)
        try:
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as exc:
            if exc.errno not in FULL_ERRNOS:
                raise
            os.ftruncate(self._fd, start)
            kept = f"the file holds only whole lines ({self.lines} written by this run)"
            if self.after_full:
                kept += f"; {self.after_full}"
            raise DiskFull(self.path, len(line), free_bytes(self.path), f"a {self.what} for", kept) from None
        self.lines += 1

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> LineAppender:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
