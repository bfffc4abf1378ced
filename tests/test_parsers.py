"""The Qwen2.5/Hermes tool-call parser: calls, content, and malformed calls reported, never raised."""

from __future__ import annotations

import pytest

from rollout.parsers import PARSERS, ParsedTurn, get_parser, parse_hermes, register_parser


def test_text_without_calls_is_all_content():
    turn = parse_hermes("The answer is \\boxed{4}.")
    assert turn.content == "The answer is \\boxed{4}." and turn.calls == []


def test_one_call_with_text_before_it():
    turn = parse_hermes(
        'Let me compute.\n<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>'
    )
    assert turn.content == "Let me compute."
    assert [(c.name, c.arguments, c.error) for c in turn.calls] == [("calculator", {"expression": "2+2"}, None)]


def test_several_calls_in_one_turn_keep_their_order():
    text = "".join(f'<tool_call>\n{{"name": "t{i}", "arguments": {{}}}}\n</tool_call>\n' for i in range(3))
    assert [c.name for c in parse_hermes(text).calls] == ["t0", "t1", "t2"]


def test_arguments_given_as_a_json_string_are_decoded():
    turn = parse_hermes('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert turn.calls[0].arguments == {"x": 1}


@pytest.mark.parametrize(
    ("text", "message_start"),
    [
        ('<tool_call>{"name": "f", "arguments": {</tool_call>', "invalid JSON in tool call"),
        ("<tool_call>[1, 2]</tool_call>", "a tool call must be a JSON object"),
        ('<tool_call>{"arguments": {}}</tool_call>', "tool call has no 'name' string"),
        (
            '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
            "the arguments of tool call 'f' must be a JSON object",
        ),
        ('<tool_call>{"name": "f", "arguments": {}}', "unclosed <tool_call>"),
        ("<tool_call></tool_call>", "invalid JSON in tool call"),
    ],
)
def test_malformed_calls_are_reported_not_raised(text, message_start):
    turn = parse_hermes(text)
    assert len(turn.calls) == 1
    assert turn.calls[0].error.startswith(message_start)


def test_a_malformed_call_does_not_hide_the_good_ones():
    text = '<tool_call>{bad}</tool_call><tool_call>{"name": "g", "arguments": {}}</tool_call>'
    calls = parse_hermes(text).calls
    assert calls[0].error is not None and calls[1].name == "g" and calls[1].error is None


def test_registry_knows_qwen25_and_hermes_and_takes_new_formats():
    assert get_parser("qwen25") is get_parser("hermes") is parse_hermes

    @register_parser("plain-test")
    def plain(text: str) -> ParsedTurn:
        return ParsedTurn(content=text)

    assert get_parser("plain-test") is plain
    del PARSERS["plain-test"]
    with pytest.raises(ValueError, match=r"unknown tool parser 'nope'; known: .*hermes, .*qwen25"):
        get_parser("nope")
