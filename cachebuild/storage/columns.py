"""Columns: per-sample arrays added to a finished local cache without rewriting a pixel (format version 3 or 4).

A column is one ``.npy`` under ``columns/``, named ``NAME-<first 12 hex digits of its digest>.npy``, and one entry
in the manifest's ``columns`` (dtype, shape, digest and size of the whole file, by the manifest's algorithm: a
column added to a sha256 cache makes it version 3, to a version 4 one keeps 4). Adding one writes the file
(durably), then swaps ``manifest.json`` atomically: a crash leaves the old manifest, whose files are all there. A
reader keeps the manifest it opened; a new version of a column has another name, and a file no current manifest
names is deleted only once no reader holds an older one (each swap keeps the old manifest's inode linked as
``columns/held-*.json``, where readers hold a shared ``flock``). The caller holds the cache's writer lock.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import io
import json
import os
import re
import secrets
from pathlib import Path
from typing import Any

import numpy as np

from cachebuild.atomic import write_bytes_atomic
from cachebuild.errors import CacheBuildError, OptionError
from cachebuild.format.manifest import (
    COLUMN_DTYPES,
    COLUMN_NAME,
    COLUMNS_DIR,
    COLUMNS_VERSION,
    DIGEST_VERSION,
    MANIFEST_NAME,
    PLAIN_VERSION,
    ColumnInfo,
    Digest,
    Manifest,
    manifest_bytes,
)
from cachebuild.storage import open_location
from cachebuild.storage.cache import load_paths, read_manifest
from cachebuild.storage.locations import is_locked

__all__ = ["COLUMNS_DIR", "ColumnError", "add_column", "columns_version", "is_own_columns_folder", "local_folder",
           "read_values", "remove_column", "sweep_columns", "write_column_file"]

_OWN = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,63}-[0-9a-f]{12}\.npy|held-\d+-[0-9a-f]{8}\.json|\..+\.tmp")
RESERVED = ("images", "labels", "sizes", "paths", "boxes", "coarse_labels")


class ColumnError(OptionError):
    """A column that cannot be added or removed as asked (the message names the file and the fix)."""


def is_own_columns_folder(folder: Path) -> bool:
    """True when ``folder`` holds only files this module writes (so a ``--force`` rebuild may replace it)."""
    try:
        return folder.is_dir() and not folder.is_symlink() and all(_OWN.fullmatch(n) for n in os.listdir(folder))
    except OSError:
        return False


def local_folder(cache: str | os.PathLike[str]) -> Path:
    location = open_location(cache)
    if not location.is_local:
        raise ColumnError(f"{location.describe()}: columns are added to and removed from a local cache only "
                          f"(a URL is read-only here): pull it, change its columns, push it back with --force")
    return location.local_path()


def _check_name(name: str, m: Manifest, folder: Path) -> None:
    if name in RESERVED or name in m.arrays:
        raise ColumnError(f"{folder}: {name!r} is a built-in array of every cache; choose another column name "
                          f"(train on it with `cachebuild train --labels NAME`)")
    if not COLUMN_NAME.fullmatch(name):
        raise ColumnError(f"{name!r} is not a column name: use letters, digits, '_' and '-' (64 at most), "
                          f"starting with a letter or '_'")


def _by_path(rows: dict[str, Any], paths: list[str], file: Path) -> np.ndarray:
    """The values keyed by source path, in sample order; every sample's path must be there."""
    missing = [p for p in paths if p not in rows]
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ColumnError(f"{file} has no value for {len(missing)} of the cache's {len(paths)} samples ({shown}); "
                          f"key every sample by its source path as `cachebuild info` / paths.json name it")
    try:
        values = np.asarray([rows[p] for p in paths])
    except ValueError as e:  # ragged rows
        raise ColumnError(f"{file}: the values are not one shape for every sample ({e}); give each the same "
                          f"number of values") from None
    if values.dtype.kind in "fc" or values.dtype == object:
        return values.astype(np.float32) if values.dtype.kind == "f" else values
    return values.astype(np.int64) if values.dtype.kind in "iu" else values


def _number(text: str) -> int | float:
    try:
        return int(text)
    except ValueError:
        return float(text)


def _read_csv(file: Path, paths: list[str]) -> np.ndarray:
    """``path,value[,value...]`` rows (a header row of names is skipped)."""
    rows: dict[str, Any] = {}
    with open(file, newline="", encoding="utf-8") as f:
        for i, row in enumerate(csv.reader(f)):
            if not row:
                continue
            try:
                values = [_number(v) for v in row[1:]]
            except ValueError:
                if i == 0:
                    continue  # the header
                raise ColumnError(f"{file}, line {i + 1}: {row[1:]!r} are not numbers; write path,value[,...] "
                                  f"rows of numbers") from None
            if not values or row[0] in rows:
                why = "no value" if not values else "a path seen before"
                raise ColumnError(f"{file}, line {i + 1}: {why} ({row[0]!r}); write one path,value[,...] row "
                                  f"per sample")
            rows[row[0]] = values[0] if len(values) == 1 else values
    return _by_path(rows, paths, file)


