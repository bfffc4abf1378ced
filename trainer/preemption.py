"""Preemption: what ``rallyrl train`` does on SIGTERM, SIGINT or the signal ``checkpoint_on_signal``
names (SLURM's ``--signal``; Kubernetes' SIGTERM before its grace period ends), and SIGTERM for
``rallyrl rollout``. docs/training.md ("Preemption") says it for users.

``Preemption`` is installed around ``GRPOTrainer.train``. The first signal sets a flag that the loop
reads between phases:

- the rollout of a step (async: the wait for finished groups) is abandoned at once: its requests
  are cancelled (each ends as aborted and releases its tools) and the step is redone after
  ``--resume`` (the same trajectories: sampling is seeded per step, prompt, sample and turn);
- an update, a weight sync or a checkpoint under way finishes, and so does the rest of its step;

then the checkpoint of the last finished step is written (unless the newest is of that step) and
``Preempted`` is raised: ``rallyrl train`` exits with ``PREEMPTED_EXIT_CODE``. A second signal ends
the process at once, by the signal's own default action (a shell reports 128 + its number: 143 for
SIGTERM, 130 for SIGINT); a checkpoint it cuts short is a ``.partial`` directory, never loaded. The
first signal again within ``REPEAT_S`` is not a second one: a launcher (torchrun, srun) passes on the
signal that its processes got themselves from the terminal or the scheduler.

With several processes (``accelerate launch``) no process cuts its rollout short (the others could
be waiting for it in a collective): they agree after each phase that a signal abandons and after
each step, so that every process stops at the same step.

Tests only: ``RALLYRL_TEST_PAUSE_AT=<phase>:<step>`` (rollout, wait, update, sync or checkpoint, and
the step it belongs to) makes the trainer print ``test pause: <phase> of step <step>`` on stderr
there and wait (at most ``PAUSE_S``) for a signal, so that a test's signal lands in that phase:
rollout and wait with their requests going on, update and sync just before they start, checkpoint
inside the write, once its ``.partial`` directory exists.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

PREEMPTED_EXIT_CODE = 75
"""``rallyrl train`` stopped by a signal, its checkpoint written: EX_TEMPFAIL (sysexits.h), "try again"
(``--resume``), for a scheduler's requeue."""
REPEAT_S = 2.0
"""The first signal again within this many seconds is the same one, relayed (see the module docstring)."""
PAUSE_AT = "RALLYRL_TEST_PAUSE_AT"
"""Tests only: the environment variable naming the phase to pause at (see the module docstring)."""
PAUSE_S = 60.0
"""Tests only: the longest a pause waits for its signal."""

T = TypeVar("T")


def signal_number(name: str) -> signal.Signals:
    """The signal ``name`` names (``SIGUSR1``, ``USR1``, ``usr1``); a ValueError for any other."""
    key = name.strip().upper()
    key = key if key.startswith("SIG") else f"SIG{key}"
    try:
        number = signal.Signals[key]
    except KeyError:
        raise ValueError(f"checkpoint_on_signal: no signal {name!r}; e.g. SIGUSR1, SIGUSR2 or SIGHUP") from None
    if number in (signal.SIGKILL, signal.SIGSTOP):
        raise ValueError(f"checkpoint_on_signal: {key} cannot be caught; e.g. SIGUSR1 (SLURM: --signal=B:USR1@120)")
    return number


class Abandoned(Exception):
    """A phase given up for a signal (the step's rollout, or async's wait for groups): the step is
    redone after ``--resume``."""


class Preempted(Exception):
    """``GRPOTrainer.train`` stopped by a signal at ``step``, with ``checkpoint`` written."""

    def __init__(self, signal_name: str, step: int, checkpoint: Path, is_main: bool = True):
        super().__init__(f"preempted by {signal_name} at step {step}: checkpoint in {checkpoint}; --resume continues")
        self.signal_name, self.step, self.checkpoint, self.is_main = signal_name, step, checkpoint, is_main


