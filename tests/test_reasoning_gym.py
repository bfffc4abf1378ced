"""reasoning-gym tasks: records that are the library's own items, graded by each dataset's own
``score_answer`` (not math-verify) in rollouts, evaluations, files and the CLI."""

from __future__ import annotations

import asyncio
import json
import re
import sys

import pytest
import reasoning_gym
from conftest import ScriptedEngine, run_cli
from reasoning_gym.composite import CompositeConfig, CompositeDataset, DatasetSpec

from data.reasoning_gym import SEED_SPACING, make_reasoning_gym_records, parse_spec, score_completion
from data.reward_fns import reward_for_records
from data.schema import load_records, save_records
from data.synthetic import CALC_SYSTEM_PROMPT
from rollout.api import SetupError, load_prompts, rollout
from rollout.config import RolloutConfig, RolloutJobConfig
from rollout.request import AsyncRolloutRequest
from rollout.runner import RolloutRunner
from rollout.tokens import ChatTokenizer
from tools.registry import DEFAULT_TOOLS, build_tools
from trainer.evaluation import evaluate

THREE = "basic_arithmetic(max_terms=3, max_digits=2)=2,chain_sum,leg_counting"
"""Three datasets that generate in milliseconds."""
FAST = RolloutConfig(max_turns=2, max_new_tokens=48, max_model_len=1024)


def independent_score(extra: dict, completion: str) -> float:
    """reasoning-gym's own grading, written here from the library alone: its item re-created from the
    stored coordinates, its ``extract_answer`` (else the last ``\\boxed{}``), its ``score_answer``."""
    source = extra["reasoning_gym"]
    dataset = reasoning_gym.create_dataset(source["dataset"], seed=source["seed"], size=source["size"],
                                           **json.loads(source["config"]))  # fmt: skip
    answer = reasoning_gym.utils.extract_answer(completion)
    if answer is None:
        boxed = re.findall(r"\\boxed\{([^{}]*)\}", completion)
        answer = boxed[-1] if boxed else None
    return 0.0 if answer is None else float(dataset.score_answer(answer, dataset[source["index"]]))


def last_answer(messages: list[dict]) -> str:
    return next((m["content"] for m in reversed(messages) if m["role"] == "assistant"), "")


# ----- records ---------------------------------------------------------------------------------------


def test_records_are_the_librarys_items_with_its_prompt_and_answers():
    records = make_reasoning_gym_records("leg_counting", 5, seed=3)
    items = reasoning_gym.create_dataset("leg_counting", seed=3 * SEED_SPACING, size=5)
    system = reasoning_gym.utils.SYSTEM_PROMPTS["default"].strip()
    for record, item in zip(records, items, strict=True):
        assert record.prompt == [{"role": "system", "content": system}, {"role": "user", "content": item["question"]}]
        assert record.ground_truth == item["answer"] and record.data_source == "reasoning_gym/leg_counting"
        assert record.extra["answer_reward"] == "reasoning_gym"


def test_a_weighted_mix_is_reasoning_gyms_composite_with_each_config():
    records = make_reasoning_gym_records(THREE, 12, seed=2)
    composite = CompositeDataset(CompositeConfig(size=12, seed=2 * SEED_SPACING, datasets=[
        DatasetSpec("basic_arithmetic", 2, {"max_terms": 3, "max_digits": 2}),
        DatasetSpec("chain_sum", 1, {}), DatasetSpec("leg_counting", 1, {})]))  # fmt: skip
    assert [r.prompt[-1]["content"] for r in records] == [composite[i]["question"] for i in range(12)]
    assert {r.data_source for r in records} == {f"reasoning_gym/{n}" for n in ("basic_arithmetic", "chain_sum",
                                                                                 "leg_counting")}  # fmt: skip


