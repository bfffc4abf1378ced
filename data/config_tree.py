"""Typed trees of dataclasses from YAML files and command-line overrides, and back to YAML.

Every rallyrl command has one root dataclass (``GRPOConfig``, ``RolloutJobConfig``, ...) whose
fields are values or further dataclasses (``rollout``, ``engine``, ``judge``). A YAML file sets
any of them by the same nesting; flags and ``--set a.b=value`` override the file. Values are
checked against the field's type hint, so a ``Literal``'s allowed values are read from the type
and never listed twice; errors name the file and the dotted field.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import textwrap
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file or override that does not fit the tree: names the file and the field."""


# ----- types ---------------------------------------------------------------------------------------


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """The resolved type hint of every field of dataclass ``cls``."""
    return typing.get_type_hints(cls)


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return " or ".join(repr(a) for a in typing.get_args(hint))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(hint))
    if hint is type(None):
        return "null"
    if dataclasses.is_dataclass(hint):
        return f"a mapping of {hint.__name__} fields"
    if origin is list:
        return f"a list of {_describe(typing.get_args(hint)[0])}"
    if origin is dict:
        return "a mapping"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(hint, str(hint))


def literal_values(hint: Any) -> tuple[Any, ...]:
    """The allowed values of a ``Literal`` hint (also inside ``X | None``); () for other hints."""
    if typing.get_origin(hint) is Literal:
        return typing.get_args(hint)
    if typing.get_origin(hint) in (Union, types.UnionType):
        return tuple(v for a in typing.get_args(hint) for v in literal_values(a))
    return ()


def convert(hint: Any, value: Any, where: str) -> Any:
    """``value`` checked against ``hint`` (ints become floats where a float is expected, mappings
    become dataclasses); ConfigError naming ``where`` when it does not fit."""
    if hint is Any:
        return value
    origin = typing.get_origin(hint)
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value in allowed and type(value) in {type(a) for a in allowed}:
            return value
        raise ConfigError(f"{where}: must be {_describe(hint)}, got {value!r}")
    if origin in (Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None:
            if type(None) in options:
                return None
            raise ConfigError(f"{where}: must be {_describe(hint)}, got null")
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return convert(option, value, where)
            except ConfigError as exc:
                errors.append(exc)
        if len(errors) == 1:
            raise errors[0]
        raise ConfigError(f"{where}: must be {_describe(hint)}, got {value!r}")
    if dataclasses.is_dataclass(hint):
        if isinstance(value, hint):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: must be {_describe(hint)}, got {value!r}")
        return build(hint, value, where)
    if origin is list:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where}: must be {_describe(hint)}, got {value!r}")
        (item,) = typing.get_args(hint) or (Any,)
        return [convert(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: must be a mapping, got {value!r}")
        return dict(value)
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, Path):
            return str(value)
    elif isinstance(value, hint):
        return value
    raise ConfigError(f"{where}: must be {_describe(hint)}, got {value!r}")


def check_fields(obj: Any) -> None:
    """Check every field of dataclass instance ``obj`` against its type (call it in
    ``__post_init__``); mappings given for nested dataclasses are built in place."""
    hints = field_types(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        converted = convert(hints[f.name], value, f"{type(obj).__name__}.{f.name}")
        if converted is not value:
            object.__setattr__(obj, f.name, converted)


# ----- building a tree -----------------------------------------------------------------------------


def build(cls: type[T], values: dict[str, Any], where: str = "") -> T:
    """``cls`` from a nested mapping: unknown keys are errors (with the closest field named),
    every value is checked against its field's type, ``__post_init__`` errors name the place.

    A section given in part keeps the rest of its parent's default for it: ``rollout: {top_k: 20}``
    in a training file changes top_k and keeps the training preset of every other rollout field."""
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = [key for key in values if key not in names]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(str(key), names, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f"; {cls.__name__} has: {', '.join(names)}"
        raise ConfigError(f"{_join(where, key)}: unknown field{hint}")
    hints = field_types(cls)
    defaults = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        hint, place = hints[key], _join(where, key)
        base = _default(defaults[key]) if isinstance(value, dict) else None
        if dataclasses.is_dataclass(base):
            kwargs[key] = _build_over(base, value, place)
        else:
            kwargs[key] = convert(hint, value, place)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where or cls.__name__}: {exc}") from None


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


def _build_over(base: Any, values: dict[str, Any], where: str) -> Any:
    """``base`` (a dataclass instance) with the fields in ``values`` changed, recursively."""
    merged = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init}
    for key, value in values.items():
        current = merged.get(key)
        if dataclasses.is_dataclass(current) and isinstance(value, dict):
            merged[key] = _build_over(current, value, _join(where, key))
        else:
            merged[key] = value
    return build(type(base), merged, where)


def _join(where: str, key: Any) -> str:
    return f"{where}.{key}" if where else str(key)


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The mapping at the top of a YAML file; ConfigError naming the file otherwise."""
    path = Path(path)
    try:
        loaded = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: expected a mapping of config fields at the top, got {type(loaded).__name__}")
    return loaded


def parse_set(items: list[str] | None) -> dict[str, Any]:
    """``--set a.b=VALUE`` items as dotted overrides; VALUE is read as YAML (``5``, ``true``, ``[a, b]``)."""
    overrides: dict[str, Any] = {}
    for item in items or []:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected FIELD=VALUE, e.g. rollout.tool_timeout_s=5")
        try:
            overrides[key.strip()] = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError:
            raise ConfigError(f"--set {item!r}: the value is not valid YAML") from None
    return overrides


def merge_dotted(values: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``values`` with each dotted key of ``overrides`` set (None values are "not given": skipped)."""
    merged = _copy_tree(values)
    for dotted, value in overrides.items():
        if value is None:
            continue
        node = merged
        *parents, leaf = dotted.split(".")
        for i, part in enumerate(parents):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"{'.'.join(parents[: i + 1])}: is not a section, so {dotted} cannot be set")
            node = child
        node[leaf] = value
    return merged


