"""``benchmarks/versus_trl.py``: the pieces that need no TRL (the held-out evaluator on the embedded
model, the CPU-budget watcher, the template extension the TRL runner uses, the report from fixed
figures), and, in the slow suite, the smallest end-to-end run where the TRL virtualenv exists."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from rich.console import Console
from transformers import AutoTokenizer

from benchmarks.versus_trl import REPO, TRL_PINS
from benchmarks.versus_trl_eval import (
    Conversation,
    Decoder,
    EvalSettings,
    HeldOutEvaluator,
    calculator_reply,
    held_out_records,
    split_turn,
)
from benchmarks.versus_trl_report import print_report, summarise, write_plot
from benchmarks.versus_trl_runner import with_tool_calls
from benchmarks.versus_trl_runs import Checkpoint, Run, eval_points, run_budgeted, step_costs
from data.embedded import EMBEDDED_MODEL
from tools.calculator import CalculatorTool

# ----- the evaluator ---------------------------------------------------------------------------


def test_a_call_is_answered_as_rallyrls_calculator_answers_it():
    assert calculator_reply('{"name": "calculator", "arguments": {"expression": "12 * 3 + 1"}}') == ("37", False)
    assert calculator_reply('{"name": "calculator", "arguments": {"expression": "1 / 0"}}')[0].startswith("Error:")
    assert calculator_reply('{"name": "calculator", "arguments": {"expression": "1 / 0"}}')[1] is False
    assert calculator_reply('{"name": "calculator", "arguments": {"expression": 12}}')[1] is True
    assert calculator_reply('{"name": "search", "arguments": {"q": "x"}}')[1] is True
    assert calculator_reply('{"name": "calculator", "arguments": {"expression": "1+')[1] is True


def test_a_turn_splits_into_its_content_and_call_bodies_an_unclosed_call_counting_as_one():
    assert split_turn("\\boxed{7}") == ("\\boxed{7}", [])
    assert split_turn('Let me see <tool_call>{"a": 1}</tool_call>') == ("Let me see", ['{"a": 1}'])
    assert split_turn('<tool_call>{"a": 1}</tool_call><tool_call>{"b"') == ("", ['{"a": 1}', "<unclosed>"])


def test_the_evaluator_scores_the_embedded_model_on_held_out_prompts():
    result = HeldOutEvaluator(held_out_records(6)).evaluate(EMBEDDED_MODEL)
    assert result.prompts == 6 and 0 <= result.correct <= 6
    assert result.accuracy == result.correct / 6
    assert 0.0 <= result.malformed_call_share <= 1.0


def test_batched_decoding_gives_each_conversation_the_turns_it_gets_alone():
    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_MODEL)
    evaluator = HeldOutEvaluator(held_out_records(5))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL).eval()
    decoder = Decoder(model, tokenizer, EvalSettings())
    together = [Conversation(r, evaluator.render_prompt(tokenizer, r)) for r in evaluator.records]
    decoder.run(together)
    for conversation in together:
        alone = Conversation(conversation.record, evaluator.render_prompt(tokenizer, conversation.record))
        decoder.run([alone])
        assert alone.turns == conversation.turns and alone.ids == conversation.ids
    assert any(c.calls for c in together), "the embedded model calls its calculator on some of these"


# ----- the TRL runner's template extension -----------------------------------------------------


def test_the_runners_template_renders_prompts_as_before_and_structured_calls_as_the_model_writes_them():
    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_MODEL)
    original = tokenizer.chat_template
    record = held_out_records(1)[0]
    schema = CalculatorTool().schema
    before = tokenizer.apply_chat_template(record.prompt, tools=[schema], add_generation_prompt=True, tokenize=False)
    tokenizer.chat_template = with_tool_calls(original)
    assert (
        tokenizer.apply_chat_template(record.prompt, tools=[schema], add_generation_prompt=True, tokenize=False)
        == before
    )
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "1 + 2"}}}
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    with_tool = messages + [{"role": "tool", "name": "calculator", "content": "3"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert '<tool_call>{"name": "calculator", "arguments": {"expression": "1 + 2"}}</tool_call><|im_end|>' in rendered
    assert tokenizer.apply_chat_template(with_tool, tokenize=False).startswith(rendered)  # prefix-preserving


# ----- the CPU-budget watcher ------------------------------------------------------------------

BURNER = textwrap.dedent(
    """
    import json, os, sys, time
    out, steps, step_cpu = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    os.makedirs(out + "/checkpoints", exist_ok=True)
    for step in range(1, steps + 1):
        began = time.process_time()
        while time.process_time() - began < step_cpu:
            pass
        with open(out + "/steps.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "tokens": 100 * step}) + "\\n")
        if step % 2 == 0:
            os.makedirs(out + f"/checkpoints/step-{step:06d}")
    """
)


def burn(tmp_path: Path, budget: float, steps: int, step_cpu: float) -> Run:
    script = tmp_path / "burn.py"
    script.write_text(BURNER)
    run = Run("fake", seed=1, lr=1e-3, budget_cpu_s=budget)
    command = [sys.executable, str(script), str(tmp_path / "out"), str(steps), str(step_cpu)]
    return run_budgeted(run, command, {}, tmp_path / "out", "steps.jsonl", {"sampled_tokens": "tokens"}, poll_s=0.01)


def test_a_run_is_stopped_once_it_has_used_its_cpu_seconds(tmp_path):
    run = burn(tmp_path, budget=1.0, steps=100, step_cpu=0.2)
    assert run.stopped_at_budget and run.returncode != 0
    assert 1.0 <= run.cpu_s < 1.5
    assert 3 <= len(run.steps) <= 6
    stamps = [s["cpu_s"] for s in run.steps]
    assert stamps == sorted(stamps) and stamps[-1] <= run.cpu_s
    assert all(abs(later - earlier - 0.2) < 0.15 for earlier, later in itertools.pairwise(stamps))
    assert [c.step for c in run.checkpoints] == [s["step"] for s in run.steps if s["step"] % 2 == 0]
    assert all(c.cpu_s == next(s["cpu_s"] for s in run.steps if s["step"] == c.step) for c in run.checkpoints)
    assert run.peak_rss_bytes > 0


def test_a_run_that_ends_within_its_budget_keeps_every_step(tmp_path):
    run = burn(tmp_path, budget=100.0, steps=3, step_cpu=0.05)
    assert not run.stopped_at_budget and run.returncode == 0
    assert [s["step"] for s in run.steps] == [1, 2, 3] and [s["sampled_tokens"] for s in run.steps] == [100, 200, 300]


def test_a_failing_run_is_an_error_with_its_log(tmp_path):
    run = Run("fake", seed=1, lr=1e-3, budget_cpu_s=10.0)
    command = [sys.executable, "-c", "import sys; print('out of cheese'); sys.exit(3)"]
    with pytest.raises(RuntimeError, match="out of cheese"):
        run_budgeted(run, command, {}, tmp_path / "out", "steps.jsonl", {})


def fixed_run(cpu: list[float], saves: dict[int, float], budget: float = 100.0) -> Run:
    run = Run("fake", 1, 1e-3, budget)
    run.steps = [{"step": i + 1, "cpu_s": c, "sampled_tokens": 1000.0} for i, c in enumerate(cpu)]
    run.checkpoints = [Checkpoint(step, cpu[step - 1], f"/x/step-{step}", save) for step, save in saves.items()]
    return run


def test_cpu_per_step_leaves_out_the_first_step_and_the_checkpoint_saves():
    run = fixed_run([30.0, 40.0, 52.0, 62.0], {2: 2.0, 4: 1.0})
    costs = step_costs(run)
    assert costs["steps_timed"] == 3
    assert costs["cpu_s_per_step"] == pytest.approx((10 + (12 - 2) + 10) / 3)
    assert costs["cpu_ms_per_sampled_token"] == pytest.approx(1000 * 30 / 3000)
    assert math.isnan(step_costs(fixed_run([30.0], {}))["cpu_s_per_step"])


def test_each_cpu_mark_gets_the_last_checkpoint_within_it():
    run = fixed_run([20.0, 40.0, 60.0, 80.0, 99.0], {1: 0, 2: 0, 3: 0, 4: 0, 5: 0}, budget=100.0)
    assert [c.step for c in eval_points(run, 4)] == [1, 2, 3, 5]  # marks 25, 50, 75, 100
    assert [c.step for c in eval_points(run, 1)] == [5]
    assert eval_points(fixed_run([120.0], {1: 0}, budget=100.0), 2) == []


# ----- the report ------------------------------------------------------------------------------


def curve_run(trainer: str, seed: int, lr: float, final: float, per_step: float, phase: str) -> dict:
    return {
        "trainer": trainer,
        "seed": seed,
        "lr": lr,
        "phase": phase,
        "budget_cpu_s": 300.0,
        "steps": [{"step": 1, "cpu_s": 50.0}, {"step": 2, "cpu_s": 50.0 + per_step}],
        "curve": [
            {"step": 0, "cpu_s": 0.0, "accuracy": 0.2, "malformed_call_share": 0.0},
            {"step": 2, "cpu_s": 280.0, "accuracy": final, "malformed_call_share": 0.1},
        ],
        "cpu_s_per_step": per_step,
        "cpu_ms_per_sampled_token": per_step / 10,
        "peak_rss_bytes": 2e9,
    }


FIXED = {
    "settings": {"budget_cpu_s": 300.0, "threads": 1},
    "start": {"accuracy": 0.2, "prompts": 300},
    "chosen_lr": {"rallyrl": 5e-4, "trl": 2e-4},
    "trl_lacks": ["something"],
    "runs": [
        curve_run("rallyrl", 1, 2e-4, 0.3, 20.0, "sweep"),
        curve_run("rallyrl", 1, 5e-4, 0.5, 20.0, "sweep"),
        curve_run("rallyrl", 2, 5e-4, 0.7, 22.0, "seeds"),
        curve_run("trl", 1, 2e-4, 0.4, 60.0, "sweep"),
        curve_run("trl", 1, 5e-4, 0.3, 60.0, "sweep"),
        curve_run("trl", 2, 2e-4, 0.2, 70.0, "seeds"),
    ],
}


def test_the_summary_compares_the_chosen_learning_rates_over_seeds():
    summary = summarise(FIXED)
    ours, theirs = summary["rallyrl"], summary["trl"]
    assert ours["seeds"] == [1, 2] and theirs["seeds"] == [1, 2]
    assert ours["accuracy_at_budget"] == {"mean": pytest.approx(0.6), "min": 0.5, "max": 0.7}
    assert ours["gain"]["mean"] == pytest.approx(0.4) and theirs["gain"]["mean"] == pytest.approx(0.1)
    assert ours["sweep_accuracy_at_budget"] == {2e-4: 0.3, 5e-4: 0.5}
    assert summary["cpu_per_step_ratio"] == pytest.approx(21.0 / 65.0)
    assert all(summary["targets"].values())


def test_the_report_prints_a_table_and_writes_the_curves(tmp_path):
    results = {**FIXED, "summary": summarise(FIXED)}
    console = Console(record=True, width=200)
    print_report(results, console)
    text = console.export_text()
    assert "0.600 [0.500, 0.700]" in text and "0.32x" in text and "something" in text
    path = write_plot(results, tmp_path / "curves.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    json.dumps(results)  # every figure is JSON


# ----- end to end ------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_smallest_side_by_side_runs_both_trainers_and_writes_its_figures(tmp_path):
    venv = REPO / ".venvs" / "trl"
    stamp = venv / ".rallyrl-installed"
    if not stamp.exists() or stamp.read_text().strip() != " ".join(TRL_PINS):
        pytest.skip(f"no TRL virtualenv at {venv}: run `python benchmarks/versus_trl.py` once to make it")
    json_path, plot_path = tmp_path / "figures.json", tmp_path / "curves.png"
    command = [
        sys.executable,
        "-m",
        "benchmarks.versus_trl",
        "--skip-install",
        "--budget-cpu-s",
        "90",
        "--seeds",
        "1",
        "--lrs",
        "5e-4",
        "--eval-prompts",
        "8",
        "--eval-points",
        "1",
        "--out",
        str(tmp_path / "work"),
        "--json",
        str(json_path),
        "--plot",
        str(plot_path),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(json_path.read_text())
    assert [(r["trainer"], r["seed"]) for r in results["runs"]] == [("rallyrl", 1), ("trl", 1)]
    assert results["runs"][0]["steps"], "rallyrl finishes a step within 90 CPU-seconds"
    for run in results["runs"]:
        assert run["stopped_at_budget"], run["trainer"]
        assert run["curve"][0]["cpu_s"] == 0.0 and all(p["cpu_s"] <= 90 for p in run["curve"])
    assert set(results["summary"]) >= {"rallyrl", "trl", "cpu_per_step_ratio", "targets"}
    assert plot_path.exists() and "CPU per step, rallyrl / TRL" in done.stdout
