"""``micro_batch_tokens: auto``: the largest micro-batch the device's memory holds, and whether gradient
checkpointing is needed for it, measured on this device once per run.

The probe runs the update's own micro-batch (``Policy.micro_batch_loss`` and its backward, the KL
reference and the chunked logprobs included) on random sequences of the step's longest length, every
token trained (the most the logprobs can cost), with the gradients already allocated (a step's later
micro-batches), and reads the peak memory of each. Three sizes at that length (a quarter, half and
all of it; for short sequences, rows of it) fit a line, peak = a + b x tokens; the budget is the
largest number of tokens whose predicted peak, plus the AdamW state not yet allocated, stays under
(1 - ``memory_headroom``) x the limit. Then one more probe runs a micro-batch of that budget, so
the largest micro-batch of the run was measured, not extrapolated (a peak above the target scales
the budget down). A probe that runs out of memory says that size does not fit.

With ``gradient_checkpointing: null`` it is decided by memory: off where the budget without it holds
the step's longest sequence, on otherwise. The decision holds until a step's longest sequence
exceeds the probed length; then the probe runs again at the new length. Memory is read as
``torch.cuda.max_memory_allocated`` on CUDA and as the process's peak RSS on the CPU (``VmHWM``,
reset through ``/proc/self/clear_refs``), where the limit is ``memory_limit_gib``.
"""

from __future__ import annotations

import gc
import math
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from rollout.engines.heap import trim_heap
from trainer.batch import Sample, collate

GiB = 2**30
FIXED_TOKENS = 8192
"""The budget of ``auto`` where it does not probe: the CPU without ``memory_limit_gib``."""
SHORT_PROBE_TOKENS = 2048
"""Sequences shorter than twice this are probed in rows of this many tokens or more, then twice that."""
ROUND_TOKENS = 128
"""Budgets are whole multiples of this."""
VERIFY_ROUNDS = 3
"""Micro-batches of the budget measured at most, each closer to the largest that fitted."""
MAX_TOKENS = 262_144
"""The largest budget probed: beyond it no card runs faster, and the probe's last micro-batch stays short."""


class MemoryMeter(ABC):
    """Peak and current memory of this process on one device, and the most it may use."""

    def __init__(self, limit_gib: float | None = None):
        self.limit_gib = limit_gib

    @abstractmethod
    def reset_peak(self) -> None: ...

    @abstractmethod
    def peak(self) -> int: ...

    @abstractmethod
    def current(self) -> int: ...

    @abstractmethod
    def limit(self) -> int: ...

    def settle(self) -> None:
        """Let freed memory go, so that the next reading is what is alive."""
        gc.collect()