def test_a_larger_num_extends_the_records_and_neighbouring_seeds_share_none():
    first = [r.prompt[-1]["content"] for r in make_reasoning_gym_records("leg_counting", 40, seed=0)]
    assert [r.prompt[-1]["content"] for r in make_reasoning_gym_records("leg_counting", 10, seed=0)] == first[:10]
    second = [r.prompt[-1]["content"] for r in make_reasoning_gym_records("leg_counting", 40, seed=1)]
    assert not set(first) & set(second)  # reasoning-gym's seeds 0 and 1 would share 39 of them


def test_the_prompt_option_states_the_boxed_format_the_embedded_model_learned():
    (record,) = make_reasoning_gym_records("chain_sum;prompt=calc", 1)
    assert record.prompt[0]["content"] == CALC_SYSTEM_PROMPT
    assert parse_spec("chain_sum; prompt=DeepSeekZero").prompt == "DeepSeekZero"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("basic_arithmetc", "unknown reasoning-gym dataset 'basic_arithmetc'; close names: basic_arithmetic"),
        ("chain_sum=heavy", "weight of 'chain_sum' is 'heavy', not a number"),
        ("chain_sum=0", "weight of 'chain_sum' must be positive"),
        ("chain_sum,chain_sum=2", "a dataset is named twice"),
        ("chain_sum(max_term=3)", r"chain_sum with config \{'max_term': 3\}: .*its config fields: min_terms, "),
        ("chain_sum(min_terms=3, max_terms=2)", "max_terms must be >= min_terms"),
        ("chain_sum(seed=3)", "seed and size come from the task's seed and num"),
        ("chain_sum(max_terms=open('x'))", "the value must be a literal"),
        ("chain_sum(3)", "must be key=value pairs"),
        ("chain_sum(max_terms=3", "unclosed bracket"),
        ("chain_sum;prompt=shouty", "unknown prompt 'shouty'; known: DeepSeekZero, boxed, calc"),
        ("chain_sum;temperature=2", "unknown option 'temperature=2'; the only option is prompt=NAME"),
        ("", "name a reasoning-gym dataset"),
        ("2+2", r"'2\+2' is not a dataset name"),
    ],
)
def test_a_bad_spec_is_one_error_that_says_what_to_write(spec, message):
    with pytest.raises(SetupError, match=f"^task: .*{message}"):
        load_prompts(RolloutJobConfig(task=f"reasoning_gym:{spec}", num_prompts=2))


def test_without_the_package_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # what an uninstalled package looks like to import
    with pytest.raises(ImportError, match=r"pip install 'rallyrl\[reasoning-gym\]'"):
        make_reasoning_gym_records("chain_sum", 1)
    with pytest.raises(SetupError, match=r"^task: the reasoning-gym tasks need .*'rallyrl\[reasoning-gym\]'"):
        load_prompts(RolloutJobConfig(task="reasoning_gym:chain_sum", num_prompts=1))


# ----- grading ---------------------------------------------------------------------------------------


def test_the_answer_is_read_from_answer_tags_else_from_a_box():
    (record,) = make_reasoning_gym_records("chain_sum", 1, seed=5)
    right, source = record.ground_truth, record.extra["reasoning_gym"]
    assert score_completion(source, f"thinking... <answer>{right}</answer>") == 1.0
    assert score_completion(source, f"so \\boxed{{{right}}}") == 1.0
    assert score_completion(source, f"\\boxed{{{right}}} <answer>none</answer>") == 0.0  # the tags win
    assert score_completion(source, right) == 0.0  # no answer format: reasoning-gym's rule


def test_a_record_written_by_another_version_is_refused_not_misgraded():
    (record,) = make_reasoning_gym_records("chain_sum", 1, seed=5)
    source = dict(record.extra["reasoning_gym"], metadata=json.dumps({"expression": "1 + 1"}))
    with pytest.raises(ValueError, match=r"re-creates item 0 of chain_sum .* otherwise than the record holds"):
        score_completion(source, "<answer>2</answer>")


