"""Writing files so that a reader never sees half of one: write a sibling, then rename it into place.
A full disk is ``DiskFull`` naming the file, the bytes it needed and the free space, and the sibling is
removed (``data/disk_space.py``)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from data.disk_space import DiskFull, check_room, free_bytes, full_disk_said, is_disk_full


def atomic_write_bytes(path: str | Path, data: bytes, what: str = "file") -> Path:
    """Replace ``path`` with ``data`` atomically (a ``.tmp`` sibling renamed over it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with full_disk_said(path, what, len(data), kept=f"{path} is as it was"):
            tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def atomic_write_text(path: str | Path, text: str, what: str = "file") -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"), what)


def atomic_write_with(path: str | Path, write: Callable[[Path], None], what: str = "file") -> Path:
    """Call ``write(tmp)`` for a sibling temporary file (say, a parquet writer or ``savefig``), then
    rename it over ``path``; the temporary is removed if ``write`` fails. The sibling keeps the
    suffix, for writers that pick a format by it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
    try:
        with full_disk_said(path, what, kept=f"{path} is as it was"):
            write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def atomic_directory(final: str | Path, write: Callable[[Path], None], needed: int | None = None,
                     what: str = "directory") -> Path:  # fmt: skip
    """Call ``write(partial)`` for an empty ``FINAL.partial`` directory, then rename it to ``final``
    (replacing an older one), so a kill never leaves a half-written directory under the final name.
    ``needed``: the bytes it will hold, compared with the free space before anything is written. A
    ``write`` that fails takes its ``.partial`` with it."""
    final = Path(final)
    partial = final.with_name(final.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    final.parent.mkdir(parents=True, exist_ok=True)
    if needed is not None:
        check_room(final, needed, what)
    partial.mkdir(parents=True)
    try:
        write(partial)
    except Exception as exc:
        full = is_disk_full(exc, partial)
        shutil.rmtree(partial, ignore_errors=True)
        if full:
            kept = f"{final} is as it was" if final.exists() else "nothing of it was kept"
            raise DiskFull(final, needed, free_bytes(final.parent), what, kept) from None
        raise
    shutil.rmtree(final, ignore_errors=True)
    os.replace(partial, final)
    return final
