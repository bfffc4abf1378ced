"""The layout's rules, read from the source: no import circle between the project's modules, no module
over 400 lines, and the old dotted paths of moved modules still import (warning with the new path).

Imports are read with ``ast``: absolute and relative, ``from pkg import name`` as an import of
``pkg.name`` when that is a module, imports inside functions too, and imports under
``if TYPE_CHECKING:`` (they never run, but a circle in the types is one in the design). Importing
``rollout.gateway.app`` counts as an import of that module only, not of the package
``rollout.gateway`` above it, so a package's ``__init__.py`` re-exporting its modules is no circle;
``from rollout.gateway import Gateway`` inside the package is an import of its ``__init__.py``, and a
circle when ``__init__.py`` imports that module back.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

from rollout._moved import MOVED

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rollout", "tools", "trainer", "data", "benchmarks")
TOP_MODULES = ("cli.py",)
MAX_LINES = 400


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted name -> file, for every module of the project's packages and top-level modules."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    for name in TOP_MODULES:
        modules[name.removesuffix(".py")] = root / name
    return modules


def _import_nodes(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import under ``node``: at module level, in functions and classes, and under
    ``if TYPE_CHECKING:`` (a module that names another's types depends on it as much)."""
    for child in ast.walk(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules that module ``name`` (at ``path``) imports."""

    def known(dotted: str) -> str | None:  # the module itself, else the closest package of ours above it
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str | None] = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(known(alias.name) for alias in node.names)
            continue
        if node.level:
            parts = package.split(".") if package else []
            base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            found.add(submodule if submodule in modules else known(base))
    found.discard(None)
    found.discard(name)
    return found  # type: ignore[return-value]


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = project_modules(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycles(graph: dict[str, Iterable[str]]) -> list[list[str]]:
    """The import circles of ``graph``: each strongly connected component of more than one module, as
    one circle through it (``[a, b, a]``), in a stable order. Tarjan's algorithm, iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(component)
    return sorted((_circle(graph, component) for component in components), key=lambda circle: circle[0])


def _circle(graph: dict[str, Iterable[str]], component: set[str]) -> list[str]:
    """One circle through a strongly connected component, from its first module back to it."""
    first = min(component)
    paths = {first: [first]}
    queue = [first]
    while queue:  # breadth first: the shortest way round
        node = queue.pop(0)
        for child in sorted(graph.get(node, ())):
            if child == first:
                return [*paths[node], first]
            if child in component and child not in paths:
                paths[child] = [*paths[node], child]
                queue.append(child)
    raise AssertionError(f"no circle through {sorted(component)}")  # a component always has one


# ----- the cycle finder itself ------------------------------------------------------------------------


def test_the_cycle_finder_finds_a_planted_circle_and_names_its_modules():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]


def test_the_cycle_finder_finds_each_circle_apart_and_none_in_a_tree():
    assert find_cycles({"a": {"b", "c"}, "b": {"d"}, "c": {"d"}, "d": set()}) == []
    graph = {"a": {"b"}, "b": {"a"}, "x": {"y"}, "y": {"z"}, "z": {"x"}, "m": {"a", "x"}}
    assert find_cycles(graph) == [["a", "b", "a"], ["x", "y", "z", "x"]]


def test_the_graph_reads_relative_function_level_package_and_type_checking_imports(tmp_path):
    files = {
        "rollout/__init__.py": "",
        "rollout/core.py": "import typing\nif typing.TYPE_CHECKING:\n    from rollout.room.kinds import Kind\n",
        "rollout/room/kinds.py": "",
        "rollout/room/__init__.py": "from rollout.room.part import Thing\n",
        "rollout/room/part.py": "def f():\n    from . import other\n    from .. import core\n",
        "rollout/room/other.py": "from rollout.room import Thing\nimport rollout.core as c\n",
        "tools/__init__.py": "",
        "trainer/__init__.py": "",
        "data/__init__.py": "",
        "benchmarks/__init__.py": "",
        "cli.py": "from rollout import core\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path)
    assert graph["rollout.core"] == {"rollout.room.kinds"}  # under TYPE_CHECKING: still a dependency
    assert graph["rollout.room.part"] == {"rollout.room.other", "rollout.core"}  # in a function, relative
    assert graph["rollout.room.other"] == {"rollout.room", "rollout.core"}  # the package's __init__
    assert graph["cli"] == {"rollout.core"}
    # part -> other -> rollout.room (__init__) -> part: the pattern to avoid
    assert find_cycles(graph) == [["rollout.room", "rollout.room.part", "rollout.room.other", "rollout.room"]]


# ----- the project --------------------------------------------------------------------------------------


def test_no_import_circle_between_the_project_modules():
    cycles = find_cycles(import_graph())
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(circle) for circle in cycles)


