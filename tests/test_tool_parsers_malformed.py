"""Each tool-call format: malformed calls become errors the model can read, the formats' variants
are read, and the registry hands schemas to the parsers that type values by them."""

from __future__ import annotations

import functools

import pytest

from rollout import parsers
from rollout.tool_parsers import get_parser, get_renderer
from rollout.tool_parsers.mistral import render_mistral_compact

DS_CALLS, DS_CALL, DS_SEP = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>"
DS_END, DS_CALLS_END = "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>"
K_SECTION, K_CALL, K_ARGS = "<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>"
K_END, K_SECTION_END = "<|tool_call_end|>", "<|tool_calls_section_end|>"
PROPERTIES = {"n": {"type": "integer"}, "o": {"type": "object"}, "s": {"type": "string"}, "b": {"type": "boolean"}}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": PROPERTIES}}}]


def qwen3_call(params: str, name: str = "f") -> str:
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


MALFORMED = [
    # qwen3_coder: a value that does not fit its type, no name, unclosed
    ("qwen3_coder", qwen3_call("<parameter=n>\nabc\n</parameter>\n"), "parameter 'n' of tool call 'f' must be integer"),
    ("qwen3_coder", qwen3_call('<parameter=o>\n{"a": 1\n</parameter>\n'), "parameter 'o' of tool call 'f' must be obj"),
    ("qwen3_coder", qwen3_call("", name=""), "tool call has no function name"),
    ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=n>\n1\n</parameter>\n", "unclosed <function=f>"),
    ("qwen3_coder", "<tool_call>\n<function=f>\n</function>\nf(1)", "expected </tool_call> after </function>"),
    ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=n>\n1", "unclosed <tool_call> (no </tool_call>): unclosed"),
    ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=n\n1\n</function></tool_call>", "unclosed <parameter= tag"),
    ("qwen3_coder", "<tool_call>\nf(1)\n</tool_call>", "expected <function=NAME>"),
    # glm45
    ("glm45", "<tool_call>f\n<arg_key>n</arg_key>\n<arg_value>x1</arg_value>\n</tool_call>", "must be integer"),
    ("glm45", "<tool_call>f\n<arg_key>o</arg_key>\n<arg_value>{1}</arg_value>\n</tool_call>", "must be object"),
    ("glm45", "<tool_call>\n<arg_key>n</arg_key>\n<arg_value>1</arg_value>\n</tool_call>", "has no function name"),
    ("glm45", "<tool_call>f\n<arg_key>n</arg_key>\n<arg_value>1</tool_call>", "unclosed <arg_value> for 'n'"),
    ("glm45", "<tool_call>f\n<arg_key>n</arg_key>\n<arg_value>1</arg_value>\n", "unclosed <tool_call>"),
    ("glm45", "<tool_call>f\n<arg_key>n</arg_key>\n</tool_call>", "is not followed by <arg_value>"),
    # llama3
    ("llama3", '{"name": "f", "parameters": {"n": 1,}}', "invalid JSON in tool call"),
    ("llama3", '<|python_tag|>{"parameters": {"n": 1}}', "tool call has no 'name' string"),
    ("llama3", '{"name": "f", "parameters": {"n": 1}', "unclosed tool call"),
    ("llama3", "<|python_tag|>brave_search.call(query='x')", "expected a JSON object with 'name'"),
    ("llama3", '{"name": "f", "parameters": [1]}', "the arguments of tool call 'f' must be a JSON object"),
    # mistral, both forms
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {,}}]', "invalid JSON in [TOOL_CALLS]"),
    ("mistral", '[TOOL_CALLS] [{"arguments": {}}]', "tool call has no 'name' string"),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {}}', "unclosed [TOOL_CALLS] array"),
    ("mistral", '[TOOL_CALLS] {"name": "f"}', "expected [ARGS]"),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"n": }', "invalid JSON in the arguments of tool call 'f'"),
    ("mistral", "[TOOL_CALLS][ARGS]{}", "tool call has no function name"),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"n": 1', "invalid JSON in the arguments of tool call 'f'"),
    ("mistral", "[TOOL_CALLS]f[ARGS]", "tool call 'f' has no arguments"),
    # deepseekv3
    ("deepseekv3", f'{DS_CALLS}{DS_CALL}function{DS_SEP}f\n```json\n{{"n": }}\n```{DS_END}{DS_CALLS_END}',
     "invalid JSON in the arguments of tool call 'f'"),
    ("deepseekv3", f"{DS_CALLS}{DS_CALL}function{DS_SEP}\n```json\n{{}}\n```{DS_END}{DS_CALLS_END}",
     "tool call has no function name"),
    ("deepseekv3", f'{DS_CALLS}{DS_CALL}function{DS_SEP}f\n```json\n{{"n": 1}}', "unclosed <｜tool▁call▁begin｜>"),
    ("deepseekv3", f'{DS_CALLS}{DS_CALL}function{DS_SEP}f\n{{"n": 1}}{DS_END}', "expected ```json after the name"),
    ("deepseekv3", f"{DS_CALLS}{DS_CALL}f{DS_END}", "no <｜tool▁sep｜>"),
    ("deepseekv3", f'{DS_CALLS}{DS_CALL}function{DS_SEP}f\n```json\n{{"n": 1}}\n{DS_END}', "expected ``` after"),
    # deepseekv31
    ("deepseekv31", f'{DS_CALLS}{DS_CALL}f{DS_SEP}{{"n": }}{DS_END}{DS_CALLS_END}', "invalid JSON in the arguments"),
    ("deepseekv31", f"{DS_CALLS}{DS_CALL}{DS_SEP}{{}}{DS_END}{DS_CALLS_END}", "tool call has no function name"),
    ("deepseekv31", f'{DS_CALLS}{DS_CALL}f{DS_SEP}{{"n": 1}}', "unclosed <｜tool▁call▁begin｜>"),
    ("deepseekv31", f'{DS_CALLS}{DS_CALL}f{DS_SEP}{{"n": 1}} oops{DS_END}', "expected <｜tool▁call▁end｜> after"),
    # kimi_k2
    ("kimi_k2", f'{K_SECTION}{K_CALL}functions.f:0{K_ARGS}{{"n": }}{K_END}{K_SECTION_END}', "invalid JSON"),
    ("kimi_k2", f"{K_SECTION}{K_CALL}0{K_ARGS}{{}}{K_END}{K_SECTION_END}", "names no function"),
    ("kimi_k2", f'{K_SECTION}{K_CALL}functions.f:0{K_ARGS}{{"n": 1}}', "unclosed <|tool_call_begin|>"),
    ("kimi_k2", f"{K_SECTION}{K_CALL}functions.f:0{K_END}", "no <|tool_call_argument_begin|>"),
    # gpt-oss
    ("gpt-oss", '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"n": }', "invalid JSON"),
    ("gpt-oss", "<|channel|>commentary to=functions. <|constrain|>json<|message|>{}", "has no function name"),
    ("gpt-oss", "<|channel|>analysis<|message|>hm<|end|><|start|>assistant<|channel|>commentary to=functions.f json",
     "unfinished tool call header"),
    ("gpt-oss", '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"n": 1', "invalid JSON"),
    ("gpt-oss", "<|channel|>commentary to=functions.f <|constrain|>json<|message|>", "has no arguments"),
]  # fmt: skip


