"""The agent gateway (``rollout/gateway/app.py``): sessions recorded token for token from agents we do
not own (``session.py``), one chat completion at a time (``calls.py``), run for training (``agents.py``)."""

from rollout.gateway.app import Gateway, write_sessions
from rollout.gateway.errors import GatewayError

__all__ = ["Gateway", "GatewayError", "write_sessions"]
