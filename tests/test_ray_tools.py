"""``executor: ray``: tools and step environments in Ray actors (tools/ray_executor.py, tools/ray_cluster.py,
rollout/envs/ray_env.py).

The config errors and the import rule run in the main suite. The rest (``slow``) runs on a real local
two-node cluster (``ray.cluster_utils.Cluster``: a head and a worker that holds the ``tools`` resource):
the same trajectories as local execution, a node lost mid-run, Ctrl-C of a real ``rallyrl rollout``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson
import pytest
import yaml
from conftest import ScriptedEngine, call

from data.synthetic import make_calc_records
from data.tiny_model import EMBEDDED_MODEL
from rollout.config import RolloutConfig
from rollout.envs.interaction import EnvironmentInteraction
from rollout.runner import RolloutRunner
from rollout.tokens import ChatTokenizer, load_tokenizer
from tests.ray_doubles import MARK, marked_program
from tools.registry import ToolConfigError, build_tools, close_tools

ROOT = Path(__file__).resolve().parents[1]
MB = 2**20


def python_and_calculator(executor: str = "local", **ray: Any) -> list[dict[str, Any]]:
    extra = {"executor": "ray", "ray": ray} if executor == "ray" else {}
    return [{"class_name": "tools.python_sandbox:PythonTool", "config": {"timeout_s": 10}, **extra},
            {"class_name": "tools.calculator:CalculatorTool", **extra}]  # fmt: skip


# ----- config errors (main suite: no cluster) ---------------------------------------------------------


def test_an_unknown_executor_is_an_error_naming_the_entry():
    with pytest.raises(ToolConfigError, match=r"tools\[0\]\.executor: 'dask' is not one of local, ray"):
        build_tools([{"class_name": "tools.calculator:CalculatorTool", "executor": "dask"}])


def test_ray_settings_without_executor_ray_are_refused():
    with pytest.raises(ToolConfigError, match=r"tools\[0\]\.ray: .*add 'executor: ray'"):
        build_tools([{"class_name": "tools.calculator:CalculatorTool", "ray": {"actors": 2}}])


def test_executor_ray_without_ray_installed_names_the_pip_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(ToolConfigError, match=r"tools\[0\]: executor: ray needs Ray.*pip install 'rallyrl\[ray\]'"):
        build_tools([{"class_name": "tools.calculator:CalculatorTool", "executor": "ray"}])


@pytest.mark.parametrize(("ray", "message"), [
    ({"actors": 0}, r"tools\[0\]\.ray: bad value\(s\) actors=0"),
    ({"cpus": 1}, r"tools\[0\]\.ray: unknown field\(s\) cpus; known: "),
    ({"timeout_s": "soon"}, r"tools\[0\]\.ray: bad value\(s\) timeout_s='soon'"),
    ([1], r"tools\[0\]\.ray: expected a mapping, got list"),
])  # fmt: skip
def test_bad_ray_settings_name_the_field(ray, message):
    pytest.importorskip("ray")
    with pytest.raises(ToolConfigError, match=message):
        build_tools([{"class_name": "tools.calculator:CalculatorTool", "executor": "ray", "ray": ray}])


def test_an_mcp_entry_cannot_run_on_ray():
    pytest.importorskip("ray")
    entry = {"class_name": "tools.mcp:MCPTool", "executor": "ray", "mcp": {"mcp_servers_config_path": "x.json"}}
    with pytest.raises(ToolConfigError, match=r"tools\[0\]\.executor: ray .* MCP entry"):
        build_tools([entry])


def test_an_environment_interaction_names_a_bad_executor():
    with pytest.raises(ValueError, match="interaction env: executor 'threads' is not one of local, ray"):
        EnvironmentInteraction({"name": "env", "env": "tests.ray_doubles:GoGame", "executor": "threads"})


def test_the_main_install_never_imports_ray():
    code = ("import sys; from tools.registry import DEFAULT_TOOLS, build_tools; import rollout.api, "
            "rollout.envs.interaction; build_tools(DEFAULT_TOOLS); assert 'ray' not in sys.modules")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


# ----- on a two-node cluster (slow) -------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster():
    """A head (2 CPUs) and a worker (2 CPUs, the ``tools`` resource, label pool=tools), no dashboard;
    the tests' actors ask for ``tools``, so they run on the worker."""
    pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    from tools import ray_cluster
    from tools.ray_options import RayOptions

    made = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "object_store_memory": 80 * MB,
                                                         "include_dashboard": False})  # fmt: skip
    worker = made.add_node(num_cpus=2, object_store_memory=80 * MB, resources={"tools": 1000}, labels={"pool": "tools"})
    made.wait_for_nodes()
    ray_cluster.connect(RayOptions(address=made.address), "tests/test_ray_tools.py")
    try:
        yield SimpleNamespace(cluster=made, worker=worker, address=made.address,
                              on_worker={"address": made.address, "num_cpus": 0, "resources": {"tools": 1},
                                         "label_selector": {"pool": "tools"}})  # fmt: skip
    finally:
        ray_cluster.shutdown()
        made.shutdown()