@pytest.mark.parametrize(("family", "text", "message"), MALFORMED)
def test_malformed_calls_are_errors_that_say_what_is_wrong(family, text, message):
    turn = get_parser(family, TOOLS)(text)
    assert len(turn.calls) == 1, turn
    call = turn.calls[0]
    assert call.error is not None and message in call.error and call.arguments is None, call.error
    assert len(call.error) < 400


@pytest.mark.parametrize("family", ["qwen3_coder", "glm45", "llama3", "mistral", "deepseekv3", "deepseekv31",
                                    "kimi_k2", "gpt-oss"])  # fmt: skip
def test_a_malformed_call_does_not_hide_the_next_one(family):
    render = get_renderer(family)
    good = render("", [("g", {"s": "x"})])
    if family == "gpt-oss":
        text = (
            "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{oops}<|call|><|start|>assistant" + good
        )
    else:
        xml = family in {"qwen3_coder", "glm45"}
        bad = render("", [("f", {"n": "x1"})]) if xml else render("", [("f", {"n": 1})]).replace("1", "oops", 1)
        separator = "; " if family == "llama3" else ""
        text = bad + separator + good
    calls = get_parser(family, TOOLS)(text).calls
    assert [c.error is None for c in calls] == [False, True] and calls[1].name == "g", calls


def test_xml_values_without_a_schema_are_json_when_they_parse():
    text = qwen3_call(
        "<parameter=a>\n12\n</parameter>\n<parameter=b>\nhello\n</parameter>\n<parameter=c>\n[1]\n</parameter>\n"
    )
    assert get_parser("qwen3_coder")(text).calls[0].arguments == {"a": 12, "b": "hello", "c": [1]}
    typed = get_parser("qwen3_coder", [{"type": "function", "function": {"name": "f", "parameters": {
        "properties": {"a": {"type": "string"}, "c": {"type": ["array", "null"]}}}}}])(text)  # fmt: skip
    assert typed.calls[0].arguments == {"a": "12", "b": "hello", "c": [1]}
    glm = "<tool_call>f\n<arg_key> a </arg_key>\n<arg_value>true</arg_value>\n"
    glm += "<arg_key>b</arg_key><arg_value>x</arg_value></tool_call>"
    assert get_parser("glm45")(glm).calls[0].arguments == {"a": True, "b": "x"}
    jinja_bool = qwen3_call("<parameter=b>\nTrue\n</parameter>\n")  # Jinja's str() of a bool
    assert get_parser("qwen3_coder", TOOLS)(jinja_bool).calls[0].arguments == {"b": True}


