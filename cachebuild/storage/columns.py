"""Columns: per-sample arrays added to a finished local cache without rewriting a pixel (format version 3 or 4).

A column is one ``.npy`` under ``columns/``, named ``NAME-<first 12 hex digits of its digest>.npy``, and one entry
in the manifest's ``columns`` (dtype, shape, digest and size of the whole file, by the manifest's algorithm: a
column added to a sha256 cache makes it version 3, to a version 4 one keeps 4). Adding one writes the file
(durably), then swaps ``manifest.json`` atomically: a crash leaves the old manifest, whose files are all there. A
reader keeps the manifest it opened; a new version of a column has another name, and a file no current manifest
names is deleted only once no reader holds an older one (each swap keeps the old manifest's inode linked as
``columns/held-*.json``, where readers hold a shared ``flock``). The caller holds the cache's writer lock.

What a column file may hold is checked whole before anything is written: a regular file (a FIFO or a device
is refused unread; a CSV or JSON at most ``TEXT_BYTES_PER_SAMPLE`` a sample), one value per sample (a JSON
object naming a path twice is refused, as a CSV row is), and every number one a column keeps exactly: CSV/JSON
integers inside int64 (never rounded into a float), floats that float32 holds, and no NaN or infinity in any
column file. Each refusal names the file, the sample and the fix.
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
import stat
from collections.abc import Iterator
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


# Text column files (CSV, JSON) may hold this many bytes per sample of the cache (a soft label of 1,000 classes
# in text is ~20 KB), and at least TEXT_FLOOR: a bound on what is read into memory, not a limit on real columns.
TEXT_BYTES_PER_SAMPLE = 64 << 10
TEXT_FLOOR = 64 << 20
_INT64 = (-(2**63), 2**63 - 1)
_FLOAT32_MAX = float(np.finfo(np.float32).max)


class _OutOfRange(int):
    """An integer of a CSV or JSON column file that int64 cannot hold, kept as read to be named."""


def _integer(text: str) -> int:
    value = int(text)
    return value if _INT64[0] <= value <= _INT64[1] else _OutOfRange(value)


def _leaves(value: Any) -> Iterator[Any]:
    if isinstance(value, list):
        for v in value:
            yield from _leaves(v)
    else:
        yield value


def _refuse_numbers(file: Path, values: np.ndarray, names: list[str]) -> None:
    """Refuse, naming the sample (``names``: per row), a float that is not finite or that float32 (what CSV/JSON
    floats become) turns into an infinity; and in an .npy, any float that is not finite."""
    if values.dtype.kind != "f" or not values.size:
        return
    rows = values.reshape(len(values), -1)
    finite = np.isfinite(rows)
    fits = finite & (np.abs(np.where(finite, rows, 0)) <= _FLOAT32_MAX) if values.dtype == np.float64 else finite
    bad = np.flatnonzero(~fits.all(axis=1))
    if not len(bad):
        return
    row = int(bad[0])
    value = float(rows[row][~fits[row]][0])
    why = ("is not a finite number; a column holds finite numbers only (NaN or an infinity makes a loss NaN): "
           "give every sample a number") if not np.isfinite(value) else \
        ("does not fit float32, which CSV/JSON numbers with a fraction become; rescale it, or write the column as "
         "an .npy of float64")
    raise ColumnError(f"{file}: the value {value!r} of {names[row]} {why}")


def _by_path(rows: dict[str, Any], paths: list[str], file: Path, flagged: bool) -> np.ndarray:
    """The values keyed by source path, in sample order; every sample's path must be there. ``flagged``: the
    reader met an integer outside int64 (found and named here)."""
    missing = [p for p in paths if p not in rows]
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ColumnError(f"{file} has no value for {len(missing)} of the cache's {len(paths)} samples ({shown}); "
                          f"key every sample by its source path as `cachebuild info` / paths.json name it")
    ordered = [rows[p] for p in paths]
    if flagged:
        for p, v in zip(paths, ordered, strict=True):
            big = next((x for x in _leaves(v) if isinstance(x, _OutOfRange)), None)
            if big is not None:
                raise ColumnError(f"{file}: the integer {int(big)} of {p!r} does not fit int64 (-2**63 to "
                                  f"2**63-1), which a column's integers are; rescale it, or write it as a float")
    try:
        values = np.asarray(ordered)
    except ValueError as e:  # ragged rows
        raise ColumnError(f"{file}: the values are not one shape for every sample ({e}); give each the same "
                          f"number of values") from None
    _refuse_numbers(file, values, [repr(p) for p in paths])
    if values.dtype.kind in "fc" or values.dtype == object:
        return values.astype(np.float32) if values.dtype.kind == "f" else values
    return values.astype(np.int64) if values.dtype.kind in "iu" else values


def _read_regular(file: Path, limit: int | None) -> tuple[int, int]:
    """An open descriptor of ``file`` and its size, refused unless it is a regular file (a FIFO would wait for a
    writer forever, a device never end) of at most ``limit`` bytes. Opened without waiting, then checked."""
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise ColumnError(f"{file} cannot be read as a column: {e.strerror or e}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ColumnError(f"{file} is not a regular file (a {_kind(st.st_mode)}); name a column file: an .npy, "
                          f".csv or .json")
    if limit is not None and st.st_size > limit:
        os.close(fd)
        raise ColumnError(f"{file} holds {st.st_size:,} bytes, over the {limit:,} a text column of this cache may "
                          f"hold; write a large column as an .npy")
    return fd, st.st_size


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "folder"), (stat.S_ISFIFO, "named pipe"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket")):
        if test(mode):
            return name
    return "special file"


def _read_text(file: Path, count: int) -> str:
    fd, size = _read_regular(file, max(TEXT_FLOOR, count * TEXT_BYTES_PER_SAMPLE))
    with os.fdopen(fd, "rb") as f:
        return f.read(size + 1).decode("utf-8")


def _read_npy(file: Path, count: int, cache: Path) -> np.ndarray:
    """An .npy's array, its header checked (one row per sample, a column dtype) before its data is read."""
    fd, _ = _read_regular(file, None)
    with os.fdopen(fd, "rb") as f:
        version = np.lib.format.read_magic(f)
        header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _fortran, dtype = header(f)
        _check_shape(file, str(dtype), shape, count, cache)
        f.seek(0)
        values = np.load(f, allow_pickle=False)
    _refuse_numbers(file, values, [f"sample {i}" for i in range(len(values))])
    return values


