"""Dataset records: the native layout, verl's parquet layout, and validating one record.

A record is one prompt and what its rollout needs around it. The native layout, one JSON
object per line of a ``.jsonl`` file::

    {"prompt": [{"role": "system", "content": "Use the calculator tool..."},
                {"role": "user", "content": "What is 4821 * 37 + 129?"}],
     "data_source": "calc", "ground_truth": "178506",
     "tools_kwargs": {"answer_check": {"create_kwargs": {"ground_truth": "178506"}}},
     "extra": {"expression": "4821*37+129"}}

verl's preprocessed layout (what its data scripts write to parquet) loads as it is::

    {"data_source": "openai/gsm8k", "prompt": [...], "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {"split": "train", "index": 0, "need_tools_kwargs": True,
                    "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}}}}

``reward_model.ground_truth`` becomes ``ground_truth``, ``extra_info.tools_kwargs`` becomes
``tools_kwargs``; the other ``extra_info`` fields, what is left of ``reward_model`` and any
unknown top-level key (``ability``) go into ``extra``. Native keys win when both are present.

Files of records are loaded and saved by ``data.record_files``; ``data.schema`` gathers the
public names of both.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import orjson

ROLES = ("system", "user", "assistant", "tool")
TOOLS_KWARGS_KEYS = ("create_kwargs", "execute_kwargs", "calc_reward_kwargs", "release_kwargs")
NATIVE_KEYS = frozenset({"prompt", "data_source", "ground_truth", "tools_kwargs", "extra"})
VERL_KEYS = frozenset({"reward_model", "extra_info"})
_KNOWN_KEYS = NATIVE_KEYS | VERL_KEYS
MAX_NESTING = 100
"""Deepest nesting of lists and mappings in a record; deeper ones are refused (Python's
recursion limit, and orjson's 255 levels when records or rollouts are written, sit above it)."""


@dataclass
class Record:
    """One prompt of a dataset with its ground truth and per-tool keyword arguments."""

    prompt: list[dict[str, Any]]
    """Chat messages, each with a ``role`` (system, user, assistant, tool) and a string ``content``."""
    data_source: str = "unknown"
    """Which dataset or task the record comes from; rewards and metrics are grouped by it."""
    ground_truth: str | None = None
    """The reference answer the reward compares against, as text."""
    tools_kwargs: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    """verl's layout: ``tools_kwargs[tool_name] = {"create_kwargs": {...}, "execute_kwargs": ..., ...}``."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Anything else the record carried (verl's ``ability``, ``extra_info`` fields, ...)."""
    index: int = 0
    """Position of the record in its file (0-based)."""

    def to_dict(self) -> dict[str, Any]:
        """The native JSON layout (``index`` is not stored: it is the position in the file)."""
        return {
            "prompt": self.prompt,
            "data_source": self.data_source,
            "ground_truth": self.ground_truth,
            "tools_kwargs": self.tools_kwargs,
            "extra": self.extra,
        }

    def to_verl_dict(self) -> dict[str, Any]:
        """verl's preprocessed layout; loading it back gives this record again."""
        extra = dict(self.extra)
        row: dict[str, Any] = {"data_source": self.data_source, "prompt": self.prompt}
        if "ability" in extra:
            row["ability"] = extra.pop("ability")
        reward_model = extra.pop("reward_model", None)
        reward_model = reward_model if isinstance(reward_model, dict) else {}
        row["reward_model"] = {**reward_model, "ground_truth": self.ground_truth}
        extra_info = extra
        if self.tools_kwargs:
            extra_info["tools_kwargs"] = self.tools_kwargs
        if extra_info:  # parquet cannot store an empty struct, and verl reads a missing one as {}
            row["extra_info"] = extra_info
        return row


class RecordError(ValueError):
    """A dataset record (or file) that cannot be used: where it is and what is wrong.

    Attributes: ``path`` (the file), ``index`` (0-based record), ``line`` (1-based line, JSONL),
    ``field`` (dotted path like ``prompt[1].role``) and ``message`` (what is wrong). ``str()``
    reads like ``data/x.jsonl line 7 (record 6), field prompt[0].content: expected a string, got int``.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | os.PathLike[str] | None = None,
        index: int | None = None,
        line: int | None = None,
        field: str | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.path: str | None = None if path is None else str(path)
        self.index = index
        self.line = line
        self.field = field

    def __str__(self) -> str:
        where = [self.path] if self.path else []
        if self.line is not None:
            where.append(f"line {self.line}" + (f" (record {self.index})" if self.index is not None else ""))
        elif self.index is not None:
            where.append(f"record {self.index}")
        location = " ".join(where)
        if self.field:
            location = f"{location}, field {self.field}" if location else f"field {self.field}"
        return f"{location}: {self.message}" if location else self.message


class _Invalid(Exception):
    """A bad field inside one record; ``validate_record`` adds the file and record to it."""

    def __init__(self, field: str | None, message: str):
        super().__init__(message)
        self.field = field
        self.message = message


def validate_record(
    obj: Any, *, path: str | os.PathLike[str] | None = None, index: int = 0, line: int | None = None
) -> Record:
    """Check one record (native or verl layout) and return it as a ``Record``.

    ``path``, ``index`` and ``line`` only say where the record came from, for the error message.
    Raises ``RecordError`` naming the bad field.
    """
    try:
        return _parse_record(_plain(obj), index)
    except _Invalid as e:
        raise RecordError(e.message, path=path, index=index, line=line, field=e.field) from None


def _parse_record(obj: Any, index: int) -> Record:
    if not isinstance(obj, dict):
        raise _Invalid(None, f"expected a JSON object, got {json_type_name(obj)}")
    reward_model = _mapping(obj.get("reward_model"), "reward_model")
    extra_info = _mapping(obj.get("extra_info"), "extra_info")

    data_source = obj.get("data_source")
    if data_source is None:
        data_source = "unknown"
    elif not isinstance(data_source, str):
        raise _Invalid("data_source", f"expected a string, got {json_type_name(data_source)}")

    if obj.get("ground_truth") is not None:
        ground_truth = _ground_truth(obj["ground_truth"], "ground_truth")
    else:
        ground_truth = _ground_truth(reward_model.get("ground_truth"), "reward_model.ground_truth")

    if obj.get("tools_kwargs") is not None:
        tools_kwargs = _tools_kwargs(obj["tools_kwargs"], "tools_kwargs")
    else:
        tools_kwargs = _tools_kwargs(extra_info.get("tools_kwargs"), "extra_info.tools_kwargs")

    extra = {key: value for key, value in extra_info.items() if key != "tools_kwargs"}
    reward_model_rest = {key: value for key, value in reward_model.items() if key != "ground_truth"}
    if reward_model_rest:
        extra["reward_model"] = reward_model_rest
    extra.update((key, value) for key, value in obj.items() if key not in _KNOWN_KEYS)
    extra.update(_mapping(obj.get("extra"), "extra"))

    return Record(
        prompt=_prompt(obj.get("prompt")),
        data_source=data_source,
        ground_truth=ground_truth,
        tools_kwargs=tools_kwargs,
        extra=extra,
        index=index,
    )


def _prompt(value: Any) -> list[dict[str, Any]]:
    if value is None:
        raise _Invalid("prompt", "missing; every record needs a list of chat messages")
    if not isinstance(value, list):
        raise _Invalid("prompt", f"expected a list of chat messages, got {json_type_name(value)}")
    if not value:
        raise _Invalid("prompt", "empty; a prompt needs at least one message")
    return [_message(message, f"prompt[{i}]") for i, message in enumerate(value)]


def _message(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _Invalid(where, f"expected a message object with role and content, got {json_type_name(value)}")
    role = value.get("role")
    if role is None:
        raise _Invalid(f"{where}.role", f"missing; expected one of {', '.join(ROLES)}")
    if not isinstance(role, str):
        raise _Invalid(f"{where}.role", f"expected a string, got {json_type_name(role)}")
    if role not in ROLES:
        raise _Invalid(f"{where}.role", f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
    content = value.get("content")
    if content is None:
        raise _Invalid(f"{where}.content", "missing; every message needs a string content")
    if not isinstance(content, str):
        raise _Invalid(f"{where}.content", f"expected a string, got {json_type_name(content)}")
    # Other keys (name, tool_calls, tool_call_id) pass through; None is parquet's filler for absent.
    rest = {key: item for key, item in value.items() if key not in ("role", "content") and item is not None}
    return {"role": role, "content": content, **rest}


def _ground_truth(value: Any, where: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):
        raise _Invalid(where, "expected a string or a number, got bool")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):  # how pandas writes a missing value
            return None
        if math.isinf(value):
            raise _Invalid(where, "expected a finite number, got infinity")
        return str(int(value)) if value.is_integer() else repr(value)
    raise _Invalid(where, f"expected a string or a number, got {json_type_name(value)}")


def _tools_kwargs(value: Any, where: str) -> dict[str, dict[str, dict[str, Any]]]:
    tools = _mapping(value, where, "a mapping of tool name to {create_kwargs, execute_kwargs, ...}")
    result: dict[str, dict[str, dict[str, Any]]] = {}
    for tool_name, entry in tools.items():
        if entry is None:  # parquet fills a tool that another record names with None
            continue
        tool_where = f"{where}.{tool_name}"
        if not isinstance(entry, dict):
            raise _Invalid(
                tool_where, f"expected a mapping with keys {', '.join(TOOLS_KWARGS_KEYS)}, got {json_type_name(entry)}"
            )
        kwargs_by_stage: dict[str, dict[str, Any]] = {}
        for stage, kwargs in entry.items():
            stage_where = f"{tool_where}.{stage}"
            if stage not in TOOLS_KWARGS_KEYS:
                raise _Invalid(stage_where, f"unknown key; allowed keys are {', '.join(TOOLS_KWARGS_KEYS)}")
            if kwargs is None:
                continue
            if not isinstance(kwargs, dict):
                raise _Invalid(stage_where, f"expected a mapping of keyword arguments, got {json_type_name(kwargs)}")
            if not all(isinstance(key, str) for key in kwargs):
                raise _Invalid(stage_where, "keyword argument names must be strings")
            kwargs_by_stage[stage] = kwargs
        result[tool_name] = kwargs_by_stage
    return result


def _mapping(value: Any, where: str, what: str = "a mapping") -> dict[str, Any]:
    """A mapping field; None means empty, and JSON text (native parquet stores it so) is decoded."""
    if value is None:
        return {}
    if isinstance(value, str | bytes):
        try:
            decoded = orjson.loads(value)
        except orjson.JSONDecodeError:
            decoded = None
        if not isinstance(decoded, dict):
            raise _Invalid(where, f"expected {what} (or JSON text of one), got a string")
        return decoded
    if not isinstance(value, dict):
        raise _Invalid(where, f"expected {what}, got {json_type_name(value)}")
    return value


def _plain(value: Any, where: str | None = None, depth: int = 0) -> Any:
    """Plain Python containers and scalars (pandas gives numpy arrays for parquet list columns).

    ``where`` is the top-level field being converted, named when it nests too deeply.
    """
    if depth > MAX_NESTING:
        raise _Invalid(where, f"nested more than {MAX_NESTING} levels deep")
    if isinstance(value, dict):
        return {key: _plain(item, key if where is None else where, depth + 1) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item, where, depth + 1) for item in value]
    if value is None or isinstance(value, str | bytes | bool | int | float):
        return value
    if hasattr(value, "tolist"):  # numpy arrays and scalars
        return _plain(value.tolist(), where, depth)
    return value


def json_type_name(value: Any) -> str:
    """A JSON-ish name for a value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "object"
    if isinstance(value, str):
        return "string"
    return type(value).__name__
