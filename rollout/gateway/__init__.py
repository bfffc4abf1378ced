"""The agent gateway (``rollout/gateway/app.py``): sessions recorded token for token from agents we do
not own (``session.py``), one chat completion at a time (``calls.py``), run for training (``agents.py``);
opened, ended and expired by ``lifecycle.py`` over the table of ``registry.py``, every request within
the caps of ``limits.py``, large work off the event loop (``offload.py``)."""

from __future__ import annotations

from typing import Any

__all__ = ["Gateway", "GatewayError", "write_sessions"]


def __getattr__(name: str) -> Any:
    """``Gateway``, ``GatewayError`` and ``write_sessions``, imported when first asked for: ``rallyrl``
    reaches ``rollout.gateway.command`` through this package and must not pay for torch to start."""
    if name in ("Gateway", "write_sessions"):
        from rollout.gateway import app

        return getattr(app, name)
    if name == "GatewayError":
        from rollout.gateway.errors import GatewayError

        return GatewayError
    raise AttributeError(f"module 'rollout.gateway' has no attribute {name!r}")