def scripted_answers(records):
    """A script that answers prompt i: right in tags, right in a box, or with a partly right answer."""

    def script(turn: int, prompt: str, rid: str) -> str:
        index = int(rid.split("-")[1])
        truth = records[index].ground_truth
        return [f"<answer>{truth}</answer>", f"\\boxed{{{truth}}}", f"<answer>{truth} legs</answer>"][index % 3]

    return script


async def test_eval_grades_each_dataset_with_its_own_score_answer(tokenizer):
    records = make_reasoning_gym_records(THREE, 12, seed=4)
    tools = build_tools(DEFAULT_TOOLS)
    chat = ChatTokenizer(tokenizer, [t.schema for t in tools.values()])
    engine = ScriptedEngine(chat, scripted_answers(records))
    report = await evaluate(engine, chat, tools, records, FAST, progress=False)
    expected: dict[str, list[bool]] = {}
    for i, record in enumerate(records):  # a partly right answer ('292 legs') scores below 1: wrong
        expected.setdefault(record.data_source, []).append(i % 3 != 2)
    assert {s: part["accuracy"] for s, part in report["by_data_source"].items()} == {
        source: pytest.approx(sum(right) / len(right)) for source, right in expected.items()
    }
    runner = RolloutRunner(ScriptedEngine(chat, scripted_answers(records)), chat, tools, FAST, progress=False)
    result = await runner.run(records)
    for request in result.requests:
        score = independent_score(request.extra, last_answer(request.messages))
        assert request.rewards.final == request.rewards.answer == pytest.approx(score)
    partial = [r.rewards.final for r in result.requests if r.prompt_index % 3 == 2]
    assert all(0.0 < reward < 1.0 for reward in partial)  # reasoning-gym's partial credit, not math-verify's 0 or 1


async def test_a_grading_failure_is_kept_out_of_training(tokenizer):
    (record,) = make_reasoning_gym_records("chain_sum", 1)
    record.extra["reasoning_gym"]["metadata"] = "{}"
    tools = build_tools(DEFAULT_TOOLS)
    chat = ChatTokenizer(tokenizer, [t.schema for t in tools.values()])
    runner = RolloutRunner(ScriptedEngine(chat, scripted_answers([record])), chat, tools, FAST, progress=False)
    (request,) = (await runner.run([record])).requests
    assert request.rewards.answer is None and "grading the answer failed" in request.rewards.reward_error


def test_named_rewards_grade_these_records_as_their_dataset_does(tokenizer):
    from rollout.request import AsyncRolloutRequest

    (record,) = make_reasoning_gym_records("leg_counting", 1, seed=9)
    request = AsyncRolloutRequest("r", 0, 0, [*record.prompt, {"role": "assistant", "content":
                                  f"<answer>{record.ground_truth} legs</answer>"}], record.data_source,
                                  record.ground_truth, extra=record.extra)  # fmt: skip
    expected = independent_score(record.extra, last_answer(request.messages))
    assert 0 < expected < 1
    assert reward_for_records("reasoning_gym")(request) == pytest.approx(expected)
    assert reward_for_records("reasoning_gym/leg_counting=reasoning_gym,default=math")(request) == pytest.approx(
        expected
    )
    assert reward_for_records("format")(request) == 1.0  # <answer> tags are a final answer


# ----- files and the embedded model ------------------------------------------------------------------


@pytest.fixture(scope="module")
def unjsonable_records():
    """arc_agi's metadata holds tuples (its grader compares them: as JSON lists a right grid would score
    0.05), graph_color's has int keys and no single answer: grading must re-create their items."""
    return make_reasoning_gym_records("arc_agi,graph_color,basic_arithmetic", 9, seed=6)


