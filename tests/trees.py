"""A folder's files, for tests that compare trees byte for byte or wait for a writer to get somewhere."""

from pathlib import Path


def tree_bytes(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` by relative POSIX path; for trees nothing is writing to."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def file_names(root: Path) -> set[str]:
    """The files under ``root`` now, read without opening any: safe while a writer renames its temporary
    files into place (a name listed a moment ago may be gone when it would be opened)."""
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}
