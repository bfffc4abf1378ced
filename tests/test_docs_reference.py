"""The generated CLI and config references name every command, option and config field."""

from __future__ import annotations

import dataclasses
import importlib.util
import types
import typing
from pathlib import Path

import pytest
import typer

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "docs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen = _load("gen_cli_config")
gen_ref = _load("gen_ref_pages")


def _all_commands(group, path=()):
    """Every (path, command) of a click group, read independently of the generator's walk."""
    for name, command in getattr(group, "commands", {}).items():
        yield (*path, name), command
        yield from _all_commands(command, (*path, name))


def _missing_cli(app: typer.Typer, page: str) -> list[str]:
    """Every command path and option name of ``app`` that ``page`` does not show."""
    missing = []
    for path, command in _all_commands(typer.main.get_command(app)):
        if f"`rallyrl {' '.join(path)}`" not in page:
            missing.append(" ".join(path))
        for param in command.params:
            missing += [f"{' '.join(path)} {n}" for n in gen.option_names(param) if f"`{n}`" not in page]
    return missing


def _all_fields(cls: type, prefix: str = "") -> list[str]:
    """Every dotted field of a config class, read from the types alone (independently of the
    generator's walk over the default values): a section typed ``X | None`` is walked too."""
    names = []
    for name, hint in typing.get_type_hints(cls).items():
        if name not in {f.name for f in dataclasses.fields(cls)}:
            continue
        names.append(prefix + name)
        options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        for option in options:
            if dataclasses.is_dataclass(option):
                names += _all_fields(option, f"{prefix}{name}.")
    return names


def _missing_config(trees: dict, page: str) -> list[str]:
    return [
        f"{command}: {dotted}"
        for command, tree in trees.items()
        for dotted in _all_fields(type(tree))
        if f"| `{dotted}` |" not in page
    ]


def test_the_cli_reference_shows_every_command_subcommand_and_option():
    import cli

    page = gen.cli_reference(cli.app)
    root = typer.main.get_command(cli.app)
    names = [" ".join(path) for path, _ in _all_commands(root)]
    assert {"rollout", "train", "config", "data", "data gsm8k", "data math"} <= set(names)
    assert _missing_cli(cli.app, page) == []


def test_the_config_reference_shows_every_field_of_every_command_tree():
    trees = gen.rallyrl_trees()
    page = gen.config_reference(trees)
    fields = _all_fields(type(trees["train"]))
    assert {"steps", "rollout.max_turns", "engine.local.max_batch_size", "judge.url", "lora.rank"} <= set(fields)
    assert _missing_config(trees, page) == []


def _small_app() -> typer.Typer:
    app = typer.Typer()
    sub = typer.Typer(help="Things in a group.")

    @app.command()
    def run(
        name: str = typer.Argument(..., help="Who to greet."),
        times: int = typer.Option(3, "-t", "--times", help="How often."),
        loud: bool = typer.Option(False, help="Shout."),
    ) -> None:
        """Greet someone."""

    @sub.command("inner")
    def inner(depth: int = typer.Option(1, help="How deep.")) -> None:
        """A subcommand."""

    app.add_typer(sub, name="group")
    return app


def test_a_synthetic_app_is_documented_option_by_option_with_defaults():
    page = gen.cli_reference(_small_app())
    for text in (
        "`rallyrl run`",
        "`rallyrl group`",
        "`rallyrl group inner`",
        "Greet someone.",
        "A subcommand.",
        "`NAME`",
        "Who to greet.",
        "`-t`, `--times`",
        "How often.",
        "`3`",
        "`--loud`, `--no-loud`",
        "`--depth`",
        "How deep.",
    ):
        assert text in page
    assert _missing_cli(_small_app(), page) == []


def test_a_command_or_option_left_out_of_the_page_is_caught():
    app = _small_app()
    page = gen.cli_reference(app)
    assert _missing_cli(app, page.replace("`--times`", "`--count`")) == ["run --times"]
    assert _missing_cli(app, page.replace("`rallyrl group inner`", "`rallyrl group`")) == ["group inner"]


@dataclasses.dataclass
class _Inner:
    depth: int = 2
    """How deep it goes."""


@dataclasses.dataclass
class _Outer:
    mode: str = "fast"
    """How it runs."""
    inner: _Inner = dataclasses.field(default_factory=_Inner)
    extra: _Inner | None = None
    """Off unless given."""


def test_a_synthetic_config_tree_is_documented_field_by_field():
    page = gen.config_reference({"demo": _Outer()})
    for text in (
        "| `mode` | str | `fast` | How it runs. |",
        "| `inner.depth` | int | `2` | How deep it goes. |",
        "### demo: `inner`",
        "| `extra.depth` | int | `2` | How deep it goes. |",
        "`extra` is null (off) by default",
    ):
        assert text in page
    assert _missing_config({"demo": _Outer()}, page) == []
    assert _missing_config({"demo": _Outer()}, page.replace("`inner.depth`", "`depth`")) == ["demo: inner.depth"]


@pytest.mark.parametrize("module", ["rollout.api", "rollout.request", "tools.base", "trainer.config", "data"])
def test_the_api_reference_walks_the_packages(module):
    assert tuple(module.split(".")) in set(gen_ref.modules())


def test_the_api_reference_follows_new_subpackages_and_skips_private_modules(tmp_path):
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "assets").mkdir()
    for name in ("pkg/__init__.py", "pkg/sub/__init__.py", "pkg/sub/mod.py", "pkg/_private.py", "pkg/assets/x.py"):
        (tmp_path / name).write_text("")
    assert list(gen_ref.modules(tmp_path, ("pkg",))) == [("pkg",), ("pkg", "sub"), ("pkg", "sub", "mod")]