def _read_csv(file: Path, paths: list[str]) -> np.ndarray:
    """``path,value[,value...]`` rows (a header row of names is skipped)."""
    rows: dict[str, Any] = {}
    flagged = False

    def number(text: str) -> int | float:
        nonlocal flagged
        try:
            value = _integer(text)
        except ValueError:
            return float(text)
        flagged = flagged or isinstance(value, _OutOfRange)
        return value

    for i, row in enumerate(csv.reader(io.StringIO(_read_text(file, len(paths)), newline=""))):
        if not row:
            continue
        try:
            values = [number(v) for v in row[1:]]
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
    return _by_path(rows, paths, file, flagged)


def _read_json(file: Path, paths: list[str]) -> np.ndarray:
    """A JSON object ``{path: value}``; a path given twice is refused, as in a CSV (JSON keeps the last)."""
    flagged = False

    def integer(text: str) -> int:
        nonlocal flagged
        value = _integer(text)
        flagged = flagged or isinstance(value, _OutOfRange)
        return value

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise ColumnError(f"{file}: the path {key!r} is given twice; write one value per sample (JSON "
                                  f"readers keep the last silently, so the file is refused)")
            out[key] = value
        return out

    try:
        doc = json.loads(_read_text(file, len(paths)), object_pairs_hook=unique, parse_int=integer)
    except RecursionError:
        raise ColumnError(f"{file}: JSON nested too deeply to be a column; write an object {{path: value}}") from None
    if not isinstance(doc, dict):
        raise ColumnError(f"{file} holds a JSON {type(doc).__name__}; write an object {{path: value}}")
    return _by_path(doc, paths, file, flagged)


