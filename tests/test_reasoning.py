"""Reasoning formats (``rollout/reasoning.py``): splitting a turn into reasoning and content."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout.reasoning import HISTORY_POLICIES, REASONING_FORMATS, ReasoningSplit, get_reasoning_format

THINK_FORMATS = [name for name in REASONING_FORMATS if name != "gpt-oss"]
FORCED = {"qwen3-thinking", "deepseek-r1"}
ANALYSIS = "<|channel|>analysis<|message|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>"


def split(name: str, text: str) -> ReasoningSplit:
    fmt = get_reasoning_format(name)
    assert fmt is not None
    return fmt.split(text)


def test_the_names_are_sglangs_and_none_is_no_format():
    assert set(REASONING_FORMATS) == {"qwen3", "qwen3-thinking", "deepseek-r1", "deepseek-v3", "glm45", "kimi",
                                      "gpt-oss", "mistral"}  # fmt: skip
    assert get_reasoning_format("none") is None and get_reasoning_format(None) is None
    assert {fmt.forced for name, fmt in REASONING_FORMATS.items() if name in FORCED} == {True}
    assert {fmt.forced for name, fmt in REASONING_FORMATS.items() if name not in FORCED} == {False}
    assert all(fmt.history in HISTORY_POLICIES for fmt in REASONING_FORMATS.values())
    assert REASONING_FORMATS["qwen3"].history == REASONING_FORMATS["glm45"].history == "drop_before_last_user"
    assert REASONING_FORMATS["deepseek-r1"].history == "drop_all"


def test_an_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown reasoning format 'qwen4'.*none, qwen3, qwen3-thinking.*mistral"):
        get_reasoning_format("qwen4")


@pytest.mark.parametrize("name", THINK_FORMATS)
def test_reasoning_between_the_markers_and_the_content_after_them(name):
    fmt = REASONING_FORMATS[name]
    text = f"{fmt.start}\nFirst 2 + 2.\nThat is 4.\n{fmt.end}\n\nThe answer is 4.\n"
    assert fmt.split(text) == ReasoningSplit("First 2 + 2.\nThat is 4.", "The answer is 4.\n", False)
    assert fmt.split(f" \n{text}") == fmt.split(text)  # whitespace before the opening marker


@pytest.mark.parametrize("name", THINK_FORMATS)
def test_output_that_starts_inside_the_reasoning(name):
    """A forced format's prompt opened the reasoning; the others read such text as all content."""
    fmt = REASONING_FORMATS[name]
    text = f"Let me see.\n{fmt.end}\n\nIt is 4."
    expected = ReasoningSplit("Let me see.", "It is 4.", False) if fmt.forced else ReasoningSplit(None, text, False)
    assert fmt.split(text) == expected


@pytest.mark.parametrize("name", THINK_FORMATS)
def test_a_turn_without_reasoning(name):
    fmt = REASONING_FORMATS[name]
    text = "It is 4."
    expected = ReasoningSplit("It is 4.", "", True) if fmt.forced else ReasoningSplit(None, text, False)
    assert fmt.split(text) == expected
    assert fmt.split("") == (ReasoningSplit("", "", True) if fmt.forced else ReasoningSplit(None, "", False))


@pytest.mark.parametrize("name", THINK_FORMATS)
def test_a_turn_cut_off_while_thinking_is_truncated(name):
    fmt = REASONING_FORMATS[name]
    assert fmt.split(f"{fmt.start}\nStill going\n") == ReasoningSplit("Still going", "", True)
    if fmt.forced:
        assert fmt.split("Still going") == ReasoningSplit("Still going", "", True)


@pytest.mark.parametrize("name", THINK_FORMATS)
def test_the_content_is_what_the_templates_keep(name):
    """Templates cut at the last end marker: a second one in the text goes with the reasoning."""
    fmt = REASONING_FORMATS[name]
    text = f"{fmt.start}a{fmt.end}b{fmt.end}\n\nc"
    assert fmt.split(text) == ReasoningSplit(f"a{fmt.end}b", "c", False)
    assert fmt.split(text).content == text.split(fmt.end)[-1].lstrip("\n")


def test_a_forced_format_skips_an_opening_marker_the_model_wrote_anyway():
    assert split("deepseek-r1", "<think>\nhm\n</think>\n\nok") == ReasoningSplit("hm", "ok", False)
    assert split("qwen3-thinking", "<think><think>hm</think>ok") == ReasoningSplit("hm", "ok", False)


