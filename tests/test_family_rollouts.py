"""One rollout per model family through the rollout loop, with a scripted engine double writing that
family's output (its reasoning markers, its tool-call format) over the family's test tokenizer and
chat template (``tests/families.py``): tool calls are read, reasoning is kept beside the content,
rewards read the content only, the tokens re-render exactly (0 consistency failures) and the
template's declared history rewrites are reported as such while a real mismatch is still caught."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from conftest import CountingTool
from families import FAMILIES, family
from test_interactions import Recording

from rollout.engines.base import Generation, SamplingParams
from rollout.loop import RolloutConfig, run_request
from rollout.reasoning import HarmonyFormat, ReasoningFormat, get_reasoning_format
from rollout.request import AsyncRolloutRequest, FinishReason
from rollout.tokens import MODEL_STOP_IDS, ChatTokenizer
from rollout.tool_parsers import get_renderer

CALL_STOP = {"gpt-oss": "<|call|>", "glm45": "<|observation|>"}
"""Where a family's model stops after a tool call, when not where it stops after an answer."""
QUESTION = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "What is 6*7?"}]


def thought(fmt: ReasoningFormat | None, text: str) -> str:
    """``text`` as the family's model writes its reasoning before the rest of a turn."""
    if fmt is None:
        return ""
    if isinstance(fmt, HarmonyFormat):
        return f"<|channel|>analysis<|message|>{text}<|end|><|start|>assistant"
    if fmt.forced:  # the generation prompt opened it
        return f"{text}\n{fmt.end}\n\n"
    return f"{fmt.start}\n{text}\n{fmt.end}\n\n"


class FamilyEngine:
    """Engine double: each turn's scripted text, ended with the stop token the family's model ends
    such a turn with (``CALL_STOP`` after a call, else its end of turn), which must be one of the
    sampling's stop tokens (a real engine stops there); a turn over budget is cut ("length")."""

    def __init__(self, chat: ChatTokenizer, spec: Any, turns: list[str]):
        self.chat, self.spec, self.turns, self.count = chat, spec, turns, {}

    async def generate(self, input_ids: list[int], sampling: SamplingParams, rid: str) -> Generation:
        turn = self.count[rid] = self.count.get(rid, -1) + 1
        text = self.turns[min(turn, len(self.turns) - 1)]
        opening = get_renderer(self.spec.tool_parser)("", [("echo", {})]).strip()[:6]  # how a call starts
        called = bool(opening) and opening in text
        stop = CALL_STOP.get(self.spec.name, self.spec.end_of_turn) if called else self.spec.end_of_turn
        ids = [*self.chat.encode(text), *self.chat.encode(stop)]
        assert ids[-1] in sampling.stop_token_ids, (stop, sampling.stop_token_ids)
        finish = "stop"
        if len(ids) > sampling.max_new_tokens:
            ids, finish = ids[: sampling.max_new_tokens], "length"
        return Generation(ids, [-0.5] * len(ids), finish, 3)


def setup(name: str) -> tuple[Any, ChatTokenizer, CountingTool, RolloutConfig, ReasoningFormat | None]:
    spec = family(name)
    setattr(spec.tokenizer, MODEL_STOP_IDS, list(spec.stop_token_ids))  # (as load_tokenizer reads them)
    tool = CountingTool()
    chat = ChatTokenizer(spec.tokenizer, [tool.schema])
    SPECS[id(chat)] = spec
    config = RolloutConfig(max_new_tokens=256, max_turns=6, max_model_len=4096, tool_parser=spec.tool_parser,
                           reasoning_parser=spec.reasoning_parser)  # fmt: skip
    return spec, chat, tool, config, get_reasoning_format(spec.reasoning_parser)


SPECS: dict[int, Any] = {}


def roll(
    chat: ChatTokenizer, tool: CountingTool, config: RolloutConfig, turns: list[str],
    interactions: dict[str, Any] | None = None, extra: dict[str, Any] | None = None,
) -> AsyncRolloutRequest:  # fmt: skip
    engine = FamilyEngine(chat, SPECS[id(chat)], turns)
    request = AsyncRolloutRequest("r0", 0, 0, [dict(m) for m in QUESTION], ground_truth="42", extra=extra or {})
    asyncio.run(run_request(request, engine, chat, {"echo": tool}, config, interactions=interactions))
    return request


@pytest.mark.parametrize("name", FAMILIES)
def test_a_tool_conversation_of_each_family_is_read_and_re_renders_exactly(name):
    spec, chat, tool, config, fmt = setup(name)
    render = get_renderer(spec.tool_parser)
    turns = [
        thought(fmt, "I should ask the tool.") + render("", [("echo", {"text": "6*7 = \"42\"\nü"})]),
        thought(fmt, "The tool agrees.") + render("The answer is \\boxed{42}.", []),
    ]
    request = roll(chat, tool, config, turns)
    assert request.finish_reason is FinishReason.STOP and request.error is None, request.error
    assert [(c.name, c.arguments, c.error) for c in request.tool_calls] == [("echo", {"text": "6*7 = \"42\"\nü"}, None)]
    assistants = [m for m in request.messages if m["role"] == "assistant"]
    assert len(assistants) == 2 and "\\boxed{42}" in assistants[-1]["content"]
    if fmt is not None:
        assert [m.get("reasoning") for m in assistants] == ["I should ask the tool.", "The tool agrees."]
        assert request.metrics.reasoning_tokens > 0
        assert all(fmt.end not in m["content"] for m in assistants)
    assert request.rewards.answer == 1.0
    assert request.consistency_diff is None, request.consistency_diff
    expected_rewrite = spec.history == "drop_all"  # (what this template does; no user turn follows an answer)
    assert (request.history_rewrite is not None) is expected_rewrite, request.history_rewrite


