"""The agent gateway's section of the config tree (``GatewayJobConfig.gateway``, ``RolloutJobConfig.gateway``).
Light on purpose (a config module: no torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from data.config_tree import check_fields


@dataclass
class GatewayConfig:
    """The agent gateway (``rollout/gateway/app.py``): an OpenAI-compatible endpoint that records each
    agent run as a session, token for token, for training."""

    host: str = "127.0.0.1"
    """Interface to bind; loopback unless you mean to expose it."""
    port: int = 0
    """Port (0: pick a free one; ``rallyrl gateway`` prints the URL)."""
    sampling: Literal["rollout", "request"] = "rollout"
    """rollout: every call samples with ``rollout``'s temperature, top_p, top_k and per-turn seed, and at
    most ``rollout.max_new_tokens`` (what the trainer assumes; the agent's own values are ignored);
    request: the values the agent sends (OpenAI's defaults where it sends none)."""
    agent_timeout_s: float = 600.0
    """Wall-clock limit of one agent run (the entry point's call); a slower run ends with an error."""
    session_timeout_s: float = 600.0
    """A session with no call for this long is ended (finish_reason abort) and its memory freed."""
    max_sessions: int = 4096
    """Most sessions open at once; creating another is refused (HTTP 429)."""
    keep_finished: int = 256
    """Finished sessions kept in memory for ``GET /sessions/{id}`` (the oldest are forgotten first)."""
    served_model_name: str | None = None
    """Model name in ``/v1/models`` (default: the model directory's name). Any name is accepted in requests."""

    def __post_init__(self) -> None:
        check_fields(self)
        if not 0 <= self.port < 65536:
            raise ValueError(f"GatewayConfig.port must be in 0..65535, got {self.port}")
        for name in ("agent_timeout_s", "session_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"GatewayConfig.{name} must be > 0, got {getattr(self, name)}")
        for name in ("max_sessions", "keep_finished"):
            if getattr(self, name) < 1:
                raise ValueError(f"GatewayConfig.{name} must be >= 1, got {getattr(self, name)}")
