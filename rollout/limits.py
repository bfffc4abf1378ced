"""What one request may ask of ``rallyrl serve`` (``ServeConfig.limits``): every bound is checked before
anything is queued, and a request past one is answered 400 (413 for the body) naming the field and
the limit. The defaults serve any rollout rallyrl runs; raise them with ``--set limits.NAME=VALUE``.
Light on purpose (a config module: no torch)."""

from __future__ import annotations

from dataclasses import dataclass

from data.config_tree import check_fields


@dataclass
class ServeLimits:
    """Bounds on one request to ``rallyrl serve`` (docs/reliability.md, "Threat model")."""

    max_body_mb: float = 16.0
    """Largest request body, in MiB; a longer one is refused with 413 before it is read (weights sent
    as tensors have their own limit)."""
    max_json_items: int = 2**20
    """Most JSON values in one request body, counted before it is parsed (its ``,``, ``[`` and ``{``
    characters): parsing millions of tiny values holds the interpreter, and so ``/health``, for a
    fraction of a second (413). A batch of many long token-id prompts goes in several requests."""
    max_prompts: int = 1024
    """Most prompts in one request (a ``/generate`` batch, a ``/v1/completions`` prompt list)."""
    max_n: int = 64
    """Most samples of one prompt (``n``)."""
    max_samples: int = 4096
    """Most generations one request asks for: prompts times ``n``."""
    max_pending: int = 16384
    """Most generations waiting or running in the whole server; past it a request is answered 503
    ("busy") at once, so that a flood cannot queue without end."""
    max_prompt_chars: int = 2**20
    """Longest text prompt (or chat message list, rendered), in characters, tokenized on a worker thread."""
    max_stop: int = 64
    """Most stop strings, and most ``stop_token_ids``, of one request."""
    max_stop_chars: int = 512
    """Longest stop string, in characters (each decoded token is searched for every stop string)."""

    def __post_init__(self) -> None:
        check_fields(self)
        if not self.max_body_mb > 0:
            raise ValueError(f"limits.max_body_mb must be > 0, got {self.max_body_mb}")
        for name in ("max_json_items", "max_prompts", "max_n", "max_samples", "max_pending", "max_prompt_chars",
                     "max_stop", "max_stop_chars"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"limits.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 2**20)