def read_values(file: str | os.PathLike[str], cache: Path, m: Manifest) -> np.ndarray:
    """The column in ``file``: an ``.npy`` of ``count`` rows in sample order, or a CSV / JSON object keyed by
    the samples' source paths (``paths.json``)."""
    file = Path(file)
    suffix = file.suffix.lower()
    if suffix not in (".npy", ".csv", ".json"):
        raise ColumnError(f"{file}: a column comes from an .npy (one row per sample, in cache order), a .csv "
                          f"(path,value[,...]) or a .json object {{path: value}}; rename or convert it")
    try:
        if suffix == ".npy":
            values = np.load(file, allow_pickle=False)
        elif suffix == ".csv":
            values = _read_csv(file, load_paths(open_location(cache), m))
        else:
            doc = json.loads(file.read_text(encoding="utf-8"))
            if not isinstance(doc, dict):
                raise ColumnError(f"{file} holds a JSON {type(doc).__name__}; write an object {{path: value}}")
            values = _by_path(doc, load_paths(open_location(cache), m), file)
    except (OSError, ValueError, UnicodeDecodeError) as e:
        if isinstance(e, CacheBuildError):
            raise
        raise ColumnError(f"{file} cannot be read as a column: {e}") from None
    if str(values.dtype) not in COLUMN_DTYPES or values.ndim == 0:
        raise ColumnError(f"{file} holds {values.dtype}{list(values.shape)}; a column is a numeric array "
                          f"({', '.join(COLUMN_DTYPES)}) with one row per sample: convert it")
    if values.shape[0] != m.count:
        raise ColumnError(f"{file} has {values.shape[0]} rows, the cache {cache} has {m.count} samples; give one "
                          f"row per sample in cache order (or key a CSV/JSON by source path)")
    return np.ascontiguousarray(values)


def _swap_manifest(folder: Path, new: Manifest) -> None:
    """Keep the old manifest's inode linked (readers hold their lock on it), then swap in ``new`` atomically."""
    cols = folder / COLUMNS_DIR
    cols.mkdir(exist_ok=True)
    os.link(folder / MANIFEST_NAME, cols / f"held-{os.getpid()}-{secrets.token_hex(4)}.json")
    write_bytes_atomic(folder / MANIFEST_NAME, manifest_bytes(new), durable=True)


def sweep_columns(folder: Path, m: Manifest) -> None:
    """Delete column files ``m`` does not name, once no reader holds an older manifest; then the held links."""
    cols = folder / COLUMNS_DIR
    if not cols.is_dir():
        return
    held = sorted(cols.glob("held-*.json"))
    if any(is_locked(p) for p in held):
        return
    named = {c.file.rsplit("/", 1)[-1] for c in m.columns.values()}
    for p in cols.iterdir():
        if p.name not in named and _OWN.fullmatch(p.name):
            p.unlink()
    with contextlib.suppress(OSError):
        cols.rmdir()  # empty: the cache has no columns left


def columns_version(version: int, has_columns: bool) -> int:
    """The format version a cache of ``version`` is written as once it holds columns or not: version 4 stays 4
    (its checksums are not sha256); a sha256 cache is 3 with columns and 2 without (what older readers read)."""
    if version >= DIGEST_VERSION:
        return version
    return COLUMNS_VERSION if has_columns else PLAIN_VERSION


def write_column_file(folder: Path, name: str, values: np.ndarray, algorithm: Digest) -> ColumnInfo:
    """Write ``values`` as column ``name``'s file under ``folder/columns/`` (durably: a manifest may name it only
    once it is whole); returns the manifest's entry for it, its digest by ``algorithm`` (the manifest's)."""
    buf = io.BytesIO()
    np.save(buf, values, allow_pickle=False)
    data = buf.getvalue()
    digest = algorithm.of(data)
    rel = f"{COLUMNS_DIR}/{name}-{digest[:12]}.npy"
    (folder / COLUMNS_DIR).mkdir(exist_ok=True)
    write_bytes_atomic(folder / rel, data, durable=True)
    return ColumnInfo(file=rel, dtype=str(values.dtype), shape=tuple(values.shape), digest=digest, size=len(data))


def add_column(cache: str | os.PathLike[str], name: str, file: str | os.PathLike[str], *,
               replace: bool = False) -> Manifest:
    """Add column ``name`` from ``file`` to the local cache ``cache``; returns the new manifest."""
    folder = local_folder(cache)
    m = read_manifest(folder)
    _check_name(name, m, folder)
    if name in m.columns and not replace:
        raise ColumnError(f"{folder} already has a column {name!r}; pass --replace to replace it, or choose "
                          f"another name")
    if m.format_version < PLAIN_VERSION:
        raise ColumnError(f"{folder} is a format version {m.format_version} cache; rebuild it with this release "
                          f"(--force) before adding columns")
    info = write_column_file(folder, name, read_values(file, folder, m), m.digest)
    new = dataclasses.replace(m, columns={**m.columns, name: info}, format_version=columns_version(m.format_version,
                                                                                                    True))
    new.check_consistent()
    _swap_manifest(folder, new)
    sweep_columns(folder, new)
    return new


def remove_column(cache: str | os.PathLike[str], name: str) -> Manifest:
    """Remove column ``name`` from the local cache ``cache`` (its file goes once no reader holds it)."""
    folder = local_folder(cache)
    m = read_manifest(folder)
    if name not in m.columns:
        have = ", ".join(sorted(m.columns)) or "none"
        raise ColumnError(f"{folder} has no column {name!r} (its columns: {have}); `cachebuild columns ls "
                          f"{folder}` lists them")
    rest = {k: v for k, v in m.columns.items() if k != name}
    new = dataclasses.replace(m, columns=rest, format_version=columns_version(m.format_version, bool(rest)))
    _swap_manifest(folder, new)
    sweep_columns(folder, new)
    return new
