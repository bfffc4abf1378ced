"""MCP servers' tools as rallyrl tools, against a real FastMCP server (tests/fixtures/mcp_server.py)
run as a subprocess over stdio and over streamable HTTP on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from conftest import ScriptedEngine, call, run_cli

from rollout.config import RolloutConfig
from rollout.loop import run_request
from rollout.request import AsyncRolloutRequest, FinishReason, validate_trajectory
from rollout.tokens import ChatTokenizer
from tools.base import BaseTool, ToolError
from tools.calculator import CalculatorTool
from tools.mcp import MCPTool, build_mcp_tools, close_mcp_clients
from tools.registry import ToolConfigError, load_tools

SERVER_SCRIPT = Path(__file__).parent / "fixtures" / "mcp_server.py"
FIXTURE_TOOLS = {"word_count", "sha256", "factorize", "calculator", "slow_echo", "failing", "server_info", "logo"}
PROMPT = [{"role": "user", "content": "Use the tools."}]


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    """Every test starts without MCP sessions and leaves none (stdio servers exit)."""
    yield
    close_mcp_clients()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class HttpServer:
    """The fixture server over streamable HTTP on 127.0.0.1:``port``, in a subprocess."""

    def __init__(self, log_path: Path, flag: str = "--http"):
        self.port, self.flag, self.log_path = free_port(), flag, log_path
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/{'sse' if self.flag == '--sse' else 'mcp'}"

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, str(SERVER_SCRIPT), self.flag, "--port", str(self.port)], stdout=log, stderr=log
            )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"the MCP server exited: {self.log_path.read_text()}"
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return
            time.sleep(0.05)
        raise AssertionError(f"the MCP server did not listen on port {self.port} within 30 s")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()


@pytest.fixture
def http_server(tmp_path) -> Iterator[HttpServer]:
    server = HttpServer(tmp_path / "mcp-http.log")
    server.start()
    yield server
    server.kill()


def stdio_spec() -> dict[str, Any]:
    return {"command": sys.executable, "args": [str(SERVER_SCRIPT)]}


def build(spec: dict[str, Any], **config: Any) -> dict[str, MCPTool]:
    entry = {"class_name": "tools.mcp:MCPTool", "config": config, "mcp": {"servers": {"fixture": spec}}}
    tools = build_mcp_tools(entry, "test.yaml: tools[0]", Path.cwd())
    assert all(isinstance(tool, MCPTool) for tool in tools)
    return {tool.name: tool for tool in tools}  # type: ignore[misc]


@pytest.fixture(params=["stdio", "http"])
def transport_tools(request, tmp_path) -> Iterator[tuple[dict[str, MCPTool], HttpServer | None]]:
    """The fixture server's tools over each transport (with the HTTP server, when there is one)."""
    if request.param == "stdio":
        yield build(stdio_spec(), timeout=10), None
        return
    server = HttpServer(tmp_path / "mcp-http.log")
    server.start()
    try:
        yield build({"url": server.url}, timeout=10), server
    finally:
        server.kill()


async def run_tool(tool: BaseTool, **arguments: Any) -> str:
    """One create / execute / release, as a request does it; a ToolError comes back as its text."""
    instance_id = await tool.create()
    try:
        return (await tool.execute(instance_id, arguments)).text
    except ToolError as exc:
        return f"Error: {exc}"
    finally:
        await tool.release(instance_id)


async def server_info(tools: dict[str, MCPTool]) -> dict[str, int]:
    return orjson.loads(await run_tool(tools["server_info"]))


async def drive(tools: dict[str, Any], calls: str, config: RolloutConfig, rid: str = "r0") -> AsyncRolloutRequest:
    """One request through the real rollout loop: the scripted model writes ``calls``, then answers."""
    chat = ChatTokenizer(_tokenizer(), [tool.schema for tool in tools.values()])
    engine = ScriptedEngine(chat, lambda turn, prompt, r: calls if turn == 0 else "done")
    request = AsyncRolloutRequest(rid, 0, 0, [dict(m) for m in PROMPT])
    return await run_request(request, engine, chat, tools, config)


def rollout_config(**fields: Any) -> RolloutConfig:
    """Room for the prompt: the eight tools' schemas take ~4,500 characters (tokens, for the char tokenizer)."""
    return RolloutConfig(max_model_len=16384, **fields)


def _tokenizer() -> Any:
    from data.tiny_model import build_char_tokenizer

    return build_char_tokenizer()


def tool_texts(request: AsyncRolloutRequest) -> list[str]:
    return [m["content"] for m in request.messages if m["role"] == "tool"]


# ----- listing and schemas -------------------------------------------------------------------