class CudaMeter(MemoryMeter):
    """``torch.cuda`` allocator statistics; the limit: what is free on the card plus what this process
    holds (``memory_limit_gib`` caps it)."""

    def __init__(self, device: torch.device, limit_gib: float | None = None):
        super().__init__(limit_gib)
        self.device = device

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def current(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def limit(self) -> int:
        free, _ = torch.cuda.mem_get_info(self.device)
        available = free + torch.cuda.memory_reserved(self.device)
        return available if self.limit_gib is None else min(available, int(self.limit_gib * GiB))


class RssMeter(MemoryMeter):
    """The process's resident memory (Linux ``/proc/self/status``); the limit: ``memory_limit_gib``."""

    def reset_peak(self) -> None:
        try:  # "5" resets VmHWM to the current RSS (Linux 4.0+); elsewhere the peak stays the run's
            with open("/proc/self/clear_refs", "w") as file:
                file.write("5")
        except OSError:
            pass

    def peak(self) -> int:
        return _status_bytes("VmHWM")

    def current(self) -> int:
        return _status_bytes("VmRSS")

    def limit(self) -> int:
        if self.limit_gib is None:
            raise ValueError("micro_batch_tokens auto on the CPU needs memory_limit_gib")
        return int(self.limit_gib * GiB)

    def settle(self) -> None:
        super().settle()
        trim_heap()  # glibc keeps freed memory otherwise: RSS would not show what the next probe adds


def _status_bytes(field: str) -> int:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def device_meter(device: torch.device, limit_gib: float | None = None) -> MemoryMeter:
    """The meter of ``device``: the CUDA allocator's, or the process's RSS."""
    return CudaMeter(device, limit_gib) if device.type == "cuda" else RssMeter(limit_gib)


def probes_on(device: torch.device, limit_gib: float | None) -> bool:
    """Whether ``auto`` probes here: on CUDA, and on the CPU where a limit is set."""
    return device.type == "cuda" or limit_gib is not None


@dataclass
class Budget:
    """What ``auto`` decided."""

    tokens: int
    checkpointing: bool
    probed_length: int
    """The sequence length the probe ran at: longer steps probe again."""
    expected_peak: int
    """Bytes: the predicted peak of a micro-batch of ``tokens`` (plus AdamW's state)."""
    limit: int
    """Bytes the update may use (before the headroom)."""
    probe_s: float
    fits: bool = True
    """False: not even one sequence of ``probed_length`` fitted the target; the budget is that sequence."""
    capped: bool = False
    """The budget is the step's size (or ``MAX_TOKENS``), not the memory's: a step twice as large probes again."""
    target_share: float = 0.85
    """The share of ``limit`` the peak aims at (1 - ``memory_headroom``)."""

    def describe(self) -> str:
        checkpointing = "on" if self.checkpointing else "off"
        probed = f"probed at {self.probed_length:,}-token sequences in {self.probe_s:.1f} s"
        if not self.fits:
            return (f"micro_batch_tokens auto: one {self.probed_length:,}-token sequence does not fit under "
                    f"{self.target_share:.0%} of {self.limit / GiB:.1f} GiB with gradient checkpointing "
                    f"{checkpointing}; the budget is that one sequence, and out of memory is likely "
                    f"({probed})")  # fmt: skip
        return (f"micro_batch_tokens auto: {self.tokens:,} tokens, gradient checkpointing {checkpointing}, "
                f"expected peak {self.expected_peak / GiB:.1f} GiB of {self.limit / GiB:.1f} GiB "
                f"({probed})")  # fmt: skip


@dataclass
class Line:
    """Peak bytes = ``base + per_token x tokens``, fitted through two probes."""

    base: float
    per_token: float

    @classmethod
    def through(cls, first: tuple[int, int], second: tuple[int, int], floor: int) -> Line:
        (t1, m1), (t2, m2) = sorted((first, second))
        slope = (m2 - m1) / (t2 - t1) if t2 > t1 else 0.0
        if slope <= 0:  # noise: all of the growth over the floor, proportional
            slope = max(m2 - floor, 1) / t2
        return cls(m2 - slope * t2, slope)

    def peak(self, tokens: int) -> float:
        return self.base + self.per_token * tokens

    def tokens_under(self, target: float) -> int:
        return max(0, int((target - self.base) / self.per_token))


class BudgetProbe:
    """Runs the probes on a ``Policy`` and decides (``decide``)."""

    def __init__(self, policy: Any, meter: MemoryMeter, headroom: float):
        self.policy, self.meter, self.headroom = policy, meter, headroom
        self.generator = torch.Generator().manual_seed(0)  # (the run's own random streams stay untouched)

    def decide(self, longest: int, step_tokens: int, setting: bool | None) -> Budget:
        """The budget for sequences of up to ``longest`` tokens, at most ``step_tokens`` (the step's, so the
        probe's last micro-batch is no larger than the step); ``setting``: gradient_checkpointing as
        configured (None: decided here)."""
        policy, started = self.policy, time.perf_counter()
        self.cap = max(longest, min(MAX_TOKENS, step_tokens))
        limit = self.meter.limit()
        target = (1 - self.headroom) * limit - self.optimizer_state_to_come()
        modes = [False, True] if setting is None else [setting]
        was_training = policy.model.training
        policy.model.train()
        try:
            for checkpointing in modes:
                tokens, peak = self.mode_budget(checkpointing, longest, target)
                tokens = policy.min_across_processes(tokens)
                if tokens >= longest or checkpointing == modes[-1]:
                    break
        finally:
            policy.optimizer.zero_grad(set_to_none=True)
            self.meter.settle()
            policy.model.train(was_training)
        fits = tokens >= longest
        expected = peak + self.optimizer_state_to_come()
        return Budget(max(tokens, longest), checkpointing, longest, int(expected), limit, time.perf_counter() - started,
                      fits, capped=tokens >= self.cap, target_share=1 - self.headroom)  # fmt: skip

    def mode_budget(self, checkpointing: bool, length: int, target: float) -> tuple[int, float]:
        """The most tokens a micro-batch of ``length``-token sequences may hold with checkpointing on or
        off (0: not one sequence fits), and the peak predicted for it."""
        self.policy.set_checkpointing(checkpointing)
        if self.measure(1, 16) is None:  # allocates the gradients, as a step's later micro-batches have them
            return 0, 0.0
        floor = self.meter.current()
        if length >= 2 * SHORT_PROBE_TOKENS:  # one sequence: a quarter, half and all of its length
            sizes = [(1, math.ceil(length / 4)), (1, math.ceil(length / 2)), (1, length)]
        else:  # short sequences: one, then rows of them
            rows = math.ceil(SHORT_PROBE_TOKENS / length)
            sizes = [(1, length), (rows, length), (2 * rows, length)]  # (rows 1: two sizes)
        saturated = self.policy.config.logprob_chunk_tokens
        points: list[tuple[int, int]] = []
        for rows, size in dict.fromkeys(sizes):
            tokens = rows * size
            alone = rows == 1 and size == length  # the longest sequence alone: if it fails, nothing fits
            guarded = len(points) > 1 and points[-2][0] >= saturated  # (below, the logprob chunk still grows)
            predicted = Line.through(points[-2], points[-1], floor).peak(tokens) if guarded else 0.0
            peak = None if predicted > target else self.measure(rows, size)
            if peak is None or peak > target:
                return (0, 0.0) if alone else self.budget_from(points, floor, length, target)
            points.append((tokens, peak))
        return self.budget_from(points, floor, length, target)

    def budget_from(self, points: list[tuple[int, int]], floor: int, length: int, target: float) -> tuple[int, float]:
        """The budget the line through the two largest probes allows, measured: a micro-batch of it is
        run, and one over the target (or out of memory) moves the budget between it and the largest
        that fitted, up to ``VERIFY_ROUNDS`` times, else the largest that fitted. So the budget is
        always a size that ran under the target."""
        if not points:
            return 0, 0.0
        fitted = points[-1]
        line = Line.through(points[-2] if len(points) > 1 else (0, floor), fitted, floor)
        tokens = self.rounded(min(line.tokens_under(target), self.cap), length)
        if tokens <= fitted[0]:
            return tokens, line.peak(tokens)
        for _ in range(VERIFY_ROUNDS):
            peak = self.measure(tokens // length, length)
            if peak is not None and peak <= target:
                return tokens, float(peak)
            if peak is None:  # out of memory: halfway
                between = (fitted[0] + tokens) // 2
            else:
                between = int(Line.through(fitted, (tokens, peak), floor).tokens_under(target) * 0.97)
            tokens = self.rounded(between, length)
            if tokens <= fitted[0]:
                break
        return fitted[0], float(fitted[1])

    @staticmethod
    def rounded(tokens: int, length: int) -> int:
        """``tokens`` down to whole sequences of ``length`` (padded micro-batches hold rows of the longest)
        and to a multiple of ``ROUND_TOKENS`` where that keeps one sequence."""
        whole = tokens // length * length
        return whole // ROUND_TOKENS * ROUND_TOKENS if whole >= max(length, ROUND_TOKENS) * 2 else whole

    def measure(self, rows: int, length: int) -> int | None:
        """Peak bytes of one forward and backward of ``rows`` random sequences of ``length`` tokens; None
        when it ran out of memory."""
        policy = self.policy
        samples = [self.sample(length) for _ in range(rows)]
        batch = collate(samples, policy.pad_id, packed=policy.packing).to(policy.accelerator.device)
        self.meter.settle()
        self.meter.reset_peak()
        try:
            with policy.gradient_sync(False):
                loss = policy.micro_batch_loss(batch, None, float(rows * length))["scaled_loss"]
                policy.accelerator.backward(loss)
            del loss
            return self.meter.peak()
        except torch.OutOfMemoryError:
            return None
        finally:
            del batch
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def sample(self, length: int) -> Sample:
        vocab = self.policy.language_model().get_input_embeddings().num_embeddings
        ids = torch.randint(0, vocab, (length,), generator=self.generator).tolist()
        return Sample(ids, [0] + [1] * (length - 1), [0.0] * length, advantage=1.0)

    def optimizer_state_to_come(self) -> int:
        """Bytes AdamW allocates at its first step (two moments per trained parameter); 0 after it."""
        policy = self.policy
        if policy.optimizer.state:
            return 0
        trained = (p for p in policy.model.parameters() if p.requires_grad)
        return sum(2 * _local(p).numel() * _local(p).element_size() for p in trained)


def _local(parameter: torch.Tensor) -> torch.Tensor:
    """This process's part of a parameter (a DTensor's shard under FSDP2)."""
    return parameter.to_local() if hasattr(parameter, "to_local") else parameter


def rounded_length(longest: int) -> int:
    """The length a probe runs at: the step's longest sequence rounded up to a multiple of 256."""
    return max(256, math.ceil(longest / 256) * 256)
