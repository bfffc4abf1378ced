"""Every tool-call format: rendering then parsing gives the content and calls back; no text makes a
parser raise, truncated calls included. (Malformed calls: tests/test_tool_parsers_malformed.py.)"""

from __future__ import annotations

import string
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout.tool_parsers import PARSERS, RENDERERS, ParsedTurn, get_parser, get_renderer

FAMILIES = ["qwen25", "hermes", "qwen3_coder", "llama3", "mistral", "deepseekv3", "deepseekv31", "gpt-oss", "kimi_k2",
            "glm45"]  # fmt: skip
XML = {"qwen3_coder", "glm45"}
"""Families that write string values raw: their round trip declares each argument's type."""
CONTENT_MARKERS = {
    "qwen25": ["<tool_call>"],
    "hermes": ["<tool_call>"],
    "qwen3_coder": ["<tool_call>"],
    "llama3": ['"name"', "<|python_tag|>"],  # a JSON object with a name in prose is a call
    "mistral": ["[TOOL_CALLS"],
    "deepseekv3": ["<｜tool▁call"],
    "deepseekv31": ["<｜tool▁call"],
    "gpt-oss": ["<|"],  # any harmony token
    "kimi_k2": ["<|tool_call"],
    "glm45": ["<tool_call>"],
}
"""What the content of a round trip avoids: the family's markers (they would start a call)."""
VALUE_MARKERS = {
    "qwen3_coder": ["</parameter>", "<parameter=", "</function>", "</tool_call>"],  # they end a raw value
    "glm45": ["</arg_value>", "</arg_key>", "</tool_call>"],
    "gpt-oss": ["<|end|>", "<|call|>", "<|return|>"],  # they end a message, JSON strings included
}
"""What the keys and string values of a round trip avoid: text the format cannot hold inside a value."""

