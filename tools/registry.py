"""Tools from a YAML or JSON config, by import path, so users plug in their own tools.

```yaml
tools:
  - class_name: "tools.calculator:CalculatorTool"   # or "pkg.module.Class" (verl's spelling)
    config: {max_digits: 2000}
    schema: {...}                                    # optional OpenAI function schema (or tool_schema)
  - class_name: my_pkg.tools.SearchTool              # a class written for verl, as it is
    config: {type: native}
    tool_schema: {type: function, function: {...}}
  - class_name: my_pkg.tools.multiply                # a function with type hints and a docstring
  - class_name: my_pkg.tools.Unused                  # verl's MCP entry: tools.mcp builds its tools
    config: {type: mcp}
    mcp: {mcp_servers_config_path: ./mcp_servers.json, tool_selected_list: [search]}
  - class_name: tools.python_sandbox:PythonTool       # any entry but MCP's: its tools run in Ray actors
    executor: ray                                    # (tools/ray_executor.py; default: local)
    ray: {actors: 2, num_cpus: 1}
```

A class_name names one of our ``BaseTool`` subclasses, a verl-style class (``tools.verl_compat``)
or a function (``tools.function_tool``). A class with a classmethod ``build_tools(entry, where,
source_dir)`` makes the entry's tools itself, any number of them (``tools.environment_class``: one
per method of an environment class). A module that is not installed is also looked for in the
current folder and the config file's folder.
"""

from __future__ import annotations

import functools
import inspect
from pathlib import Path
from typing import Any

import orjson
import yaml

from tools.base import BaseTool
from tools.function_tool import FunctionTool, is_function
from tools.loading import ToolConfigError, import_class
from tools.verl_compat import VerlTool, is_verl_style, schema_dict

DEFAULT_TOOLS = [{"class_name": "tools.calculator:CalculatorTool"}]
FIELDS = {"class_name", "config", "schema", "tool_schema", "mcp", "executor", "ray"}
EXECUTORS = ("local", "ray")
"""Where an entry's tools run: in the rollout process, or in Ray actors (``tools/ray_executor.py``)."""
MCP_CLASS_NAMES = {"tools.mcp:MCPTool", "tools.mcp.MCPTool"}
VERL_ALIASES = {"verl.tools.gsm8k_tool.Gsm8kTool": "tools.answer_check:AnswerCheckTool"}
"""verl's built-in tools that verl 0.9 from PyPI no longer ships, used where they do not import: verl's
GSM8K tool YAML (``calc_gsm8k_reward``) then runs as it is, on rallyrl's answer checker."""


def build_tools(
    entries: list[dict[str, Any]], source: str = "<tools>", source_dir: Path | None = None
) -> dict[str, BaseTool]:
    """Instantiate every entry; the result maps each tool's name to the tool. Relative paths in an
    entry (an MCP server config) are read from ``source_dir`` (default: the current folder)."""
    tools: dict[str, BaseTool] = {}
    for i, entry in enumerate(entries):
        where = f"{source}: tools[{i}]"
        for tool in _build_entry(entry, where, source_dir or Path.cwd()):
            if tool.name in tools:
                raise ToolConfigError(f"{where}: a second tool named {tool.name!r}")
            tools[tool.name] = tool
    return tools


def _build_entry(entry: Any, where: str, source_dir: Path) -> list[BaseTool]:
    """One entry's tools: one for a class or a function, all of a server's for an MCP entry; with
    ``executor: ray``, proxies to Ray actors that each build the same tools."""
    if not isinstance(entry, dict):
        raise ToolConfigError(f"{where}: expected a mapping with 'class_name', got {type(entry).__name__}")
    unknown = set(entry) - FIELDS
    if unknown:
        raise ToolConfigError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
    executor = entry.get("executor", "local")
    if executor not in EXECUTORS:
        raise ToolConfigError(f"{where}.executor: {executor!r} is not one of {', '.join(EXECUTORS)}")
    if "ray" in entry and executor != "ray":
        raise ToolConfigError(f"{where}.ray: settings for Ray, but the entry's executor is {executor!r}; "
                              "add 'executor: ray'")  # fmt: skip
    local_entry = {key: value for key, value in entry.items() if key not in ("executor", "ray")}
    if executor == "local":
        return _build_local(local_entry, where, source_dir)
    from tools.ray_options import RayOptions  # here: the Ray modules load only for an entry that runs on Ray

    if _is_mcp(local_entry):
        raise ToolConfigError(f"{where}.executor: ray runs a tool class in Ray actors; an MCP entry's tools run "
                              "on their MCP servers already (drop 'executor: ray')")  # fmt: skip
    options = RayOptions.parse(entry.get("ray"), where, ToolConfigError)
    tools = _build_local(local_entry, where, source_dir)
    from tools.ray_executor import on_ray

    try:
        return on_ray(tools, functools.partial(_build_local, local_entry, where, source_dir), options, where)
    except ValueError as exc:  # no Ray at the address, a second address
        raise ToolConfigError(str(exc)) from None


def _is_mcp(entry: dict[str, Any]) -> bool:
    class_name, config = entry.get("class_name"), entry.get("config")
    return "mcp" in entry or (isinstance(config, dict) and config.get("type") == "mcp") or (
        isinstance(class_name, str) and class_name in MCP_CLASS_NAMES)  # fmt: skip