def test_every_server_tool_becomes_a_tool_with_the_servers_input_schema():
    tools = build(stdio_spec())
    assert set(tools) == FIXTURE_TOOLS
    factorize = tools["factorize"].schema
    assert factorize["type"] == "function"
    assert factorize["function"]["name"] == "factorize"
    assert factorize["function"]["description"].startswith("The prime factors of an integer")
    parameters = factorize["function"]["parameters"]
    assert parameters["type"] == "object" and parameters["required"] == ["n"]
    assert parameters["properties"]["n"]["type"] == "integer"
    assert tools["factorize"].check_arguments({"n": "twelve"}) == "n: 'twelve' is not of type 'integer'"
    assert tools["factorize"].check_arguments({"n": 12}) is None


def test_tool_selected_list_keeps_only_the_named_tools():
    entry = {"mcp": {"servers": {"fixture": stdio_spec()}, "tool_selected_list": ["sha256", "word_count"]}}
    assert sorted(tool.name for tool in build_mcp_tools(entry, "t.yaml: tools[0]", Path.cwd())) == [
        "sha256",
        "word_count",
    ]


# ----- calls ---------------------------------------------------------------------------------


async def test_calls_do_real_work_on_the_server(transport_tools):
    tools, _ = transport_tools
    text = "the quick brown fox jumps over the lazy dog"
    assert await run_tool(tools["word_count"], text=text) == "9"
    assert await run_tool(tools["sha256"], text=text) == hashlib.sha256(text.encode()).hexdigest()
    assert await run_tool(tools["factorize"], n=360) == "\n".join(["2", "2", "2", "3", "3", "5"])
    assert await run_tool(tools["calculator"], expression="(17 + 4) * 3") == "63"


async def test_sse_transport_lists_and_calls(tmp_path):
    server = HttpServer(tmp_path / "mcp-sse.log", flag="--sse")
    server.start()
    try:
        tools = build({"url": server.url}, timeout=10)  # a URL ending in /sse is an SSE server
        assert set(tools) == FIXTURE_TOOLS
        assert await run_tool(tools["factorize"], n=97) == "97"
    finally:
        server.kill()


async def test_concurrent_calls_of_many_requests_share_one_session(transport_tools):
    tools, _ = transport_tools
    words = [" ".join(["w"] * n) for n in range(1, 25)]
    results = await asyncio.gather(*(run_tool(tools["word_count"], text=w) for w in words),
                                   *(run_tool(tools["sha256"], text=w) for w in words))  # fmt: skip
    assert results[:24] == [str(n) for n in range(1, 25)]
    assert results[24:] == [hashlib.sha256(w.encode()).hexdigest() for w in words]
    info = await server_info(tools)
    assert info["sessions"] == 1  # the server saw one client session for all 49 calls
    assert {tool.client for tool in tools.values()} == {tools["word_count"].client}
    assert tools["word_count"].client.connections == 1
    assert all(tool.live_instances == 0 for tool in tools.values())


async def test_image_content_becomes_a_short_note_next_to_the_text():
    tools = build(stdio_spec())
    assert await run_tool(tools["logo"]) == "a 1x1 logo\n[image omitted: image/png, not shown to a text model]"


async def test_failing_tool_is_an_error_text_for_the_model():
    tools = build(stdio_spec(), timeout=10)
    request = await drive(tools, call("failing", message="boom"), rollout_config(tool_timeout_s=10))
    assert tool_texts(request) == ["Error: Error executing tool failing: failing tool: boom"]
    assert request.tool_calls[0].error == "Error executing tool failing: failing tool: boom"
    assert request.finish_reason is FinishReason.STOP
    assert all(tool.live_instances == 0 for tool in tools.values())


async def test_slow_tool_hits_the_timeout_with_an_error_text_and_the_session_goes_on():
    tools = build(stdio_spec(), timeout=1)
    started = time.monotonic()
    request = await drive(tools, call("slow_echo", text="hi", seconds=30), rollout_config(tool_timeout_s=30))
    assert time.monotonic() - started < 10
    assert tool_texts(request) == ["Error: MCP tool slow_echo on server 'fixture' timed out after 1 s"]
    assert request.finish_reason is FinishReason.STOP
    assert await run_tool(tools["word_count"], text="still here") == "2"
    assert tools["word_count"].client.connections == 1  # a timeout is not a lost connection


async def test_cancelled_request_cancels_its_call_releases_and_leaves_the_session_usable():
    tools = build(stdio_spec(), timeout=30)
    request = asyncio.create_task(drive(tools, call("slow_echo", text="hi", seconds=30), rollout_config()))
    await asyncio.sleep(1.0)  # the call is in flight
    started = time.monotonic()
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request
    assert time.monotonic() - started < 2
    assert all(tool.live_instances == 0 for tool in tools.values())
    assert await run_tool(tools["word_count"], text="a b") == "2"
    assert tools["word_count"].client.connections == 1


