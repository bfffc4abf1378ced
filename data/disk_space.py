"""A full disk said in one line: every write of trajectories, metrics, checkpoints, weights and model
directories turns ``ENOSPC`` / ``EDQUOT`` into ``DiskFull``, which names the path, the bytes the write
needed and the free space; the commands print it and exit 1 (``data/command_options.py``).

What was written before stays (whole trajectories, complete checkpoints); a directory that did not fit is
removed (``data/files.py``). Writes whose size is known in advance (a checkpoint, a weight version, a
model) compare it with the free space first (``check_room``), so a shortfall is said before anything is
written, with a warning when the disk will hold fewer than two more of them.

Not every writer keeps the errno: safetensors reports ``I/O error: No space left on device (os error
28)``, torch's zip writer only ``unexpected pos``; ``is_disk_full`` reads those too.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
FULL_WORDS = ("No space left on device", "Disk quota exceeded", "os error 28", "os error 122")
"""How a full disk reads in errors without an errno (safetensors' Rust I/O errors)."""
TORCH_WRITER_WORDS = ("unexpected pos", "PytorchStreamWriter failed writing")
"""torch's zip writer on a failed write: a full disk when the disk is then (nearly) full."""
NEARLY_FULL_BYTES = 2**20
MARGIN = 1.02
"""Room asked beyond a write's known size (file system blocks, small files written beside it)."""
MARGIN_BYTES = 2**20


class DiskFull(RuntimeError):
    """A write that did not fit on its disk (module docstring). Exit code 1."""

    def __init__(self, path: str | Path, needed: int | None, free: int, what: str, kept: str = ""):
        self.path, self.needed, self.free = Path(path), needed, free
        need = f"needs {size(needed)}" if needed is not None else "did not fit"
        message = f"disk full: {what} {path} {need}, {size(free)} free on {mount_of(path)}"
        super().__init__(message + (f"; {kept}" if kept else ""))


def size(count: int | None) -> str:
    """Bytes for people: ``20.7 MB``, ``512 KB``, ``731 bytes`` (decimal units, as ``df -H``)."""
    if count is None:
        return "?"
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} bytes"


def _existing(path: str | Path) -> Path:
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: str | Path) -> int:
    """Bytes an unprivileged writer may still put on the file system of ``path`` (or its nearest parent)."""
    stats = os.statvfs(_existing(path))
    return stats.f_bavail * stats.f_frsize


def mount_of(path: str | Path) -> Path:
    """The mount point holding ``path``."""
    path = _existing(path)
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def is_disk_full(exc: BaseException, path: str | Path) -> bool:
    """Whether ``exc`` (or an error it was raised from) is a full disk or quota under ``path``."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in FULL_ERRNOS:
            return True
        text = str(seen)
        if any(word in text for word in FULL_WORDS):
            return True
        if any(word in text for word in TORCH_WRITER_WORDS) and free_bytes(path) < NEARLY_FULL_BYTES:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def room_for(needed: int) -> int:
    """The free space asked of a write of ``needed`` bytes."""
    return int(needed * MARGIN) + MARGIN_BYTES


def check_room(path: str | Path, needed: int, what: str) -> None:
    """Before writing ``needed`` bytes (``what`` at ``path``): DiskFull when they do not fit, with nothing
    written; a warning when, after them, the disk holds fewer than two more writes of the same size."""
    free = free_bytes(path)
    if free < room_for(needed):
        raise DiskFull(path, needed, free, what, "nothing was written")
    if free - needed < 2 * room_for(needed):
        logger.warning("%s %s: %s free on %s holds fewer than two more of %s", what, path, size(free - needed),
                       mount_of(path), size(needed))  # fmt: skip


@contextlib.contextmanager
def full_disk_said(path: str | Path, what: str, needed: int | None = None, kept: str = "") -> Iterator[None]:
    """Turn a full disk while writing ``what`` at ``path`` into ``DiskFull`` (``kept``: what stays)."""
    try:
        yield
    except DiskFull:
        raise
    except Exception as exc:
        if is_disk_full(exc, path):
            raise DiskFull(path, needed, free_bytes(path), what, kept) from None
        raise


def tensor_bytes(tensors: object, seen: set[int] | None = None) -> int:
    """Bytes of the tensors in a state dict, an optimizer's state, or nested lists and dicts of them
    (a tensor shared by several names, as tied embeddings are, counted once)."""
    import torch

    seen = set() if seen is None else seen
    if isinstance(tensors, torch.Tensor):
        try:
            key = tensors.untyped_storage().data_ptr() if tensors.device.type != "meta" else id(tensors)
        except (RuntimeError, NotImplementedError):  # no storage of its own to read (FSDP's sharded views)
            key = id(tensors)
        if key in seen and key != 0:
            return 0
        seen.add(key)
        return tensors.numel() * tensors.element_size()
    if isinstance(tensors, dict):
        return sum(tensor_bytes(value, seen) for value in tensors.values())
    if isinstance(tensors, list | tuple):
        return sum(tensor_bytes(value, seen) for value in tensors)
    return 0


def directory_bytes(path: str | Path) -> int:
    """Bytes of the files under ``path`` (a model directory to copy)."""
    return sum(file.stat().st_size for file in Path(path).rglob("*") if file.is_file())
