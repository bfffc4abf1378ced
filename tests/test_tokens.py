"""Chat-template rendering, delta rendering and the consistency check on a ChatML template."""

from __future__ import annotations

import pytest

from rollout.tokens import ChatTokenizer, TemplateError, load_tokenizer

SCHEMA = {
    "type": "function",
    "function": {"name": "echo", "description": "Echo.", "parameters": {"type": "object", "properties": {}}},
}
PROMPT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]


@pytest.fixture
def chat(tokenizer):
    return ChatTokenizer(tokenizer, [SCHEMA])


def test_prompt_includes_the_tool_schemas_and_the_generation_prompt(chat):
    text = chat.decode(chat.prompt_ids(PROMPT))
    assert '"name": "echo"' in text
    assert text.endswith("<|im_start|>assistant\n")


def test_turn_glue_and_stop_tokens_come_from_the_template(chat, tokenizer):
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert chat.turn_close_ids == [im_end, *tokenizer.encode("\n", add_special_tokens=False)]
    assert im_end in chat.stop_token_ids


def test_assistant_close_adds_only_what_the_engine_did_not_produce(chat):
    im_end = chat.turn_close_ids[0]
    assert chat.assistant_close_ids([5, 6, im_end]) == chat.turn_close_ids[1:]
    assert chat.assistant_close_ids([5, 6]) == chat.turn_close_ids


def test_incremental_tokens_equal_a_full_render(chat):
    ids = chat.prompt_ids(PROMPT)
    messages = list(PROMPT)
    for answer, tools in [("call one", ["r1"]), ("call two", ["r2", "r3"]), ("done", [])]:
        out = [*chat.encode(answer), chat.turn_close_ids[0]]
        ids += out
        messages.append({"role": "assistant", "content": chat.assistant_text(out)})
        if tools:
            new = [{"role": "tool", "content": t} for t in tools]
            ids += chat.assistant_close_ids(out) + chat.delta_ids(new)
            messages += new
    assert chat.check_consistency(messages, ids).ok
    assert ids == chat.encode(chat.render(messages))[: len(ids)]


def test_consistency_check_reports_where_tokens_differ(chat):
    messages = [*PROMPT, {"role": "assistant", "content": "abc"}]
    ids = chat.encode(chat.render(messages))
    ids[len(chat.prompt_ids(PROMPT)) + 1] = chat.encode("X")[0]
    report = chat.check_consistency(messages, ids)
    assert not report.ok
    assert report.first_mismatch == len(chat.prompt_ids(PROMPT)) + 1
    assert "re-rendered has 'b'" in report.diff and "incremental has 'X'" in report.diff


def test_consistency_check_reports_missing_tokens(chat):
    messages = [*PROMPT, {"role": "user", "content": "more"}]
    ids = chat.prompt_ids(PROMPT)
    report = chat.check_consistency(messages, ids)
    assert not report.ok and "lengths" in report.diff


def test_template_that_rewrites_history_is_refused_for_deltas(tokenizer):
    # like Qwen3's template, earlier assistant turns render differently once later turns follow
    rewriting = (
        "{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}[old]{% else %}"
        "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    clone = tokenizer.__class__(
        tokenizer_object=tokenizer.backend_tokenizer, chat_template=rewriting, eos_token="<|im_end|>"
    )
    chat = ChatTokenizer(clone)
    with pytest.raises(TemplateError, match="changes earlier turns"):
        chat.delta_ids([{"role": "tool", "content": "x"}])


def test_tokenizer_without_template_is_refused(tokenizer):
    clone = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer)
    with pytest.raises(TemplateError, match="has no chat_template"):
        ChatTokenizer(clone)


def test_saved_tiny_model_tokenizer_reloads_exactly(tiny_model_dir, tokenizer):
    text = "<|im_start|>assistant\n a  b\t<tool_call>{} </tool_call><|im_end|>\n"
    loaded = load_tokenizer(tiny_model_dir)
    assert loaded.encode(text, add_special_tokens=False) == tokenizer.encode(text, add_special_tokens=False)
    assert loaded.decode(loaded.encode(text, add_special_tokens=False)) == text
    assert loaded.chat_template == tokenizer.chat_template
