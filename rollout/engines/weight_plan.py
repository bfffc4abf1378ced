"""Which transport each server's weight syncs take, decided once before the first rollout, and the
check that the server's model takes the trainer's weights at all (names and shapes).

Each server client says what it can take (``ServerWeights``: ``weight_support`` of the SGLang and
vLLM clients); ``choose_transport`` picks by ``weight_sync.transport``:

- ``tensor``: the server shares this machine; by CUDA IPC when both the trainer's weights and the
  server are on a GPU (nothing is copied between processes), by value on a CPU;
- ``broadcast``: a process group of the trainer and the server's workers (gloo on a CPU, NCCL
  between GPUs): the server needs to reach the trainer's address;
- ``disk``: saved under the run's directory and loaded by the server, which must see that path.

``auto`` takes tensor where it goes by CUDA IPC, else broadcast where the server can, else disk (a
by-value tensor through HTTP is slower than a broadcast on loopback: ``benchmarks/weight_sync.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from rollout.engines.base import EngineError
from rollout.engines.config import WeightSyncConfig
from rollout.engines.weight_buckets import WeightSpec, target_specs

Transport = Literal["disk", "broadcast", "tensor"]
logger = logging.getLogger(__name__)


class WeightSyncError(EngineError):
    """A server cannot take the trainer's weights the way asked (or at all): the message says why and
    what to change."""


@dataclass
class ServerWeights:
    """What one server says about taking weights (its client asks it once)."""

    url: str
    kind: str
    """"SGLang 0.5.23", "rallyrl serve", "vLLM 0.32.0"."""
    device: str
    """Where its model runs: "cpu", "cuda"."""
    dtype: torch.dtype | None
    """Its weights' dtype (None: unknown; buckets then travel in the trainer's dtype)."""
    local: bool
    """Whether it runs on this machine (tensors can be handed over)."""
    broadcast: str | None
    """Why it cannot join a broadcast, with the fix (None: it can)."""
    tensor: str | None
    """Why it cannot take tensors (None: it can, when local)."""
    model_config: dict[str, Any] | None
    """Its model's ``config.json`` (None: unknown here; the shapes are then checked by the server as it loads)."""
    world_size: int = 1
    """Its ranks in a broadcast group (tensor parallel workers)."""
    max_bucket_bytes: int | None = None
    """The largest broadcast bucket it allocates for (None: no limit known; rallyrl serve says)."""
    max_body_bytes: int | None = None
    """The largest ``/update_weights_from_tensor`` body it reads (None: no limit known)."""

    def label(self) -> str:
        dtype = "" if self.dtype is None else f", {str(self.dtype).removeprefix('torch.')}"
        return f"{self.url} ({self.kind}, {self.device}{dtype})"


def choose_transport(server: ServerWeights, config: WeightSyncConfig, trainer_device: torch.device) -> Transport:
    """The transport ``config.transport`` means for ``server``; WeightSyncError when it cannot take it."""
    ipc = server.local and server.device.startswith("cuda") and trainer_device.type == "cuda"
    tensor_problem = server.tensor
    if tensor_problem is None and not server.local:
        tensor_problem = f"{server.url} is not on this machine (tensors are handed over on one machine only)"
    if tensor_problem is None and server.device.startswith("cuda") and trainer_device.type != "cuda":
        tensor_problem = f"{server.url} runs on {server.device} and the trainer's weights are on the CPU"
    wanted = config.transport
    if wanted == "auto":
        if ipc and tensor_problem is None:
            return "tensor"
        return "broadcast" if server.broadcast is None else "disk"
    problem = {"broadcast": server.broadcast, "tensor": tensor_problem}.get(wanted)
    if problem is not None:
        raise WeightSyncError(f"weight_sync.transport {wanted}: {problem} (or set weight_sync.transport: auto)")
    return wanted


def backend_for(server: ServerWeights, config: WeightSyncConfig, trainer_device: torch.device) -> str:
    """The broadcast backend: NCCL between GPUs, gloo otherwise (or what ``config.backend`` names)."""
    if config.backend != "auto":
        return config.backend
    return "nccl" if server.device.startswith("cuda") and trainer_device.type == "cuda" else "gloo"


