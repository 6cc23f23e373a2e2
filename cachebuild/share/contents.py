"""What a transfer moves: a cache's manifest (as bytes: it travels unchanged), its file table and the list
of its files with what each is checked against. Every name passes ``check_name`` before anything is
fetched or written, so a crafted manifest or table cannot make a pull write outside its destination."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from cachebuild.errors import CacheCorruptError, NoSuchBucketError, RemoteError, RemoteNotFoundError
from cachebuild.format.manifest import MANIFEST_NAME, Manifest
from cachebuild.share.listing import find_caches
from cachebuild.share.transfer import Item
from cachebuild.storage import Location, check_name
from cachebuild.storage.cache import is_unfinished_write, parse_manifest, read_file_table, read_manifest

__all__ = ["PUSH_MARKER", "CacheContents", "read_contents", "read_manifest_bytes", "split_caches"]

PUSH_MARKER = "push-in-progress.json"  # on a remote being pushed to: which manifest the files belong to


@dataclass(frozen=True)
class CacheContents:
    manifest: Manifest
    raw: bytes  # manifest.json exactly as stored
    items: list[Item]  # every file but manifest.json and the table
    table: bytes | None  # files.json as stored; None for caches built before file tables

    @property
    def manifest_sha256(self) -> str:
        return hashlib.sha256(self.raw).hexdigest()

    @property
    def table_name(self) -> str | None:
        return self.manifest.files.get("table") if self.table is not None else None

    @property
    def total_bytes(self) -> int:
        return sum(max(0, i.size) for i in self.items)


def read_manifest_bytes(location: Location) -> bytes | None:
    """``manifest.json`` of ``location`` as stored; None when there is none (access errors are raised)."""
    try:
        return location.read_bytes(MANIFEST_NAME)
    except NoSuchBucketError:
        raise  # not "no cache here": nothing can be there
    except (FileNotFoundError, NotADirectoryError, RemoteNotFoundError):
        return None


def _named_files(m: Manifest) -> list[str]:
    names = [s.file for s in m.shards] + [a.file for a in m.arrays.values()] + [c.file for c in m.columns.values()]
    inputs = m.source.get("inputs")
    if isinstance(inputs, dict) and inputs.get("file"):
        names.append(check_name(inputs["file"], "source.inputs.file"))
    return sorted(set(names))


def _check_covered(m: Manifest, names: set[str], where: str) -> None:
    """Every file the manifest names is in the list (or, for a folder such as ``images.zarr``, under it)."""
    for name in _named_files(m):
        if name not in names and not any(n.startswith(name + "/") for n in names):
            raise CacheCorruptError(f"{where} does not list {name}, which the manifest names: the cache is "
                                    f"incomplete or its file table damaged")


def read_contents(location: Location, raw: bytes | None = None) -> CacheContents:
    """The manifest, table and file list of the cache at ``location`` (a named error if it is not one)."""
    if raw is None:
        raw = read_manifest_bytes(location)
    if raw is None:
        read_manifest(location)  # raises the standard "not a cachebuild cache" error, with its hints
        raise AssertionError("unreachable")  # pragma: no cover
    m = parse_manifest(raw, location.describe(MANIFEST_NAME))
    got = read_file_table(location, m)
    if got is not None:
        table, data = got
        # columns (format version 3, 4) are outside the table: the manifest holds their files' size and digest
        columns = {c.file: Item(c.file, c.size, c.digest, m.digest) for c in m.columns.values()}
        items = sorted([Item(name, e.size, e.digest, m.digest) for name, e in table.items() if name not in columns]
                       + list(columns.values()), key=lambda i: i.name)
        _check_covered(m, set(table) | set(columns), location.describe(m.files["table"]))
        return CacheContents(m, raw, items, data)
    # Built before file tables: the files are whatever the folder holds.
    try:
        listed = location.list_files()
    except RemoteError as e:
        raise CacheCorruptError(
            f"{location.describe()} was built before caches recorded a file table, and its files cannot be "
            f"listed ({e}); rebuild it with this cachebuild, or push it again from a local copy") from None
    items = []
    for name, size in sorted(listed.items()):
        base = name.rsplit("/", 1)[-1]
        if name in (MANIFEST_NAME, PUSH_MARKER) or is_unfinished_write(base):
            continue
        items.append(Item(check_name(name, "listed file name"), size, None, m.digest))
    _check_covered(m, {i.name for i in items}, location.describe())
    return CacheContents(m, raw, items, None)


def split_caches(location: Location) -> list[str]:
    """Names of the complete caches directly under ``location`` (a folder of splits: train/, val/...)."""
    try:
        found = find_caches(location, max_depth=1)
    except (OSError, RemoteError):
        return []
    return [f.path for f in found if f.state == "complete" and f.path]
