"""The incremental consistency check (``rollout/transcript.py``) reports exactly what a full
re-render and re-encoding of the conversation reports: every request is run through
``run_request`` (whose check is the incremental one) and its ``consistency_diff`` compared with
``check_consistency`` without a transcript, on hostile engine output and on chat templates
that drift from the tokens built turn by turn."""

from __future__ import annotations

import asyncio

import pytest
from conftest import CountingTool, ScriptedEngine
from hypothesis import given
from hypothesis import strategies as st
from test_hostile_text import HOSTILE, LOOP, TokenEngine, decodable_text, model_outputs

from data.tiny_model import CHAT_TEMPLATE, EMBEDDED_MODEL
from rollout.loop import RolloutConfig, run_request
from rollout.request import AsyncRolloutRequest
from rollout.tokens import ChatTokenizer, load_tokenizer


def run(engine, chat: ChatTokenizer, config: RolloutConfig = HOSTILE) -> AsyncRolloutRequest:
    tool = CountingTool()
    request = AsyncRolloutRequest("r0", 0, 0, [{"role": "system", "content": "S."}, {"role": "user", "content": "Go."}])
    asyncio.run(run_request(request, engine, chat, {"echo": tool}, config))
    return request


def by_transformers(chat: ChatTokenizer) -> ChatTokenizer:
    """The same tokenizer and tools with every shortcut off: each check renders the conversation
    with transformers' ``apply_chat_template`` and encodes all of it with the tokenizer."""
    reference = ChatTokenizer(chat.tokenizer, chat.tools)
    reference._direct = reference._backend = reference._splitter = reference._encode = reference._ascii_decode = None
    return reference


def assert_same_as_full_check(chat: ChatTokenizer, request: AsyncRolloutRequest) -> None:
    full = by_transformers(chat).check_consistency(request.messages, request.all_ids)
    assert (request.consistency_diff is None) == full.ok, request.consistency_diff
    if not full.ok:
        assert request.consistency_diff == full.diff


@pytest.fixture(scope="module")
def chat(tokenizer):
    return ChatTokenizer(tokenizer, [CountingTool().schema])


def test_the_test_and_embedded_tokenizers_have_the_incremental_check(chat):
    assert chat._splitter is not None
    assert ChatTokenizer(load_tokenizer(EMBEDDED_MODEL), [CountingTool().schema])._splitter is not None


def test_a_consistent_conversation_is_checked_without_encoding_it_again(chat, monkeypatch):
    encoded: list[str] = []
    encode = chat.encode
    monkeypatch.setattr(chat, "encode", lambda text: encoded.append(text) or encode(text))
    turns = ['<tool_call>{"name": "echo", "arguments": {"text": "ok"}}</tool_call>', "done"]
    request = run(ScriptedEngine(chat, lambda turn, prompt, rid: turns[min(turn, 1)]), chat)
    assert request.consistency_diff is None and request.metrics.tool_calls == 1
    assert [text for text in encoded if "<|im_start|>" in text] == []  # a full check encodes the conversation


def test_delta_pieces_are_reused_only_where_the_template_prints_contents_as_they_are(tokenizer):
    def pieces(template: str):
        clone = tokenizer.__class__(
            tokenizer_object=tokenizer.backend_tokenizer, chat_template=template, eos_token="<|im_end|>"
        )
        return ChatTokenizer(clone)._delta_pieces((("tool", False),))

    assert pieces(CHAT_TEMPLATE) == [
        "<|im_start|>user\n<tool_response>\n",
        "\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
    ]
    for name in ("trims-tool-results", "tool-results-as-json", "branches-on-tool-content"):
        assert pieces(TEMPLATES[name]) is None, name


@LOOP
@given(data=st.data())
def test_same_report_as_a_full_check_whatever_token_ids_the_engine_returns(chat, tokenizer, data):
    ids = st.lists(st.integers(0, len(tokenizer) - 1), max_size=120)
    turns = data.draw(st.lists(st.tuples(ids, st.sampled_from(["stop", "length", "abort"])), min_size=1, max_size=3))
    assert_same_as_full_check(chat, run(TokenEngine(turns), chat))


