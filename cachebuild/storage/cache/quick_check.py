"""``cachebuild verify --quick``: structure without re-hashing a pixel, in seconds for any cache size.

Checks the manifest (format, version, names inside the cache, shards tiling ``[0, count)``), the image
files as a reader opens them (npy headers and sizes; zarr metadata, every chunk present, raw chunk sizes),
the side arrays' headers against their manifest dtype and shape, and, for caches with a file table, the
size of every file the table lists (one listing for a remote cache). A flipped byte inside a shard keeps
every size and header, so only the full ``verify`` (or a pull's per-file checksum) finds it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from cachebuild.errors import CacheCorruptError, RemoteError, RemoteNotFoundError
from cachebuild.format.manifest import Manifest
from cachebuild.storage import Location, get_backend, open_location
from cachebuild.storage.cache.file_table import read_file_table
from cachebuild.storage.cache.reader import read_manifest
from cachebuild.storage.kinds.rows import npy_header

__all__ = ["QuickReport", "quick_check"]

_HEAD = 4096


@dataclass
class QuickReport:
    manifest: Manifest
    location: Location
    problems: list[str] = field(default_factory=list)
    sizes_checked: int = 0
    headers_checked: int = 0


def _sizes(location: Location, names: list[str]) -> dict[str, int]:
    """Actual sizes (-1: missing) of ``names``: stat locally, one listing remotely (HEAD each as a fallback)."""
    if location.is_local:
        out = {}
        for n in names:
            try:
                out[n] = location.local_path(n).stat().st_size
            except FileNotFoundError:
                out[n] = -1
        return out
    try:
        listed = location.list_files()
        if all(v >= 0 for v in listed.values()):
            return {n: listed.get(n, -1) for n in names}
    except RemoteError:
        pass  # a server that cannot list: ask file by file
    out = {}
    for n in names:
        try:
            out[n] = location.size(n)
        except RemoteNotFoundError:
            out[n] = -1
    return out


def quick_check(where: str | os.PathLike[str] | Location) -> QuickReport:
    """Check the cache at ``where`` without reading its pixels; problems are listed, not raised (a path that
    is not a cache, or a manifest that cannot be parsed, raises as ``read_manifest`` does)."""
    location = open_location(where)
    m = read_manifest(location)
    report = QuickReport(m, location)
    try:
        get_backend(m.storage).open(location, m)  # headers, sizes, chunks present: what every reader checks
        report.headers_checked += len(m.shards)
    except (CacheCorruptError, RemoteError) as e:
        report.problems.append(str(e))
    arrays = [(k, a) for k, a in m.arrays.items() if a.dtype != "str"]
    try:
        heads = location.read_heads([a.file for _, a in arrays], _HEAD)
    except (OSError, RemoteError) as e:
        report.problems.append(f"side arrays: {e}")
        heads = []
    for (_, a), head in zip(arrays, heads, strict=False):
        try:
            _, shape, dtype = npy_header(head, location.describe(a.file))
        except CacheCorruptError as e:
            report.problems.append(str(e))
            continue
        report.headers_checked += 1
        if tuple(shape) != a.shape or np.dtype(dtype) != np.dtype(a.dtype):
            report.problems.append(f"{a.file} holds {dtype}{list(shape)}, the manifest says {a.dtype}{list(a.shape)}")
    try:
        got = read_file_table(location, m)
    except CacheCorruptError as e:
        report.problems.append(str(e))
        got = None
    if got is not None:
        table = got[0]
        actual = _sizes(location, sorted(table))
        for name, entry in sorted(table.items()):
            size = actual[name]
            if size < 0:
                report.problems.append(f"{name}: missing (the file table lists it)")
            elif size != entry.size:
                report.problems.append(f"{name}: {size} bytes, the file table says {entry.size}")
        report.sizes_checked = len(table)
    columns = sorted(c.file for c in m.columns.values())  # outside the table: their sizes are in the manifest
    if columns:
        actual = _sizes(location, columns)
        for c in m.columns.values():
            if actual[c.file] != c.size:
                found = "missing" if actual[c.file] < 0 else f"{actual[c.file]} bytes"
                report.problems.append(f"{c.file}: {found}, the manifest's column entry says {c.size} bytes")
        report.sizes_checked += len(columns)
    return report
