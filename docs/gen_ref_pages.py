"""The API reference: one page per module, found by walking the packages at build time.

No module list is written down anywhere: every module of the packages below (subpackages
included, however they are rearranged) gets a page ``reference/api/<dotted/path>.md`` holding
``::: dotted.name``, which mkdocstrings renders from the docstrings by static analysis (griffe
reads the source; nothing is imported). ``SUMMARY.md`` beside them is the section's navigation,
read by mkdocs-literate-nav. mkdocs-gen-files runs this file (``plugins: gen-files`` in mkdocs.yml).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rollout", "tools", "trainer", "data")


def modules(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> Iterator[tuple[str, ...]]:
    """Dotted-name parts of every public module and package under ``packages``, sorted; a package
    is a directory with an ``__init__.py`` (so data files' folders are left out), a private
    module (``_name.py``) is left out, as is everything below a private package."""
    for package in packages:
        base = root / package
        if not (base / "__init__.py").exists():
            continue
        for path in sorted(base.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if any(not (root.joinpath(*parts[:i]) / "__init__.py").exists() for i in range(1, len(parts))):
                continue  # inside a folder that is not a package
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if any(part.startswith("_") for part in parts):
                continue
            yield parts


def page_path(parts: tuple[str, ...], is_package: bool) -> Path:
    """Where a module's page goes under reference/api/: a package's is its folder's index.md."""
    if is_package:
        return Path(*parts, "index.md")
    return Path(*parts).with_suffix(".md")


def write_pages() -> None:
    import mkdocs_gen_files

    nav = mkdocs_gen_files.Nav()
    with mkdocs_gen_files.open("reference/api/index.md", "w") as page:
        page.write(
            "# API reference\n\n"
            "Generated at build time from the docstrings, one page per module of "
            + ", ".join(f"`{p}`" for p in PACKAGES)
            + ". The public entry points are `rollout.api` (what the commands call), "
            "`rollout.request` (the request state machine), `tools.base` (what a tool subclasses), "
            "`trainer.config` and `rollout.config` (the config trees); see [Python API](../../api.md).\n"
        )
    nav["Overview"] = "index.md"
    for parts in modules():
        is_package = (ROOT.joinpath(*parts) / "__init__.py").exists()
        doc_path = page_path(parts, is_package)
        dotted = ".".join(parts)
        nav[parts] = doc_path.as_posix()
        with mkdocs_gen_files.open(Path("reference/api", doc_path), "w") as page:
            page.write(f"# `{dotted}`\n\n::: {dotted}\n")
    with mkdocs_gen_files.open("reference/api/SUMMARY.md", "w") as summary:
        summary.writelines(nav.build_literate_nav())


if __name__ == "<run_path>":  # mkdocs-gen-files
    write_pages()
elif __name__ == "__main__":
    for parts in modules():
        print(".".join(parts))
