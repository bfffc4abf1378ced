"""Where the shipped tiny-calc model lives: a path, importable without torch or transformers."""

from __future__ import annotations

from pathlib import Path

EMBEDDED_MODEL = Path(__file__).resolve().parent / "assets" / "tiny-calc"
"""The shipped tiny-calc model (``rallyrl sft --recipe tiny-calc`` rebuilds it): the default of every command."""