@pytest.mark.parametrize("name", [n for n in FAMILIES if family(n).reasoning_parser != "none"])
def test_an_answer_only_in_the_reasoning_scores_0_and_one_in_the_content_scores_1(name):
    spec, chat, tool, config, fmt = setup(name)
    render = get_renderer(spec.tool_parser)
    hidden = roll(chat, tool, config, [thought(fmt, "It is \\boxed{42}.") + render("I will not say.", [])])
    shown = roll(chat, tool, config, [thought(fmt, "Six sevens.") + render("It is \\boxed{42}.", [])])
    assert hidden.rewards.answer == 0.0 and shown.rewards.answer == 1.0
    assert "\\boxed{42}" in hidden.messages[-1]["reasoning"]


def test_a_budget_spent_inside_the_reasoning_is_a_length_finish_the_metrics_name():
    _, chat, tool, config, _ = setup("qwen3")
    request = roll(chat, tool, RolloutConfig(**{**config.__dict__, "max_new_tokens": 12}),
                   ["<think>\n" + "hmm " * 40])  # fmt: skip
    assert request.finish_reason is FinishReason.LENGTH and request.metrics.truncated_in_reasoning
    assert request.metrics.reasoning_tokens == 12 and request.messages[-1]["content"] == ""


@pytest.mark.parametrize("name", [n for n in FAMILIES if family(n).history == "drop_before_last_user"])
def test_a_template_that_drops_earlier_reasoning_is_a_declared_rewrite_not_a_failure(name):
    spec, chat, tool, config, fmt = setup(name)
    render = get_renderer(spec.tool_parser)
    user = Recording({"name": "user"})
    turns = [thought(fmt, "Maybe 41.") + render("\\boxed{41}", []), thought(fmt, "Oh, 42.") + render("\\boxed{42}", [])]
    request = roll(chat, tool, config, turns, {"user": user},
                   {"interaction_kwargs": {"name": "user", "replies": ["Wrong, try again.", None]}})  # fmt: skip
    assert [m["role"] for m in request.messages[2:]] == ["assistant", "user", "assistant"]
    assert request.consistency_diff is None, request.consistency_diff
    assert request.history_rewrite is not None and "1 assistant turn" in request.history_rewrite
    # the tokens keep what the model saw: the first turn's reasoning is still in them
    assert "Maybe 41." in chat.decode(request.response_ids)


def test_a_real_mismatch_is_still_caught_where_a_rewrite_is_declared():
    from rollout.history import check_history

    _, chat, tool, config, fmt = setup("qwen3")
    user = Recording({"name": "user"})
    turns = ["<think>\nMaybe 41.\n</think>\n\n\\boxed{41}", "<think>\nOh.\n</think>\n\n\\boxed{42}"]
    request = roll(chat, tool, config, turns, {"user": user},
                   {"interaction_kwargs": {"name": "user", "replies": ["Wrong.", None]}})  # fmt: skip
    assert request.consistency_diff is None and request.history_rewrite is not None
    tampered = [dict(m) for m in request.messages]
    tampered[3]["content"] = "Right."  # the user turn as the tokens do not have it
    diff, rewrite = check_history(chat, tampered, request.all_ids, request.assistant_texts, fmt)
    assert diff is not None and rewrite is None


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_rallyrl_rollout_takes_each_familys_parsers_on_a_saved_model(name, tmp_path):
    from conftest import TINY, run_cli
    from families import save_family_model

    spec = family(name)
    directory = save_family_model(name, tmp_path / name, TINY)
    out = tmp_path / "rollouts.jsonl"
    done = run_cli("rollout", "--model", str(directory), "--task", "calc", "--num-prompts", "2", "-n", "2",
                   "--max-new-tokens", "24", "--tool-parser", spec.tool_parser, "--reasoning-parser",
                   spec.reasoning_parser, "--out", str(out), "--no-progress")  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    checked = run_cli("check", str(out))
    assert checked.returncode == 0 and "4 valid trajectories" in checked.stderr, checked.stderr[-2000:]


def test_show_and_the_parquet_export_keep_each_turns_reasoning(tmp_path):
    import orjson
    from rich.console import Console

    from rollout.files.export import export_parquet, iter_parquet_trajectories
    from rollout.files.show import load_trajectory, render

    _, chat, tool, config, _ = setup("qwen3")
    user = Recording({"name": "user"})
    turns = ["<think>\nMaybe 41.\n</think>\n\n\\boxed{41}", "<think>\nOh, 42.\n</think>\n\n\\boxed{42}"]
    request = roll(chat, tool, config, turns, {"user": user},
                   {"interaction_kwargs": {"name": "user", "replies": ["Wrong.", None]}})  # fmt: skip
    path = tmp_path / "r.jsonl"
    path.write_bytes(orjson.dumps(request.to_record()) + b"\n")
    console = Console(record=True, width=200)
    console.print(render(load_trajectory(path), path))
    shown = console.export_text()
    assert "reasoning: Maybe 41." in shown and "reasoning: Oh, 42." in shown and "history rewrite" in shown
    export_parquet(path, tmp_path / "r.parquet")
    (record,) = list(iter_parquet_trajectories(tmp_path / "r.parquet"))
    assert [m.get("reasoning") for m in record["messages"] if m["role"] == "assistant"] == ["Maybe 41.", "Oh, 42."]
    assert record["history_rewrite"] == request.history_rewrite is not None
