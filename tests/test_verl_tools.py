"""verl users' tools run unchanged: verl-style classes (0.9 and older), plain functions, verl's YAML.

The classes are written as verl users write them but without importing verl
(``tests/fixtures/verl_style_tools.py``); ``tests/real_engines/test_verl.py`` runs the real verl.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
from pathlib import Path

import orjson
import pytest
from conftest import CountingTool, ScriptedEngine, call, run_cli
from fixtures import verl_style_tools as user
from fixtures.verl_style_tools import CALCULATOR_SCHEMA, ToolResponse

from rollout.loop import RolloutConfig, run_request
from rollout.request import AsyncRolloutRequest, FinishReason
from rollout.tokens import ChatTokenizer
from tools import base
from tools.calculator import CalculatorTool
from tools.function_tool import FunctionTool
from tools.registry import ToolConfigError, build_tools, load_tools
from tools.verl_compat import OpenAIFunctionToolSchema, VerlTool, read_response

FIXTURES = "fixtures.verl_style_tools"

VERL_YAML = f"""
tools:
  - class_name: {FIXTURES}.Calculator09
    config:
      type: native
    tool_schema:
      type: function
      function:
        name: calculator
        description: "Exact arithmetic: + - * / // % ** and parentheses."
        parameters:
          type: object
          properties:
            expression:
              type: string
          required: ["expression"]
"""


def schema(name: str, **properties: str) -> dict:
    """An OpenAI function schema whose parameters are all required, of the given JSON types."""
    parameters = {"type": "object", "properties": {k: {"type": t} for k, t in properties.items()}}
    return {"type": "function", "function": {"name": name, "description": name, "parameters": {
        **parameters, "required": list(properties)}}}  # fmt: skip


def one(entry: dict):
    """The one tool an entry builds."""
    (tool,) = build_tools([entry]).values()
    return tool


async def run_one(tool, turns: list[str], tokenizer, tools_kwargs: dict | None = None) -> AsyncRolloutRequest:
    """One request through the real rollout loop, the model's turns scripted."""
    chat = ChatTokenizer(tokenizer, [tool.schema])
    engine = ScriptedEngine(chat, lambda i, prompt, rid: turns[min(i, len(turns) - 1)])
    request = AsyncRolloutRequest("r0", 0, 0, [{"role": "user", "content": "go"}], tools_kwargs=tools_kwargs or {})
    await run_request(request, engine, chat, {tool.name: tool}, RolloutConfig())
    return request


# --- verl tool classes ---------------------------------------------------------------------------


async def test_a_verl_09_class_loads_from_verls_yaml_with_a_pydantic_schema(tmp_path):
    path = tmp_path / "tool_config.yaml"
    path.write_text(VERL_YAML)
    tool = load_tools(path)["calculator"]
    assert isinstance(tool, VerlTool) and isinstance(tool.tool, user.Calculator09)
    assert tool.tool.tool_schema.function.name == "calculator"  # verl's attribute access
    assert orjson.loads(tool.tool.schema_json) == CALCULATOR_SCHEMA  # its model_dump(exclude_unset, exclude_none)
    assert tool.schema == CALCULATOR_SCHEMA and tool.tool.config == {"type": "native"}


async def test_a_verl_09_class_runs_its_lifecycle_with_tuples_unwrapped(tokenizer):
    tool = one({"class_name": f"{FIXTURES}.Calculator09", "tool_schema": CALCULATOR_SCHEMA})
    request = await run_one(tool, [call("calculator", expression="6*7"), "42"], tokenizer)
    assert request.finish_reason is FinishReason.STOP
    (record,) = request.tool_calls
    assert (record.text, record.reward, record.metrics, record.error) == ("42", 0.1, {"style": "verl-0.9"}, None)
    assert request.rewards.tools == {"calculator": 0.5}
    instance = request.tool_instance_ids["calculator"]
    assert tool.tool.events == [f"create {instance}", f"execute {instance}", f"release {instance}"]


