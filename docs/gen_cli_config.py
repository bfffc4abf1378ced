"""The CLI and config references, generated from the code so that they cannot drift.

- ``cli_reference(app)``: every command and subcommand of the typer app (walked as the click
  command tree ``typer.main.get_command`` builds), with its help, and every option and argument
  with its help and default.
- ``config_reference(trees)``: every field of every section of each command's config tree (the
  dataclasses ``rallyrl config --show`` prints), with its type, default and documentation.

mkdocs-gen-files runs this file at build time (``plugins: gen-files`` in mkdocs.yml) and it writes
``reference/cli.md`` and ``reference/config.md``; ``tests/test_docs_reference.py`` calls the two
functions directly. Run it by hand (``python docs/gen_cli_config.py``) to print both pages.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, Union

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


# ----- the command line -----------------------------------------------------------------------------


def walk_commands(group: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """(path of names, click command) for ``group``'s every command and subcommand, depth first,
    in the order the app registers them; a group is yielded before its subcommands."""
    for name, command in getattr(group, "commands", {}).items():
        if getattr(command, "hidden", False):
            continue
        yield (*path, name), command
        yield from walk_commands(command, (*path, name))


def option_names(param: Any) -> list[str]:
    """What a user types for a parameter: ``--flag``, ``-n``, ``--no-flag``, or an argument's NAME."""
    if param.param_type_name == "argument":
        return [param.name.upper()]
    return [*param.opts, *param.secondary_opts]


def _cell(text: str | None) -> str:
    """Text made safe for one Markdown table cell."""
    text = inspect.cleandoc(text or "").replace("\n", " ")
    return text.replace("|", "\\|")


def _default(param: Any) -> str:
    if param.param_type_name == "argument":
        return "required" if param.required else "optional"
    default = param.default
    if callable(default):
        return "computed"
    if default is None or default == () or default == []:
        return "-"
    if getattr(param, "is_flag", False) and param.secondary_opts:
        return param.opts[0] if default else param.secondary_opts[0]
    return f"`{default}`"


def _anchor(path: tuple[str, ...]) -> str:
    return "-".join(path)


def cli_reference(app: Any, prog: str = "rallyrl") -> str:
    """The Markdown reference of a typer app: one section per command, a table of its parameters."""
    import typer

    root = typer.main.get_command(app)
    lines = [
        "# CLI reference",
        "",
        f"Generated from the typer app in `cli.py` at build time: every command of `{prog}` with its "
        "help, every option and argument with its help and default. `--help` on any command prints "
        "the same. A default shown as `-` means the option is optional and, when not given, leaves the "
        "config tree's value (see the [Config reference](config.md)).",
        "",
    ]
    if root.help:
        lines += [inspect.cleandoc(root.help), ""]
    lines += ["| command | what it does |", "| --- | --- |"]
    commands = list(walk_commands(root))
    for path, command in commands:
        summary = _cell((command.help or "").strip().split("\n\n")[0])
        lines.append(f"| [`{prog} {' '.join(path)}`](#{_anchor(path)}) | {summary} |")
    lines.append("")
    for path, command in commands:
        usage = " ".join(path)
        lines += [f"## `{prog} {usage}` {{ #{_anchor(path)} }}", ""]
        if command.help:
            lines += [inspect.cleandoc(command.help), ""]
        if hasattr(command, "commands"):
            subs = ", ".join(f"`{name}`" for name in command.commands)
            lines += [f"Subcommands: {subs}.", ""]
        params = [p for p in command.params if not getattr(p, "hidden", False)]
        if params:
            lines += ["| option | help | default |", "| --- | --- | --- |"]
            for param in params:
                names = ", ".join(f"`{n}`" for n in option_names(param))
                lines.append(f"| {names} | {_cell(getattr(param, 'help', None))} | {_default(param)} |")
            lines.append("")
    return "\n".join(lines)


# ----- the config trees ------------------------------------------------------------------------------


