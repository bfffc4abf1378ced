"""The dataset record format in one import: ``Record`` and its validation (``data.records``:
the native and verl layouts, described there), and loading and saving files of records
(``data.record_files``)."""

from __future__ import annotations

from data.record_files import SUFFIXES, Layout, load_records, save_records
from data.records import (
    MAX_NESTING,
    NATIVE_KEYS,
    ROLES,
    TOOLS_KWARGS_KEYS,
    VERL_KEYS,
    Record,
    RecordError,
    validate_record,
)

__all__ = [
    "MAX_NESTING",
    "NATIVE_KEYS",
    "ROLES",
    "SUFFIXES",
    "TOOLS_KWARGS_KEYS",
    "VERL_KEYS",
    "Layout",
    "Record",
    "RecordError",
    "load_records",
    "save_records",
    "validate_record",
]