IDENTIFIER = string.ascii_letters + string.digits + "_"
SPECIAL = st.sampled_from(list('"\\\n\t {}[]<>|:;,/=ab7') + ["é", "漢", "😀", "\u2028"])
"""Quotes, backslashes, newlines, brackets and unicode, for strings that test escaping."""
text = st.text(max_size=12) | st.text(SPECIAL, max_size=12)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | text
    | st.sampled_from(["12", "-3.5", "true", "null", '"quoted"', "[1]", "{}", " 7 ", "", "\n", "a\\nb"])
)  # the last: strings that look like JSON, which the XML formats must keep as strings
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3), max_leaves=8
)
names = st.builds(str.__add__, st.sampled_from(string.ascii_letters + "_"), st.text(IDENTIFIER, max_size=20))
"""Tool names: ``[A-Za-z_][A-Za-z0-9_]{0,20}``."""
MODEST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _strings(value: Any):
    """Every string in a JSON value, keys included."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _keys(family: str) -> st.SearchStrategy[str]:
    if family == "qwen3_coder":  # <parameter=KEY>: a key ends at '>'
        return text.map(lambda key: key.replace(">", ""))
    if family == "glm45":  # keys are read stripped
        return text.map(str.strip)
    return text


@st.composite
def turns(draw, family: str) -> tuple[str, list[tuple[str, dict]]]:
    """Content (may be empty) and 0-4 calls the family can write."""
    content = draw((st.text(max_size=40) | st.text(SPECIAL, max_size=40)).map(str.rstrip))
    if any(marker in content for marker in CONTENT_MARKERS[family]):
        content = ""
    count = draw(st.integers(0, 4))
    call_names = draw(st.lists(names, min_size=count, max_size=count, unique=family in XML))  # one schema per name
    forbidden = VALUE_MARKERS.get(family, [])
    arguments = st.dictionaries(_keys(family), json_values, max_size=4).filter(
        lambda args: not any(m in s for s in _strings(args) for m in forbidden)
    )
    return content, [(name, draw(arguments)) for name in call_names]


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    types = {int: "integer", float: "number", str: "string", type(None): "null", list: "array", dict: "object"}
    return types[type(value)]


def tools_for(calls: list[tuple[str, dict]]) -> list[dict]:
    """OpenAI-style tool schemas declaring each argument's type as in ``calls``."""
    return [
        {"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "properties": {key: {"type": _json_type(value)} for key, value in args.items()}}}}
        for name, args in calls
    ]  # fmt: skip


def test_every_family_has_a_parser_and_a_renderer():
    assert set(FAMILIES) <= set(PARSERS) and set(FAMILIES) <= set(RENDERERS)


@pytest.mark.parametrize("family", FAMILIES)
@MODEST
@given(data=st.data())
def test_rendered_calls_parse_back(family, data):
    content, calls = data.draw(turns(family))
    rendered = get_renderer(family)(content, calls)
    turn = get_parser(family, tools_for(calls) if family in XML else None)(rendered)
    assert turn.content == content, rendered
    assert [(c.name, c.arguments, c.error) for c in turn.calls] == [(n, a, None) for n, a in calls], rendered


MARKERS = sorted({
    "<tool_call>", "</tool_call>", "<function=f>", "<function=", "</function>", "<parameter=a>", "</parameter>",
    "<|python_tag|>", '{"name": "f", "parameters": ', '{"name": "f", "arguments": ', "[TOOL_CALLS]", "[ARGS]",
    "[CALL_ID]", "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
    "<｜tool▁calls▁end｜>", "function", "\n```json\n", "\n```", "<|channel|>", "analysis", "final", "commentary",
    " to=functions.f", "<|constrain|>json", "<|message|>", "<|end|>", "<|call|>", "<|return|>",
    "<|start|>assistant", "<|tool_calls_section_begin|>", "<|tool_call_begin|>", "functions.f:0",
    "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|tool_calls_section_end|>", "<arg_key>", "</arg_key>",
    "<arg_value>", "</arg_value>", "{", "}", "[", "]", '"', "\\", ";", "\n", "{}", '{"a": 1}', "[1, 2]", "123",
})  # fmt: skip
lone_surrogates = st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=3)
hostile = st.lists(st.sampled_from(MARKERS) | st.text(max_size=8) | lone_surrogates, max_size=30).map("".join)
"""Text of the families' markers and JSON pieces in any order, with stray text and lone surrogates."""
HOSTILE_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer"}, "b": {"type": ["string", "null"]}, "c": {"anyOf": [{"type": "object"}]}}}}}]  # fmt: skip


def _check(turn: Any) -> None:
    """A parse result: content and calls, each call readable or an error (then without arguments)."""
    assert isinstance(turn, ParsedTurn) and isinstance(turn.content, str)
    for call in turn.calls:
        assert isinstance(call.name, str)
        if call.error is None:
            assert isinstance(call.arguments, dict)
        else:
            assert call.arguments is None and call.error
            call.error.encode("utf-8")  # an error always serialises


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=hostile | st.text(max_size=200))
def test_no_text_makes_a_parser_raise(family, text):
    _check(get_parser(family)(text))
    _check(get_parser(family, HOSTILE_TOOLS)(text))


@pytest.mark.parametrize("family", FAMILIES)
def test_every_truncation_of_a_rendered_turn_parses(family):
    calls = [("search", {"query": 'say "hi" \\ 漢字\n', "n": 3, "deep": {"a": [1, 2.5, None, True]}}),
             ("fetch", {"url": "https://x.y/?a=1&b={2}"})]  # fmt: skip
    rendered = get_renderer(family)("Let me look.", calls)
    parse = get_parser(family, tools_for(calls))
    for cut in range(len(rendered) + 1):
        turn = parse(rendered[:cut])
        _check(turn)
        readable = [(c.name, c.arguments) for c in turn.calls if c.error is None]
        assert readable == calls[: len(readable)], (cut, rendered[:cut])  # never a call the text did not make


@pytest.mark.parametrize("family", FAMILIES)
def test_deep_and_long_text_is_handled_quickly(family):
    for text in ("[" * 100_000, "{" * 100_000, '{"' * 50_000, "<tool_call>" * 10_000, "<|message|>" * 10_000):
        _check(get_parser(family)(text))