def _build_local(entry: dict[str, Any], where: str, source_dir: Path) -> list[BaseTool]:
    """The tools of an entry (without ``executor``), in this process."""
    class_name = entry.get("class_name")
    config = entry.get("config") or {}
    if not isinstance(config, dict):
        raise ToolConfigError(f"{where}.config: expected a mapping, got {type(config).__name__}")
    if _is_mcp(entry):
        from tools.mcp import build_mcp_tools  # here: the MCP SDK takes a second or more to import

        return build_mcp_tools(entry, where, source_dir)
    if not isinstance(class_name, str):
        raise ToolConfigError(f"{where}.class_name: expected an import path like 'pkg.module:Class'")
    try:
        try:
            target = import_class(class_name, (Path.cwd(), source_dir))
        except ImportError:
            if class_name not in VERL_ALIASES:
                raise
            target = import_class(VERL_ALIASES[class_name])
    except ImportError as exc:
        raise ToolConfigError(f"{where}.class_name: cannot import {class_name!r}: {exc}") from None
    except Exception as exc:  # the module itself fails: a syntax error, an error at import, a relative path
        raise ToolConfigError(
            f"{where}.class_name: cannot import {class_name!r}: {type(exc).__name__}: {exc}"
        ) from None
    schema_key = "schema" if "schema" in entry else "tool_schema"
    schema = _schema(entry.get(schema_key), f"{where}.{schema_key}")
    try:
        if isinstance(target, type) and isinstance(inspect.getattr_static(target, "build_tools", None), classmethod):
            return _built_tools(target.build_tools(entry, where, source_dir), where, class_name)
        if isinstance(target, type) and issubclass(target, BaseTool):
            tool = target(config=config, schema=schema)
        elif is_verl_style(target):
            tool = VerlTool.build(target, config, schema)
        elif is_function(target):
            if set(config) - {"type"}:
                raise ToolConfigError(f"{where}.config: a function takes no config, got {', '.join(sorted(config))}")
            tool = FunctionTool(target, schema)
        else:
            raise ToolConfigError(
                f"{where}.class_name: {class_name!r} is not a subclass of tools.base.BaseTool, a verl-style "
                "tool class (async create and execute) or a function"
            )
        tool.check_arguments({})  # compiles the parameters schema: a bad one fails here
    except ToolConfigError:
        raise
    except Exception as exc:
        raise ToolConfigError(f"{where}: {class_name} could not be created: {_one_line(exc)}") from None
    return [tool]


def _built_tools(tools: Any, where: str, class_name: str) -> list[BaseTool]:
    """What a class's ``build_tools`` gave: a list of BaseTools, each parameters schema compiled."""
    if not isinstance(tools, list) or not all(isinstance(tool, BaseTool) for tool in tools):
        raise ToolConfigError(f"{where}: {class_name}.build_tools must return a list of tools.base.BaseTool")
    for tool in tools:
        tool.check_arguments({})  # compiles the parameters schema: a bad one fails here
    return tools


def _schema(raw: Any, where: str) -> dict[str, Any] | None:
    """The entry's OpenAI function schema (a mapping or a pydantic model such as verl's), checked."""
    try:
        schema = schema_dict(raw)
    except TypeError as exc:
        raise ToolConfigError(f"{where}: {exc}") from None
    if schema is None:
        return None
    if not (isinstance(schema, dict) and isinstance(schema.get("function"), dict)):
        raise ToolConfigError(f"{where}: expected an OpenAI function schema {{'type': 'function', ...}}")
    if not (isinstance(schema["function"].get("name"), str) and schema["function"]["name"]):
        raise ToolConfigError(f"{where}.function.name: expected the tool's name, a non-empty string")
    return schema


def close_tools(tools: dict[str, BaseTool]) -> None:
    """End what the tools started for the run: the Ray actors of ``executor: ray`` entries (killed)."""
    for tool in tools.values():
        close = getattr(tool, "close_executor", None)
        if callable(close):
            close()


def read_config_file(path: Path, what: str, error: type[ValueError] = ToolConfigError) -> Any:
    """A YAML (``.yaml``/``.yml``) or JSON config file's content; ``error`` names the file and what is wrong."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise error(f"{path}: cannot read {what}: {exc.strerror}") from None
    try:
        return orjson.loads(raw) if path.suffix == ".json" else yaml.safe_load(raw)
    except (orjson.JSONDecodeError, yaml.YAMLError) as exc:
        raise error(f"{path}: not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {_one_line(exc)}") from None


def load_tools(path: str | Path) -> dict[str, BaseTool]:
    """Read a YAML (``.yaml``/``.yml``) or JSON tool config and build its tools."""
    path = Path(path)
    data = read_config_file(path, "tool config")
    if not isinstance(data, dict) or not isinstance(data.get("tools"), list):
        raise ToolConfigError(f"{path}: expected a top-level 'tools:' list")
    return build_tools(data["tools"], str(path), path.parent)


def _one_line(exc: Exception) -> str:
    """A parse error on one line: PyYAML's messages span several, with a caret drawing."""
    mark = getattr(exc, "problem_mark", None)
    if isinstance(exc, yaml.MarkedYAMLError) and mark is not None:
        context = f" {exc.context}" if exc.context else ""
        return f"line {mark.line + 1}, column {mark.column + 1}: {exc.problem}{context}"
    return " ".join(str(exc).split())