def type_name(hint: Any) -> str:
    """A field's type hint as a reader writes it in YAML terms: ``int``, ``'a' | 'b'``, ``list[str]``."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        return " \\| ".join(repr(a) for a in typing.get_args(hint))
    if origin in (Union, types.UnionType):
        return " \\| ".join(type_name(a) for a in typing.get_args(hint))
    if hint is type(None):
        return "null"
    if origin is not None:
        args = ", ".join(type_name(a) for a in typing.get_args(hint))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    return getattr(hint, "__name__", str(hint).replace("typing.", ""))


def optional_section(hint: Any) -> type | None:
    """The dataclass of a section that is off by default (``LoRAConfig | None = None``), else None."""
    if typing.get_origin(hint) in (Union, types.UnionType):
        classes = [a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)]
        return classes[0] if len(classes) == 1 else None
    return None


def walk_fields(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any, dataclasses.Field, Any, str]]:
    """(dotted name, owning dataclass, field, type hint, documentation) for every field of the tree
    rooted at dataclass instance ``obj``, nested sections after the field that holds them. A section
    that is null by default is walked with its own defaults, the values it takes once given."""
    from data.config_tree import field_docs, field_types

    hints = field_types(type(obj))
    docs = field_docs(type(obj))
    for f in dataclasses.fields(obj):
        dotted = f"{prefix}{f.name}"
        yield dotted, obj, f, hints[f.name], docs.get(f.name, "")
        value = getattr(obj, f.name)
        if value is None and (section := optional_section(hints[f.name])) is not None:
            value = section()
        if dataclasses.is_dataclass(value):
            yield from walk_fields(value, dotted + ".")


def _value(value: Any) -> str:
    import yaml

    if dataclasses.is_dataclass(value):
        return "section below"
    dumped = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    dumped = dumped.removesuffix("...").strip()
    return f"`{dumped}`".replace("|", "\\|")


def _section_value(tree: Any, dotted: str) -> Any:
    """The value at a dotted section path of ``tree``; None where a section on the way is null."""
    value = tree
    for part in dotted.split("."):
        value = getattr(value, part, None) if value is not None else None
    return value


def config_reference(trees: dict[str, Any]) -> str:
    """The Markdown reference of the config trees ``{command: root dataclass instance}`` (the
    defaults, as ``rallyrl config --show --command COMMAND`` prints them)."""
    lines = [
        "# Config reference",
        "",
        "Generated at build time from the config trees, the same dataclasses `rallyrl config --show` "
        "prints: for each command, every field of every section, its type, its default for that "
        "command and its documentation. Set a field in a YAML file given as `--config`, or with "
        "`--set dotted.name=VALUE` (see [Configuration](../configuration.md)).",
        "",
    ]
    for command, tree in trees.items():
        lines += [
            f"## `{command}`: `{type(tree).__name__}` {{ #{command} }}",
            "",
            f"`rallyrl config --show --command {command}` prints this tree with its values.",
            "",
        ]
        sections: dict[str, list[str]] = {}
        for dotted, owner, f, hint, doc in walk_fields(tree):
            section = dotted.rpartition(".")[0]
            rows = sections.setdefault(section, [])
            rows.append(f"| `{dotted}` | {type_name(hint)} | {_value(getattr(owner, f.name))} | {_cell(doc)} |")
        for section, rows in sections.items():
            title = f"`{section}`" if section else "top level"
            lines += [f"### {command}: {title}", ""]
            if section and _section_value(tree, section) is None:
                lines += [f"`{section}` is null (off) by default; once given, its fields default as below.", ""]
            lines += ["| field | type | default | description |"]
            lines += ["| --- | --- | --- | --- |", *rows, ""]
    return "\n".join(lines)


def rallyrl_trees() -> dict[str, Any]:
    """Each command's config tree with its defaults, built as ``rallyrl config --show`` builds it."""
    import cli
    from data.config_tree import build

    return {command: build(cli._config_class(command), {}) for command in cli.COMMANDS}


def write_pages() -> None:
    """At build time: reference/cli.md and reference/config.md, as virtual files of the site."""
    import mkdocs_gen_files

    import cli

    with mkdocs_gen_files.open("reference/cli.md", "w") as page:
        page.write(cli_reference(cli.app))
    with mkdocs_gen_files.open("reference/config.md", "w") as page:
        page.write(config_reference(rallyrl_trees()))


if __name__ == "<run_path>":  # mkdocs-gen-files
    write_pages()
elif __name__ == "__main__":
    import cli

    print(cli_reference(cli.app))
    print(config_reference(rallyrl_trees()))
