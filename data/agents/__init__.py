"""Example agents written against the OpenAI API, trained through the agent gateway (``rollout/gateway/agents.py``)."""
