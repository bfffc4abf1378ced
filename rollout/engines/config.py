"""Settings of every engine, and ``EngineConfig``, the ``engine:`` section of a command's config.

Light on purpose (no torch, no aiohttp): ``rallyrl config --show`` and the YAML loader import it.

```yaml
engine:
  urls: [http://127.0.0.1:30000]   # servers (SGLang or `rallyrl serve`); empty: an in-process engine
  kind: local                      # the in-process engine when urls is empty: local | sglang
  local: {max_batch_size: 256, device: auto}
  http: {timeout_s: 600, max_retries: 5}
  pool: {health_interval_s: 1.0}
```
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from data.config_tree import check_fields


@dataclass
class LocalEngineConfig:
    """The embedded engine (``rollout/engines/local.py``): continuous batching over transformers."""

    max_batch_size: int = 256
    """Most sequences decoded together; more wait in a FIFO queue. Independent of
    ``rollout.max_concurrency`` (requests in flight), which bounds what can be waiting."""
    max_prefill_tokens: int = 8192
    """Most prompt tokens (padded) prefilled in one step, so decode is never starved for long."""
    max_model_len: int | None = None
    """Context limit (prompt + output); None: ``rollout.max_model_len`` in a rollout or training
    run, the model's ``max_position_embeddings`` when serving."""
    device: str = "auto"
    """"auto" (CUDA when present, else CPU), "cpu", "cuda", "cuda:1", ..."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """"auto": bfloat16 on CUDA, float32 on CPU."""
    seed: int | None = None
    """Seed of the sampling generator; None: the command's ``seed`` (training adds 1000 x the
    process index). Seeded rollouts (``rollout.seed``) sample each turn with its own seed instead."""
    prefix_cache_mb: int = 512
    """Memory for the KV of finished sequences, reused by prompts that extend them (0 = off)."""
    recompute_on_update: bool = True
    """True: a request in flight during a weight update continues from the tokens it has, its
    keys and values recomputed with the new weights (as SGLang's resumed requests); False: it
    keeps the old keys and values (cheaper; the context mixes weights)."""

    def __post_init__(self) -> None:
        check_fields(self)
        for name in ("max_batch_size", "max_prefill_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"LocalEngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"LocalEngineConfig.max_model_len must be >= 1, got {self.max_model_len}")
        if self.prefix_cache_mb < 0:
            raise ValueError(f"LocalEngineConfig.prefix_cache_mb must be >= 0, got {self.prefix_cache_mb}")


@dataclass
class SGLangHTTPConfig:
    """The client of one SGLang (or ``rallyrl serve``) server (``rollout/engines/sglang_http.py``)."""

    timeout_s: float = 600.0
    """Wall-clock limit of one /generate attempt (the whole response)."""
    connect_timeout_s: float = 10.0
    """Limit on opening a connection."""
    max_retries: int = 5
    """Retries of a failed attempt (connection error, timeout, 408, 429, 5xx) before giving up."""
    backoff_s: float = 0.25
    """First retry delay; doubles each retry, with full jitter."""
    backoff_max_s: float = 8.0
    """Longest retry delay."""
    max_connections: int = 0
    """Most open connections to the server (0: no limit, so thousands of requests can be in flight)."""
    max_resumes: int = 32
    """Most times one generation is resumed after server-side aborts before it is returned as aborted."""
    control_timeout_s: float = 300.0
    """Limit of control calls (weight updates, pause, flush, health)."""
    api_key: str | None = None
    """Sent as ``Authorization: Bearer`` when the server was started with --api-key."""

    def __post_init__(self) -> None:
        check_fields(self)
        for name in ("timeout_s", "connect_timeout_s", "control_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SGLangHTTPConfig.{name} must be > 0, got {getattr(self, name)}")
        for name in ("max_retries", "max_connections", "max_resumes"):
            if getattr(self, name) < 0:
                raise ValueError(f"SGLangHTTPConfig.{name} must be >= 0, got {getattr(self, name)}")


@dataclass
class PoolConfig:
    """A pool of servers (``rollout/engines/pool.py``): least-in-flight routing, sticky per request."""

    health_interval_s: float = 1.0
    """Seconds between health checks of every server."""
    failures_to_eject: int = 2
    """Consecutive failed health checks that take a server out (a failed request takes it out at once)."""
    wait_for_server_s: float = 120.0
    """How long a request waits for a server to come back when none is healthy, before it fails."""
    sticky_entries: int = 200_000
    """Most remembered request -> server assignments (oldest forgotten first)."""
    client: SGLangHTTPConfig = field(default_factory=lambda: SGLangHTTPConfig(max_retries=1))
    """Settings of each server's client: few retries, since another server can take the request."""

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass
class SGLangEngineConfig:
    """The in-process SGLang engine (``rollout/engines/sglang_engine.py``, ``rallyrl[sglang]``)."""

    model_path: str = ""
    """Model directory (or a name SGLang resolves) that ``sglang.Engine`` loads; empty: the
    command's ``model``."""
    server_args: dict[str, Any] = field(default_factory=dict)
    """Passed as they are to ``sglang.Engine(**server_args)``: mem_fraction_static, tp_size, dtype, ..."""
    max_resumes: int = 32
    """Most times one generation is resumed after weight-update aborts before it is returned as aborted."""
    abort_on_update: bool = True
    """Abort in-flight generations at a weight update (they resume on the new weights); False lets
    SGLang wait for them to finish first."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.max_resumes < 0:
            raise ValueError(f"SGLangEngineConfig.max_resumes must be >= 0, got {self.max_resumes}")
        if "model_path" in self.server_args:
            raise ValueError("give the model as SGLangEngineConfig.model_path, not in server_args")


WeightTransport = Literal["auto", "disk", "broadcast", "tensor"]


@dataclass
class WeightSyncConfig:
    """How a training run's weights reach its servers after each step (``rollout/engines/weight_push.py``).
    In-process engines (the embedded one, in-process SGLang) always take the tensors themselves."""

    transport: WeightTransport = "auto"
    """``broadcast``: through a process group of the trainer and each server's workers (gloo on a CPU,
    NCCL between GPUs; SGLang, ``rallyrl serve``, and vLLM with rallyrl's worker extension);
    ``tensor``: the tensors handed over on the same machine (CUDA IPC on a GPU, by value on a CPU;
    SGLang and ``rallyrl serve``); ``disk``: saved under ``out/weights/`` and loaded by each server
    (``/update_weights_from_disk``, vLLM's ``reload_weights``); ``auto``: for each server the fastest it
    supports (tensor by CUDA IPC for a GPU server on this machine, else broadcast, else disk), said once
    before the first rollout. A transport a server cannot take is an error naming the fix."""
    bucket_mb: int = 512
    """Most MiB per bucket: tensors travel in flattened buckets of one dtype each; the trainer holds at
    most two buckets beyond its own weights."""
    timeout_s: float = 120.0
    """Deadline of each step of a sync on one server (joining its group, one bucket, the version read
    back); a server that misses it is taken out of rotation and synced again when it answers."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Broadcast backend: ``auto`` is NCCL when the trainer's weights and the server are on GPUs, gloo otherwise."""
    master_address: str | None = None
    """The address servers reach this trainer at for a broadcast; None: loopback for servers on this
    machine, else the address of the interface on the route to each server."""
    check_logprobs: bool = False
    """After each sync, have every server generate a few greedy tokens of a fixed prompt and compare its
    logprobs with the trainer's forward pass (``sync/logprob_gap`` in metrics.jsonl): a broken sync
    shows at once. Costs one short generation per server and one forward per step."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.bucket_mb < 1:
            raise ValueError(f"weight_sync.bucket_mb must be >= 1, got {self.bucket_mb}")
        if not self.timeout_s > 0:
            raise ValueError(f"weight_sync.timeout_s must be > 0, got {self.timeout_s}")

    @property
    def bucket_bytes(self) -> int:
        return self.bucket_mb * 2**20


@dataclass
class EngineConfig:
    """Which engine a command rolls out on, and the settings of each kind."""

    urls: list[str] = field(default_factory=list)
    """SGLang (or ``rallyrl serve``) servers; one is a client, several a pool. Empty: the
    in-process engine named by ``kind``. With servers, ``model`` names the tokenizer, and a
    training run syncs its weights into them after each step (``weight_sync`` of the training config)."""
    server: Literal["auto", "sglang", "vllm"] = "auto"
    """What serves ``urls``: "sglang" (SGLang or ``rallyrl serve``), "vllm" (weight sync needs it
    started with VLLM_SERVER_DEV_MODE=1), or "auto": asked once per URL when the engine opens
    (GET /get_model_info answers on SGLang and ``rallyrl serve``; vLLM answers /version and /v1/models)."""
    kind: Literal["local", "sglang"] = "local"
    """In-process engine when ``urls`` is empty: the embedded one, or SGLang's (CUDA)."""
    local: LocalEngineConfig = field(default_factory=LocalEngineConfig)
    sglang: SGLangEngineConfig = field(default_factory=SGLangEngineConfig)
    http: SGLangHTTPConfig = field(default_factory=SGLangHTTPConfig)
    """The client of a single server (``urls`` of one)."""
    pool: PoolConfig = field(default_factory=PoolConfig)
    """A pool (``urls`` of several); its ``client`` is each server's client."""

    def __post_init__(self) -> None:
        check_fields(self)
        for url in self.urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"engine.urls: {url!r} is not an http:// or https:// URL")
