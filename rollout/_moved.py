"""Old dotted paths of modules that moved into rollout's rooms: ``import rollout.interactions`` (or a
config's ``class_name: rollout.interactions:AnswerChecker``) still works, gives the module at its new
path and warns (DeprecationWarning) naming that path."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from importlib.machinery import ModuleSpec
from types import ModuleType

MOVED = {
    "rollout.server": "rollout.serve.app",
    "rollout.server_generate": "rollout.serve.generate",
    "rollout.server_http": "rollout.serve.http",
    "rollout.server_openai": "rollout.serve.openai_routes",
    "rollout.serve_process": "rollout.serve.processes",
    "rollout.faults": "rollout.serve.faults",
    "rollout.gateway_session": "rollout.gateway.session",
    "rollout.agents": "rollout.gateway.agents",
    "rollout.interactions": "rollout.users.interactions",
    "rollout.simulated_user": "rollout.users.simulated_user",
    "rollout.judge": "rollout.users.judge",
    "rollout.chat_model": "rollout.users.chat_model",
    "rollout.show": "rollout.files.show",
    "rollout.export": "rollout.files.export",
    "rollout.file_commands": "rollout.files.commands",
    "rollout.engine_servers": "rollout.engines.launch",
    "rollout.adapters": "rollout.engines.adapter_dirs",
}
"""Old dotted path -> new dotted path."""


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path of ``MOVED`` and loads it as the module at its new path."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return None  # a placeholder; exec_module puts the real module in its place

    def exec_module(self, module: ModuleType) -> None:
        new = MOVED[module.__name__]
        warnings.warn(f"{module.__name__} moved to {new}: import {new} instead", DeprecationWarning, stacklevel=2)
        # The import system returns what sys.modules holds under the old name once this returns.
        sys.modules[module.__name__] = importlib.import_module(new)


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(MovedModules())
