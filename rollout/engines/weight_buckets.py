"""Weights in flattened buckets, as they travel from the trainer to an engine in memory.

A bucket is the bytes of several tensors of one dtype laid end to end in one ``uint8`` tensor, with
the names, dtypes and shapes that cut it apart again: SGLang's ``flattened_bucket`` layout
(``/update_weights_from_distributed`` with ``load_format: "flattened_bucket"``), which rallyrl serve
and rallyrl's vLLM worker extension read too. Buckets hold one dtype each (so every tensor starts at
an offset its dtype aligns to) and at most ``bucket_bytes`` (a tensor larger than that is a bucket of
its own). Torch only: the vLLM worker extension imports this module inside vLLM's own environment.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import torch

DTYPES = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64,
    "int64": torch.int64, "int32": torch.int32, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
    "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
}  # fmt: skip
"""The dtypes a bucket may carry, by the names SGLang's requests give them."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> "float32"."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: object, where: str) -> torch.dtype:
    """The dtype named ``name`` ("float32", "torch.bfloat16"); ValueError naming ``where`` otherwise."""
    dtype = DTYPES.get(str(name).removeprefix("torch.")) if isinstance(name, str) else None
    if dtype is None:
        raise ValueError(f"{where}: unknown dtype {name!r} (one of {', '.join(DTYPES)})")
    return dtype


@dataclass(frozen=True)
class WeightSpec:
    """One tensor as it is sent: its Hugging Face name, dtype and shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class Bucket:
    """Tensors of one dtype sent as one flat ``uint8`` tensor; ``index`` counts from 0 in the plan."""

    index: int
    specs: tuple[WeightSpec, ...]

    @property
    def nbytes(self) -> int:
        return sum(spec.nbytes for spec in self.specs)

    @property
    def dtype(self) -> torch.dtype:
        return self.specs[0].dtype

    def payload(self) -> dict[str, list]:
        """``names``, ``dtypes`` and ``shapes`` as SGLang's ``/update_weights_from_distributed`` takes them."""
        return {
            "names": [spec.name for spec in self.specs],
            "dtypes": [dtype_name(spec.dtype) for spec in self.specs],
            "shapes": [list(spec.shape) for spec in self.specs],
        }

    def describe(self, count: int) -> str:
        """"bucket 2/5 (12 tensors, 512.0 MiB, float32)"."""
        return (f"bucket {self.index + 1}/{count} ({len(self.specs)} tensors, {self.nbytes / 2**20:.1f} MiB, "
                f"{dtype_name(self.dtype)})")  # fmt: skip


def target_specs(specs: Sequence[WeightSpec], dtype: torch.dtype | None) -> list[WeightSpec]:
    """``specs`` as a server of ``dtype`` takes them: floating tensors in its dtype, others as they are
    (``dtype`` None: all as they are)."""
    if dtype is None:
        return list(specs)
    return [replace(spec, dtype=dtype) if spec.dtype.is_floating_point else spec for spec in specs]


def plan_buckets(specs: Sequence[WeightSpec], bucket_bytes: int) -> list[Bucket]:
    """``specs`` in buckets of one dtype and at most ``bucket_bytes`` each, in their order within a dtype
    (a tensor larger than ``bucket_bytes`` goes alone); the dtypes in the order they first appear."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    by_dtype: dict[torch.dtype, list[WeightSpec]] = {}
    for spec in specs:
        by_dtype.setdefault(spec.dtype, []).append(spec)
    groups: list[list[WeightSpec]] = []
    for same in by_dtype.values():
        current: list[WeightSpec] = []
        size = 0
        for spec in same:
            if current and size + spec.nbytes > bucket_bytes:
                groups.append(current)
                current, size = [], 0
            current.append(spec)
            size += spec.nbytes
        if current:
            groups.append(current)
    return [Bucket(index, tuple(group)) for index, group in enumerate(groups)]


def bucket_views(flat: torch.Tensor, specs: Iterable[WeightSpec]) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a flat ``uint8`` bucket, as views into it (no copy), named."""
    views = []
    offset = 0
    for spec in specs:
        views.append((spec.name, flat[offset : offset + spec.nbytes].view(spec.dtype).view(spec.shape)))
        offset += spec.nbytes
    if offset != flat.numel():
        raise ValueError(f"a bucket of {flat.numel()} bytes holds {offset} bytes of tensors")
    return views


def fill_bucket(flat: torch.Tensor, bucket: Bucket, tensor: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """Copy each tensor of ``bucket`` (``tensor(name)``: in any dtype and on any device) into ``flat``,
    converted to the bucket's dtype; returns the filled part of ``flat``."""
    part = flat[: bucket.nbytes]
    for (name, view), spec in zip(bucket_views(part, bucket.specs), bucket.specs, strict=True):
        value = tensor(name)
        if tuple(value.shape) != spec.shape:
            raise ValueError(f"{name}: shape {tuple(value.shape)} is not the planned {spec.shape}")
        view.copy_(value, non_blocking=False)
    return part


def read_bucket_specs(names: object, dtypes: object, shapes: object, where: str,
                      max_bytes: int | None = None) -> list[WeightSpec]:  # fmt: skip
    """The specs of a bucket from a request's ``names``, ``dtypes`` and ``shapes``; ValueError naming
    ``where`` and the field when they are malformed, misaligned or larger than ``max_bytes``."""
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
        raise ValueError(f"{where}: names, dtypes and shapes must be lists")
    if not names or not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"{where}: names, dtypes and shapes must be non-empty lists of one length")
    specs = []
    offset = 0
    for i, (name, dtype, shape) in enumerate(zip(names, dtypes, shapes, strict=True)):
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}: names[{i}] must be a parameter name")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                  for d in shape):  # fmt: skip
            raise ValueError(f"{where}: shapes[{i}] ({name}) must be a list of sizes, got {shape!r}")
        spec = WeightSpec(name, parse_dtype(dtype, f"{where}: dtypes[{i}] ({name})"), tuple(shape))
        if offset % spec.dtype.itemsize:
            raise ValueError(f"{where}: {name} would start at byte {offset}, not aligned to its {dtype}")
        offset += spec.nbytes
        specs.append(spec)
    if max_bytes is not None and offset > max_bytes:
        raise ValueError(f"{where}: {offset / 2**20:.1f} MiB in one bucket is over this server's "
                         f"{max_bytes / 2**20:.0f} MiB limit")  # fmt: skip
    return specs
