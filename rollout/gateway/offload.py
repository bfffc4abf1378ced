"""Work that would stall the gateway's event loop (and with it ``/health`` and every other session),
done on a small thread pool of its own; and the memory a large request leaves behind given back.

A call whose body or tool list is large is checked, rendered and tokenized on a worker thread
(``BIG_BODY``, ``BIG_TOOLS``). Freed memory stays in the C allocator's arenas (building the chat
tokenizer of a 1 MB tool list left ~260 MiB there once it was freed, until ``malloc_trim`` gave them
back), so a trim is run on the pool, at most one at a time and shortly after, whenever a large
request, a session that made one, or many sessions together end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from rollout.engines.heap import trim_heap

T = TypeVar("T")
logger = logging.getLogger(__name__)

BIG_BODY = 256 * 2**10
"""Calls whose bodies are at least this long (or of unknown length) are prepared on a worker thread."""
BIG_TOOLS = 16 * 2**10
"""So are calls whose tools have at least this many bytes of JSON (rendering them is the work)."""
TRIM_DELAY_S = 0.2
"""How long after a large request ends its memory is given back (requests ending together share one trim)."""


class OffLoop:
    """The gateway's worker threads (``workers``) and its memory trims."""

    def __init__(self, workers: int = 2):
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="gateway-prep")
        self._trim_pending = False
        self.trims = 0

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a worker thread. If the caller is cancelled (its client went away), this
        waits for the thread to end before letting the cancellation through, so that a session's lock
        is not released while a thread still reads the session."""
        future = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            with contextlib.suppress(BaseException):
                await future
            raise

    def trim_soon(self) -> None:
        """Give freed memory back to the OS shortly (once for requests ending together)."""
        if self._trim_pending:
            return
        self._trim_pending = True
        asyncio.get_running_loop().call_later(TRIM_DELAY_S, self._start_trim)

    def _start_trim(self) -> None:
        try:
            self._pool.submit(self._run_trim)
        except RuntimeError:  # the pool was shut down meanwhile (the gateway stopped)
            self._trim_pending = False

    def _run_trim(self) -> None:
        self._trim_pending = False
        try:
            self.trims += trim_heap()
        except Exception:  # never fatal: the memory is only kept longer
            logger.debug("malloc_trim failed", exc_info=True)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
