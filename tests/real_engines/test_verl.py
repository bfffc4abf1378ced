"""A verl user's tools on the real verl 0.9.1 (``.ci/install_engines verl``): classes subclassing
``verl.tools.base_tool.BaseTool`` in verl 0.9's shapes and in older verl's, verl's pydantic schema
and ToolResponse, ``@function_tool`` functions, verl's tool YAML, and ``rallyrl rollout`` and
``rallyrl train`` run by the verl virtualenv, from the user's own folder."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import orjson
import pytest

from tests.conftest import run_cli
from tests.fixtures import verl_style_tools
from tests.real_engines.conftest import require_engine

CALCULATOR = verl_style_tools.CALCULATOR_SCHEMA
USER_MODULES = [Path(verl_style_tools.__file__), Path(verl_style_tools.__file__).with_name("verl_real_tools.py")]


def verl_python() -> Path:
    return require_engine("verl")  # type: ignore[arg-type]  # the venv is found like an engine's


@pytest.fixture
def project(tmp_path) -> Path:
    """The user's folder: their tool modules (not installed) and verl's tool YAML for each class."""
    for module in USER_MODULES:  # verl_real_tools imports verl: only the verl venv can import it
        shutil.copy(module, tmp_path / module.name)
    for class_name in ("VerlCalculator", "OldStyleCalculator"):
        entry = {"class_name": f"verl_real_tools.{class_name}", "tool_schema": CALCULATOR,
                 "config": {"type": "native", "log_path": str(tmp_path / f"{class_name}.log")}}  # fmt: skip
        (tmp_path / f"{class_name}.yaml").write_text(json.dumps({"tools": [entry]}))
    return tmp_path


def in_verl_venv(*args: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    """``rallyrl ARGS`` (or, with ``-c``, a Python program) run by verl's virtualenv in ``cwd``."""
    venv = verl_python().parent.parent
    command = [str(venv / "bin" / "python"), *args] if args[0] == "-c" else [str(venv / "bin" / "rallyrl"), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=cwd)


CHECKS = """
import asyncio, json
from tools.registry import build_tools
from tools.verl_compat import read_response
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
import verl_real_tools

CALCULATOR = {calculator}
PICTURE = {{"type": "function", "function": {{"name": "picture", "description": "d"}}}}


async def main():
    tools = build_tools([
        {{"class_name": "verl_real_tools.VerlCalculator", "config": {{"type": "native"}}, "tool_schema": CALCULATOR}},
        {{"class_name": "verl_real_tools.Picture", "config": {{"type": "native"}},
          "tool_schema": OpenAIFunctionToolSchema.model_validate(PICTURE)}},
        {{"class_name": "verl_real_tools.calculate"}},
        {{"class_name": "verl_real_tools:graded"}},
    ])
    calculator, picture = tools["calculator"], tools["picture"]
    instance = await calculator.create(None, ground_truth="x")
    out = {{
        "names": sorted(tools),
        "schema_is_verls": isinstance(calculator.tool.tool_schema, OpenAIFunctionToolSchema),
        "picture_schema": picture.schema,
        "execute": vars(await calculator.execute(instance, {{"expression": "6*7"}})),
        "calc_reward": await calculator.calc_reward(instance),
        "calc": tools["calc"].schema,
        "calc_text": (await tools["calc"].execute("i", {{"expression": "1+2"}})).text,
        "graded": vars(await tools["graded"].execute("i", {{"answer": 42}})),
        "verl_response": vars(read_response((ToolResponse(text="t"), None, None), "t")),
    }}
    await calculator.release(instance)
    try:
        await picture.execute(await picture.create(), {{}})
    except Exception as exc:
        out["picture_error"] = f"{{type(exc).__name__}}: {{exc}}"
    print("RESULT " + json.dumps(out))


asyncio.run(main())
"""


def test_real_verl_classes_schemas_responses_and_function_tools_load_and_run(project):
    done = in_verl_venv("-c", CHECKS.format(calculator=CALCULATOR), cwd=project)
    assert done.returncode == 0, done.stderr[-4000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    out = json.loads(line.removeprefix("RESULT "))
    assert out["names"] == ["calc", "calculator", "graded", "picture"]
    assert out["schema_is_verls"] is True
    assert out["picture_schema"] == {"type": "function", "function": {"name": "picture", "description": "d"}}
    assert out["execute"] == {"text": "42", "reward": 0.1, "metrics": {"style": "verl-0.9"}}
    assert out["calc_reward"] == 0.5
    # @function_tool("calc") renamed it: verl's registration is the schema (pydantic-shaped by verl)
    assert out["calc"]["function"]["name"] == "calc"
    assert out["calc"]["function"]["parameters"]["required"] == ["expression"]
    assert out["calc_text"] == "3"
    assert out["graded"] == {"text": "right", "reward": 1.0, "metrics": {}}
    assert out["verl_response"] == {"text": "t", "reward": 0.0, "metrics": {}}
    assert out["picture_error"] == "ToolError: tool picture returned an image; this rollout is text-only"


def lifecycle(log: Path) -> dict[str, list[str]]:
    events: dict[str, list[str]] = {"create": [], "execute": [], "release": []}
    for line in log.read_text().splitlines():
        kind, instance = line.split()
        events[kind].append(instance)
    return events


@pytest.mark.parametrize(
    ("class_name", "reward", "metrics"),
    [("VerlCalculator", 0.1, {"style": "verl-0.9"}), ("OldStyleCalculator", 0.2, {"style": "verl-old"})],
)
def test_rallyrl_rollout_runs_real_verl_tool_classes_from_verls_yaml(project, class_name, reward, metrics):
    done = in_verl_venv("rollout", "--tools", f"{class_name}.yaml", "--num-prompts", "8", "--out", "out.jsonl",
                        "--no-progress", cwd=project)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    checked = run_cli("check", str(project / "out.jsonl"))
    assert checked.returncode == 0 and "8 valid trajectories" in checked.stderr, checked.stderr
    trajectories = [orjson.loads(line) for line in (project / "out.jsonl").read_bytes().splitlines()]
    calls = [c for t in trajectories for c in t["tool_calls"]]
    assert calls, "the embedded model called no tool"
    for c in calls:
        assert (c["name"], c["reward"], c["metrics"], c["error"]) == ("calculator", reward, metrics, None)
        assert c["text"] == verl_style_tools.evaluate(c["arguments"]["expression"])
    events = lifecycle(project / f"{class_name}.log")
    assert len(events["create"]) == 8 and sorted(events["release"]) == sorted(events["create"])
    assert len(events["execute"]) == len(calls)


def test_rallyrl_train_runs_a_real_verl_tool_class(project):
    done = in_verl_venv("train", "--set", "tools=VerlCalculator.yaml", "--out", "run", "--steps", "2",
                        "--prompts-per-step", "2", "-n", "2", "--no-progress", cwd=project)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    steps = [orjson.loads(line)["step"] for line in (project / "run" / "metrics.jsonl").read_bytes().splitlines()]
    assert steps == [1, 2]
    events = lifecycle(project / "VerlCalculator.log")
    assert len(events["create"]) >= 8 and sorted(events["release"]) == sorted(events["create"])
