"""rallyrl's vLLM worker extension: each vLLM worker joins a weight group with a rallyrl trainer and
loads what the trainer broadcasts, bucket by bucket, while the trainer sends it.

vLLM 0.32's own weight transfer (``/init_weight_transfer_engine``, ``/update_weights``) has NCCL and
CUDA IPC backends only; this extension is the route that also works on a CPU (gloo), after TRL's
``vllm_serve``. Start the server with it (rallyrl must be importable in vLLM's environment:
``pip install --no-deps rallyrl`` there, or the checkout on its ``PYTHONPATH``)::

    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model DIR \\
        --worker-extension-cls rollout.engines.vllm_worker.WeightReceiver --logprobs-mode processed_logprobs

The trainer (``rollout/engines/vllm_weights.py``) calls the methods below through vLLM's
``/collective_rpc``; every worker runs them. ``rallyrl_receive_weights`` feeds the buckets, as they
arrive, to vLLM's own in-place reload (``reload_weights`` with an iterator: the layer-wise processing
vLLM applies after loading, packing included, runs as for a checkpoint). On vLLM's CPU backend the
LM head multiplies by a packed copy of its weight; when it is tied to the input embeddings the
trainer sends the embeddings once and this extension loads them under the head's name too, so that
the packed copy is remade. Imports torch and rallyrl's two torch-only weight modules, nothing else.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from rollout.engines.weight_buckets import bucket_views, read_bucket_specs
from rollout.engines.weight_group import destroy_weight_group, init_weight_group


class WeightReceiver:
    """Mixed into vLLM's worker class by ``--worker-extension-cls``; every name starts with ``rallyrl_``
    (vLLM refuses an extension whose names collide with its worker's)."""

    def _rallyrl_groups(self) -> dict[str, Any]:
        groups = getattr(self, "_rallyrl_weight_groups", None)
        if groups is None:
            groups = self._rallyrl_weight_groups = {}
        return groups

    def rallyrl_model_config(self) -> dict[str, Any]:
        """The served model's ``config.json`` contents, dtype and device, and this worker's rank."""
        config = self.model_config  # type: ignore[attr-defined]
        return {
            "hf_config": json.loads(config.hf_config.to_json_string()),
            "dtype": str(config.dtype).removeprefix("torch."),
            "device": str(getattr(self, "device", "cpu")),
            "rank": int(getattr(self, "rank", 0)),
        }

    def rallyrl_join_weight_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str, timeout_s: float) -> dict[str, Any]:  # fmt: skip
        """Join the group the trainer opened (as rank ``rank_offset`` + this worker's rank)."""
        rank = int(rank_offset) + int(getattr(self, "rank", 0))
        if rank < 1:
            raise ValueError(f"rank_offset {rank_offset}: rank 0 is the trainer's")
        group = init_weight_group(backend, master_address, int(master_port), int(world_size), rank, group_name,
                                  float(timeout_s))  # fmt: skip
        self._rallyrl_groups()[group_name] = group
        return {"rank": rank}

    def rallyrl_leave_weight_group(self, group_name: str) -> dict[str, Any]:
        group = self._rallyrl_groups().pop(group_name, None)
        if group is not None:
            destroy_weight_group(group)
        return {"left": group is not None}

    def rallyrl_receive_weights(self, group_name: str, buckets: list[dict[str, Any]],
                                aliases: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
        """Receive ``buckets`` (each ``{names, dtypes, shapes, flat}``, in the order the trainer broadcasts
        them: one flat tensor, or each tensor by itself) and load them in place. ``aliases``: {a tied
        parameter the trainer did not send: the name it travels under}, loaded under both names on a
        CPU (the packed copy of a tied LM head)."""
        group = self._rallyrl_groups().get(group_name)
        if group is None:
            raise ValueError(f"no weight group {group_name!r} on this worker: join one first")
        device = torch.device("cpu") if dist.get_backend(group) == "gloo" else self.device  # type: ignore[attr-defined]
        doubled = {}
        if aliases and str(getattr(self, "device", "cpu")).startswith("cpu"):
            doubled = {kept: alias for alias, kept in aliases.items()}
        count = 0

        def weights() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count
            for index, bucket in enumerate(buckets):
                specs = read_bucket_specs(bucket.get("names"), bucket.get("dtypes"), bucket.get("shapes"),
                                          f"bucket {index + 1}")  # fmt: skip
                if bucket.get("flat", True):
                    flat = torch.empty(sum(spec.nbytes for spec in specs), dtype=torch.uint8, device=device)
                    dist.broadcast(flat, src=0, group=group)
                    named = bucket_views(flat, specs)
                else:
                    named = [(spec.name, torch.empty(spec.shape, dtype=spec.dtype, device=device)) for spec in specs]
                    for work in [dist.broadcast(t, src=0, group=group, async_op=True) for _, t in named]:
                        work.wait()
                for name, tensor in named:
                    count += 1
                    yield name, tensor
                    if name in doubled:
                        yield doubled[name], tensor

        self.reload_weights(weights_iterator=weights(), is_checkpoint_format=True)  # type: ignore[attr-defined]
        return {"tensors": count}