def _copy_tree(values: dict[str, Any]) -> dict[str, Any]:
    return {k: _copy_tree(v) if isinstance(v, dict) else v for k, v in values.items()}


def load_tree(
    cls: type[T],
    path: str | Path | None = None,
    overrides: dict[str, Any] | None = None,
    sets: list[str] | None = None,
) -> T:
    """``cls`` from defaults, then the YAML file at ``path``, then ``overrides`` (dotted keys; None
    skipped: flags not given), then ``--set`` items. Errors name the file (or flag) and field."""
    return build(cls, given_values(cls, path, overrides, sets))


def given_values(
    cls: type,
    path: str | Path | None = None,
    overrides: dict[str, Any] | None = None,
    sets: list[str] | None = None,
) -> dict[str, Any]:
    """The nested mapping of what the file, the flags and ``--set`` give (defaults left out);
    the file is checked against ``cls`` on its own first, so that its errors name it."""
    values = read_yaml(path) if path is not None else {}
    try:
        build(cls, values)
    except ConfigError as exc:
        if path is not None:
            raise ConfigError(f"{path}: {exc}") from None
        raise
    values = merge_dotted(values, overrides or {})
    return merge_dotted(values, parse_set(sets))


def to_dict(obj: Any) -> dict[str, Any]:
    """A config tree as plain nested dicts (for YAML, JSON and checkpoints)."""
    return dataclasses.asdict(obj)


# ----- printing a tree -----------------------------------------------------------------------------


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of ``cls`` (and its dataclass bases)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, following in zip(body, [*body[1:], None], strict=True):
            documented = isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and documented:
                docs[node.target.id] = inspect.cleandoc(str(following.value.value))
    return docs


def to_yaml(obj: Any, comments: bool = True) -> str:
    """The resolved tree as YAML, each field under a comment with its documentation."""
    return "\n".join(_yaml_lines(obj, 0, comments)) + "\n"


def _yaml_lines(obj: Any, indent: int, comments: bool) -> list[str]:
    lines: list[str] = []
    pad = " " * indent
    docs = field_docs(type(obj)) if comments else {}
    hints = field_types(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if comments and dataclasses.is_dataclass(value):
            lines.append("")
        if comments and f.name in docs:
            for line in docs[f.name].splitlines():
                lines.append(f"{pad}# {line}".rstrip())
        if comments and (allowed := literal_values(hints[f.name])):
            lines.append(f"{pad}# one of: {', '.join(str(a) for a in allowed)}")
        if dataclasses.is_dataclass(value):
            lines.append(f"{pad}{f.name}:")
            lines += _yaml_lines(value, indent + 2, comments)
        else:
            dumped = yaml.safe_dump({f.name: value}, default_flow_style=True, sort_keys=False, width=10_000)
            lines.append(pad + dumped.strip().removeprefix("{").removesuffix("}"))
    return lines
