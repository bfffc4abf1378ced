"""Weight sync from the trainer to its engine after each optimizer step.

In-process engines (the embedded one, in-process SGLang) take the state dict directly. Servers
(``--engine-url``, always behind a pool: ``rollout/engines/pool.py``) take it as ``weight_sync``
says, by the transport ``plan_sync`` chose for each before the first rollout
(``rollout/engines/weight_plan.py``): a broadcast into their workers or tensors handed over on this
machine, in buckets and in memory (``rollout/engines/weight_push.py``), or a saved model directory
(``trainer/weight_files.py``: safetensors in ``out/weights/v{version}``, a temporary directory
renamed into place so a server never reads half a file; the servers must see that path).

With LoRA (``lora.sync``), servers that can load adapters get the adapter alone instead
(``weight_files.save_adapter_version``, ``sync_adapter_from_disk``: ``rollout/engines/server_adapters.py``);
``adapter_sync_plan`` decides which, before the first rollout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from data.config_tree import ConfigError
from rollout.engines.base import Engine, LoadsAdapters, PushesWeights
from rollout.engines.config import WeightSyncConfig
from trainer.config import LoRAConfig

if TYPE_CHECKING:
    from trainer.config import GRPOConfig
    from trainer.weight_source import PolicyWeights

async def plan_servers(engine: Engine, config: GRPOConfig, policy: Any,
                       weights: PolicyWeights) -> tuple[bool, list[str]]:  # fmt: skip
    """With servers: whether each sync sends the LoRA adapter alone (``adapter_sync_plan``), and the
    lines that say how each server takes the weights (``plan_sync``); in-process engines: (False,
    the one line that says they take the tensors themselves)."""
    if not isinstance(engine, PushesWeights):
        return False, await plan_sync(engine, config.weight_sync, weights)
    lines = []
    adapter = False
    if config.lora is not None:
        modules = sorted(policy.peft.peft_config["default"].target_modules)
        adapter, line = await adapter_sync_plan(engine, config.lora, modules)
        lines.append(line)
    if not adapter:
        lines += await plan_sync(engine, config.weight_sync, weights)
    return adapter, lines


async def plan_sync(engine: Engine, config: WeightSyncConfig, weights: PolicyWeights) -> list[str]:
    """How each server will take the weights (said once, before the first rollout); a server that
    cannot take them as asked, or serves a model of another shape, is a WeightSyncError naming it."""
    if isinstance(engine, PushesWeights):
        return await engine.plan_weight_sync(config, weights, weights.device)
    line = f"weight sync: tensor, in process ({type(engine).__name__} takes the trainer's tensors themselves)"
    if config.transport in ("broadcast", "disk"):
        line += f"; weight_sync.transport {config.transport} is for servers (--engine-url)"
    return [line]


async def sync_engine(engine: Engine, weights: PolicyWeights, version: int) -> dict[str, float]:
    """Give ``engine`` the policy's weights as ``version``; the ``sync/`` metrics: the lowest version
    a server reports after the sync and how many servers failed it (and left rotation)."""
    if isinstance(engine, PushesWeights):
        versions = await engine.push_weights(weights, version)
        synced = [v for v in versions.values() if v is not None]
        return {"weight_version": min(synced), "servers_failed": float(len(versions) - len(synced))}
    reported = await engine.update_weights(weights.state_dict(), weight_version=version)
    return {"weight_version": reported, "servers_failed": 0.0}


async def adapter_sync_plan(engine: Engine, lora: LoRAConfig, modules: Sequence[str]) -> tuple[bool, str]:
    """For servers and a LoRA run: whether each sync sends the adapter alone (True) or merged full
    weights, and the line that says so. ``lora.sync`` ``adapter`` or ``auto`` with a server that
    lacks a flag or a large enough ``--max-lora-rank`` is a ConfigError naming the fix."""
    merged = "lora: the servers get the adapter merged into full weights at each sync"
    if lora.sync == "merged" or not isinstance(engine, LoadsAdapters):
        return False, f"{merged} (lora.sync: {lora.sync})"
    support = await engine.adapter_support(lora.rank, modules)
    if support.ready:
        return True, "lora: the servers load each version's adapter alone through their LoRA endpoints"
    if support.impossible and lora.sync == "auto":
        return False, f"{merged}: {support.problem}"
    raise ConfigError(f"lora.sync {lora.sync}: {support.problem}: {support.fix or 'set lora.sync: merged'}")
