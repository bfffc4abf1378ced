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
    unused_session_timeout_s: float = 60.0
    """A session opened with ``POST /sessions`` and never called for this long is ended the same way (an
    abandoned open); the trainer's own sessions end with their agent run (``agent_timeout_s``)."""
    max_sessions: int = 4096
    """Most sessions open at once. Opening one more first ends the expired sessions, then the one that
    has waited longest for its first call; only when every open session has made a call is it refused
    (HTTP 429)."""
    keep_finished: int = 256
    """Finished sessions kept in memory for ``GET /sessions/{id}`` (the oldest are forgotten first)."""
    remember_finished: int = 65536
    """Ids of finished sessions remembered (beyond ``keep_finished``): such an id answers 409 and cannot
    be opened again until this many newer sessions have finished."""
    max_body_mb: float = 16.0
    """Largest request body, in MiB; a longer one is refused with 413 before it is read."""
    max_metadata_bytes: int = 64 * 2**10
    """Most bytes of a session's ``metadata``, ``ground_truth`` and ``data_source`` (their JSON) at open (413)."""
    max_tools_bytes: int = 512 * 2**10
    """Most bytes of one call's ``tools`` (their JSON); a longer list is refused (413)."""
    max_history_bytes: int = 4 * 2**20
    """Most bytes of one call's ``messages`` (their JSON); a longer history is refused (413)."""
    max_messages: int = 4096
    """Most messages in one call (400)."""
    max_json_items: int = 262144
    """Most JSON values in one request body, counted before it is parsed as its ``,`` ``[`` and ``{``
    characters (those in strings too): parsing millions of tiny values holds the interpreter for
    seconds (413)."""
    served_model_name: str | None = None
    """Model name in ``/v1/models`` (default: the model directory's name). Any name is accepted in requests."""

    def __post_init__(self) -> None:
        check_fields(self)
        if not 0 <= self.port < 65536:
            raise ValueError(f"GatewayConfig.port must be in 0..65535, got {self.port}")
        for name in ("agent_timeout_s", "session_timeout_s", "unused_session_timeout_s", "max_body_mb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"GatewayConfig.{name} must be > 0, got {getattr(self, name)}")
        for name in ("max_sessions", "keep_finished", "remember_finished", "max_metadata_bytes", "max_tools_bytes",
                     "max_history_bytes", "max_messages", "max_json_items"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"GatewayConfig.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 2**20)
