"""The ``ray:`` settings beside ``executor: ray`` (a tool entry, an environment interaction's config),
checked without importing Ray (``tools/ray_cluster.py`` uses them)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field, fields
from typing import Any

RAY_INSTALL = "pip install 'rallyrl[ray]'"


@dataclass
class RayOptions:
    """The ``ray:`` mapping beside ``executor: ray`` (a tool entry, an environment interaction's config)."""

    address: str | None = None
    """A running cluster (``"auto"``, ``"10.0.0.1:6379"``); None: ``RAY_ADDRESS``, else a local Ray for this run."""
    actors: int = 1
    """Actors of the pool; each holds many instances (``max_concurrency`` calls at once)."""
    num_cpus: float = 1.0
    """CPUs Ray reserves per actor (the node must have them free)."""
    memory_mb: int | None = None
    """Memory Ray reserves per actor; None: none reserved."""
    resources: dict[str, float] = field(default_factory=dict)
    """Custom resources per actor, e.g. ``{sandbox: 1}`` for nodes started with ``--resources``."""
    label_selector: dict[str, str] = field(default_factory=dict)
    """Node labels an actor must run on, e.g. ``{pool: tools}`` for nodes started with ``--labels``."""
    timeout_s: float = 60.0
    """The longest wait for any one call, an actor's start included; then the call fails."""
    max_replacements: int = 8
    """Actors started over the run in place of lost ones; past it, a pool with no live actor fails its creates."""
    max_concurrency: int = 1000
    """Calls one actor runs at once (it is an async actor)."""
    runtime_env: dict[str, Any] | None = None
    """Ray's ``runtime_env`` for the actors (``env_vars``, ``py_modules``, ``working_dir`` ...)."""

    @classmethod
    def parse(cls, raw: Any, where: str, error: type[Exception] = ValueError) -> RayOptions:
        """The options of a ``ray:`` mapping (None: the defaults); ``error`` names ``where`` and the field."""
        if importlib.util.find_spec("ray") is None:
            raise error(f"{where}: executor: ray needs Ray, which is not installed: {RAY_INSTALL}")
        if raw is None:
            return cls()
        if not isinstance(raw, dict):
            raise error(f"{where}.ray: expected a mapping, got {type(raw).__name__}")
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(raw) - known):
            raise error(f"{where}.ray: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        options = cls(**raw)
        checks = {
            "actors": isinstance(options.actors, int) and options.actors >= 1,
            "num_cpus": _number(options.num_cpus) and options.num_cpus >= 0,
            "memory_mb": options.memory_mb is None or (isinstance(options.memory_mb, int) and options.memory_mb > 0),
            "timeout_s": _number(options.timeout_s) and options.timeout_s > 0,
            "max_replacements": isinstance(options.max_replacements, int) and options.max_replacements >= 0,
            "max_concurrency": isinstance(options.max_concurrency, int) and options.max_concurrency >= 1,
            "address": options.address is None or isinstance(options.address, str),
            "resources": isinstance(options.resources, dict) and all(map(_number, options.resources.values())),
            "label_selector": isinstance(options.label_selector, dict),
            "runtime_env": options.runtime_env is None or isinstance(options.runtime_env, dict),
        }
        if bad := [name for name, ok in checks.items() if not ok]:
            values = ", ".join(f"{name}={getattr(options, name)!r}" for name in bad)
            raise error(f"{where}.ray: bad value(s) {values} (see docs/beyond-one-machine.md)")
        return options

    def actor_options(self) -> dict[str, Any]:
        """Ray's ``.options(...)`` for one actor of the pool."""
        options: dict[str, Any] = {"num_cpus": self.num_cpus, "max_concurrency": self.max_concurrency,
                                   "max_restarts": 0, "max_task_retries": 0}  # fmt: skip
        if self.memory_mb is not None:
            options["memory"] = self.memory_mb * 2**20
        if self.resources:
            options["resources"] = dict(self.resources)
        if self.label_selector:
            options["label_selector"] = {str(k): str(v) for k, v in self.label_selector.items()}
        if self.runtime_env:
            options["runtime_env"] = dict(self.runtime_env)
        return options


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
