"""``--update`` of a cache with columns: each column's rows follow their samples into the new cache, by path.

A column (``cachebuild columns add``) holds one row per sample of the cache it was added to. An update adds,
removes and reorders samples; a row belongs to its sample's source path, so the new cache's row for a path
is the old row of that path, whether or not the file's pixels changed (a label-cleaning column keyed by path
stays true of a re-encoded image). A file the old cache had no sample for (added since, or unreadable then)
has no row: the update is refused before anything is written, naming it and how to proceed. Rows are
checked against the old manifest's checksums before they are carried (nothing damaged is copied into the new
cache), and written with the build's (``format.digests.BUILD``): an update of a sha256 cache makes a version 4 one.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cachebuild.errors import CacheBuildError, CacheExistsError
from cachebuild.format.manifest import BUILD, ColumnInfo, Manifest
from cachebuild.storage import Location
from cachebuild.storage.columns import write_column_file

__all__ = ["CarriedColumns", "plan_columns"]


@dataclass(frozen=True)
class CarriedColumns:
    """The old cache's columns, checked, and for every planned file the old sample whose row it takes."""

    values: dict[str, np.ndarray]  # name -> rows, one per old sample
    row_of: np.ndarray  # int64 (len(plan),): old sample of the same path

    def write(self, staging: Path, ok: np.ndarray) -> dict[str, ColumnInfo]:
        """Write each column's rows for the new samples (plan positions ``ok``) into ``staging``."""
        rows = self.row_of[ok]
        return {name: write_column_file(staging, name, np.ascontiguousarray(values[rows]), BUILD)
                for name, values in sorted(self.values.items())}


def plan_columns(out: Path, location: Location, m: Manifest, keys: Sequence[str], paths: list[str],
                 fix: str) -> CarriedColumns | None:
    """The columns of the cache at ``out`` (manifest ``m``, old sample paths ``paths``) carried to the planned
    ``keys``; None when it has none. Refuses a planned file without a row, or a damaged column file."""
    if not m.columns:
        return None
    if list(keys) == paths:  # nothing added, removed or moved (the usual update: files rewritten in place)
        row_of = np.arange(len(paths), dtype=np.int64)
    else:
        index = {p: i for i, p in enumerate(paths)}
        row_of = np.fromiter((index.get(k, -1) for k in keys), dtype=np.int64, count=len(keys))
    missing = np.flatnonzero(row_of < 0)
    names = ", ".join(sorted(m.columns))
    if len(missing):
        first = keys[int(missing[0])]
        raise CacheExistsError(
            f"cannot update {out}: it has columns ({names}) with one row per sample, and {len(missing)} planned "
            f"file(s) had no sample in it (first: {first}), so they have no row; remove the columns "
            f"(cachebuild columns rm), update, and add them again with rows for every file, or {fix}")
    values = {}
    for name, info in m.columns.items():
        data = location.read_bytes(info.file)
        if len(data) != info.size or m.digest.of(data) != info.digest:
            raise CacheBuildError(f"cannot update {out}: its column file {location.describe(info.file)} does not "
                                  f"match the checksum its manifest records: nothing damaged is carried over; "
                                  f"add the column again (cachebuild columns add --replace), or {fix}")
        values[name] = np.load(io.BytesIO(data), allow_pickle=False)
        if len(values[name]) != m.count:
            raise CacheBuildError(f"cannot update {out}: its column {name!r} has {len(values[name])} rows for "
                                  f"{m.count} samples; add the column again (cachebuild columns add --replace), "
                                  f"or {fix}")
    return CarriedColumns(values, row_of)
