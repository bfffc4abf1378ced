"""Hostile text: whatever a model writes, whatever a dataset or tool config holds, nothing crashes.

Model output goes through the qwen25/hermes parser, the chat tokenizer and ``run_request``:
never an exception, every call either readable or an error, every record serialisable.
Malformed datasets and tool configs given to ``rallyrl rollout`` exit 2 with one line naming
the file, the line and the field, without a traceback and without touching ``--out``.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import CountingTool, ScriptedEngine, run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from data.schema import MAX_NESTING, RecordError, load_records
from rollout.engines.base import Generation, SamplingParams
from rollout.loop import RolloutConfig, run_request
from rollout.parsers import MAX_ARGUMENT_DEPTH, ParsedTurn, get_parser
from rollout.request import AsyncRolloutRequest, FinishReason, RequestState, validate_trajectory
from rollout.tokens import ChatTokenizer
from tools.registry import ToolConfigError, load_tools

MODEST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LOOP = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
parse = get_parser("qwen25")

# ----- what a model may write ----------------------------------------------------------------

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=16)
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
objects = st.dictionaries(st.sampled_from(["text", "sleep", "fail"]) | st.text(max_size=8), json_values, max_size=4)
not_objects = st.lists(json_values, max_size=3) | scalars
names = st.just("echo") | st.text(max_size=12) | not_objects


@st.composite
def call_bodies(draw) -> str:
    """The JSON inside ``<tool_call>``: any name (or none), arguments that are an object, not
    an object, JSON text of either, or absent; sometimes cut short."""
    call = {}
    if draw(st.booleans()):
        call["name"] = draw(names)
    key = draw(st.sampled_from(["arguments", "parameters", None]))
    if key is not None:
        arguments = draw(objects | not_objects)
        call[key] = json.dumps(arguments) if draw(st.booleans()) else arguments
    body = json.dumps(call)
    return body[: draw(st.integers(0, len(body)))] if draw(st.booleans()) else body


lone_surrogates = st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=4)
bad_bytes = st.binary(max_size=48)
any_text = st.text(max_size=40) | lone_surrogates | bad_bytes.map(lambda b: b.decode("utf-8", "surrogateescape"))
"""What a caller may hand the parser: lone surrogates and undecodable bytes included."""
decodable_text = st.text(max_size=40) | bad_bytes.map(lambda b: b.decode("utf-8", "replace"))
"""What a tokenizer can decode to (a Python str without lone surrogates)."""

DEEP_BODIES = {
    "100k-brackets": "[" * 100_000 + "]" * 100_000,  # past orjson's 1024 levels
    "100k-braces": "{" * 100_000,
    "300-deep": '{"name": "echo", "arguments": {"text": ' + "[" * 300 + "]" * 300 + "}}",  # parses, too deep to store
    "1000-deep": '{"name": "echo", "arguments": ' + '{"a": ' * 1000 + "1" + "}" * 1001,
    "1MB-string": '{"name": "echo", "arguments": {"text": "' + "x" * 1_000_000 + '"}}',
    "100k-name": '{"name": "' + "n" * 100_000 + '", "arguments": []}',
}
echo_calls = st.text(max_size=20).map(lambda text: json.dumps({"name": "echo", "arguments": {"text": text}}))


def model_outputs(text: st.SearchStrategy[str], huge: bool = True) -> st.SearchStrategy[str]:
    """Assistant turns: ``text`` around well-formed, malformed, unclosed, nested and stray tool-call tags
    (``huge``: sometimes around one of ``DEEP_BODIES``)."""
    bodies = call_bodies() | echo_calls | text
    if huge:
        bodies |= st.sampled_from(list(DEEP_BODIES.values()))
    segments = st.one_of(
        text,
        bodies.map(lambda body: f"<tool_call>{body}</tool_call>"),
        bodies.map(lambda body: f"<tool_call>{body}"),  # unclosed
        bodies.map(lambda body: f"<tool_call><tool_call>{body}</tool_call></tool_call>"),  # nested
        st.sampled_from(["<tool_call>", "</tool_call>", "<|im_end|>", "<|im_start|>user\n"]),
    )
    return st.lists(segments, max_size=8).map("".join)


def assert_well_formed(turn: ParsedTurn, text: str) -> None:
    assert isinstance(turn, ParsedTurn) and isinstance(turn.content, str)
    assert "<tool_call>" not in turn.content
    assert bool(turn.calls) == ("<tool_call>" in text)
    assert len(turn.calls) <= text.count("<tool_call>")
    for call in turn.calls:
        assert isinstance(call.name, str)
        assert isinstance(call.arguments, dict) != isinstance(call.error, str), call
        orjson.dumps({"tool_calls": [asdict(call)]})  # as the rollout JSONL holds it


# ----- the parser ----------------------------------------------------------------------------


@MODEST
@given(model_outputs(any_text))
def test_parser_never_raises_and_every_call_has_arguments_or_an_error(text):
    assert_well_formed(parse(text), text)


untagged_calls = st.tuples(st.text(min_size=1, max_size=12), objects).filter(
    lambda call: "tool_call>" not in json.dumps(call)  # see test_a_closing_tag_inside_an_argument_string...
)


@settings(MODEST, max_examples=100)
@given(st.lists(untagged_calls, min_size=1, max_size=20), st.text(" \n.ab"))
def test_many_well_formed_calls_in_one_turn_come_back_in_order(calls, gap):
    text = "thinking" + gap.join(f"<tool_call>{json.dumps({'name': n, 'arguments': a})}</tool_call>" for n, a in calls)
    turn = parse(text)
    assert turn.content == "thinking"
    assert [(c.name, c.arguments, c.error) for c in turn.calls] == [(n, a, None) for n, a in calls]


def test_a_closing_tag_inside_an_argument_string_does_not_cut_the_call_short():
    (call,) = parse('<tool_call>{"name": "echo", "arguments": {"text": "say </tool_call>"}}</tool_call>').calls
    assert call.arguments == {"text": "say </tool_call>"}


def test_ten_thousand_calls_in_one_turn_are_all_read():
    turn = parse('<tool_call>{"name": "echo", "arguments": {"text": "x"}}</tool_call>' * 10_000)
    assert len(turn.calls) == 10_000 and all(call.error is None for call in turn.calls)


@MODEST
@given(not_objects.filter(lambda value: not isinstance(value, str)) | st.text(max_size=16).map(json.dumps))
def test_arguments_that_are_not_an_object_are_an_error_naming_the_tool(arguments):
    (call,) = parse(f"<tool_call>{json.dumps({'name': 'echo', 'arguments': arguments})}</tool_call>").calls
    assert call.arguments is None
    assert call.error.startswith("the arguments of tool call 'echo' must be a JSON object")


@MODEST
@given(st.none() | st.just("") | st.integers() | st.lists(st.text(max_size=3), max_size=2) | st.booleans())
def test_a_name_that_is_missing_or_not_a_string_is_an_error(name):
    body = json.dumps({"arguments": {}} if name is None else {"name": name, "arguments": {}})
    (call,) = parse(f"<tool_call>{body}</tool_call>").calls
    assert call.arguments is None and call.error.startswith("tool call has no 'name' string")


@pytest.mark.parametrize("body", DEEP_BODIES.values(), ids=DEEP_BODIES.keys())
def test_huge_and_deep_json_is_read_or_refused_never_raised(body):
    assert_well_formed(parse(f"<tool_call>{body}</tool_call>"), f"<tool_call>{body}</tool_call>")


@pytest.mark.parametrize("depth", [MAX_ARGUMENT_DEPTH + 1, 300, 1000])
def test_arguments_nested_too_deep_to_store_are_an_error(depth):
    body = '{"name": "echo", "arguments": ' + '{"a": ' * (depth - 1) + "{}" + "}" * (depth - 1) + "}"
    (call,) = parse(f"<tool_call>{body}</tool_call>").calls
    assert call.arguments is None
    assert call.error == f"the arguments of tool call 'echo' nest deeper than {MAX_ARGUMENT_DEPTH} levels"


def test_arguments_nested_up_to_the_limit_are_read():
    body = '{"name": "echo", "arguments": ' + '{"a": ' * (MAX_ARGUMENT_DEPTH - 1) + "{}" + "}" * MAX_ARGUMENT_DEPTH
    (call,) = parse(f"<tool_call>{body}</tool_call>").calls
    assert call.error is None and isinstance(call.arguments, dict)


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "echo\ud800", "arguments": {}}</tool_call>',
        b'<tool_call>{"name": "\xff\xfe", "arguments": {}}</tool_call>'.decode("utf-8", "surrogateescape"),
        b'<tool_call>{"name": "\xff\xfe", "arguments": {}}</tool_call>'.decode("utf-8", "replace"),
        '<tool_call>{"name": "echo", "arguments": {"text": "\\ud800"}}</tool_call>',  # an escaped lone surrogate
    ],
    ids=["lone-surrogate", "surrogateescape", "replace", "escaped-surrogate"],
)
def test_invalid_unicode_gives_calls_that_serialise(text):
    assert_well_formed(parse(text), text)


# ----- the chat tokenizer and run_request ----------------------------------------------------


@pytest.fixture(scope="module")
def chat(tokenizer):
    return ChatTokenizer(tokenizer, [CountingTool().schema])


@MODEST
@given(data=st.data())
def test_assistant_text_of_any_token_ids_is_a_string_json_can_hold(chat, tokenizer, data):
    ids = data.draw(st.lists(st.integers(0, len(tokenizer) - 1), max_size=300))
    text = chat.assistant_text(ids)
    assert isinstance(text, str)
    orjson.dumps(text)
    assert_well_formed(parse(text), text)


HOSTILE = RolloutConfig(max_turns=3, tool_timeout_s=0.05, tool_reward_timeout_s=0.05, max_new_tokens=400,
                        max_model_len=4096)  # fmt: skip


def run_to_the_end(engine, chat, config: RolloutConfig = HOSTILE) -> AsyncRolloutRequest:
    """Run one request to its end and check what every request must hold, however it ended."""
    tool = CountingTool()
    request = AsyncRolloutRequest("r0", 0, 0, [{"role": "user", "content": "Go."}])
    returned = asyncio.run(run_request(request, engine, chat, {"echo": tool}, config))
    assert returned is request
    assert request.state is RequestState.COMPLETED and isinstance(request.finish_reason, FinishReason)
    if request.finish_reason is FinishReason.ERROR:
        assert request.error
    validate_trajectory(orjson.loads(orjson.dumps(request.to_record())))
    assert tool.created == tool.released == 1
    return request


@LOOP
@given(st.lists(model_outputs(decodable_text, huge=False), min_size=1, max_size=3))
def test_run_request_ends_normally_whatever_the_model_writes(chat, turns):
    engine = ScriptedEngine(chat, lambda turn, prompt, rid: turns[min(turn, len(turns) - 1)])
    run_to_the_end(engine, chat)


@dataclass
class TokenEngine:
    """Engine double returning the given token ids (special tokens included) and finish reasons."""

    turns: list[tuple[list[int], str]]
    calls: int = 0

    async def generate(self, input_ids: list[int], sampling: SamplingParams, rid: str) -> Generation:
        ids, finish = self.turns[min(self.calls, len(self.turns) - 1)]
        self.calls += 1
        ids = ids[: sampling.max_new_tokens]
        return Generation(ids, [-0.5] * len(ids), finish, 0)  # type: ignore[arg-type]


@LOOP
@given(data=st.data())
def test_run_request_ends_normally_whatever_token_ids_the_engine_returns(chat, tokenizer, data):
    ids = st.lists(st.integers(0, len(tokenizer) - 1), max_size=120)
    turns = data.draw(st.lists(st.tuples(ids, st.sampled_from(["stop", "length", "abort"])), min_size=1, max_size=3))
    run_to_the_end(TokenEngine(turns), chat)


@pytest.mark.parametrize("body", DEEP_BODIES.values(), ids=DEEP_BODIES.keys())
def test_run_request_answers_huge_json_calls_and_ends_normally(chat, body):
    turns = [f"<tool_call>{body}</tool_call>", "done"]
    config = RolloutConfig(max_new_tokens=1_200_000, max_model_len=2_500_000, tool_timeout_s=0.05)
    request = run_to_the_end(ScriptedEngine(chat, lambda turn, prompt, rid: turns[min(turn, 1)]), chat, config)
    assert request.finish_reason is FinishReason.STOP
    tool_message = next(m["content"] for m in request.messages if m["role"] == "tool")
    assert len(tool_message) <= config.max_tool_response_chars


# ----- malformed datasets and tool configs ---------------------------------------------------

GOOD_LINE = '{"prompt": [{"role": "user", "content": "What is 2 + 2?"}]}\n'


def test_a_record_nested_too_deep_is_a_record_error_naming_the_field(tmp_path):
    path = tmp_path / "deep.jsonl"
    path.write_text(GOOD_LINE + '{"prompt": [{"role": "user", "content": "x"}], "extra": ' + "[" * 1000 + "]" * 1000
                    + "}\n")  # fmt: skip
    with pytest.raises(RecordError) as info:
        load_records(path)
    assert str(info.value) == f"{path} line 2 (record 1), field extra: nested more than {MAX_NESTING} levels deep"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("tools: [\n", "not valid YAML: line 2, column 1: expected the node content"),
        ('tools:\n  - class_name: ".calculator:CalculatorTool"\n', "tools[0].class_name: cannot import"),
        (
            'tools:\n  - class_name: "tools.calculator:CalculatorTool"\n    schema: {type: function, function: {}}\n',
            "tools[0].schema.function.name: expected the tool's name, a non-empty string",
        ),
        (
            'tools:\n  - class_name: "tools.calculator:CalculatorTool"\n'
            "    schema: {type: function, function: {name: 12}}\n",
            "tools[0].schema.function.name: expected the tool's name, a non-empty string",
        ),
    ],
    ids=["invalid-yaml", "relative-import", "schema-without-name", "schema-name-not-a-string"],
)
def test_tool_config_errors_are_one_line_naming_the_file_and_field(tmp_path, body, message):
    path = tmp_path / "tools.yaml"
    path.write_text(body)
    with pytest.raises(ToolConfigError) as info:
        load_tools(path)
    assert str(info.value).startswith(f"{path}: ") and message in str(info.value)
    assert "\n" not in str(info.value)


def test_a_tool_module_that_fails_to_import_is_a_tool_config_error(tmp_path, monkeypatch):
    (tmp_path / "broken_tool_module.py").write_text("def (:\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "tools.yaml"
    path.write_text('tools:\n  - class_name: "broken_tool_module:Tool"\n')
    with pytest.raises(ToolConfigError, match=r"tools\[0\].class_name: cannot import .*SyntaxError"):
        load_tools(path)


def write_parquet(path: Path, columns: dict) -> Path:
    pq.write_table(pa.table(columns), path)
    return path


BAD_DATA = {
    "invalid-json": (GOOD_LINE + '{"prompt": [\n', ["line 2 (record 1)", "invalid JSON"]),
    "missing-prompt": (GOOD_LINE + '{"data_source": "x"}\n', ["line 2 (record 1)", "field prompt: missing"]),
    "message-without-content": (
        GOOD_LINE + '{"prompt": [{"role": "user"}]}\n',
        ["line 2 (record 1)", "field prompt[0].content: missing"],
    ),
    "role-not-a-string": (
        GOOD_LINE + GOOD_LINE + '{"prompt": [{"role": 7, "content": "x"}]}\n',
        ["line 3 (record 2)", "field prompt[0].role: expected a string, got int"],
    ),
    "parquet-prompt-column-of-ints": (
        {"prompt": [5]},
        ["record 0", "field prompt: expected a list of chat messages, got int"],
    ),
}

BAD_TOOLS = {
    "unknown-class-path": ('class_name: "nowhere.mod:Tool"', "tools[0].class_name: cannot import 'nowhere.mod:Tool'"),
    "not-a-base-tool": ('class_name: "collections:OrderedDict"', "is not a subclass of tools.base.BaseTool"),
    "bad-parameters-schema": (
        'class_name: "tools.calculator:CalculatorTool"\n'
        "    schema: {type: function, function: {name: c, description: d, parameters: {type: 12}}}",
        "invalid parameters schema",
    ),
    "config-value-of-wrong-type": (
        'class_name: "tools.calculator:CalculatorTool"\n    config: {max_digits: "many"}',
        "config 'max_digits' must be a positive integer, got 'many'",
    ),
}


def bad_data_file(tmp_path: Path, case: str) -> Path:
    content = BAD_DATA[case][0]
    if isinstance(content, dict):
        return write_parquet(tmp_path / "bad.parquet", content)
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    return path


def bad_tools_file(tmp_path: Path, case: str) -> Path:
    path = tmp_path / "tools.yaml"
    path.write_text(f"tools:\n  - {BAD_TOOLS[case][0]}\n")
    return path


def assert_one_error_line(done, path: Path, fragments: list[str]) -> None:
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"error: {path}")
    for fragment in fragments:
        assert fragment in lines[0]


@pytest.mark.parametrize("case", list(BAD_DATA))
def test_cli_bad_dataset_exits_2_with_one_line_naming_file_line_and_field(tmp_path, tiny_model_dir, case):
    data, out = bad_data_file(tmp_path, case), tmp_path / "out.jsonl"
    done = run_cli("rollout", "--model", str(tiny_model_dir), "--data", str(data), "--out", str(out), "--no-progress")
    assert_one_error_line(done, data, BAD_DATA[case][1])
    assert not out.exists()


@pytest.mark.parametrize("case", list(BAD_TOOLS))
def test_cli_bad_tool_config_exits_2_with_one_line_naming_file_entry_and_field(tmp_path, tiny_model_dir, case):
    tools, out = bad_tools_file(tmp_path, case), tmp_path / "out.jsonl"
    done = run_cli("rollout", "--model", str(tiny_model_dir), "--task", "calc", "--num-prompts", "1",
                   "--tools", str(tools), "--out", str(out), "--no-progress")  # fmt: skip
    assert_one_error_line(done, tools, [BAD_TOOLS[case][1]])
    assert not out.exists()


@pytest.mark.parametrize("bad", ["--data", "--tools"])
def test_cli_bad_input_leaves_an_existing_out_file_as_it_was(tmp_path, tiny_model_dir, bad):
    out = tmp_path / "out.jsonl"
    out.write_bytes(b'{"an earlier": "run"}\n')
    if bad == "--data":
        args = ["--data", str(bad_data_file(tmp_path, "role-not-a-string"))]
    else:
        args = ["--task", "calc", "--num-prompts", "1", "--tools", str(bad_tools_file(tmp_path, "unknown-class-path"))]
    done = run_cli("rollout", "--model", str(tiny_model_dir), *args, "--out", str(out), "--no-progress")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert out.read_bytes() == b'{"an earlier": "run"}\n'
