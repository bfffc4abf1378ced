"""Dataset records: the native layout, verl's parquet layout, validation, loading and saving.

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
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Literal

import orjson

ROLES = ("system", "user", "assistant", "tool")
TOOLS_KWARGS_KEYS = ("create_kwargs", "execute_kwargs", "calc_reward_kwargs", "release_kwargs")
SUFFIXES = (".jsonl", ".json", ".parquet")
NATIVE_KEYS = frozenset({"prompt", "data_source", "ground_truth", "tools_kwargs", "extra"})
VERL_KEYS = frozenset({"reward_model", "extra_info"})
_KNOWN_KEYS = NATIVE_KEYS | VERL_KEYS
MAX_NESTING = 100
"""Deepest nesting of lists and mappings in a record; deeper ones are refused (Python's
recursion limit, and orjson's 255 levels when records or rollouts are written, sit above it)."""

Layout = Literal["native", "verl"]


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


def load_records(path: str | Path) -> list[Record]:
    """Load and validate every record of a ``.jsonl``, ``.json`` (a list) or ``.parquet`` file."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise RecordError(
            f"unsupported file type {suffix or '(no extension)'!r}; use one of {', '.join(SUFFIXES)}",
            path=path,
        )
    if not path.exists():
        raise RecordError("file not found", path=path)
    if not path.is_file():
        raise RecordError(f"not a file; expected a {suffix} file", path=path)
    if suffix == ".jsonl":
        return _load_jsonl(path)
    objs = _read_json(path) if suffix == ".json" else _read_parquet(path)
    return [validate_record(obj, path=path, index=i) for i, obj in enumerate(objs)]


def save_records(records: Iterable[Record], path: str | Path, *, layout: Layout = "native") -> None:
    """Write records to ``.jsonl``, ``.json`` or ``.parquet`` (by extension), atomically.

    ``layout="verl"`` writes verl's preprocessed layout (``reward_model``, ``extra_info``), so that
    verl reads the file as one of its own. In the native parquet layout ``tools_kwargs`` and
    ``extra`` are stored as JSON text, since parquet columns need one type per field across rows.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise RecordError(
            f"unsupported file type {suffix or '(no extension)'!r}; use one of {', '.join(SUFFIXES)}",
            path=path,
        )
    if layout not in ("native", "verl"):
        raise ValueError(f"unknown layout {layout!r}; use 'native' or 'verl'")
    rows = [record.to_dict() if layout == "native" else record.to_verl_dict() for record in records]
    if suffix == ".parquet":
        if layout == "native":
            rows = [
                {
                    **row,
                    "tools_kwargs": _dumps(row["tools_kwargs"], path, i),
                    "extra": _dumps(row["extra"], path, i),
                }
                for i, row in enumerate(rows)
            ]
        data = _parquet_bytes(rows, path)
    elif suffix == ".json":
        data = _dumps(rows, path, None)
    else:
        data = b"".join(_dumps(row, path, i) + b"\n" for i, row in enumerate(rows))
    _write_atomic(path, lambda f: f.write(data))


# ---------------------------------------------------------------------------------------------
# Reading and writing files


def _load_jsonl(path: Path) -> list[Record]:
    records: list[Record] = []
    try:
        lines = path.read_bytes().splitlines()
    except OSError as e:
        raise RecordError(f"cannot read file: {e.strerror}", path=path) from None
    for number, raw in enumerate(lines, start=1):
        if number == 1:
            raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte order mark
        if not raw.strip():
            continue
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise RecordError(f"invalid JSON: {e}", path=path, index=len(records), line=number) from None
        records.append(validate_record(obj, path=path, index=len(records), line=number))
    return records


def _read_json(path: Path) -> list[Any]:
    try:
        objs = orjson.loads(path.read_bytes())
    except OSError as e:
        raise RecordError(f"cannot read file: {e.strerror}", path=path) from None
    except orjson.JSONDecodeError as e:
        raise RecordError(f"invalid JSON: {e}", path=path, line=e.lineno) from None
    if not isinstance(objs, list):
        raise RecordError(f"expected a JSON list of records, got {_kind(objs)}", path=path)
    return objs


def _read_parquet(path: Path) -> list[Any]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as e:
        raise RecordError(f"cannot read parquet: {e}", path=path) from None


def _parquet_bytes(rows: list[dict[str, Any]], path: Path) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pa.Table.from_pylist(rows)
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink)
    except pa.ArrowException as e:
        raise RecordError(
            f"cannot store these records in parquet ({e}); fields need one type across records "
            "and no empty mappings; save as .jsonl instead",
            path=path,
        ) from None
    return sink.getvalue().to_pybytes()