async def test_an_older_verl_class_returning_an_id_and_text_tuples_runs(tokenizer):
    tool = one({"class_name": f"{FIXTURES}:CalculatorOld", "tool_schema": CALCULATOR_SCHEMA})
    request = await run_one(tool, [call("calculator", expression="2+3"), "5"], tokenizer)
    (record,) = request.tool_calls
    assert (record.text, record.reward, record.metrics) == ("5", 0.2, {"style": "verl-old"})
    assert request.rewards.tools == {"calculator": 1.0}
    assert tool.tool.released == [request.tool_instance_ids["calculator"]]


@pytest.mark.parametrize(
    ("result", "text", "reward", "metrics"),
    [
        ((ToolResponse(text="a"), 0.5, {"m": 1}), "a", 0.5, {"m": 1}),  # verl 0.9
        (("a", 0.5, {"m": 1}), "a", 0.5, {"m": 1}),  # older verl
        ((ToolResponse(text="a"), None, None), "a", 0.0, {}),
        ((ToolResponse(text=None), 1), "", 1.0, {}),
        (("a",), "a", 0.0, {}),
        (ToolResponse(text="a"), "a", 0.0, {}),
        ("a", "a", 0.0, {}),
        (base.ToolResponse("a", 0.25, {"m": 2}), "a", 0.25, {"m": 2}),  # ours
        ((base.ToolResponse("a"), 0.5), "a", 0.5, {}),
    ],
)
def test_every_execute_shape_verl_has_used_is_read(result, text, reward, metrics):
    assert read_response(result, "t") == base.ToolResponse(text, reward, metrics)


@pytest.mark.parametrize(
    ("result", "message"),
    [
        (("a", 0.0, {}, "extra"), "tuple of 4"),
        (("a", 0.0, ["m"]), "metrics of type list"),
        (42, "returned int"),
    ],
)
def test_a_result_of_no_known_shape_is_a_type_error_naming_it(result, message):
    with pytest.raises(TypeError, match=message):
        read_response(result, "t")


async def test_an_image_comes_back_to_the_model_as_an_error_not_a_crash(tokenizer):
    tool = one({"class_name": f"{FIXTURES}.Picture", "tool_schema": schema("picture")})
    request = await run_one(tool, [call("picture"), "ok"], tokenizer)
    assert request.finish_reason is FinishReason.STOP and request.error is None
    message = "tool picture returned an image; this rollout is text-only"
    assert request.tool_calls[0].error == message
    assert [m["content"] for m in request.messages if m["role"] == "tool"] == [f"Error: {message}"]


async def test_a_bare_tool_response_and_the_classes_own_schema_are_accepted(tokenizer):
    reverse = one({"class_name": f"{FIXTURES}.BareResponse", "tool_schema": schema("reverse", text="string")})
    assert (await reverse.execute(await reverse.create(), {"text": "abc"})).text == "cba"
    own = one({"class_name": f"{FIXTURES}.OwnSchema", "config": {"type": "native"}})
    assert own.schema == CALCULATOR_SCHEMA
    request = await run_one(own, [call("calculator", expression="9//2"), "4"], tokenizer)
    assert request.tool_calls[0].text == "4" and request.tool_calls[0].reward == 0.0


@pytest.mark.parametrize("class_name", ["AnswerChecker", "ZeroNineOnlyCreate"])
async def test_create_kwargs_reach_verl_tools_of_either_generation(tokenizer, class_name):
    """Older verl spread a record's create_kwargs into create; verl 0.9 passes create_kwargs=."""
    tool = one({"class_name": f"{FIXTURES}.{class_name}", "tool_schema": schema("check", answer="string")})
    tools_kwargs = {"check": {"create_kwargs": {"ground_truth": "4"}}}
    request = await run_one(tool, [call("check", answer="4"), "4"], tokenizer, tools_kwargs)
    if class_name == "AnswerChecker":
        assert request.tool_calls[0].text == "correct" and request.tool_calls[0].reward == 1.0
    else:
        assert tool.tool.seen == {"ground_truth": "4"}