@pytest.mark.parametrize(("suffix", "layout"), [(".jsonl", "native"), (".parquet", "native"), (".parquet", "verl")])
def test_records_survive_files_and_still_grade_as_the_library_does(tmp_path, suffix, layout, unjsonable_records):
    records = unjsonable_records
    path = tmp_path / f"records{suffix}"
    save_records(records, path, layout=layout)
    loaded = load_records(path)
    assert [(r.prompt, r.data_source, r.ground_truth, r.extra) for r in loaded] == [
        (r.prompt, r.data_source, r.ground_truth, r.extra) for r in records
    ]
    assert {r.data_source for r in loaded} == {f"reasoning_gym/{n}" for n in ("arc_agi", "graph_color",
                                                                              "basic_arithmetic")}  # fmt: skip
    for record in loaded:
        answer = record.ground_truth
        if answer is None:  # graph_color: one of the right colourings
            answer = json.dumps(json.loads(record.extra["reasoning_gym"]["metadata"])["possible_answer"])
        assert score_completion(record.extra["reasoning_gym"], f"<answer>{answer}</answer>") == 1.0


def test_a_rollout_of_the_embedded_model_is_rewarded_by_the_datasets_scores(tmp_path):
    job = RolloutJobConfig(task=f"reasoning_gym:{THREE};prompt=calc", num_prompts=6, samples_per_prompt=2,
                           out=str(tmp_path / "out.jsonl"), progress=False, rollout=FAST)  # fmt: skip
    result = asyncio.run(rollout(job))
    assert len(result.requests) == 12 and not any(r.error for r in result.requests)
    assert {r.data_source for r in result.requests} == {
        "reasoning_gym/basic_arithmetic", "reasoning_gym/chain_sum", "reasoning_gym/leg_counting"}  # fmt: skip
    for request in result.requests:
        assert request.rewards.final == independent_score(request.extra, last_answer(request.messages))


def test_a_prepared_parquet_rolls_out_through_the_cli_with_the_same_rewards(tmp_path):
    task, data = f"reasoning_gym:{THREE};prompt=calc", tmp_path / "rg.parquet"
    prepared = run_cli("data", "prep", task, "--out", str(data), "--num", "4", "--seed", "7", "--layout", "verl")
    assert prepared.returncode == 0, prepared.stderr
    out = tmp_path / "out.jsonl"
    done = run_cli("rollout", "--data", str(data), "--out", str(out), "--temperature", "0", "--max-new-tokens", "48",
                   "--no-progress")  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    records = make_reasoning_gym_records(f"{THREE};prompt=calc", 4, seed=7)
    assert sorted(line["messages"][1]["content"] for line in lines) == sorted(r.prompt[1]["content"] for r in records)
    for line in lines:
        assert line["reward"] == independent_score(records[line["prompt_index"]].extra, last_answer(line["messages"]))


def test_training_metrics_show_each_dataset_of_a_mix_apart(tmp_path, tiny_model_dir):
    from trainer.config import GRPOConfig
    from trainer.grpo import GRPOTrainer

    config = GRPOConfig(model=str(tiny_model_dir), out=str(tmp_path / "run"), prompts_per_step=2, progress=False,
                        task="reasoning_gym:chain_sum,leg_counting")  # fmt: skip
    trainer = GRPOTrainer(config)
    assert trainer.prompts.sources == ["reasoning_gym/chain_sum", "reasoning_gym/leg_counting"]
    requests = []
    for i, (source, answer, final) in enumerate([("reasoning_gym/chain_sum", 1.0, 1.0),
                                                 ("reasoning_gym/chain_sum", 0.0, 0.0),
                                                 ("reasoning_gym/leg_counting", 0.5, 0.5)]):  # fmt: skip
        request = AsyncRolloutRequest(f"r{i}", i, 0, [], data_source=source)
        request.rewards.answer, request.rewards.final = answer, final
        requests.append(request)
    metrics = trainer.rollout_metrics(requests)
    assert metrics["accuracy/reasoning_gym/chain_sum"] == 0.5 and metrics["reward_mean/reasoning_gym/chain_sum"] == 0.5
    assert metrics["accuracy/reasoning_gym/leg_counting"] == 0.0  # partial credit is not a right answer
    assert metrics["reward_mean/reasoning_gym/leg_counting"] == 0.5
    assert metrics["accuracy"] == pytest.approx(1 / 3)
