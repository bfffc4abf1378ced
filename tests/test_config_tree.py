"""The config tree: YAML files, flags and --set map onto nested dataclasses, every field is
documented, ``rallyrl config --show`` prints the whole resolved tree, and the example file loads."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from data.config_tree import ConfigError, field_docs, field_types, literal_values, load_tree, to_dict, to_yaml
from rollout.config import RolloutConfig, RolloutJobConfig, ServeConfig
from tests.conftest import run_cli
from trainer.config import EvalConfig, GRPOConfig, SFTConfig, load_config

ROOTS = {"train": GRPOConfig, "rollout": RolloutJobConfig, "eval": EvalConfig, "serve": ServeConfig, "sft": SFTConfig}
EXAMPLE = Path(__file__).resolve().parents[1] / "data" / "configs" / "grpo_calc.yaml"


def dataclass_types(cls: type, seen: set[type] | None = None) -> set[type]:
    """``cls`` and every dataclass type nested in its fields."""
    seen = set() if seen is None else seen
    seen.add(cls)
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default) and type(default) not in seen:
            dataclass_types(type(default), seen)
    return seen


def leaf_paths(tree: dict, prefix: str = "") -> set[str]:
    paths = set()
    for key, value in tree.items():
        path = f"{prefix}{key}"
        paths |= leaf_paths(value, path + ".") if isinstance(value, dict) and value and key != "server_args" else {path}
    return paths


@pytest.mark.parametrize("command", sorted(ROOTS))
def test_every_field_of_every_command_tree_is_documented_where_it_is_defined(command):
    for cls in dataclass_types(ROOTS[command]):
        undocumented = [f.name for f in dataclasses.fields(cls) if f.name not in field_docs(cls)
                        and not dataclasses.is_dataclass(field_types(cls)[f.name])]  # fmt: skip
        assert not undocumented, f"{cls.__name__}: {undocumented}"


def test_the_rollout_section_is_a_field_of_the_training_config_with_its_own_preset():
    config = GRPOConfig()
    assert isinstance(config.rollout, RolloutConfig)
    assert (config.rollout.max_turns, config.rollout.max_concurrency) == (3, 256)
    assert RolloutJobConfig().rollout.max_turns == RolloutConfig().max_turns == 8


def test_yaml_sets_nested_sections_and_flags_override_the_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("steps: 5\nrollout: {tool_timeout_s: 5, tool_parser: hermes}\n"
                    "engine: {local: {max_batch_size: 32}}\njudge: {max_concurrency: 4}\n")  # fmt: skip
    config = load_config(path, {"steps": 7, "rollout.top_k": 20, "lr": None})
    assert config.steps == 7 and config.lr == GRPOConfig().lr  # a flag not given leaves the default
    assert config.rollout.tool_timeout_s == 5.0 and isinstance(config.rollout.tool_timeout_s, float)
    assert config.rollout.tool_parser == "hermes" and config.rollout.top_k == 20
    assert config.rollout.max_turns == 3  # the rest of the section keeps the training preset
    assert config.engine.local.max_batch_size == 32 and config.judge.max_concurrency == 4
    assert load_config(path, sets=["rollout.max_parallel_calls=2", "engine.urls=[http://127.0.0.1:1]"]).engine.urls


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("rollout: {tool_timout_s: 5}\n", "rollout.tool_timout_s: unknown field; did you mean 'tool_timeout_s'?"),
        ("rollout: {temperature: hot}\n", "rollout.temperature: must be a number, got 'hot'"),
        ("advantage_mode: nope\n", "advantage_mode: must be 'trajectory' or 'broadcast' or 'per_step'"),
        ("engine: {kind: vllm}\n", "engine.kind: must be 'local' or 'sglang'"),
        ("steps: true\n", "steps: must be an integer, got True"),
        ("rollout: 3\n", "rollout: must be a mapping of RolloutConfig fields"),
        ("rollout: {max_turns: 0}\n", "RolloutConfig.max_turns must be >= 1"),
        ("- 1\n", "expected a mapping of config fields"),
        ("steps: [\n", "not valid YAML"),
    ],
)
def test_a_bad_file_is_an_error_naming_the_file_and_the_field(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as raised:
        load_config(path)
    assert str(path) in str(raised.value) and message in str(raised.value)


def test_a_bad_set_item_names_the_field():
    with pytest.raises(ConfigError, match=r"rollout\.nope: unknown field"):
        load_tree(GRPOConfig, sets=["rollout.nope=1"])
    with pytest.raises(ConfigError, match="expected FIELD=VALUE"):
        load_tree(GRPOConfig, sets=["rollout.top_k"])
    with pytest.raises(ConfigError, match="steps: must be an integer"):
        load_tree(GRPOConfig, sets=["steps.x=1"])


def test_literal_values_are_read_from_the_type():
    assert literal_values(field_types(GRPOConfig)["loss_aggregation"]) == (
        "token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")  # fmt: skip
    assert "# one of: trajectory, broadcast, per_step" in to_yaml(GRPOConfig())


@pytest.mark.parametrize("command", sorted(ROOTS))
def test_show_prints_the_whole_tree_and_it_loads_back_as_the_same_config(tmp_path, command):
    done = run_cli("config", "--show", "--command", command, "--set", "seed=9")
    assert done.returncode == 0, done.stderr
    printed = yaml.safe_load(done.stdout)
    expected = to_dict(load_tree(ROOTS[command], sets=["seed=9"]))
    assert printed == expected
    assert leaf_paths(printed) == leaf_paths(to_dict(ROOTS[command]()))
    path = tmp_path / "shown.yaml"
    path.write_text(done.stdout)
    assert to_dict(load_tree(ROOTS[command], path)) == expected


def test_show_with_a_config_file_resolves_it(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("rollout: {top_k: 7}\n")
    done = run_cli("config", "--show", "--config", str(path), "--no-comments")
    assert done.returncode == 0 and "  top_k: 7\n" in done.stdout and "#" not in done.stdout


@pytest.mark.slow
def test_commands_report_a_bad_config_file_with_exit_2(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("rollout: {tool_timout_s: 5}\n")
    for command in ("rollout", "eval", "serve", "sft", "train"):
        done = run_cli(command, "--config", str(path))
        assert done.returncode == 2, command
        assert "unknown field" in done.stderr and "Traceback" not in done.stderr, command


def test_the_example_file_is_complete_and_loads_as_the_training_defaults():
    loaded = yaml.safe_load(EXAMPLE.read_text())
    assert leaf_paths(loaded) == leaf_paths(to_dict(GRPOConfig()))
    assert to_dict(load_config(EXAMPLE)) == to_dict(GRPOConfig())


def test_the_rollout_config_module_is_light():
    code = ("import sys, rollout.config, rollout.engines.config, trainer.config; "
            "print(sorted(m for m in ('torch', 'sympy', 'math_verify', 'aiohttp') if m in sys.modules))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
