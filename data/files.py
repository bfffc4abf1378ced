"""Writing files so that a reader never sees half of one: write a sibling, then rename it into place."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Replace ``path`` with ``data`` atomically (a ``.tmp`` sibling renamed over it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_with(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp)`` for a sibling temporary file (say, a parquet writer or ``savefig``), then
    rename it over ``path``; the temporary is removed if ``write`` fails. The sibling keeps the
    suffix, for writers that pick a format by it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def atomic_directory(final: str | Path, write: Callable[[Path], None]) -> Path:
    """Call ``write(partial)`` for an empty ``FINAL.partial`` directory, then rename it to ``final``
    (replacing an older one), so a kill never leaves a half-written directory under the final name."""
    final = Path(final)
    partial = final.with_name(final.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    write(partial)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(partial, final)
    return final