async def test_rate_limit_spaces_calls_out():
    tools = build(stdio_spec(), timeout=10, rate_limit=5)
    started = time.monotonic()
    assert await asyncio.gather(*(run_tool(tools["word_count"], text="a b") for _ in range(10))) == ["2"] * 10
    assert time.monotonic() - started >= 0.9  # 5 at once, then one every 0.2 s


# ----- the server dies mid-rollout ----------------------------------------------------------


async def test_server_killed_mid_rollout_fails_the_calls_in_flight_and_reconnects(transport_tools):
    tools, http = transport_tools
    config = rollout_config(tool_timeout_s=30, tool_reward_timeout_s=5)
    pid = (await server_info(tools))["pid"]
    slow = call("slow_echo", text="never", seconds=20)
    requests = [asyncio.create_task(drive(tools, slow, config, rid=f"r{i}")) for i in range(6)]
    await asyncio.sleep(1.0)  # the six calls are in flight on the server
    os.kill(pid, signal.SIGKILL)
    async with asyncio.timeout(10):  # nothing hangs: the loss is seen at once, not at the 20 s timeout
        done = await asyncio.gather(*requests)
    for request in done:
        assert request.finish_reason is FinishReason.STOP
        [text] = tool_texts(request)
        assert text.startswith("Error: MCP tool slow_echo on server 'fixture': connection lost"), text
        validate_trajectory(orjson.loads(orjson.dumps(request.to_record())))
    assert all(tool.live_instances == 0 for tool in tools.values())

    if http is not None:  # down: a call is refused quickly with the reason, not left waiting
        http.process.wait()  # type: ignore[union-attr]
        started = time.monotonic()
        down = await run_tool(tools["word_count"], text="a b c")
        assert down.startswith("Error: cannot connect to MCP server 'fixture'") and "ConnectError" in down, down
        assert time.monotonic() - started < 5
        http.start()  # back on the same port
    request = await drive(tools, call("word_count", text="back in business"), config)
    assert tool_texts(request) == ["3"]  # reconnected (stdio: a new server process was started)
    info = await server_info(tools)
    assert info["pid"] != pid and info["sessions"] == 1
    assert tools["word_count"].client.connections == 2
    assert all(tool.live_instances == 0 for tool in tools.values())


async def test_unreachable_server_is_a_config_error_naming_the_server():
    entry = {
        "config": {"connect_timeout": 5},
        "mcp": {"servers": {"gone": {"url": f"http://127.0.0.1:{free_port()}/mcp"}}},
    }
    with pytest.raises(ToolConfigError, match=r"t.yaml: tools\[0\].mcp: cannot list the tools of MCP server 'gone'"):
        build_mcp_tools(entry, "t.yaml: tools[0]", Path.cwd())


async def test_closing_the_clients_ends_the_stdio_server_and_later_calls_fail():
    tools = build(stdio_spec())
    pid = (await server_info(tools))["pid"]
    close_mcp_clients()
    assert not _alive(pid)
    assert await run_tool(tools["word_count"], text="a") == "Error: MCP server " + (
        f"'fixture' ({sys.executable} {SERVER_SCRIPT}): the client is closed"
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):  # a zombie is not alive
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    return True


# ----- config files --------------------------------------------------------------------------


VERL_YAML = """
tools:
  - class_name: verl.tools.mcp_search_tool.MCPSearchTool
    config:
      rate_limit: 120
      timeout: 30
      type: mcp
    mcp:
      mcp_servers_config_path: ./mcp_server.json
      tool_selected_list:
        - word_count
        - slow_echo
"""


def write_verl_config(tmp_path: Path) -> Path:
    (tmp_path / "mcp_server.json").write_bytes(orjson.dumps({"mcpServers": {"fixture": stdio_spec()}}))
    path = tmp_path / "tools.yaml"
    path.write_text(VERL_YAML)
    return path


async def test_verl_mcp_tool_config_loads_through_the_registry(tmp_path, monkeypatch):
    path = write_verl_config(tmp_path)
    monkeypatch.chdir("/")  # the servers file is found next to the YAML, wherever the command runs
    tools = load_tools(path)
    assert sorted(tools) == ["slow_echo", "word_count"]
    assert all(isinstance(tool, MCPTool) and tool.timeout_s == 30 for tool in tools.values())
    assert await run_tool(tools["word_count"], text="one two") == "2"


