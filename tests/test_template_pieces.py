"""Rendering from cached template pieces (``ChatTokenizer.render``) is rendering: on any conversation of
plain messages it gives what transformers' ``apply_chat_template`` gives, for templates that only
print contents (or test whether they are empty), and templates that read contents are rendered
every time."""

from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_consistency_incremental import TEMPLATES

from data.tiny_model import CHAT_TEMPLATE
from rollout.tokens import ChatTokenizer
from tests.conftest import CountingTool

MORE_TEMPLATES = {
    "marks-empty-contents": CHAT_TEMPLATE.replace(
        "{{ message.content }}<|im_end|>",
        "{% if message.content %}{{ message.content }}{% else %}(empty){% endif %}<|im_end|>",
    ),
    "concatenates-like-qwen25": CHAT_TEMPLATE.replace(
        "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>",
        "{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' }}",
    ),
}
ALL = {**TEMPLATES, **MORE_TEMPLATES}
READS_CONTENTS = {"trims-tool-results", "tool-results-as-json", "branches-on-tool-content", "drops-earlier-reasoning"}


@functools.cache
def chat_for(tokenizer, name: str) -> ChatTokenizer:
    clone = tokenizer.__class__(
        tokenizer_object=tokenizer.backend_tokenizer, chat_template=ALL[name], eos_token="<|im_end|>"
    )
    return ChatTokenizer(clone, [CountingTool().schema])


CONTENTS = st.one_of(
    st.just(""),
    st.sampled_from([" ", "x", "a\nb", "</think>", "<think>hm</think>ok", "error!", "{{ x }}", "  padded  ", "None"]),
    st.text(max_size=20),
)
MESSAGES = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool"]), "content": CONTENTS}),
    min_size=1,
    max_size=7,
)


@pytest.mark.parametrize("name", ALL)
@settings(max_examples=120, deadline=None)
@given(messages=MESSAGES, add_generation_prompt=st.booleans())
def test_rendering_from_pieces_is_what_transformers_renders(tokenizer, name, messages, add_generation_prompt):
    chat = chat_for(tokenizer, name)
    expected = chat.tokenizer.apply_chat_template(
        messages, tools=chat.tools, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert chat.render(messages, add_generation_prompt) == expected


@pytest.mark.parametrize("name", ALL)
def test_pieces_are_kept_only_for_templates_that_print_contents_as_they_are(tokenizer, name):
    chat = chat_for(tokenizer, name)
    conversation = [{"role": "system", "content": "S."}, {"role": "user", "content": "Go."},
                    {"role": "assistant", "content": "ok"}, {"role": "tool", "content": "3"}]  # fmt: skip
    chat.render(conversation, True)
    shape = tuple((m["role"], False) for m in conversation)
    pieces = chat._conversation_pieces(shape, True)
    assert (pieces is None) == (name in READS_CONTENTS or name == "drops-earlier-reasoning")
