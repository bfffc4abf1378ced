"""The soak's verdict (``benchmarks/soak.py``): anything lost, duplicated, invalid or leaked fails it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from benchmarks.soak import soak_failures

CLEAN = {"requests_in": 200, "lost": 0, "duplicated": 0, "invalid_lines": 0, "creates": 180, "releases": 180,
         "instances_left": 0}  # fmt: skip


def test_a_clean_run_passes():
    assert soak_failures(CLEAN) == []


@pytest.mark.parametrize(
    ("figures", "reason"),
    [
        ({"lost": 3}, "3 of 200 requests lost"),
        ({"duplicated": 1}, "1 trajectories written more than once"),
        ({"invalid_lines": 2}, "2 JSONL lines are not valid"),
        ({"releases": 179, "instances_left": 1}, "180 tool instances created but 179 released"),
        ({"instances_left": 1}, "1 tool instances never released"),
    ],
)
def test_a_lost_duplicated_invalid_or_unbalanced_run_fails(figures, reason):
    failures = soak_failures({**CLEAN, **figures})
    assert failures and any(reason in failure for failure in failures)


def test_benchmarks_import_nothing_from_tests():
    benchmarks = Path(__file__).resolve().parent.parent / "benchmarks"
    for path in benchmarks.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n == "tests" or n.startswith("tests.") for n in names), f"{path.name} imports {names}"