def test_no_module_is_over_400_lines():
    long = {
        str(path.relative_to(ROOT)): lines
        for path in project_modules().values()
        if (lines := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines (split them by responsibility): {long}"


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_imports_the_moved_module_and_warns_naming_the_new_one(old):
    new = MOVED[old]
    saved = sys.modules.pop(old, None)
    try:
        with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}"):
            module = importlib.import_module(old)
        assert module is importlib.import_module(new)
    finally:
        sys.modules.pop(old, None)
        if saved is not None:
            sys.modules[old] = saved


def test_from_an_old_path_import_a_name_and_a_config_class_name_still_work():
    from tools.registry import import_class

    sys.modules.pop("rollout.interactions", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from rollout.interactions import AnswerChecker  # the old path
    assert any("rollout.users.interactions" in str(w.message) for w in caught)
    from rollout.users.interactions import AnswerChecker as moved

    assert AnswerChecker is moved
    sys.modules.pop("rollout.interactions", None)
    with pytest.warns(DeprecationWarning, match="rollout.users.interactions"):
        assert import_class("rollout.interactions:AnswerChecker") is moved
    sys.modules.pop("rollout.interactions", None)


def test_every_new_path_of_the_table_is_a_module_of_the_project():
    modules = project_modules()
    assert not [new for new in MOVED.values() if new not in modules]
    assert not [old for old in MOVED if old in modules], "an old path that is a module again shadows the table"


def test_the_command_line_starts_without_torch_transformers_or_an_engine():
    """``rallyrl --help``, ``check``, a config error: each ``rallyrl`` process imports ``cli`` first, so
    the commands' modules keep torch and transformers (seconds to import) for when a command runs."""
    code = "import sys, cli; print(sorted(m for m in ('torch', 'transformers', 'aiohttp') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


BAD_INPUT = {  # what a user gets wrong, by command: each is told so before torch loads
    "rollout-tools": (["rollout", "--tools", "{tmp}/tools.yaml", "--task", "calc"], "cannot import 'nowhere.mod:Tool'"),
    "rollout-model": (["rollout", "--model", "{tmp}/missing"], "no such directory"),
    "rollout-task": (["rollout", "--task", "nope"], "unknown synthetic task 'nope'"),
    "train-setting": (["train", "--set", "stepz=3"], "stepz: unknown field"),
    "eval-model": (["eval", "--model", "{tmp}/missing"], "no such directory"),
    "sft-config": (["sft", "--config", "{tmp}/bad.yaml"], "unknown field"),
    "serve-model": (["serve", "--model", "{tmp}/missing"], "no such directory"),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_a_command_given_bad_input_says_so_before_torch_loads(tmp_path, case):
    """Seconds per process otherwise (a bad tool config took 7-9 s to be told about): the settings, the
    user's files and the model directory are checked first."""
    (tmp_path / "tools.yaml").write_text('tools:\n  - class_name: "nowhere.mod:Tool"\n')
    (tmp_path / "bad.yaml").write_text("stepz: 3\n")
    args, message = BAD_INPUT[case]
    args = [arg.format(tmp=tmp_path) for arg in args]
    args += {"serve": ["--port", "0"], "eval": []}.get(args[0], ["--out", str(tmp_path / "out")])
    code = ("import sys, cli; from typer.testing import CliRunner\n"
            f"done = CliRunner().invoke(cli.app, {args!r})\n"
            "print(done.exit_code, 'torch' in sys.modules, 'transformers' in sys.modules)\n"
            "print(done.output)")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    status, output = done.stdout.split("\n", 1)
    assert message in output, output
    assert status == "2 False False", (status, output)
