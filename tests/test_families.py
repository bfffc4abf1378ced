"""The test models of each chat family (``tests/families.py``): tokenizers, templates, saved models."""

from __future__ import annotations

import asyncio
import json
import unicodedata

import pytest
import torch
from conftest import TINY
from families import FAMILIES, build_family_tokenizer, family, save_family_model
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from rollout.reasoning import REASONING_FORMATS, get_reasoning_format
from rollout.tokens import ChatTokenizer, TemplateError, load_tokenizer
from tools.base import function_schema

TOOLS = [function_schema("echo", "Echo text back.", {
    "type": "object", "properties": {"text": {"type": "string", "description": "What to echo."}}, "required": ["text"],
})]  # fmt: skip
UNICODE = "Grüße, naïve café — 日本語 😀 ｜▁ ◁▷ «ok»\t\r\n"

CALLS = {
    "qwen25": '<tool_call>\n{"name": "echo", "arguments": {"text": "hi"}}\n</tool_call>',
    "qwen3-coder": "<tool_call>\n<function=echo>\n<parameter=text>\nhi\n</parameter>\n</function>\n</tool_call>",
    "llama3": '{"name": "echo", "parameters": {"text": "hi"}}',
    "mistral": '[TOOL_CALLS][{"name": "echo", "arguments": {"text": "hi"}}]',
    "deepseek-v3": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>echo\n```json\n"
                   '{"text": "hi"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "gpt-oss": '<|channel|>commentary to=functions.echo <|constrain|>json<|message|>{"text": "hi"}',
    "kimi_k2": '<|tool_calls_section_begin|><|tool_call_begin|>functions.echo:0<|tool_call_argument_begin|>'
               '{"text": "hi"}<|tool_call_end|><|tool_calls_section_end|>',
    "glm45": "<tool_call>echo\n<arg_key>text</arg_key>\n<arg_value>hi</arg_value>\n</tool_call>",
}  # fmt: skip
CALLS |= {"qwen3": CALLS["qwen25"], "qwen3-thinking": CALLS["qwen25"], "deepseek-r1": CALLS["deepseek-v3"]}


def output(name: str, content: str) -> str:
    """An assistant turn as the model writes it: where its prompt opened the reasoning, that first."""
    fmt = get_reasoning_format(family(name).reasoning_parser)
    return f"Thinking.\n{fmt.end}\n\n{content}" if fmt is not None and fmt.forced else content


def conversation(name: str) -> list[dict[str, str]]:
    """Three turns with a tool call in the family's own format: user, assistant calls, tool, assistant answers."""
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Echo hi."},
        {"role": "assistant", "content": output(name, CALLS[name])},
        {"role": "tool", "content": "hi"},
        {"role": "assistant", "content": output(name, "It said hi.")},
        {"role": "user", "content": "Thanks."},
    ]


def with_reasoning(name: str, reasoning: str, answer: str) -> str:
    """An assistant turn with reasoning in the family's format (``<think>`` where it has none)."""
    fmt = get_reasoning_format(family(name).reasoning_parser)
    if fmt is None:
        return f"<think>\n{reasoning}\n</think>\n\n{answer}"
    if fmt.name == "gpt-oss":
        return f"<|channel|>analysis<|message|>{reasoning}<|end|><|start|>assistant<|channel|>final<|message|>{answer}"
    return f"{fmt.start}\n{reasoning}\n{fmt.end}\n\n{answer}"


def test_the_families_and_their_parsers():
    assert set(FAMILIES) == {"qwen25", "qwen3", "qwen3-thinking", "qwen3-coder", "llama3", "mistral", "deepseek-r1",
                             "deepseek-v3", "gpt-oss", "kimi_k2", "glm45"}  # fmt: skip
    tool_parsers = {name: family(name).tool_parser for name in FAMILIES}
    assert set(tool_parsers.values()) == {"qwen25", "qwen3_coder", "llama3", "mistral", "deepseekv3", "gpt-oss",
                                          "kimi_k2", "glm45"}  # fmt: skip
    for name in FAMILIES:
        assert family(name).reasoning_parser in {"none", *REASONING_FORMATS}
    with pytest.raises(ValueError, match="unknown family 'qwen9'"):
        family("qwen9")


@pytest.mark.parametrize("name", FAMILIES)
def test_the_chat_tokenizer_accepts_the_template(name):
    spec = family(name)
    chat = ChatTokenizer(spec.tokenizer, TOOLS)
    stop_ids = spec.stop_token_ids
    assert None not in stop_ids and len(set(stop_ids)) == len(stop_ids)
    assert all(len(spec.tokenizer.encode(token, add_special_tokens=False)) == 1 for token in spec.stop_tokens)
    if name == "glm45":  # no end-of-turn token: the model stops at the next turn's role tag
        assert chat.turn_close_ids == []
    elif name == "gpt-oss":  # the model ends with <|return|> or <|call|>; history closes messages with <|end|>
        assert chat.decode(chat.turn_close_ids) == "<|end|>" and spec.end_of_turn == "<|return|>"
    else:
        assert chat.turn_close_ids[0] == spec.tokenizer.convert_tokens_to_ids(spec.end_of_turn)
    assert chat._direct is not None and chat._splitter is not None  # the fast paths hold


@pytest.mark.parametrize("name", FAMILIES)
def test_a_three_turn_conversation_with_tools_renders_and_builds_turn_by_turn(name):
    spec = family(name)
    chat = ChatTokenizer(spec.tokenizer, TOOLS)
    messages = conversation(name)
    text = chat.render(messages, add_generation_prompt=True)
    assert "echo" in text and "Echo text back." in text and "Be brief." in text
    assert CALLS[name] in text and "It said hi." in text and "Thanks." in text
    assert chat.render(messages, add_generation_prompt=True) == spec.tokenizer.apply_chat_template(
        messages, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    ids = chat.encode(text)
    assert chat.decode(ids) == text
    assert all(chat.encode(token) == [i] for token, i in spec.tokenizer.get_added_vocab().items())

    # as a rollout builds it: the prompt, each output with its stop token, the template's glue, the delta
    built = chat.prompt_ids(messages[:2])
    for output, delta in ((messages[2], [messages[3]]), (messages[4], None)):
        out = chat.encode(output["content"]) + chat.turn_close_ids[:1]
        assert chat.assistant_text(out) == output["content"]
        built += out
        if delta is not None:
            built += chat.assistant_close_ids(out) + chat.delta_ids(delta)
    # DeepSeek-R1's template drops the reasoning, and the <think> its generation prompt opened, of every turn
    assert chat.check_consistency(messages[:5], built).ok == (spec.history != "drop_all")


@pytest.mark.parametrize("name", FAMILIES)
def test_unicode_text_encodes_and_decodes_back_exactly(name):
    spec = family(name)
    chat = ChatTokenizer(spec.tokenizer, TOOLS)
    tokenizer = spec.tokenizer
    ids = tokenizer.encode(UNICODE, add_special_tokens=False)
    assert tokenizer.decode(ids) == UNICODE and chat.decode(chat.encode(UNICODE)) == UNICODE
    assert len(ids) == len(UNICODE.encode())  # one token a byte: no merges
    markers = [token for token in tokenizer.get_added_vocab() if token not in tokenizer.all_special_tokens]
    text = UNICODE.join([*markers, *tokenizer.all_special_tokens, ""])
    assert chat.decode(chat.encode(text)) == text
    rendered = chat.render([{"role": "user", "content": UNICODE}, {"role": "assistant", "content": UNICODE}])
    assert UNICODE in rendered and chat.decode(chat.encode(rendered)) == rendered  # (Llama 3 trims user turns)


_QWEN3 = build_family_tokenizer("qwen3")


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=40).map(lambda s: unicodedata.normalize("NFC", s)))
def test_any_nfc_text_round_trips(text):
    assert _QWEN3.decode(_QWEN3.encode(text, add_special_tokens=False)) == text


@pytest.mark.parametrize("name", FAMILIES)
def test_what_each_template_does_with_earlier_reasoning(name):
    spec = family(name)
    chat = ChatTokenizer(spec.tokenizer, TOOLS)
    messages = [
        {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": with_reasoning(name, "EARLIER-THOUGHT", "Four.")},
        {"role": "user", "content": "And 3 + 3?"},
        {"role": "assistant", "content": with_reasoning(name, "LATER-THOUGHT", "Six.")},
    ]
    text = chat.render(messages)
    assert "Four." in text and "Six." in text
    kept = ("EARLIER-THOUGHT" in text, "LATER-THOUGHT" in text)
    expected = {"keep": (True, True), "drop_before_last_user": (False, True), "drop_all": (False, False)}
    assert kept == expected[spec.history]
    fmt = get_reasoning_format(spec.reasoning_parser)
    if fmt is not None and fmt.history != spec.history:  # these test templates print the turns as given
        assert name in {"gpt-oss", "deepseek-v3"} and spec.history == "keep"


def test_qwen3_drops_reasoning_before_the_last_user_message_only():
    chat = ChatTokenizer(family("qwen3").tokenizer, TOOLS)
    first = "<think>\nstep one\n</think>\n\nFour."
    messages = [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": first}]
    assert chat.render(messages).endswith(f"<|im_start|>assistant\n{first}<|im_end|>\n")
    later = [*messages, {"role": "tool", "content": "4"}, {"role": "assistant", "content": first}]
    assert chat.render(later).count("step one") == 2  # tool turns do not end the query
    asked = [*messages, {"role": "user", "content": "3 + 3?"}]
    assert "step one" not in chat.render(asked)
    assert "<|im_start|>assistant\nFour.<|im_end|>\n<|im_start|>user\n3 + 3?" in chat.render(asked)


def test_thinking_prompts_open_the_reasoning():
    user = [{"role": "user", "content": "hi"}]
    thinking = ChatTokenizer(family("qwen3-thinking").tokenizer)
    assert thinking.render(user, True).endswith("<|im_start|>assistant\n<think>\n")
    assert ChatTokenizer(family("deepseek-r1").tokenizer).render(user, True).endswith("<｜Assistant｜><think>\n")
    assert ChatTokenizer(family("qwen3").tokenizer).render(user, True).endswith("<|im_start|>assistant\n")


def test_mistral_moves_the_tools_to_the_last_user_message():
    """As Mistral's own templates do: a user turn after an assistant turn cannot be appended incrementally."""
    chat = ChatTokenizer(family("mistral").tokenizer, TOOLS)
    assert chat.delta_ids([{"role": "tool", "content": "ok"}])
    with pytest.raises(TemplateError, match="changes earlier turns"):
        chat.delta_ids([{"role": "user", "content": "more"}])


@pytest.mark.parametrize("name", ["qwen3", "llama3", "gpt-oss", "glm45"])
def test_a_saved_family_model_loads_as_engines_load_it(tmp_path, name):
    spec = family(name)
    directory = save_family_model(name, tmp_path / name, TINY)
    loaded = load_tokenizer(directory)
    text = ChatTokenizer(spec.tokenizer, TOOLS).render(conversation(name), True) + UNICODE
    assert loaded.encode(text, add_special_tokens=False) == spec.tokenizer.encode(text, add_special_tokens=False)
    assert loaded.chat_template == spec.tokenizer.chat_template
    model = AutoModelForCausalLM.from_pretrained(directory)
    assert model.config.vocab_size == len(spec.tokenizer)
    assert json.loads((directory / "generation_config.json").read_text())["eos_token_id"] == spec.stop_token_ids
    with torch.no_grad():
        logits = model(torch.tensor([loaded.encode(text, add_special_tokens=False)])).logits
    assert logits.shape[-1] == len(spec.tokenizer)


def test_a_rollout_runs_on_a_saved_family_model(tmp_path):
    from rollout.api import rollout
    from rollout.config import RolloutConfig, RolloutJobConfig

    spec = family("qwen3")
    directory = save_family_model("qwen3", tmp_path / "qwen3", TINY)
    settings = RolloutConfig(max_turns=2, max_new_tokens=8, tool_parser=spec.tool_parser,
                             reasoning_parser=spec.reasoning_parser)  # fmt: skip
    job = RolloutJobConfig(model=str(directory), num_prompts=1, samples_per_prompt=2, out=str(tmp_path / "out.jsonl"),
                           progress=False, rollout=settings)  # fmt: skip
    result = asyncio.run(rollout(job))
    assert len(result.requests) == 2
