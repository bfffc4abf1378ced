"""Sums and maxima across the processes of a data-parallel run (``accelerate launch``); the
identity in a single process."""

from __future__ import annotations

from typing import Any

import torch


def sum_across_processes(accelerator: Any, values: dict[str, float]) -> dict[str, float]:
    """Each value summed over every process (every process gets the sums)."""
    if accelerator.num_processes == 1:
        return dict(values)
    keys = sorted(values)
    tensor = torch.tensor([float(values[k]) for k in keys], device=accelerator.device)
    summed = accelerator.reduce(tensor, reduction="sum")
    return {k: float(v) for k, v in zip(keys, summed.tolist(), strict=True)}


def max_across_processes(accelerator: Any, value: int) -> int:
    """The largest ``value`` of any process."""
    if accelerator.num_processes == 1:
        return value
    gathered = accelerator.gather(torch.tensor([value], device=accelerator.device))
    return int(gathered.max())