class Preemption:
    """The signals that stop a training run at its next safe point (see the module docstring); a
    context manager, entered on the event loop the run uses."""

    def __init__(self, accelerator: Any, extra_signal: str | None = None, steps_done: Callable[[], int] = lambda: 0):
        self.accelerator = accelerator
        self.signals = {signal.SIGTERM, signal.SIGINT} | ({signal_number(extra_signal)} if extra_signal else set())
        self.steps_done = steps_done  # the steps finished so far (the trainer's state.step)
        self.signum: int | None = None  # the first signal this process caught
        self._caught_at = 0.0
        self.stopped = False  # the run stops: a signal came (with several processes: to any, all agreed)
        self.pause_at = os.environ.get(PAUSE_AT)  # tests only
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._previous: dict[int, Any] = {}
        self._hook: Any = None

    def __enter__(self) -> Preemption:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        self.signum, self.stopped = None, False
        if threading.current_thread() is threading.main_thread():  # (where Python runs signal handlers)
            for signum in self.signals:
                if signal.getsignal(signum) != signal.SIG_IGN:  # ignored (nohup, a script's background job): left so
                    self._previous[signum] = signal.signal(signum, self._on_signal)
        if self.pause_at and self.pause_at.startswith("checkpoint:"):
            self._hook = self.accelerator.register_save_state_pre_hook(self._pause_in_checkpoint)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, signal.SIG_DFL if previous is None else previous)
        self._previous.clear()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    @property
    def signal_name(self) -> str:
        return "a signal to another process" if self.signum is None else signal.Signals(self.signum).name

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if signum == self.signum and time.monotonic() - self._caught_at < REPEAT_S:
            return  # the first, relayed by a launcher
        if self.signum is not None:  # the second: no more waiting, by the signal's default action
            self._say(f"{name}: a second signal, stopping at once; the last complete checkpoint stays")
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            os._exit(128 + signum)  # (where the signal is blocked)
        self.signum, self._caught_at = signum, time.monotonic()
        self._say(f"{name}: a rollout under way is dropped (redone after --resume), an update, weight sync or "
                  f"checkpoint under way finishes; then a checkpoint and exit {PREEMPTED_EXIT_CODE}. "
                  "A second signal stops at once.")  # fmt: skip
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)

    def _say(self, line: str) -> None:
        if self.accelerator.is_main_process:  # raw, from a signal handler: no buffered stream is re-entered
            with contextlib.suppress(OSError):
                os.write(2, f"{line}\n".encode())

    async def abandonable(self, phase: str, work: Coroutine[Any, Any, T]) -> T:
        """Await ``work``, a ``phase`` that a signal abandons: it is cancelled at once (its requests end
        as aborted and release their tools) and Abandoned raised. With several processes it runs to
        its end; ``check`` after it decides for all of them."""
        if self._stop is None or self.accelerator.num_processes > 1:
            return await work
        task, stop = asyncio.ensure_future(work), asyncio.ensure_future(self._stop.wait())
        try:
            if self._pauses(phase):
                await asyncio.wait({stop}, timeout=PAUSE_S)  # tests: the signal lands in this phase
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in (task, stop):
                waiting.cancel()  # (nothing, once done)
            await asyncio.gather(task, stop, return_exceptions=True)  # its requests have released their tools
        if task.cancelled():
            self.stopped = True
            raise Abandoned(phase)
        return task.result()

    async def check(self) -> None:
        """Abandoned when a signal came (to any process), at the end of a phase that it abandons."""
        if await self.stopping():
            raise Abandoned

    async def stopping(self) -> bool:
        """Whether the run stops here: a signal came (to any process; each gets the same answer)."""
        if not self.stopped:
            caught = int(self.signum is not None)
            if self.accelerator.num_processes > 1:
                from trainer.distributed import max_across_processes  # (torch: not for the CLI's start)

                caught = await asyncio.to_thread(max_across_processes, self.accelerator, caught)
            self.stopped = bool(caught)
        return self.stopped

    def preempted(self, trainer: Any) -> Preempted:
        """The end of a run that a signal stopped: the checkpoint of its last finished step (written
        unless the newest is of that step), and the Preempted to raise."""
        step = trainer.state.step
        if trainer.saved_step != step:
            trainer.save_checkpoint()
        return Preempted(self.signal_name, step, trainer.out / "checkpoints" / f"step-{step:06d}", trainer.is_main)

    async def pause(self, phase: str) -> None:
        """Tests only (``RALLYRL_TEST_PAUSE_AT``): wait here for a signal."""
        if self._stop is not None and self._pauses(phase):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), PAUSE_S)

    def _pause_in_checkpoint(self, *_: object) -> None:
        """Accelerate's save_state pre-hook (the ``.partial`` directory exists): wait for a signal."""
        if self._pauses("checkpoint"):
            deadline = time.monotonic() + PAUSE_S
            while self.signum is None and time.monotonic() < deadline:
                time.sleep(0.05)

    def _pauses(self, phase: str) -> bool:
        """Whether the test hook pauses at ``phase`` of this step (saying so on stderr)."""
        step = self.steps_done() if phase == "checkpoint" else self.steps_done() + 1
        if self.pause_at != f"{phase}:{step}":
            return False
        print(f"test pause: {phase} of step {step}", file=sys.stderr, flush=True)
        return True


@dataclass
class Terminated:
    """What ``sigterm_as_ctrl_c`` saw: the SIGTERM, if one came."""

    signum: int | None = None

    @property
    def exit_code(self) -> int:
        """130 after Ctrl-C, 143 after SIGTERM: 128 + the signal's number, as a shell reports a kill."""
        return 128 + (self.signum or signal.SIGINT)


@contextlib.contextmanager
def sigterm_as_ctrl_c() -> Iterator[Terminated]:
    """Inside, SIGTERM does what Ctrl-C does (``rallyrl rollout``: keep the finished trajectories):
    SIGINT's handler is called (Python's raises KeyboardInterrupt; asyncio's cancels the main task,
    which then raises it). A second SIGTERM, as a second Ctrl-C, stops at once."""
    caught = Terminated()

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        caught.signum = signum
        interrupt = signal.getsignal(signal.SIGINT)
        if not callable(interrupt):  # (SIGINT ignored, as in a script's background job)
            raise KeyboardInterrupt
        interrupt(signal.SIGINT, frame)

    if threading.current_thread() is not threading.main_thread():
        yield caught
        return
    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield caught
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