def test_pydantic_schema_objects_are_accepted_for_verl_classes_and_ours():
    model = OpenAIFunctionToolSchema.model_validate(CALCULATOR_SCHEMA)
    verl_tool = one({"class_name": f"{FIXTURES}.Calculator09", "tool_schema": model})
    ours = one({"class_name": "tools.calculator:CalculatorTool", "schema": model})
    assert verl_tool.schema == ours.schema == CALCULATOR_SCHEMA
    assert isinstance(ours, CalculatorTool)


def test_a_schema_verl_would_refuse_is_a_config_error_naming_the_entry(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text(
        f"tools:\n  - class_name: {FIXTURES}.Calculator09\n"
        "    tool_schema: {type: function, function: {name: c, description: d,"
        " parameters: {type: object, properties: {x: {description: no type}}}}}\n"
    )
    with pytest.raises(ToolConfigError, match=r"tools\[0\]: .*Calculator09 could not be created: .*type"):
        load_tools(path)


# --- functions -----------------------------------------------------------------------------------


async def test_a_sync_function_is_a_tool_with_its_schema_from_hints_and_docstring(tokenizer):
    tool = one({"class_name": f"{FIXTURES}.calculator"})
    assert isinstance(tool, FunctionTool)
    assert tool.schema["function"]["name"] == "calculator"
    described = {"type": "string", "description": 'The arithmetic expression to evaluate, such as "12*(3+4)".'}
    assert tool.schema["function"]["parameters"] == {
        "type": "object", "properties": {"expression": described}, "required": ["expression"]
    }  # fmt: skip
    request = await run_one(tool, [call("calculator", expression="(1+2)*4"), "12"], tokenizer)
    assert request.tool_calls[0].text == "12" and request.tool_calls[0].error is None


async def test_a_sync_function_runs_off_the_event_loop(tmp_path, monkeypatch):
    (tmp_path / "verl_thread_tool.py").write_text(
        "import threading\n\n\ndef where() -> str:\n"
        '    """Name the thread this runs in."""\n    return threading.current_thread().name\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    tool = one({"class_name": "verl_thread_tool.where"})
    assert (await tool.execute("i", {})).text != threading.current_thread().name
    sys.modules.pop("verl_thread_tool", None)


async def test_an_async_function_returning_a_dict_gives_json_text():
    tool = one({"class_name": f"{FIXTURES}.lookup"})
    assert tool.schema["function"]["parameters"]["required"] == ["city"]
    response = await tool.execute("i", {"city": "Oslo", "metric": False})
    assert orjson.loads(response.text) == {"city": "Oslo", "temperature": 70}


async def test_a_function_returning_verls_triple_sets_the_step_reward():
    tool = one({"class_name": f"{FIXTURES}.graded"})
    assert await tool.execute("i", {"answer": 42}) == base.ToolResponse("right", 1.0, {"answer": 42})
    assert (await tool.execute("i", {"answer": 7})).reward == 0.0


async def test_a_function_takes_a_schema_from_the_config_instead():
    tool = one({"class_name": f"{FIXTURES}.no_docstring", "schema": schema("double", x="integer")})
    assert tool.name == "double" and (await tool.execute("i", {"x": 3})).text == "3"


@pytest.mark.parametrize(
    ("name", "message"),
    [("no_docstring", "has no docstring"), ("no_type_hint", "missing a type hint")],
)
def test_a_function_without_docstring_or_hints_is_a_config_error_naming_the_entry(tmp_path, name, message):
    path = tmp_path / "tools.yaml"
    path.write_text(f"tools:\n  - class_name: {FIXTURES}.calculator\n  - class_name: {FIXTURES}.{name}\n")
    with pytest.raises(ToolConfigError) as info:
        load_tools(path)
    text = str(info.value)
    assert text.startswith(f"{path}: tools[1]: {FIXTURES}.{name} could not be created: ")
    assert "Google-style docstring" in text and message in text and "\n" not in text


def test_a_function_with_config_is_refused():
    with pytest.raises(ToolConfigError, match=r"tools\[0\].config: a function takes no config, got colour"):
        build_tools([{"class_name": f"{FIXTURES}.calculator", "config": {"type": "native", "colour": "red"}}])


def test_something_that_is_no_tool_says_what_a_tool_may_be():
    with pytest.raises(ToolConfigError, match=r"not a subclass of tools\.base\.BaseTool, a verl-style tool class"):
        build_tools([{"class_name": f"{FIXTURES}.CALCULATOR_SCHEMA"}])


# --- the registry: MCP entries, relative modules ---------------------------------------------------


@pytest.mark.parametrize(
    "entry",
    [
        {"class_name": "verl.tools.mcp_search_tool.MCPSearchTool", "config": {"type": "mcp"},
         "mcp": {"mcp_servers_config_path": "./servers.json", "tool_selected_list": ["echo"]}},
        {"class_name": "tools.mcp:MCPTool", "config": {"command": "my-server"}},
    ],
)  # fmt: skip
def test_mcp_entries_are_handed_to_tools_mcp_with_the_config_files_folder(tmp_path, monkeypatch, entry):
    seen = []

    def build_mcp_tools(entry, where, source_dir):
        seen.append((entry, where, source_dir))
        return [CountingTool()]

    monkeypatch.setitem(sys.modules, "tools.mcp", type(sys)("tools.mcp"))
    monkeypatch.setattr(sys.modules["tools.mcp"], "build_mcp_tools", build_mcp_tools, raising=False)
    path = tmp_path / "tools.json"
    path.write_bytes(orjson.dumps({"tools": [entry]}))
    assert list(load_tools(path)) == ["echo"]
    assert seen == [(entry, f"{path}: tools[0]", tmp_path)]


def test_a_class_name_that_is_no_string_is_still_a_config_error():
    with pytest.raises(ToolConfigError, match=r"tools\[0\].class_name: expected an import path"):
        build_tools([{"class_name": ["tools.mcp:MCPTool"]}])


def test_a_user_module_beside_the_config_file_is_found(tmp_path, monkeypatch):
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(user.__file__, project / "verl_beside_tools.py")
    (project / "tools.yaml").write_text(VERL_YAML.replace(FIXTURES, "verl_beside_tools"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    tool = load_tools(project / "tools.yaml")["calculator"]
    assert type(tool.tool).__module__ == "verl_beside_tools"
    sys.modules.pop("verl_beside_tools", None)


# --- end to end: rallyrl rollout and train in a real process -------------------------------------


@pytest.fixture
def verl_project(tmp_path) -> Path:
    """A user's folder: their tool module (not installed) and verl's tool YAML naming it."""
    shutil.copy(user.__file__, tmp_path / "my_verl_tools.py")
    config = VERL_YAML.replace(FIXTURES, "my_verl_tools").replace(
        "type: native", f"type: native\n      log_path: {tmp_path / 'lifecycle.log'}"
    )
    (tmp_path / "tool_config.yaml").write_text(config)
    return tmp_path


def rallyrl(*args: str, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    """The installed ``rallyrl`` command run in ``cwd`` (where the user's module is)."""
    return subprocess.run([shutil.which("rallyrl") or "rallyrl", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def lifecycle(project: Path) -> dict[str, list[str]]:
    """The tool's logged events by kind: create / execute / release -> instance ids."""
    events: dict[str, list[str]] = {"create": [], "execute": [], "release": []}
    for line in (project / "lifecycle.log").read_text().splitlines():
        kind, instance = line.split()
        events[kind].append(instance)
    return events


@pytest.mark.slow
def test_rallyrl_rollout_runs_a_verl_tool_class_from_verls_yaml(verl_project):
    done = rallyrl("rollout", "--tools", "tool_config.yaml", "--num-prompts", "8", "--out", "out.jsonl",
                   "--no-progress", cwd=verl_project)  # fmt: skip
    assert done.returncode == 0, done.stderr
    checked = run_cli("check", str(verl_project / "out.jsonl"))
    assert checked.returncode == 0 and "8 valid trajectories" in checked.stderr, checked.stderr
    trajectories = [orjson.loads(line) for line in (verl_project / "out.jsonl").read_bytes().splitlines()]
    calls = [c for t in trajectories for c in t["tool_calls"]]
    assert calls, "the embedded model called no tool"
    for c in calls:
        assert c["name"] == "calculator" and c["metrics"] == {"style": "verl-0.9"} and c["reward"] == 0.1
        assert c["text"] == user.evaluate(c["arguments"]["expression"])
    assert [t["rewards"]["tools"]["calculator"] for t in trajectories] == [0.5 if t["tool_calls"] else 0.0
                                                                          for t in trajectories]  # fmt: skip
    events = lifecycle(verl_project)
    assert len(events["create"]) == 8 and sorted(events["release"]) == sorted(events["create"])
    assert len(events["execute"]) == len(calls)


@pytest.mark.slow
def test_rallyrl_train_runs_with_a_verl_tool_class(verl_project):
    done = rallyrl("train", "--set", "tools=tool_config.yaml", "--out", "run", "--steps", "1",
                   "--prompts-per-step", "2", "-n", "2", "--no-progress", cwd=verl_project)  # fmt: skip
    assert done.returncode == 0, done.stderr
    (metrics,) = [orjson.loads(line) for line in (verl_project / "run" / "metrics.jsonl").read_bytes().splitlines()]
    assert metrics["step"] == 1
    events = lifecycle(verl_project)
    assert len(events["create"]) >= 4 and sorted(events["release"]) == sorted(events["create"])


@pytest.mark.slow
def test_rallyrl_rollout_runs_a_plain_function_tool(tmp_path):
    """With the schema the embedded model was trained on (a derived one adds text it never saw)."""
    shutil.copy(user.__file__, tmp_path / "my_verl_tools.py")
    entry = {"class_name": "my_verl_tools.calculator", "schema": CALCULATOR_SCHEMA}
    (tmp_path / "tools.yaml").write_bytes(orjson.dumps({"tools": [entry]}))
    done = rallyrl("rollout", "--tools", "tools.yaml", "--num-prompts", "8", "--out", "out.jsonl", "--no-progress",
                   cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    trajectories = [orjson.loads(line) for line in (tmp_path / "out.jsonl").read_bytes().splitlines()]
    calls = [c for t in trajectories for c in t["tool_calls"] if c["error"] is None]
    assert calls, "the embedded model called no tool"
    assert all(c["text"] == user.evaluate(c["arguments"]["expression"]) for c in calls)


def test_verls_own_gsm8k_tool_yaml_loads_on_the_answer_checker(tmp_path):
    """verl's examples/sglang_multiturn/config/tool_config/gsm8k_tool_config.yaml, as it is: its class
    is not in verl 0.9 from PyPI, so rallyrl's answer checker stands in under verl's tool name."""
    from tools.answer_check import AnswerCheckTool
    from tools.registry import load_tools

    path = tmp_path / "gsm8k_tool_config.yaml"
    path.write_text("""
tools:
  - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"
    config:
      type: native
    tool_schema:
      type: "function"
      function:
        name: "calc_gsm8k_reward"
        description: "A tool for calculating the reward of gsm8k"
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
              description: "The model's answer to the GSM8K math problem, must be a digits"
          required: ["answer"]
""")
    tools = load_tools(path)
    assert list(tools) == ["calc_gsm8k_reward"] and isinstance(tools["calc_gsm8k_reward"], AnswerCheckTool)