def test_qwen3_reasoning_only_at_the_start():
    text = "The tag <think> is mid-sentence.</think> here"
    assert split("qwen3", text) == ReasoningSplit(None, text, False)


def test_the_family_markers():
    assert split("kimi", "\u25c1think\u25b7r\u25c1/think\u25b7c") == ReasoningSplit("r", "c", False)
    assert split("mistral", "[THINK]r[/THINK]c") == ReasoningSplit("r", "c", False)
    assert split("mistral", "<think>r</think>c") == ReasoningSplit(None, "<think>r</think>c", False)


# ----- gpt-oss (harmony) ---------------------------------------------------------------------------------


def test_harmony_reasoning_is_the_analysis_channel_and_the_rest_stays():
    text = f"{ANALYSIS}Add them.\n<|end|>{FINAL}The answer is 4."
    assert split("gpt-oss", text) == ReasoningSplit("Add them.", f"{FINAL}The answer is 4.", False)


def test_harmony_analysis_around_a_tool_call_is_taken_out_and_the_call_kept():
    call = '<|start|>assistant<|channel|>commentary to=functions.echo <|constrain|>json<|message|>{"text": "hi"}'
    text = f"{ANALYSIS}Call echo.<|end|>{call}<|call|>"
    assert split("gpt-oss", text) == ReasoningSplit("Call echo.", f"{call}<|call|>", False)
    text = f"{ANALYSIS}One.<|end|><|start|>assistant{ANALYSIS}Two.<|end|>{FINAL}4"
    assert split("gpt-oss", text) == ReasoningSplit("One.\nTwo.", f"{FINAL}4", False)


def test_harmony_without_analysis_and_cut_off_inside_it():
    text = "<|channel|>final<|message|>4"
    assert split("gpt-oss", text) == ReasoningSplit(None, text, False)
    assert split("gpt-oss", "plain text") == ReasoningSplit(None, "plain text", False)
    assert split("gpt-oss", f"{ANALYSIS}Still thin") == ReasoningSplit("Still thin", "", True)
    assert split("gpt-oss", f"{ANALYSIS}a<|end|>{FINAL}4<|return|>{ANALYSIS}b") == ReasoningSplit(
        "a\nb", f"{FINAL}4<|return|>", True
    )
    assert split("gpt-oss", "<|channel|>analy") == ReasoningSplit(None, "<|channel|>analy", False)


# ----- answers and robustness ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(REASONING_FORMATS))
def test_a_boxed_answer_inside_the_reasoning_is_not_content(name):
    fmt = REASONING_FORMATS[name]
    if name == "gpt-oss":
        text = f"{ANALYSIS}Maybe \\boxed{{41}}?<|end|>{FINAL}\\boxed{{42}}"
    else:
        text = f"{'' if fmt.forced else fmt.start}Maybe \\boxed{{41}}?{fmt.end}\\boxed{{42}}"
    parts = fmt.split(text)
    assert "\\boxed{41}" in (parts.reasoning or "") and "\\boxed{41}" not in parts.content
    assert "\\boxed{42}" in parts.content and not parts.truncated
    cut = fmt.split(text[: text.index("?")])
    assert cut.truncated and "\\boxed{41}" in (cut.reasoning or "") and cut.content == ""


_PIECES = ["<think>", "</think>", "\u25c1think\u25b7", "\u25c1/think\u25b7", "[THINK]", "[/THINK]", ANALYSIS,
           "<|channel|>", "analysis", "<|message|>", "<|end|>", "<|start|>assistant", "<", "|", "\n", " ", "x",
           "\\boxed{1}"]  # fmt: skip
_TEXTS = st.lists(st.sampled_from(_PIECES) | st.text(max_size=4), max_size=12).map("".join)


@settings(max_examples=300, deadline=None)
@given(text=_TEXTS)
def test_split_never_raises_and_keeps_its_promises(text):
    for name, fmt in REASONING_FORMATS.items():
        parts = fmt.split(text)
        assert isinstance(parts.content, str) and (parts.reasoning is None or isinstance(parts.reasoning, str))
        if parts.reasoning is None:
            assert parts.content == text and not parts.truncated
        if parts.truncated:
            assert parts.reasoning is not None
        if name == "gpt-oss":
            assert len(parts.content) <= len(text)
            continue
        assert text.endswith(parts.content)
        if parts.truncated:
            assert parts.content == ""
        elif parts.reasoning is not None:
            assert parts.content == text.split(fmt.end)[-1].lstrip("\n")