def _dumps(obj: Any, path: Path, index: int | None) -> bytes:
    try:
        return orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY)
    except orjson.JSONEncodeError as e:
        raise RecordError(f"cannot be written as JSON: {e}", path=path, index=index) from None


def _write_atomic(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Write to a temporary file next to ``path``, then rename it over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = path.stat().st_mode & 0o777 if path.exists() else 0o644
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# ---------------------------------------------------------------------------------------------
# Validating one record


def _parse_record(obj: Any, index: int) -> Record:
    if not isinstance(obj, dict):
        raise _Invalid(None, f"expected a JSON object, got {_kind(obj)}")
    reward_model = _mapping(obj.get("reward_model"), "reward_model")
    extra_info = _mapping(obj.get("extra_info"), "extra_info")

    data_source = obj.get("data_source")
    if data_source is None:
        data_source = "unknown"
    elif not isinstance(data_source, str):
        raise _Invalid("data_source", f"expected a string, got {_kind(data_source)}")

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
        raise _Invalid("prompt", f"expected a list of chat messages, got {_kind(value)}")
    if not value:
        raise _Invalid("prompt", "empty; a prompt needs at least one message")
    return [_message(message, f"prompt[{i}]") for i, message in enumerate(value)]


def _message(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _Invalid(where, f"expected a message object with role and content, got {_kind(value)}")
    role = value.get("role")
    if role is None:
        raise _Invalid(f"{where}.role", f"missing; expected one of {', '.join(ROLES)}")
    if not isinstance(role, str):
        raise _Invalid(f"{where}.role", f"expected a string, got {_kind(role)}")
    if role not in ROLES:
        raise _Invalid(f"{where}.role", f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
    content = value.get("content")
    if content is None:
        raise _Invalid(f"{where}.content", "missing; every message needs a string content")
    if not isinstance(content, str):
        raise _Invalid(f"{where}.content", f"expected a string, got {_kind(content)}")
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
    raise _Invalid(where, f"expected a string or a number, got {_kind(value)}")


def _tools_kwargs(value: Any, where: str) -> dict[str, dict[str, dict[str, Any]]]:
    tools = _mapping(value, where, "a mapping of tool name to {create_kwargs, execute_kwargs, ...}")
    result: dict[str, dict[str, dict[str, Any]]] = {}
    for tool_name, entry in tools.items():
        if entry is None:  # parquet fills a tool that another record names with None
            continue
        tool_where = f"{where}.{tool_name}"
        if not isinstance(entry, dict):
            raise _Invalid(
                tool_where, f"expected a mapping with keys {', '.join(TOOLS_KWARGS_KEYS)}, got {_kind(entry)}"
            )
        kwargs_by_stage: dict[str, dict[str, Any]] = {}
        for stage, kwargs in entry.items():
            stage_where = f"{tool_where}.{stage}"
            if stage not in TOOLS_KWARGS_KEYS:
                raise _Invalid(stage_where, f"unknown key; allowed keys are {', '.join(TOOLS_KWARGS_KEYS)}")
            if kwargs is None:
                continue
            if not isinstance(kwargs, dict):
                raise _Invalid(stage_where, f"expected a mapping of keyword arguments, got {_kind(kwargs)}")
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
        raise _Invalid(where, f"expected {what}, got {_kind(value)}")
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


def _kind(value: Any) -> str:
    """A JSON-ish name for a value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "object"
    if isinstance(value, str):
        return "string"
    return type(value).__name__
