"""Tools from a YAML or JSON config, by import path, so users plug in their own classes.

```yaml
tools:
  - class_name: "tools.calculator:CalculatorTool"   # or "pkg.module.Class" (verl's spelling)
    config: {max_digits: 2000}
    schema: {...}                                    # optional OpenAI function schema
```
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import orjson
import yaml

from tools.base import BaseTool

DEFAULT_TOOLS = [{"class_name": "tools.calculator:CalculatorTool"}]


class ToolConfigError(ValueError):
    """A tool config that cannot be loaded; the message names the file, the entry and the field."""


def import_class(path: str) -> type:
    """``"pkg.module:Class"`` or ``"pkg.module.Class"`` -> the class."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ImportError(f"{path!r} is not an import path like 'pkg.module:Class'")
    module = importlib.import_module(module_name)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ImportError(f"module {module_name!r} has no attribute {attr!r}") from None


def build_tools(entries: list[dict[str, Any]], source: str = "<tools>") -> dict[str, BaseTool]:
    """Instantiate every entry; the result maps each tool's name to the tool."""
    tools: dict[str, BaseTool] = {}
    for i, entry in enumerate(entries):
        where = f"{source}: tools[{i}]"
        if not isinstance(entry, dict):
            raise ToolConfigError(f"{where}: expected a mapping with 'class_name', got {type(entry).__name__}")
        unknown = set(entry) - {"class_name", "config", "schema", "tool_schema"}
        if unknown:
            raise ToolConfigError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
        class_name = entry.get("class_name")
        if not isinstance(class_name, str):
            raise ToolConfigError(f"{where}.class_name: expected an import path like 'pkg.module:Class'")
        try:
            cls = import_class(class_name)
        except ImportError as exc:
            raise ToolConfigError(f"{where}.class_name: cannot import {class_name!r}: {exc}") from None
        except Exception as exc:  # the module itself fails: a syntax error, an error at import, a relative path
            raise ToolConfigError(
                f"{where}.class_name: cannot import {class_name!r}: {type(exc).__name__}: {exc}"
            ) from None
        if not (isinstance(cls, type) and issubclass(cls, BaseTool)):
            raise ToolConfigError(f"{where}.class_name: {class_name!r} is not a subclass of tools.base.BaseTool")
        config = entry.get("config") or {}
        schema = entry.get("schema", entry.get("tool_schema"))
        if not isinstance(config, dict):
            raise ToolConfigError(f"{where}.config: expected a mapping, got {type(config).__name__}")
        if schema is not None and not (isinstance(schema, dict) and isinstance(schema.get("function"), dict)):
            raise ToolConfigError(f"{where}.schema: expected an OpenAI function schema {{'type': 'function', ...}}")
        if schema is not None and not (isinstance(schema["function"].get("name"), str) and schema["function"]["name"]):
            raise ToolConfigError(f"{where}.schema.function.name: expected the tool's name, a non-empty string")
        try:
            tool = cls(config=config, schema=schema)
            tool.check_arguments({})  # compiles the parameters schema: a bad one fails here
        except Exception as exc:
            raise ToolConfigError(f"{where}: {class_name} could not be created: {exc}") from None
        if tool.name in tools:
            raise ToolConfigError(f"{where}: a second tool named {tool.name!r}")
        tools[tool.name] = tool
    return tools


def load_tools(path: str | Path) -> dict[str, BaseTool]:
    """Read a YAML (``.yaml``/``.yml``) or JSON tool config and build its tools."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ToolConfigError(f"{path}: cannot read tool config: {exc.strerror}") from None
    try:
        data = orjson.loads(raw) if path.suffix == ".json" else yaml.safe_load(raw)
    except (orjson.JSONDecodeError, yaml.YAMLError) as exc:
        raise ToolConfigError(
            f"{path}: not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {_one_line(exc)}"
        ) from None
    if not isinstance(data, dict) or not isinstance(data.get("tools"), list):
        raise ToolConfigError(f"{path}: expected a top-level 'tools:' list")
    return build_tools(data["tools"], str(path))


def _one_line(exc: Exception) -> str:
    """A parse error on one line: PyYAML's messages span several, with a caret drawing."""
    mark = getattr(exc, "problem_mark", None)
    if isinstance(exc, yaml.MarkedYAMLError) and mark is not None:
        context = f" {exc.context}" if exc.context else ""
        return f"line {mark.line + 1}, column {mark.column + 1}: {exc.problem}{context}"
    return " ".join(str(exc).split())
