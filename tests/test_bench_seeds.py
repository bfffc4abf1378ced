"""benchmarks/seeds.py: the seed table read from run directories (the runs themselves are `rallyrl train`)."""

from __future__ import annotations

import json

from benchmarks.seeds import summarize


def make_run(out, name, accuracy, malformed, warned=False):
    (out / name).mkdir()
    steps = [{"step": i + 1, "rollout/malformed_call_share": m, "train/collapse_warning": float(warned and i == 1)}
             for i, m in enumerate(malformed)]  # fmt: skip
    (out / name / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    (out / f"{name}.eval.json").write_text(json.dumps({"prompts": 300, "accuracy": accuracy}))


def test_the_table_groups_seeds_by_task_and_learning_rate(tmp_path):
    make_run(tmp_path, "calc_2e-4_1", 0.6, [0.02, 0.05])
    make_run(tmp_path, "calc_2e-4_2", 0.5, [0.01, 0.12])
    make_run(tmp_path, "calc_4e-4_1", 0.1, [0.02, 0.45], warned=True)
    (tmp_path / "calc_4e-4_2").mkdir()  # a run not evaluated yet is left out
    rows = summarize(tmp_path)
    assert [(r["task"], r["lr"], r["seeds"]) for r in rows] == [("calc", "2e-4", [1, 2]), ("calc", "4e-4", [1])]
    assert rows[0]["mean"] == 0.55 and rows[0]["min"] == 0.5 and rows[0]["max"] == 0.6
    assert rows[0]["worst_malformed"] == 0.12 and rows[0]["warned"] == 0
    assert rows[1]["warned"] == 1 and rows[1]["steps"] == [2]
