"""What loading a tool config needs in both ``registry.py`` and ``mcp.py``: the error that names the
file, entry and field, and ``import_class`` for ``class_name`` import paths."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any


class ToolConfigError(ValueError):
    """A tool config that cannot be loaded; the message names the file, the entry and the field."""


def import_class(path: str, search: tuple[Path, ...] = ()) -> Any:
    """``"pkg.module:Class"`` or ``"pkg.module.Class"`` -> the class (or function). A module that
    is not importable but sits in one of ``search``'s folders is imported from there, as
    ``python -m`` would from the folder it runs in."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ImportError(f"{path!r} is not an import path like 'pkg.module:Class'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        top = module_name.partition(".")[0]
        folder = next((f for f in search if (f / top).is_dir() or (f / f"{top}.py").is_file()), None)
        if exc.name != top or folder is None:
            raise
        sys.path.insert(0, str(folder))
        module = importlib.import_module(module_name)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ImportError(f"module {module_name!r} has no attribute {attr!r}") from None
