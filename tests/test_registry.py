"""Tool configs: built-ins and users' own classes by import path, from YAML or JSON, with clear errors."""

from __future__ import annotations

import sys
import textwrap

import pytest

from tools.registry import ToolConfigError, build_tools, load_tools

USER_TOOL = """
from tools.base import BaseTool, ToolResponse, function_schema


class Shout(BaseTool):
    @classmethod
    def default_schema(cls):
        return function_schema("shout", "Upper-case text.", {
            "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]})

    async def execute(self, instance_id, parameters, **kwargs):
        return ToolResponse(parameters["text"].upper() + self.config.get("suffix", ""))
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_tools.py").write_text(USER_TOOL)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_tools"
    sys.modules.pop("my_tools", None)


async def test_users_own_tool_class_loads_from_yaml_by_import_path(tmp_path, user_module):
    path = tmp_path / "tools.yaml"
    path.write_text(f'tools:\n  - class_name: "{user_module}:Shout"\n    config: {{suffix: "!"}}\n')
    tools = load_tools(path)
    shout = tools["shout"]
    instance = await shout.create()
    assert (await shout.execute(instance, {"text": "hi"})).text == "HI!"
    await shout.release(instance)


def test_verl_dotted_class_name_and_tool_schema_key_are_accepted(tmp_path, user_module):
    path = tmp_path / "tools.json"
    schema = '{"type": "function", "function": {"name": "yell", "description": "d", "parameters": {"type": "object"}}}'
    path.write_text(f'{{"tools": [{{"class_name": "{user_module}.Shout", "tool_schema": {schema}}}]}}')
    assert list(load_tools(path)) == ["yell"]


def test_builtin_calculator_loads_with_its_default_schema():
    tools = build_tools([{"class_name": "tools.calculator:CalculatorTool"}])
    assert tools["calculator"].schema["function"]["parameters"]["required"] == ["expression"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("tools: 3", "expected a top-level 'tools:' list"),
        ("tools:\n  - 7", "tools[0]: expected a mapping with 'class_name'"),
        ("tools:\n  - config: {}", "tools[0].class_name: expected an import path"),
        ('tools:\n  - class_name: "nowhere.mod:Tool"', "tools[0].class_name: cannot import 'nowhere.mod:Tool'"),
        ('tools:\n  - class_name: "pathlib:Path"', "tools[0].class_name: 'pathlib:Path' is not a subclass"),
        ('tools:\n  - class_name: "tools.calculator:CalculatorTool"\n    colour: red', "unknown field(s) colour"),
        ('tools:\n  - class_name: "tools.calculator:CalculatorTool"\n    config: [1]', "tools[0].config: expected"),
        ('tools:\n  - class_name: "tools.calculator:CalculatorTool"\n    schema: {}', "tools[0].schema: expected"),
        (
            'tools:\n  - class_name: "tools.calculator:CalculatorTool"\n'
            '  - class_name: "tools.calculator:CalculatorTool"',
            "tools[1]: a second tool named 'calculator'",
        ),
        ("tools: [", "not valid YAML"),
    ],
)
def test_bad_configs_name_the_file_entry_and_field(tmp_path, body, message):
    path = tmp_path / "tools.yaml"
    path.write_text(textwrap.dedent(body))
    with pytest.raises(ToolConfigError) as info:
        load_tools(path)
    assert str(path) in str(info.value)
    assert message in str(info.value)


def test_invalid_parameters_schema_is_refused_at_load(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text(
        'tools:\n  - class_name: "tools.calculator:CalculatorTool"\n'
        "    schema: {type: function, function: {name: c, description: d, parameters: {type: 12}}}\n"
    )
    with pytest.raises(ToolConfigError, match="invalid parameters schema"):
        load_tools(path)


def test_missing_config_file_is_a_clear_error(tmp_path):
    with pytest.raises(ToolConfigError, match="cannot read tool config"):
        load_tools(tmp_path / "absent.yaml")
