"""Shared plumbing of dataset preparation: read source rows, convert them, write records atomically.

A source file is ``.jsonl`` (one object per line), ``.json`` (one object or a list of them),
``.parquet`` (Hugging Face's layout: one column per field) or a directory of ``.json``/``.jsonl``
files (the original MATH release: one problem per file). Every row comes with where it came
from, so a converter's error names the file, the line or row and the field. Nothing is written
until every row has been converted; the output is then written atomically (``save_records``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from data.record_files import read_parquet
from data.schema import SUFFIXES, Layout, Record, RecordError, save_records

MAX_SKIPPED_SHOWN = 3
"""How many skipped rows the summary names."""


@dataclass(frozen=True)
class Row:
    """One source row and where it is: ``path``, 0-based ``index`` in the input, 1-based ``line`` (JSONL)."""

    data: dict[str, Any]
    path: Path
    index: int
    line: int | None = None

    def error(self, message: str, field: str | None = None) -> RecordError:
        return RecordError(message, path=self.path, index=self.index, line=self.line, field=field)

    def where(self) -> str:
        """``file line 7`` or ``file row 6``: for the summary of skipped rows."""
        return f"{self.path} line {self.line}" if self.line is not None else f"{self.path} row {self.index}"

    def text(self, name: str, *, required: bool = True) -> str | None:
        """The string field ``name``; a RecordError naming it when it is missing, empty or not text."""
        value = self.data.get(name)
        if value is None:
            if not required:
                return None
            raise self.error(f"missing; {_found(self.data)}", field=name)
        if not isinstance(value, str):
            raise self.error(f"expected a string, got {type(value).__name__}", field=name)
        if required and not value.strip():
            raise self.error("empty", field=name)
        return value


class Skip(Exception):
    """Raised by a converter for a row that is left out (an error naming ``field`` when ``strict``)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field


@dataclass
class PrepResult:
    """What a preparation wrote: the output, how many records, and which rows were skipped."""

    output: Path
    written: int
    skipped: list[tuple[str, str]] = field(default_factory=list)
    """``(where, why)`` of every skipped row."""

    def summary(self) -> str:
        line = f"wrote {self.written} records to {self.output}; skipped {len(self.skipped)}"
        if self.skipped:
            shown = "; ".join(f"{where}: {why}" for where, why in self.skipped[:MAX_SKIPPED_SHOWN])
            hidden = len(self.skipped) - MAX_SKIPPED_SHOWN
            more = f"; and {hidden} more" if hidden > 0 else ""
            line += f" ({shown}{more})"
        return line


def prepare(
    input_path: str | Path,
    output_path: str | Path,
    convert: Callable[[Row], Record],
    *,
    limit: int | None = None,
    strict: bool = True,
    layout: Layout = "native",
) -> PrepResult:
    """Convert the first ``limit`` rows of ``input_path`` with ``convert`` and write ``output_path``.

    A row ``convert`` skips (raises ``Skip``) is counted, or is an error when ``strict``. Any error
    (a ``RecordError`` naming file, line/row and field) leaves ``output_path`` untouched.
    """
    input_path, output_path = Path(input_path), Path(output_path)
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    if layout not in ("native", "verl"):
        raise ValueError(f"--layout must be native or verl, got {layout!r}")
    if output_path.suffix.lower() not in SUFFIXES:
        raise RecordError(f"unsupported output type {output_path.suffix or '(no extension)'!r}; use one of "
                          f"{', '.join(SUFFIXES)}", path=output_path)  # fmt: skip
    if input_path.exists() and output_path.exists() and output_path.resolve() == input_path.resolve():
        raise RecordError("the output is the input file; choose another --output", path=output_path)
    records: list[Record] = []
    skipped: list[tuple[str, str]] = []
    for row in read_rows(input_path, limit):
        try:
            record = convert(row)
        except Skip as exc:
            if strict:
                raise row.error(exc.message, field=exc.field) from None
            skipped.append((row.where() + (f", field {exc.field}" if exc.field else ""), exc.message))
            continue
        record.index = len(records)
        records.append(record)
    if not records:
        reason = "no rows"
        if skipped:
            reason = f"all {len(skipped)} rows were skipped (first: {skipped[0][0]}: {skipped[0][1]})"
        raise RecordError(f"nothing to write: {reason}", path=input_path)
    save_records(records, output_path, layout=layout)
    return PrepResult(output=output_path, written=len(records), skipped=skipped)


def read_rows(path: str | Path, limit: int | None = None) -> Iterator[Row]:
    """The rows of a ``.jsonl``, ``.json`` or ``.parquet`` file, or of the JSON files under a directory."""
    path = Path(path)
    if not path.exists():
        raise RecordError("file not found", path=path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix.lower() in (".json", ".jsonl") and p.is_file())
        if not files:
            raise RecordError("directory holds no .json or .jsonl files", path=path)
    else:
        files = [path]
    index = 0
    for file in files:
        for data, line in _read_file(file):
            if limit is not None and index >= limit:
                return
            row = Row(data, file, index, line)
            if not isinstance(data, dict):
                raise row.error(f"expected a JSON object, got {type(data).__name__}")
            yield row
            index += 1


def infer_split(path: str | Path) -> str:
    """``test``, ``validation`` or ``train`` when the file's name says so (``gsm8k/test.jsonl``,
    ``test-00000-of-00001.parquet``; for a directory, its name or its parent's: ``MATH/test/algebra``),
    else ``train``."""
    path = Path(path)
    names = [path.name] if path.suffix else [path.name, path.parent.name]
    words = {word for name in names for word in re.split(r"[^a-z]+", name.lower())}
    for split, aliases in (("test", {"test"}), ("validation", {"validation", "val", "dev"}), ("train", {"train"})):
        if words & aliases:
            return split
    return "train"


def _read_file(path: Path) -> Iterator[tuple[Any, int | None]]:
    suffix = path.suffix.lower()
    if suffix not in (".jsonl", ".json", ".parquet"):
        raise RecordError(f"unsupported input type {suffix or '(no extension)'!r}; use .jsonl, .json or .parquet",
                          path=path)  # fmt: skip
    if suffix == ".parquet":
        yield from ((row, None) for row in read_parquet(path))
        return
    try:
        raw = path.read_bytes().removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte order mark
    except OSError as e:
        raise RecordError(f"cannot read file: {e.strerror}", path=path) from None
    if suffix == ".json":
        try:
            value = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise RecordError(f"invalid JSON: {e}", path=path, line=e.lineno) from None
        yield from ((item, None) for item in (value if isinstance(value, list) else [value]))
        return
    for number, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = orjson.loads(line)
        except orjson.JSONDecodeError as e:
            raise RecordError(f"invalid JSON: {e}", path=path, line=number) from None
        yield value, number


def _found(data: dict[str, Any]) -> str:
    """What the row holds instead, for a missing-field error."""
    if "prompt" in data and ({"reward_model", "ground_truth"} & data.keys()):
        return "this is an already prepared record (rallyrl or verl layout): pass the file to --data as it is"
    return "the row has " + (", ".join(sorted(map(str, data))) if data else "no fields")