def expected_specs(model_config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The tensors a model of ``model_config`` (a ``config.json``) loads, by Hugging Face name, with their
    shapes; a tied LM head is left out (it comes with the embeddings). Built on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    values = dict(model_config)
    model_type = values.pop("model_type", None)
    if not model_type:
        raise WeightSyncError("the server's config.json names no model_type")
    config = AutoConfig.for_model(model_type, **values)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)
    return shapes


def check_shapes(specs: Sequence[WeightSpec], server: ServerWeights) -> None:
    """WeightSyncError naming the first parameter the server's model lacks, does not get, or has in
    another shape; nothing when its config is unknown here."""
    if server.model_config is None:
        return
    try:
        theirs = expected_specs(server.model_config)
    except Exception as exc:  # a model type or config this transformers does not know: the server checks as it loads
        logger.warning("%s: cannot check its model's shapes here (%s: %s)", server.url, type(exc).__name__, exc)
        return
    ours = {spec.name: spec.shape for spec in specs}
    where = f"{server.url} serves a model of another shape than the trainer's"
    for name, shape in ours.items():
        if name not in theirs:
            raise WeightSyncError(f"{where}: it has no parameter {name} (the trainer's is {list(shape)})")
        if theirs[name] != shape:
            raise WeightSyncError(f"{where}: {name} is {list(theirs[name])} there and {list(shape)} in the trainer")
    missing = sorted(set(theirs) - set(ours))
    if missing:
        raise WeightSyncError(f"{where}: the trainer has no {missing[0]} (shape {list(theirs[missing[0]])} there)"
                              + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))  # fmt: skip


def check_limits(specs: Sequence[WeightSpec], server: ServerWeights, transport: Transport, bucket_bytes: int) -> None:
    """WeightSyncError, before the first step, when a bucket or a tensor would be over what the server
    takes by ``transport`` (a bucket of ``bucket_bytes``; a tensor larger goes alone); nothing when it
    states no limit. A tensor payload travels as base64 in a JSON body (4/3 of its bytes, and a margin)."""
    tensor = transport == "tensor"
    limit = server.max_body_bytes if tensor else server.max_bucket_bytes
    if limit is None:
        return
    mib = 2**20
    most = (limit - mib) * 3 // 4 if tensor else limit  # the most bytes of weights one body or bucket holds
    unit = "tensor body" if tensor else "broadcast bucket"
    for spec in target_specs(specs, server.dtype):
        if spec.nbytes > most:
            raise WeightSyncError(f"{server.url} takes at most {limit / mib:.0f} MiB per {unit}, and {spec.name} "
                                  f"alone is {spec.nbytes / mib:.0f} MiB: use weight_sync.transport disk for this "
                                  "model")  # fmt: skip
    if bucket_bytes > most:
        raise WeightSyncError(f"{server.url} takes at most {limit / mib:.0f} MiB per {unit}: weight_sync.bucket_mb "
                              f"{bucket_bytes // mib} is over it (set it to {most // mib} or less)")  # fmt: skip


def sglang_dtype(server_dtype: str | None, model_config: dict[str, Any] | None) -> torch.dtype | None:
    """The dtype an SGLang server runs a model in, from its ``--dtype`` and the model's config: "auto"
    is the config's dtype, float16 for a float32 model (bfloat16 for Gemma), as SGLang decides."""
    from rollout.engines.weight_buckets import DTYPES

    named = DTYPES.get(str(server_dtype or "").removeprefix("torch."))
    if named is not None:
        return named
    if server_dtype not in (None, "auto") or model_config is None:
        return None
    config_dtype = DTYPES.get(str(model_config.get("dtype") or model_config.get("torch_dtype") or "float32"))
    if config_dtype in (None, torch.float32):
        return torch.bfloat16 if str(model_config.get("model_type", "")).startswith("gemma") else torch.float16
    return config_dtype
