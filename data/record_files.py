"""Loading and saving files of dataset records: ``.jsonl``, ``.json`` (a list) and ``.parquet``,
in the native layout or verl's; errors name the file, the line or record and the field."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import orjson

from data.files import atomic_write_bytes
from data.records import Record, RecordError, json_type_name, validate_record

SUFFIXES = (".jsonl", ".json", ".parquet")
Layout = Literal["native", "verl"]


def load_records(path: str | Path) -> list[Record]:
    """Load and validate every record of a ``.jsonl``, ``.json`` (a list) or ``.parquet`` file."""
    path = Path(path)
    suffix = _suffix(path)
    if not path.exists():
        raise RecordError("file not found", path=path)
    if not path.is_file():
        raise RecordError(f"not a file; expected a {suffix} file", path=path)
    if suffix == ".jsonl":
        return _load_jsonl(path)
    objs = _read_json(path) if suffix == ".json" else read_parquet(path)
    return [validate_record(obj, path=path, index=i) for i, obj in enumerate(objs)]


def save_records(records: Iterable[Record], path: str | Path, *, layout: Layout = "native") -> None:
    """Write records to ``.jsonl``, ``.json`` or ``.parquet`` (by extension), atomically.

    ``layout="verl"`` writes verl's preprocessed layout (``reward_model``, ``extra_info``), so that
    verl reads the file as one of its own. In the native parquet layout ``tools_kwargs`` and
    ``extra`` are stored as JSON text, since parquet columns need one type per field across rows.
    """
    path = Path(path)
    suffix = _suffix(path)
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
    atomic_write_bytes(path, data)


def _suffix(path: Path) -> str:
    """``path``'s suffix, lower case; a RecordError when it is not one of SUFFIXES."""
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise RecordError(
            f"unsupported file type {suffix or '(no extension)'!r}; use one of {', '.join(SUFFIXES)}",
            path=path,
        )
    return suffix


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
        raise RecordError(f"expected a JSON list of records, got {json_type_name(objs)}", path=path)
    return objs


def read_parquet(path: Path) -> list[dict[str, Any]]:
    """Every row of a parquet file as a mapping; a RecordError names the file pyarrow cannot read."""
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