def read_values(file: str | os.PathLike[str], cache: Path, m: Manifest) -> np.ndarray:
    """The column in ``file``: an ``.npy`` of ``count`` rows in sample order, or a CSV / JSON object keyed by
    the samples' source paths (``paths.json``). Regular files only; every number checked (see the module doc)."""
    file = Path(file)
    suffix = file.suffix.lower()
    if suffix not in (".npy", ".csv", ".json"):
        raise ColumnError(f"{file}: a column comes from an .npy (one row per sample, in cache order), a .csv "
                          f"(path,value[,...]) or a .json object {{path: value}}; rename or convert it")
    try:
        if suffix == ".npy":
            values = _read_npy(file, m.count, cache)
        elif suffix == ".csv":
            values = _read_csv(file, load_paths(open_location(cache), m))
        else:
            values = _read_json(file, load_paths(open_location(cache), m))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        if isinstance(e, CacheBuildError):
            raise
        raise ColumnError(f"{file} cannot be read as a column: {e}") from None
    _check_shape(file, str(values.dtype), values.shape, m.count, cache)
    return np.ascontiguousarray(values)


def _check_shape(file: Path, dtype: str, shape: tuple[int, ...], count: int, cache: Path) -> None:
    if dtype not in COLUMN_DTYPES or not shape:
        raise ColumnError(f"{file} holds {dtype}{list(shape)}; a column is a numeric array "
                          f"({', '.join(COLUMN_DTYPES)}) with one row per sample: convert it")
    if shape[0] != count:
        raise ColumnError(f"{file} has {shape[0]} rows, the cache {cache} has {count} samples; give one "
                          f"row per sample in cache order (or key a CSV/JSON by source path)")


def _columns_dir(folder: Path) -> Path:
    """``folder/columns``, refused when it is a link or not a folder: columns are written, linked and deleted
    only inside the cache (a link would send them, and the sweep's deletions, elsewhere)."""
    cols = folder / COLUMNS_DIR
    if cols.is_symlink() or (cols.exists() and not cols.is_dir()):
        raise ColumnError(f"{cols} is {'a symbolic link' if cols.is_symlink() else 'not a folder'}, where a cache "
                          f"keeps its columns: nothing is written through it; put the cache's own columns folder "
                          f"back (or rebuild the cache)")
    return cols


def _swap_manifest(folder: Path, new: Manifest) -> None:
    """Keep the old manifest's inode linked (readers hold their lock on it), then swap in ``new`` atomically."""
    cols = _columns_dir(folder)
    cols.mkdir(exist_ok=True)
    os.link(folder / MANIFEST_NAME, cols / f"held-{os.getpid()}-{secrets.token_hex(4)}.json")
    write_bytes_atomic(folder / MANIFEST_NAME, manifest_bytes(new), durable=True)


def sweep_columns(folder: Path, m: Manifest) -> None:
    """Delete column files ``m`` does not name, once no reader holds an older manifest; then the held links."""
    cols = folder / COLUMNS_DIR
    if not cols.is_dir() or cols.is_symlink():
        return  # nothing of ours to delete, or a link: never swept through
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
    _columns_dir(folder).mkdir(exist_ok=True)
    write_bytes_atomic(folder / rel, data, durable=True)
    return ColumnInfo(file=rel, dtype=str(values.dtype), shape=tuple(values.shape), digest=digest, size=len(data))


def add_column(cache: str | os.PathLike[str], name: str, file: str | os.PathLike[str], *,
               replace: bool = False) -> Manifest:
    """Add column ``name`` from ``file`` to the local cache ``cache``; returns the new manifest."""
    folder = local_folder(cache)
    m = read_manifest(folder)
    _columns_dir(folder)
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
    _columns_dir(folder)
    if name not in m.columns:
        have = ", ".join(sorted(m.columns)) or "none"
        raise ColumnError(f"{folder} has no column {name!r} (its columns: {have}); `cachebuild columns ls "
                          f"{folder}` lists them")
    rest = {k: v for k, v in m.columns.items() if k != name}
    new = dataclasses.replace(m, columns=rest, format_version=columns_version(m.format_version, bool(rest)))
    _swap_manifest(folder, new)
    sweep_columns(folder, new)
    return new