@pytest.fixture(scope="module")
def merges_chat():
    from test_ascii_tokens import byte_level_bpe

    return ChatTokenizer(byte_level_bpe("qwen"), [CountingTool().schema])


@LOOP
@given(data=st.data())
def test_same_report_as_a_full_check_with_merges_whatever_token_ids_the_engine_returns(merges_chat, data):
    """With merges, random ids are mostly not how the tokenizer would spell their text."""
    ids = st.lists(st.integers(0, len(merges_chat.tokenizer) - 1), max_size=60)
    turns = data.draw(st.lists(st.tuples(ids, st.sampled_from(["stop", "length"])), min_size=1, max_size=3))
    assert_same_as_full_check(merges_chat, run(TokenEngine(turns), merges_chat))


@LOOP
@given(st.lists(model_outputs(decodable_text, huge=False), min_size=1, max_size=3))
def test_same_report_as_a_full_check_whatever_the_model_writes(chat, turns):
    assert_same_as_full_check(
        chat, run(ScriptedEngine(chat, lambda turn, prompt, rid: turns[min(turn, len(turns) - 1)]), chat)
    )


TOOL = "{{ message.content }}\n</tool_response>"
TEMPLATES = {
    "trims-tool-results": CHAT_TEMPLATE.replace(TOOL, "{{ message.content | trim }}\n</tool_response>"),
    "tool-results-as-json": CHAT_TEMPLATE.replace(TOOL, "{{ message.content | tojson }}\n</tool_response>"),
    "branches-on-tool-content": CHAT_TEMPLATE.replace(
        TOOL, "{% if 'error' in message.content %}[failed] {% endif %}{{ message.content }}\n</tool_response>"
    ),
    "numbers-the-turns": CHAT_TEMPLATE.replace(
        "<|im_start|>{{ message.role }}\n", "<|im_start|>{{ message.role }} {{ loop.index }}\n"
    ),
    "drops-earlier-reasoning": CHAT_TEMPLATE.replace(
        "{{ message.content }}<|im_end|>",
        "{% if message.role == 'assistant' and not loop.last %}{{ message.content.split('</think>')[-1] }}"
        "{% else %}{{ message.content }}{% endif %}<|im_end|>",
    ),
    "unchanged": CHAT_TEMPLATE,
}
DRIFTING = {"numbers-the-turns", "drops-earlier-reasoning"}
"""Templates whose full render differs from the tokens built turn by turn on some conversation;
the others change contents (trim, JSON, a branch on the content) in a way delta rendering follows."""
SCRIPTS = {
    "padded-result": ['<tool_call>{"name": "echo", "arguments": {"text": "  padded \\n"}}</tool_call>', "done"],
    "error-result": ['<tool_call>{"name": "echo", "arguments": {"text": "an error"}}</tool_call>', "done"],
    "quoted-result": ['<tool_call>{"name": "echo", "arguments": {"text": "say \\"hi\\""}}</tool_call>', "ok"],
    "reasoning": ['<think>hm</think><tool_call>{"name": "echo", "arguments": {"text": "x"}}</tool_call>', "y"],
    "two-calls": [
        '<tool_call>{"name": "echo", "arguments": {"text": "a"}}</tool_call>'
        '<tool_call>{"name": "echo", "arguments": {"text": "b"}}</tool_call>',
        "done",
    ],
    "no-call": ["just an answer"],
    "cut-short": ["x" * 150],
}


@pytest.mark.parametrize("template", TEMPLATES)
def test_same_report_as_a_full_check_on_templates_that_drift_or_change_contents(tokenizer, template):
    clone = tokenizer.__class__(
        tokenizer_object=tokenizer.backend_tokenizer, chat_template=TEMPLATES[template], eos_token="<|im_end|>"
    )
    chat = ChatTokenizer(clone, [CountingTool().schema])
    config = RolloutConfig(max_turns=3, max_new_tokens=120, max_model_len=4096)
    diffs = {}
    for name, turns in SCRIPTS.items():
        request = run(
            ScriptedEngine(chat, lambda turn, prompt, rid, turns=turns: turns[min(turn, len(turns) - 1)]), chat, config
        )
        assert_same_as_full_check(chat, request)
        diffs[name] = request.consistency_diff is not None
        assert request.error is None
    assert any(diffs.values()) == (template in DRIFTING), diffs