def marked_processes() -> list[int]:
    """Pids of the sandboxed programs the doubles start (``MARK`` in their command line)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if MARK.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


async def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


def trajectory(request) -> dict[str, Any]:
    """What must match between local and Ray execution: the tokens, masks, rewards, messages, tool texts."""
    return {"prompt_ids": request.prompt_ids, "response_ids": request.response_ids, "loss_mask": request.loss_mask,
            "messages": request.messages, "rewards": request.rewards, "finish_reason": request.finish_reason,
            "error": request.error,
            "tools": [(c.name, c.text, c.error, c.reward) for c in request.tool_calls]}  # fmt: skip


def tool_script(turn: int, prompt: str, rid: str) -> str:
    """Every request calls python (a result, then a failing program) and the calculator, then answers."""
    n = len(prompt) % 97
    if turn == 0:
        return call("python", code=f"print(sum(range({n})))") + call("calculator", expression=f"{n} * 3 + 0.5")
    if turn == 1:
        return call("python", code="import sys; print('half'); sys.exit('no')") + call("calculator", expression="1/0")
    return f"The answer is {n * 3}."


async def scripted_rollout(tools, tokenizer, tmp_path: Path, name: str) -> list[dict[str, Any]]:
    chat = ChatTokenizer(tokenizer, [tool.schema for tool in tools.values()])
    runner = RolloutRunner(ScriptedEngine(chat, tool_script), chat, tools, RolloutConfig(max_turns=4),
                           max_concurrency=8, progress=False)  # fmt: skip
    result = await runner.run(make_calc_records(4, seed=3), samples_per_prompt=2, out_path=tmp_path / f"{name}.jsonl")
    return [trajectory(request) for request in result.requests]


async def model_rollout(tools, tmp_path: Path, name: str) -> list[dict[str, Any]]:
    """The embedded model, seeded, one request at a time (the same batches whatever the tools' latency)."""
    from rollout.engines.config import LocalEngineConfig
    from rollout.engines.local import LocalEngine

    chat = ChatTokenizer(load_tokenizer(EMBEDDED_MODEL), [tool.schema for tool in tools.values()])
    config = RolloutConfig(max_turns=3, max_new_tokens=48, seed=7)
    async with LocalEngine.from_pretrained(EMBEDDED_MODEL, LocalEngineConfig(device="cpu", seed=0)) as engine:
        runner = RolloutRunner(engine, chat, tools, config, max_concurrency=1, progress=False)
        result = await runner.run(make_calc_records(4, seed=5), samples_per_prompt=2,
                                  out_path=tmp_path / f"{name}.jsonl")  # fmt: skip
    return [trajectory(request) for request in result.requests]


@pytest.mark.slow
@pytest.mark.xdist_group("ray-cluster")
async def test_python_and_calculator_on_ray_give_the_same_trajectories_as_local_ones(cluster, tokenizer, tmp_path):
    local = build_tools(python_and_calculator())
    on_ray = build_tools(python_and_calculator("ray", **cluster.on_worker))
    try:
        scripted = await scripted_rollout(on_ray, tokenizer, tmp_path, "ray")
        assert scripted == await scripted_rollout(local, tokenizer, tmp_path, "local")
        failing = {t["tools"][2][1] for t in scripted}  # the sandboxed program ran: its output, its failure
        assert failing == {"half\n[stderr]\nno\nError: exit code 1"}
        model = await model_rollout(on_ray, tmp_path, "ray-model")
        assert model == await model_rollout(local, tmp_path, "local-model")
        assert any(t["tools"] for t in model)  # the model called its tools
        python, calculator = on_ray["python"], on_ray["calculator"]
        for tool in (python, calculator):
            assert tool.stats.created == tool.stats.released == 16  # 8 scripted + 8 model requests
            assert tool.stats.lost == [] and tool.stats.live() == 0
        placed = {slot.node_id for tool in (python, calculator) for slot in tool.pool.slots}
        assert placed == {cluster.worker.node_id}  # the resource and the label put them on the worker
    finally:
        close_tools(on_ray)


@pytest.mark.slow
@pytest.mark.xdist_group("ray-cluster")
async def test_the_sandbox_on_a_ray_worker_keeps_every_protection_it_has_here(cluster):
    from tools.python_sandbox import PythonTool

    here = (await PythonTool().execute("i", {"code": "print(1)"})).metrics["sandbox"]
    tools = build_tools(python_and_calculator("ray", **cluster.on_worker)[:1])
    try:
        python = tools["python"]
        instance = await python.create("r")
        there = (await python.execute(instance, {"code": "print(1)"})).metrics["sandbox"]
        await python.release(instance)
    finally:
        close_tools(tools)
    assert there == here


@pytest.mark.slow
@pytest.mark.xdist_group("ray-cluster")
async def test_a_node_lost_mid_run_ends_its_calls_as_tool_errors_and_accounts_for_every_instance(
    cluster, tokenizer, tmp_path
):
    doomed = cluster.cluster.add_node(num_cpus=1, object_store_memory=80 * MB, resources={"doomed": 1000})
    cluster.cluster.wait_for_nodes()
    entry = {"class_name": "tools.python_sandbox:PythonTool", "config": {"timeout_s": 60, "max_concurrent": 8},
             "executor": "ray", "ray": {"address": cluster.address, "num_cpus": 0, "resources": {"doomed": 1},
                                        "timeout_s": 90}}  # fmt: skip
    tools = build_tools([entry])
    chat = ChatTokenizer(tokenizer, [tools["python"].schema])

    def script(turn: int, prompt: str, rid: str) -> str:
        return call("python", code=marked_program(60, "never printed")) if turn == 0 else "It did not answer."

    config = RolloutConfig(max_turns=3, max_new_tokens=1024, tool_timeout_s=120)
    runner = RolloutRunner(ScriptedEngine(chat, script), chat, tools, config, max_concurrency=6, progress=False)
    out = tmp_path / "out.jsonl"
    run = asyncio.create_task(runner.run(make_calc_records(6, seed=1), samples_per_prompt=1, out_path=out))
    try:
        await wait_until(lambda: len(marked_processes()) >= 6 or run.done(), 120, "six sandboxed programs running")
        assert not run.done(), [(r.error, [c.text for c in r.tool_calls]) for r in run.result().requests]
        cluster.cluster.remove_node(doomed)
        result = await asyncio.wait_for(run, 90)  # a hang fails here
        await wait_until(lambda: not marked_processes(), 30, "the lost node's sandboxes to be gone")
    finally:
        run.cancel()
        close_tools(tools)
    assert len(out.read_bytes().splitlines()) == 6  # no trajectory lost
    for request in result.requests:  # the request went on: the model read the error and answered
        assert request.finish_reason.value == "stop", request.error
        (record,) = request.tool_calls
        assert record.text.startswith("Error: tool python: its Ray actor on node ")
        assert doomed.node_id in record.text and "lost" in record.text
    stats = tools["python"].stats
    assert (stats.created, stats.released, len(stats.lost), stats.live()) == (6, 0, 6, 0)
    assert {lost.node_id for lost in stats.lost} == {doomed.node_id}
    assert stats.actors_lost == 1


@pytest.mark.slow
@pytest.mark.xdist_group("ray-cluster")
async def test_a_step_environment_on_ray_plays_like_a_local_one(cluster):
    config = {"name": "env", "env": "tests.ray_doubles:GoGame", "env_kwargs": {"turns": 2}}

    async def episode(interaction: EnvironmentInteraction) -> list[Any]:
        async with interaction:
            seen = []
            for seed in (1, 2):
                instance = await interaction.start_interaction(None, seed=seed)
                seen.append(await interaction.start_messages(instance, []))
                for action in ("go", "stop"):
                    seen.append(await interaction.generate_response(instance, [{"role": "assistant",
                                                                               "content": action}]))  # fmt: skip
                seen.append(await interaction.calculate_score(instance))
                await interaction.finalize_interaction(instance)
            return seen

    on_ray = EnvironmentInteraction({**config, "executor": "ray", "ray": cluster.on_worker})
    assert await episode(on_ray) == await episode(EnvironmentInteraction(config))
    stats = on_ray.ray.stats
    assert (stats.created, stats.released, stats.lost) == (3, 3, [])  # the start check's episode and two more
    assert on_ray.stats.opened == on_ray.stats.closed == 3
    assert {slot.node_id for slot in on_ray.ray.pool.slots} == {cluster.worker.node_id}


def _interruptible() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
@pytest.mark.xdist_group("ray-cluster")
async def test_ctrl_c_of_a_rollout_leaves_no_actor_and_no_sandbox_behind(cluster, tmp_path):
    import ray
    from ray._private import state

    from rollout.serve.processes import rallyrl_command

    ours = ray.get_runtime_context().get_job_id()

    def theirs_alive() -> list[dict[str, Any]]:  # the rollout's actors: ToolHosts of another job
        return [actor for actor in state.actors().values() if actor["ActorClassName"] == "ToolHost"
                and actor["JobID"] != ours and actor["State"] != "DEAD"]  # fmt: skip

    config = tmp_path / "tools.yaml"
    config.write_text(yaml.safe_dump({"tools": [{
        "class_name": "tests.ray_doubles:SlowSandboxCalculator", "config": {"sleep_s": 60, "timeout_s": 90},
        "executor": "ray", "ray": cluster.on_worker,
    }]}))  # fmt: skip
    out = tmp_path / "out.jsonl"
    command = [*rallyrl_command(), "rollout", "--tools", str(config), "--num-prompts", "16", "--max-concurrency", "16",
               "--max-new-tokens", "96", "--no-progress", "--out", str(out)]  # fmt: skip
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=_interruptible)  # fmt: skip
    try:
        await wait_until(lambda: marked_processes() or process.poll() is not None, 240, "a sandboxed call")
        assert process.poll() is None, process.communicate()[1]
        assert theirs_alive()
        process.send_signal(signal.SIGINT)
        _, stderr = await asyncio.to_thread(process.communicate, timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, stderr
    assert "interrupted:" in stderr
    await wait_until(lambda: not marked_processes(), 30, "every sandbox to be gone")
    await wait_until(lambda: not theirs_alive(), 30, "the rollout's actors to be dead")
    assert all(orjson.loads(line) for line in out.read_bytes().splitlines())  # what finished is whole