def test_qwen3_coder_tolerates_a_missing_parameter_end_and_reads_several_functions_per_block():
    text = "Hi\n\n<tool_call>\n<function=f>\n<parameter=s>\nx\n<parameter=n>\n2\n</function>\n"
    text += "<function=g>\n</function>\n</tool_call>"
    turn = get_parser("qwen3_coder", TOOLS)(text)
    assert turn.content == "Hi" and [(c.name, c.arguments) for c in turn.calls] == [
        ("f", {"s": "x", "n": 2}),
        ("g", {}),
    ]


def test_llama3_prose_with_braces_is_not_a_call():
    for text in ('Use {x} or {"a": 1} here.', 'The JSON {"name": "Bob"} is a person.', "{not json", "a } b {"):
        turn = get_parser("llama3")(text)
        assert turn.calls == [] and turn.content == text
    turn = get_parser("llama3")(
        'Sure: {"a": {"b": 1}} then\n{"name": "f", "arguments": {"x": 1}};{"name": "g", "parameters": {}}'
    )
    assert turn.content == 'Sure: {"a": {"b": 1}} then' and [c.name for c in turn.calls] == ["f", "g"]
    tagged = get_parser("llama3")('Let me check.<|python_tag|>{"name": "f", "parameters": {"x": "}"}}')
    assert tagged.content == "Let me check." and tagged.calls[0].arguments == {"x": "}"}


def test_mistral_reads_the_compact_form_with_or_without_call_ids():
    calls = [("f", {"a": [1, "]"]}), ("g", {})]
    turn = get_parser("mistral")(render_mistral_compact("Hi", calls))
    assert turn.content == "Hi" and [(c.name, c.arguments) for c in turn.calls] == calls
    turn = get_parser("mistral")('[TOOL_CALLS]f[CALL_ID]abc123XYZ[ARGS]{"a": 1}')
    assert [(c.name, c.arguments) for c in turn.calls] == [("f", {"a": 1})]


def test_kimi_k2_reads_the_name_out_of_the_id():
    text = (
        f"ok{K_SECTION}{K_CALL} functions.web.search:7 {K_ARGS}{{}}{K_END}{K_CALL}g:8{K_ARGS}{{}}{K_END}{K_SECTION_END}"
    )
    turn = get_parser("kimi_k2")(text)
    assert turn.content == "ok" and [c.name for c in turn.calls] == ["web.search", "g"]


def test_gpt_oss_content_is_the_final_channel_and_analysis_is_left_out():
    parse = get_parser("gpt-oss")
    text = "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>The answer."
    assert parse(text).content == "The answer." and parse(text).calls == []
    call_first = "<|channel|>analysis<|message|>Hm.<|end|>"
    call_first += '<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{"n": 1}'
    turn = parse(call_first)
    assert turn.content == "" and [(c.name, c.arguments) for c in turn.calls] == [("f", {"n": 1})]
    preamble = "<|channel|>commentary<|message|>Checking.<|end|>"
    preamble += "<|start|>assistant<|channel|>commentary to=browser.search <|constrain|>json<|message|>{}"
    turn = parse(preamble)
    assert turn.content == "Checking." and turn.calls[0].name == "browser.search"
    assert parse("plain text, no harmony").content == "plain text, no harmony"


def test_registry_hands_schemas_only_to_the_parsers_that_read_them():
    assert isinstance(get_parser("qwen3_coder", TOOLS), functools.partial)
    assert get_parser("qwen3_coder") is get_parser("qwen3_coder", None)
    assert get_parser("hermes", TOOLS) is parsers.parse_hermes
    with pytest.raises(ValueError, match="unknown tool parser 'nope'; known: deepseekv3, deepseekv31, gl"):
        get_parser("nope", TOOLS)
    with pytest.raises(ValueError, match="unknown tool-call renderer 'nope'"):
        get_renderer("nope")


def test_the_compatibility_module_keeps_its_names():
    for name in ("ToolCall", "ParsedTurn", "Parser", "PARSERS", "register_parser", "get_parser", "parse_call_json",
                 "parse_hermes", "OPEN", "CLOSE", "MAX_ARGUMENT_DEPTH"):  # fmt: skip
        assert hasattr(parsers, name), name
    assert parsers.OPEN == "<tool_call>" and parsers.get_parser("qwen25") is parsers.parse_hermes