@pytest.mark.parametrize(
    ("mcp", "message"),
    [
        ({"servers": {"s": {"command": "x", "url": "http://h/mcp"}}}, "tools[0].mcp.servers.s: give 'command'"),
        ({"servers": {"s": {"comand": "x"}}}, "tools[0].mcp.servers.s: unknown field(s) comand"),
        ({"servers": {"s": {"url": "ftp://h"}}}, "tools[0].mcp.servers.s.url: expected an http:// or https:// URL"),
        ({"servers": {"s": {"url": "http://h/mcp", "transport": "grpc"}}}, "tools[0].mcp.servers.s.transport: 'grpc'"),
        ({"servers": {"s": {"command": "x", "args": "a b"}}}, "tools[0].mcp.servers.s.args: expected a list"),
        ({"mcp_servers_config_path": "missing.json"}, "tools[0].mcp.mcp_servers_config_path: no file 'missing.json'"),
        ({}, "tools[0].mcp: give exactly one of 'mcp_servers_config_path', 'servers'"),
        ({"servers": {"s": stdio_spec()}, "tools": ["nope"]}, "tools[0].mcp.tool_selected_list: no MCP server has "),
    ],
)
def test_bad_mcp_config_is_an_error_naming_the_entry_and_field(mcp, message):
    with pytest.raises(ToolConfigError) as raised:
        build_mcp_tools({"mcp": mcp}, "t.yaml: tools[0]", Path.cwd())
    assert message in str(raised.value)


def test_mcp_tool_without_an_mcp_block_says_what_it_needs():
    with pytest.raises(ToolConfigError, match="needs an 'mcp:' mapping"):
        build_mcp_tools({"class_name": "tools.mcp:MCPTool", "config": {"type": "mcp"}}, "t.yaml: tools[0]", Path("."))
    with pytest.raises(ValueError, match="takes its tools from an MCP server"):
        MCPTool(config={}, schema=None)


def test_a_class_that_is_not_an_mcp_tool_is_replaced_by_mcp_tool_with_a_warning():
    entry = {
        "class_name": "tools.calculator:CalculatorTool",
        "mcp": {"servers": {"s": stdio_spec()}, "tools": ["sha256"]},
    }
    with pytest.warns(UserWarning, match=r"tools\[0\]\.class_name: 'tools\.calculator:CalculatorTool' is not used"):
        [tool] = build_mcp_tools(entry, "t.yaml: tools[0]", Path("."))
    assert type(tool) is MCPTool


class UpperMCPTool(MCPTool):
    """A user's subclass: formats results its own way."""

    def result_text(self, result: Any) -> str:
        return super().result_text(result).upper()


async def test_a_subclass_of_mcp_tool_is_used_by_its_import_path():
    entry = {"class_name": f"{__name__}:UpperMCPTool", "mcp": {"servers": {"s": stdio_spec()}, "tools": ["sha256"]}}
    [tool] = build_mcp_tools(entry, "t.yaml: tools[0]", Path("."))
    assert type(tool).__name__ == "UpperMCPTool"
    assert await run_tool(tool, text="x") == hashlib.sha256(b"x").hexdigest().upper()


# ----- the command line ----------------------------------------------------------------------


@pytest.mark.slow
def test_cli_rollout_calls_the_mcp_servers_calculator_and_leaves_no_server_behind(tmp_path):
    marker = f"mcp-e2e-{os.getpid()}-{time.monotonic_ns()}"
    servers = {"mcpServers": {"calc": {**stdio_spec(), "env": {"RALLYRL_TEST_MARKER": marker}}}}
    (tmp_path / "servers.json").write_bytes(orjson.dumps(servers))
    tools_yaml = tmp_path / "tools.yaml"
    tools_yaml.write_text(yaml.safe_dump({"tools": [{
        "class_name": "tools.mcp:MCPTool", "config": {"type": "mcp", "timeout": 20},
        "mcp": {"mcp_servers_config_path": "servers.json", "tool_selected_list": ["calculator"]},
    }]}))  # fmt: skip
    out = tmp_path / "out.jsonl"
    done = run_cli("rollout", "--tools", str(tools_yaml), "--num-prompts", "8", "--out", str(out), "--no-progress")
    assert done.returncode == 0, done.stderr
    trajectories = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert len(trajectories) == 8
    calls = [c for t in trajectories for c in t["tool_calls"]]
    assert calls, "the embedded model made no tool call"
    answered = [c for c in calls if c["error"] is None]
    assert answered and all(c["name"] == "calculator" for c in answered)
    for c in answered:  # the server's answers are the arithmetic of the model's expressions
        assert float(c["text"]) == pytest.approx(float(Fraction(exact(c["arguments"]["expression"]))), rel=1e-5)
    leftover = subprocess.run(["pgrep", "-f", "mcp_server.py"], capture_output=True, text=True).stdout.split()
    assert not [pid for pid in leftover if marker in _environ(int(pid))]


def exact(expression: str) -> str:
    """rallyrl's own calculator's answer (an independent implementation)."""
    tool = CalculatorTool()
    return asyncio.run(tool.execute(asyncio.run(tool.create()), {"expression": expression})).text


def _environ(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    except OSError:
        return ""
