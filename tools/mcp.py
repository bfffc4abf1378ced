"""The tools of MCP servers as rallyrl tools: every tool a server lists becomes a ``BaseTool``
whose schema is the server's own (``inputSchema`` as the function's ``parameters``).

verl's tool config runs as it is (its MCP class is replaced by ``MCPTool``, its server file is
read as verl and Claude Desktop read it; a ``class_name`` that is not a subclass of ``MCPTool``
only earns a warning); the servers may also be given inline:

```yaml
tools:
  - class_name: verl.tools.mcp_search_tool.MCPSearchTool   # or tools.mcp:MCPTool, or a subclass
    config: {type: mcp, timeout: 30, rate_limit: 10}         # seconds per call; calls/s (optional)
    mcp:
      mcp_servers_config_path: ./mcp_server.json   # {"mcpServers": {name: {...}}}, relative to this file
      tool_selected_list: [word_count, sha256]     # optional: only these tools
  - class_name: tools.mcp:MCPTool
    mcp:
      servers:
        local: {command: python, args: [server.py], env: {KEY: value}, cwd: ., stderr: server.log}
        remote: {url: "http://127.0.0.1:8000/mcp", headers: {X-Team: rl}, auth_token: secret}
      tools: [calculator]
```

A server with ``command`` runs as a subprocess over stdio; one with ``url`` is reached over
streamable HTTP, or over SSE when ``transport: sse`` is set or the URL ends in ``/sse``. One
session per server is shared by every request and every tool of that server (``tools/mcp_client.py``);
each request gets its own instance (``create``/``release``), as with any rallyrl tool.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import orjson
import yaml
from mcp import types

from tools.base import BaseTool, ToolError, ToolResponse, function_schema
from tools.loading import ToolConfigError, import_class
from tools.mcp_client import MCPClient, MCPServer, TokenBucket, Transport, close_mcp_clients, mcp_client

__all__ = ["MCPTool", "build_mcp_tools", "close_mcp_clients"]

DEFAULT_TIMEOUT_S = 30.0
"""``config.timeout``: the limit of one call, in seconds (the rollout's ``tool_timeout_s`` applies too)."""
DEFAULT_CONNECT_TIMEOUT_S = 60.0
"""``config.connect_timeout``: the limit of starting a server and listing its tools (``npx`` may install first)."""
CONFIG_FIELDS = {"type", "timeout", "connect_timeout", "rate_limit"}
MCP_FIELDS = {"mcp_servers_config_path", "servers", "mcpServers", "tool_selected_list", "tools"}
SERVER_FIELDS = {"command", "args", "env", "cwd", "url", "headers", "auth_token", "transport", "type", "stderr",
                 "disabled", "description"}  # fmt: skip
TRANSPORTS: dict[str, Transport] = {"stdio": "stdio", "sse": "sse", "http": "streamable-http",
                                    "streamable-http": "streamable-http", "streamable_http": "streamable-http",
                                    "streamableHttp": "streamable-http"}  # fmt: skip


class MCPTool(BaseTool):
    """One tool of an MCP server. Built by ``build_mcp_tools`` (from a tool entry with ``mcp:``),
    never from a schema alone. Subclass it and override ``result_text`` to format results your way."""

    def __init__(
        self,
        config: dict[str, Any] | None = None,
        schema: dict[str, Any] | None = None,
        *,
        client: MCPClient | None = None,
        limiter: TokenBucket | None = None,
    ):
        if client is None or schema is None:
            raise ValueError(
                "tools.mcp:MCPTool takes its tools from an MCP server: give the tool entry an 'mcp:' mapping "
                "with 'mcp_servers_config_path' or 'servers'"
            )
        super().__init__(config, schema)
        self.client = client
        self.limiter = limiter
        self.timeout_s = float(self.config.get("timeout", DEFAULT_TIMEOUT_S))

    @property
    def live_instances(self) -> int:
        """How many per-request instances are created and not yet released."""
        return len(self._instances)

    async def execute(self, instance_id: str, parameters: dict[str, Any], **execute_kwargs: Any) -> ToolResponse:
        self.instance(instance_id)
        result = await self.client.call_tool(self.name, parameters, self.timeout_s, self.limiter)
        text = self.result_text(result)
        if result.isError:
            raise ToolError(text or f"MCP tool {self.name} reported an error")
        return ToolResponse(text=text)

    def result_text(self, result: types.CallToolResult) -> str:
        """The text parts joined by newlines; other parts as a short note; the structured result
        (as JSON) when there is no content."""
        parts = [_part_text(part) for part in result.content]
        if not parts and result.structuredContent is not None:
            return orjson.dumps(result.structuredContent).decode()
        return "\n".join(parts)


def _part_text(part: Any) -> str:
    if isinstance(part, types.TextContent):
        return part.text
    if isinstance(part, types.ImageContent | types.AudioContent):
        return f"[{part.type} omitted: {part.mimeType}, not shown to a text model]"
    if isinstance(part, types.EmbeddedResource):
        if isinstance(part.resource, types.TextResourceContents):
            return part.resource.text
        return f"[binary resource omitted: {part.resource.uri}]"
    if isinstance(part, types.ResourceLink):
        return f"[resource: {part.uri}]"
    return f"[{getattr(part, 'type', type(part).__name__)} content omitted]"


def build_mcp_tools(entry: dict[str, Any], where: str, source_dir: Path) -> list[BaseTool]:
    """The tools of one ``mcp:`` tool entry; ``where`` names the entry in errors, ``source_dir``
    anchors its relative paths. Connects to every server (blocking) to list its tools."""
    source_dir = Path(source_dir)
    unknown = set(entry) - {"class_name", "config", "mcp"}
    if unknown:
        raise ToolConfigError(f"{where}: unknown field(s) {', '.join(sorted(unknown))} in an MCP tool entry")
    cls = _tool_class(entry.get("class_name"), where, source_dir)
    config = _mapping(entry.get("config") or {}, f"{where}.config")
    _no_unknown(config, CONFIG_FIELDS, f"{where}.config")
    if config.get("type", "mcp") != "mcp":
        raise ToolConfigError(f"{where}.config.type: an entry with 'mcp:' has type 'mcp', not {config['type']!r}")
    timeout_s = _positive(config.get("timeout", DEFAULT_TIMEOUT_S), f"{where}.config.timeout")
    connect_timeout_s = _positive(config.get("connect_timeout", DEFAULT_CONNECT_TIMEOUT_S),
                                  f"{where}.config.connect_timeout")  # fmt: skip
    rate = config.get("rate_limit")
    limiter = TokenBucket(_positive(rate, f"{where}.config.rate_limit")) if rate is not None else None
    if "mcp" not in entry:
        raise ToolConfigError(
            f"{where}: an MCP tool entry needs an 'mcp:' mapping with 'mcp_servers_config_path' or 'servers'"
        )
    servers = _servers(_mapping(entry["mcp"], f"{where}.mcp"), f"{where}.mcp", source_dir)
    selected = _selected(entry["mcp"], f"{where}.mcp")

    tools: list[BaseTool] = []
    owners: dict[str, str] = {}
    for server in servers:
        client = mcp_client(server, connect_timeout_s, timeout_s)
        try:
            listed = client.list_tools()
        except ToolError as exc:
            raise ToolConfigError(f"{where}.mcp: cannot list the tools of MCP server {server.name!r}: {exc}") from None
        for tool in listed:
            if selected is not None and tool.name not in selected:
                continue
            if tool.name in owners:
                raise ToolConfigError(
                    f"{where}.mcp: MCP servers {owners[tool.name]!r} and {server.name!r} both have a tool "
                    f"{tool.name!r}; keep one with 'tool_selected_list' or split the servers into two entries"
                )
            owners[tool.name] = server.name
            schema = function_schema(tool.name, tool.description or tool.title or "", tool.inputSchema)
            tools.append(cls({**config, "timeout": timeout_s}, schema, client=client, limiter=limiter))
    missing = sorted(set(selected or ()) - set(owners))
    if missing:
        raise ToolConfigError(
            f"{where}.mcp.tool_selected_list: no MCP server has tool(s) {', '.join(missing)} "
            f"(servers: {', '.join(s.name for s in servers)})"
        )
    return tools


def _tool_class(class_name: Any, where: str, source_dir: Path) -> type[MCPTool]:
    """A user's subclass of ``MCPTool`` by its import path; ``MCPTool`` itself for any other class
    (verl's MCP classes need verl's own MCP client, so ours stands in for them)."""
    if class_name is None or class_name in ("tools.mcp:MCPTool", "tools.mcp.MCPTool"):
        return MCPTool
    if not isinstance(class_name, str):
        raise ToolConfigError(f"{where}.class_name: expected an import path like 'tools.mcp:MCPTool'")
    if class_name.startswith("verl."):
        return MCPTool
    try:
        cls = import_class(class_name, (Path.cwd(), source_dir))
    except Exception as exc:
        cls, why = None, f"it cannot be imported ({type(exc).__name__}: {exc})"
    else:
        why = "it is not a subclass of tools.mcp.MCPTool"
    if isinstance(cls, type) and issubclass(cls, MCPTool):
        return cls
    warnings.warn(f"{where}.class_name: {class_name!r} is not used, {why}; tools.mcp:MCPTool runs its MCP tools",
                  stacklevel=3)  # fmt: skip
    return MCPTool


def _servers(block: dict[str, Any], where: str, source_dir: Path) -> list[MCPServer]:
    _no_unknown(block, MCP_FIELDS, where)
    inline = [key for key in ("servers", "mcpServers") if key in block]
    if len(inline) + ("mcp_servers_config_path" in block) != 1:
        raise ToolConfigError(f"{where}: give exactly one of 'mcp_servers_config_path', 'servers' (or 'mcpServers')")
    if inline:
        specs, base, where = block[inline[0]], source_dir, f"{where}.{inline[0]}"
    else:
        path = _config_file(block["mcp_servers_config_path"], f"{where}.mcp_servers_config_path", source_dir)
        specs, base, where = _read_servers_file(path), path.parent, f"{path}: mcpServers"
    specs = _mapping(specs, where)
    servers = [
        _server(str(name), _mapping(spec, f"{where}.{name}"), f"{where}.{name}", base)
        for name, spec in specs.items()
        if not (isinstance(spec, dict) and spec.get("disabled") is True)
    ]
    if not servers:
        raise ToolConfigError(f"{where}: no MCP servers")
    return servers


def _config_file(value: Any, where: str, source_dir: Path) -> Path:
    """The servers file: relative to the tool config's directory, else (as verl reads it) to the working directory."""
    if not isinstance(value, str) or not value:
        raise ToolConfigError(f"{where}: expected the path of a JSON file with 'mcpServers'")
    path = Path(value).expanduser()
    if path.is_absolute():
        return path
    for candidate in (source_dir / path, Path.cwd() / path):
        if candidate.is_file():
            return candidate
    raise ToolConfigError(
        f"{where}: no file {value!r} next to the tool config ({source_dir}) or in the working directory"
    )


def _read_servers_file(path: Path) -> Any:
    try:
        raw = path.read_bytes()
        data = yaml.safe_load(raw) if path.suffix in (".yaml", ".yml") else orjson.loads(raw)
    except OSError as exc:
        raise ToolConfigError(f"{path}: cannot read the MCP servers file: {exc.strerror}") from None
    except (orjson.JSONDecodeError, yaml.YAMLError) as exc:
        raise ToolConfigError(
            f"{path}: not valid {'YAML' if path.suffix in ('.yaml', '.yml') else 'JSON'}: {exc}"
        ) from None
    if not isinstance(data, dict) or "mcpServers" not in data:
        raise ToolConfigError(f"{path}: expected a top-level 'mcpServers' mapping of server names to servers")
    return data["mcpServers"]


def _server(name: str, spec: dict[str, Any], where: str, base: Path) -> MCPServer:
    _no_unknown(spec, SERVER_FIELDS, where)
    if ("command" in spec) == ("url" in spec):
        raise ToolConfigError(f"{where}: give 'command' (a stdio server) or 'url' (an HTTP server), exactly one")
    kind = spec.get("transport", spec.get("type"))
    if kind is not None and kind not in TRANSPORTS:
        raise ToolConfigError(f"{where}.transport: {kind!r} is not one of {', '.join(TRANSPORTS)}")
    stderr = spec.get("stderr")
    if stderr is not None:
        stderr = str(base / _string(stderr, f"{where}.stderr"))
    if "command" in spec:
        if kind not in (None, "stdio"):
            raise ToolConfigError(f"{where}.transport: a server with 'command' runs over stdio, not {kind!r}")
        args = spec.get("args", [])
        if not isinstance(args, list) or not all(isinstance(a, str | int | float) for a in args):
            raise ToolConfigError(f"{where}.args: expected a list of strings")
        env = spec.get("env")
        cwd = spec.get("cwd")
        return MCPServer(
            name,
            "stdio",
            command=_string(spec["command"], f"{where}.command"),
            args=tuple(str(a) for a in args),
            env=None if env is None else tuple(sorted(_string_map(env, f"{where}.env").items())),
            cwd=None if cwd is None else str(base / _string(cwd, f"{where}.cwd")),
            stderr=stderr,
        )
    url = _string(spec["url"], f"{where}.url")
    if not url.startswith(("http://", "https://")):
        raise ToolConfigError(f"{where}.url: expected an http:// or https:// URL, got {url!r}")
    headers = _string_map(spec.get("headers") or {}, f"{where}.headers")
    if "auth_token" in spec:
        headers["Authorization"] = f"Bearer {_string(spec['auth_token'], f'{where}.auth_token')}"
    transport = (
        TRANSPORTS[kind] if kind is not None else "sse" if url.rstrip("/").endswith("/sse") else "streamable-http"
    )
    if transport == "stdio":
        raise ToolConfigError(f"{where}.transport: a server with 'url' is reached over HTTP, not stdio")
    if stderr is not None:
        raise ToolConfigError(f"{where}.stderr: only a stdio server (with 'command') has a stderr to keep")
    return MCPServer(name, transport, url=url, headers=tuple(sorted(headers.items())))


def _selected(block: dict[str, Any], where: str) -> set[str] | None:
    if "tool_selected_list" in block and "tools" in block:
        raise ToolConfigError(f"{where}: give 'tool_selected_list' or 'tools', not both")
    key = "tool_selected_list" if "tool_selected_list" in block else "tools"
    names = block.get(key)
    if names is None:
        return None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ToolConfigError(f"{where}.{key}: expected a list of tool names")
    return set(names)


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ToolConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
    return value


def _no_unknown(mapping: dict[str, Any], known: set[str], where: str) -> None:
    unknown = set(mapping) - known
    if unknown:
        raise ToolConfigError(
            f"{where}: unknown field(s) {', '.join(sorted(map(str, unknown)))}; known: {', '.join(sorted(known))}"
        )


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise ToolConfigError(f"{where}: expected a non-empty string")
    return value


def _string_map(value: Any, where: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(v, str | int | float | bool) for v in value.values()):
        raise ToolConfigError(f"{where}: expected a mapping of names to strings")
    return {str(k): str(v) for k, v in value.items()}


def _positive(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ToolConfigError(f"{where}: expected a positive number, got {value!r}")
    return float(value)
