"""The processes of a run: the Accelerator every trainer uses (one process, DDP or FSDP through
``accelerate launch``), sums and maxima across processes (the identity in a single process), and
the whole state of a model that FSDP shards."""

from __future__ import annotations

import os
from typing import Any

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin


def make_accelerator(**options: Any) -> Accelerator:
    """The run's Accelerator: bf16 autocast over float32 weights on CUDA, float32 on the CPU (gloo
    ranks under ``accelerate launch``); the scheduler steps once per optimizer step, however many
    processes. ``options``: more of Accelerator's arguments (the trackers: ``trainer/trackers.py``).

    ``accelerate launch --use_fsdp`` on a machine without CUDA: Accelerate 1.15 keeps FSDP to
    accelerators and would silently fall back to DDP, while torch's ``fully_shard`` runs on gloo;
    so the launcher's FSDP settings (its ``FSDP_*`` environment) are applied here.
    """
    cuda = torch.cuda.is_available()
    accelerator = Accelerator(cpu=not cuda, mixed_precision="bf16" if cuda else "no",
                              step_scheduler_with_optimizer=False, **options)  # fmt: skip
    launched_fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if launched_fsdp and accelerator.distributed_type == DistributedType.MULTI_CPU:
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # (prepare reads this one)
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin()  # from the launcher's FSDP_* settings
    return accelerator

def sum_across_processes(accelerator: Any, values: dict[str, float]) -> dict[str, float]:
    """Each value summed over every process (every process gets the sums)."""
    if accelerator.num_processes == 1:
        return dict(values)
    keys = sorted(values)
    tensor = torch.tensor([float(values[k]) for k in keys], device=accelerator.device)
    summed = accelerator.reduce(tensor, reduction="sum")
    return {k: float(v) for k, v in zip(keys, summed.tolist(), strict=True)}


def gather_rows(accelerator: Any, rows: torch.Tensor) -> torch.Tensor:
    """The ``[n, k]`` float rows of every process, concatenated (padded with NaN rows in transit: a
    row's first value must not be NaN)."""
    if accelerator.num_processes == 1:
        return rows
    padded = accelerator.pad_across_processes(rows.to(accelerator.device), dim=0, pad_index=float("nan"))
    gathered = accelerator.gather(padded).cpu()
    return gathered[~gathered[:, 0].isnan()]


def max_across_processes(accelerator: Any, value: int) -> int:
    """The largest ``value`` of any process."""
    if accelerator.num_processes == 1:
        return value
    gathered = accelerator.gather(torch.tensor([value], device=accelerator.device))
    return int(gathered.max())


def is_fsdp(accelerator: Any) -> bool:
    """Whether the run shards its model with FSDP (``accelerate launch --use_fsdp``)."""
    return accelerator.distributed_type == DistributedType.FSDP


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole state dict of an FSDP-sharded model, gathered onto every process (on its device)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # a second to import

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))


def shard_like_policy(accelerator: Any, model: torch.nn.Module) -> torch.nn.Module:
    """A frozen model sharded as Accelerate's FSDP2 plugin shards the policy: each block named in
    ``_no_split_modules`` (the decoder layers), then the whole; parameters stay in their dtype."""
    from torch.distributed.fsdp import fully_shard

    model = model.to(accelerator.device)
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if type(module).__name__ in blocks:
            fully_shard(module)
    fully_shard(model)
    return model
