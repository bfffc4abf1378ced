"""Giving freed memory back to the operating system. glibc keeps the memory of freed allocations below
its (self-raising) mmap threshold in its arenas, so a burst of large temporary tensors (a prefill of
long prompts) leaves the process's RSS at its high-water mark after every tensor is gone;
``malloc_trim`` returns it. Elsewhere (no glibc) this does nothing."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


def trim_heap() -> bool:
    """Return the free memory of the C heap to the system (glibc's ``malloc_trim(0)``); whether it could."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def give_back_memory(device: object) -> None:
    """What was freed goes back for others: the CUDA allocator's cached blocks (another process, or the
    trainer's own allocations, can take them), the C heap's free pages on the CPU."""
    import torch

    if getattr(device, "type", str(device)).startswith("cuda"):
        torch.cuda.empty_cache()
    else:
        trim_heap()
