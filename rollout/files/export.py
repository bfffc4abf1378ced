"""Rollout trajectories (JSONL, one ``AsyncRolloutRequest.to_record()`` per line) to parquet, and back.

One row per trajectory, the columns named as the JSONL fields (``SCHEMA``):

- typed columns: ``request_id``, ``prompt_index``, ``sample_index``, ``state``, ``finish_reason``,
  ``error``, ``data_source``, ``ground_truth``, ``reward``, ``turns``, ``consistency_diff``,
  ``trace_start``; token lists ``prompt_ids``, ``response_ids`` (int32), ``loss_mask`` (int8),
  ``logprobs`` (float64, null where loss_mask is 0), ``weight_versions`` (int64, nulls);
  ``trace`` a list of structs (``state``, ``t``); ``reward`` is ``rewards.final``;
- JSON text, where the shape is free or still growing: ``messages`` (a message may carry any
  keys), ``tool_calls`` (free-form ``arguments`` and ``metrics``), ``rewards`` (step, tools,
  answer, final, judge, ...), ``metrics`` (per-state seconds), ``segments`` (a split gateway
  session's earlier samples, each with its own messages and token lists; ``[]`` for every other
  trajectory), and ``extra``: the record's top-level keys this schema does not know (null when
  there are none).

``iter_parquet_trajectories`` gives the JSONL records back (JSON text decoded, ``extra`` merged
in). The conversion streams: ``batch_size`` lines at a time are held in memory, and the output
appears only once every line has converted (a temporary file renamed over it)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from data.files import atomic_write_with
from rollout.request import validate_trajectory

SCHEMA = pa.schema(
    [
        ("request_id", pa.string()),
        ("prompt_index", pa.int64()),
        ("sample_index", pa.int64()),
        ("state", pa.string()),
        ("finish_reason", pa.string()),
        ("error", pa.string()),
        ("data_source", pa.string()),
        ("ground_truth", pa.string()),
        ("messages", pa.string()),  # JSON text: a list of message objects
        ("prompt_ids", pa.list_(pa.int32())),
        ("response_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("logprobs", pa.list_(pa.float64())),
        ("weight_versions", pa.list_(pa.int64())),
        ("reward", pa.float64()),  # null: missing (a failed judgment)
        ("rewards", pa.string()),  # JSON text: Rewards
        ("turns", pa.int64()),
        ("tool_calls", pa.string()),  # JSON text: a list of ToolCallRecord objects
        ("interaction_turns", pa.string()),  # JSON text: a list of InteractionTurn objects (null: an older file)
        ("metrics", pa.string()),  # JSON text: RequestMetrics
        ("consistency_diff", pa.string()),
        ("history_rewrite", pa.string()),  # null: none declared (the trajectory then has no such key)
        ("segments", pa.string()),  # JSON text: a list of Segment objects (null: an older file)
        ("trace", pa.list_(pa.struct([("state", pa.string()), ("t", pa.float64())]))),
        ("trace_start", pa.float64()),
        ("extra", pa.string()),  # JSON text: unknown top-level keys, or null
    ]
)
JSON_COLUMNS = ("messages", "rewards", "tool_calls", "interaction_turns", "metrics", "segments")
OPTIONAL_COLUMNS = ("interaction_turns", "segments", "history_rewrite")
"""Columns a trajectory written before them lacks: null in the row, left out of the record read back."""
BATCH_SIZE = 1024
"""Trajectories converted (and held in memory) at a time."""


class ExportError(ValueError):
    """Bad input to an export: the message names the file and line."""


def trajectory_row(record: dict[str, Any]) -> dict[str, Any]:
    """One JSONL trajectory as a parquet row of ``SCHEMA`` (free-form fields as JSON text).
    A ValueError names the field that does not fit."""
    validate_trajectory(record)
    for name in ("ground_truth", "error", "data_source", "consistency_diff", "history_rewrite"):
        if record.get(name) is not None and not isinstance(record[name], str):
            raise ValueError(f"{name}: expected a string or null, got {type(record[name]).__name__}")
    for i, event in enumerate(record["trace"]):
        if not isinstance(event, dict) or set(event) - {"state", "t"}:
            raise ValueError(f"trace[{i}]: expected an object with 'state' and 't'")
    known = set(SCHEMA.names) - {"extra"}  # a top-level "extra" key goes into the extra column too
    row = {name: record.get(name) for name in SCHEMA.names if name not in (*JSON_COLUMNS, "extra")}
    for name in JSON_COLUMNS:
        row[name] = None if record.get(name) is None else orjson.dumps(record[name]).decode()
    extra = {key: value for key, value in record.items() if key not in known}
    row["extra"] = orjson.dumps(extra).decode() if extra else None
    return row


def _batch(rows: list[dict[str, Any]], lines: list[int], path: Path) -> pa.RecordBatch:
    """``rows`` as one record batch; when pyarrow refuses one, the row that breaks is found and named."""
    try:
        return pa.RecordBatch.from_pylist(rows, schema=SCHEMA)
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        for row, line in zip(rows, lines, strict=True):
            try:
                pa.RecordBatch.from_pylist([row], schema=SCHEMA)
            except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
                raise ExportError(f"{path} line {line}: does not fit the parquet schema: {exc}") from None
        raise


def export_parquet(source: str | Path, out: str | Path, *, batch_size: int = BATCH_SIZE) -> int:
    """Convert a rollout JSONL file to parquet (``SCHEMA``), ``batch_size`` lines at a time, atomically:
    a bad line raises ExportError naming the file and line, and ``out`` is left as it was.
    Returns the number of trajectories written."""
    source, out = Path(source), Path(out)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if source.resolve() == out.resolve():
        raise ExportError(f"{source}: the output would overwrite the input; choose another --out")
    try:
        reader = source.open("rb")
    except OSError as exc:
        raise ExportError(f"{source}: {exc.strerror or exc}") from None
    if reader.read(4) == b"PAR1":
        reader.close()
        raise ExportError(f"{source}: already parquet; export reads rollout JSONL")
    reader.seek(0)
    count = 0

    def write(tmp: Path) -> None:
        nonlocal count
        with pq.ParquetWriter(str(tmp), SCHEMA) as writer:
            rows: list[dict[str, Any]] = []
            lines: list[int] = []
            for number, line in enumerate(reader, start=1):
                if not line.strip():
                    continue
                rows.append(_row(line, source, number))
                lines.append(number)
                if len(rows) >= batch_size:
                    writer.write_batch(_batch(rows, lines, source))
                    count += len(rows)
                    rows, lines = [], []
            if rows:
                writer.write_batch(_batch(rows, lines, source))
                count += len(rows)

    with reader:
        atomic_write_with(out, write)
    return count


def _row(line: bytes, path: Path, number: int) -> dict[str, Any]:
    torn = "" if line.endswith(b"\n") else " (the last line, cut short: a rollout killed mid-write?)"
    try:
        return trajectory_row(orjson.loads(line))
    except orjson.JSONDecodeError as exc:
        raise ExportError(f"{path} line {number}: not JSON{torn}: {exc}") from None
    except ValueError as exc:
        raise ExportError(f"{path} line {number}: not a trajectory: {exc}") from None


def record_from_row(row: dict[str, Any]) -> dict[str, Any]:
    """A parquet row of ``SCHEMA`` back as the JSONL trajectory it came from."""
    record = {name: value for name, value in row.items() if name != "extra" and name in SCHEMA.names}
    for name in JSON_COLUMNS:
        if record.get(name) is not None:
            record[name] = orjson.loads(record[name])
    for name in OPTIONAL_COLUMNS:
        if record.get(name) is None:
            record.pop(name, None)
    if row.get("extra"):
        record.update(orjson.loads(row["extra"]))
    return record


def is_parquet(path: str | Path) -> bool:
    """Whether ``path`` starts with parquet's magic bytes."""
    with open(path, "rb") as handle:
        return handle.read(4) == b"PAR1"


def iter_parquet_trajectories(path: str | Path, *, batch_size: int = BATCH_SIZE) -> Iterator[dict[str, Any]]:
    """The trajectories of an ``export_parquet`` file as JSONL records, ``batch_size`` rows at a time."""
    for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_size):
        for row in batch.to_pylist():
            yield record_from_row(row)


def count_parquet_trajectories(path: str | Path) -> int:
    return pq.ParquetFile(path).metadata.num_rows


def read_parquet_trajectory(path: str | Path, index: int) -> dict[str, Any]:
    """Trajectory ``index`` (0-based) of an ``export_parquet`` file; only its row group is read."""
    parquet = pq.ParquetFile(path)
    if not 0 <= index < parquet.metadata.num_rows:
        raise IndexError(index)
    for group in range(parquet.num_row_groups):
        rows = parquet.metadata.row_group(group).num_rows
        if index < rows:
            return record_from_row(parquet.read_row_group(group).slice(index, 1).to_pylist()[0])
        index -= rows
    raise IndexError(index)
