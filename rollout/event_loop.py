"""The event loop a command runs on: uvloop where it is installed (``pip install 'rallyrl[uvloop]'``),
asyncio's own otherwise, or the one ``event_loop`` names.

uvloop (libuv under asyncio's API) takes less CPU per socket event than asyncio's selector loop:
``rallyrl bench`` reports the client's CPU per turn on both (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Callable, Coroutine
from typing import Any, Literal, TypeVar, get_args

EventLoop = Literal["auto", "asyncio", "uvloop"]
T = TypeVar("T")


def uvloop_installed() -> bool:
    return importlib.util.find_spec("uvloop") is not None


def resolve(choice: str) -> Literal["asyncio", "uvloop"]:
    """The loop ``choice`` runs on; a ValueError for an unknown name or uvloop not installed."""
    if choice not in get_args(EventLoop):
        raise ValueError(f"event_loop must be one of {', '.join(get_args(EventLoop))}, got {choice!r}")
    if choice == "uvloop" and not uvloop_installed():
        raise ValueError("event_loop: uvloop is not installed (pip install 'rallyrl[uvloop]'), or use auto or asyncio")
    if choice == "auto":
        return "uvloop" if uvloop_installed() else "asyncio"
    return choice  # type: ignore[return-value]


def loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """What ``asyncio.Runner`` makes its loop with (None: asyncio's default)."""
    if resolve(choice) == "asyncio":
        return None
    import uvloop

    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T], choice: str = "auto") -> T:
    """``asyncio.run(main)`` on the loop ``choice`` names (Ctrl-C cancels ``main`` as asyncio.run does)."""
    with asyncio.Runner(loop_factory=loop_factory(choice)) as runner:
        return runner.run(main)
