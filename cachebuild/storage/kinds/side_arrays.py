"""The per-sample arrays beside the images, the same for every storage kind: ``labels.npy``, ``sizes.npy``,
optional ``boxes.npy`` / ``coarse_labels.npy`` (plain ``.npy``, read with ``allow_pickle=False``) and
``paths.json`` (provenance). At a URL they are read whole; in a local folder the numeric ones are memory-mapped
(:func:`map_array`), so that a reader and each of its DataLoader workers share one copy in the page cache
instead of holding one each (16 bytes a sample: 20 MB a process at ImageNet's 1.28M). Columns (format version
3 and 4: arrays added after the build, ``columns/NAME-<digest prefix>.npy``) are read the same way
(:func:`load_column`). Written arrays are hashed with the build's algorithm (``format.digests.BUILD``), read ones
checked with the manifest's.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import numpy as np

from cachebuild.atomic import AtomicFile, write_bytes_atomic
from cachebuild.errors import CacheCorruptError, RemoteError
from cachebuild.format.manifest import BUILD, ArrayInfo, ColumnInfo, Digest, Manifest, decode_paths, encode_paths
from cachebuild.storage.kinds.rows import NPY_HEADER_ERRORS, npy_header
from cachebuild.storage.locations import Location

__all__ = ["PATHS_FILE", "array_digest", "load_array", "load_column", "load_paths", "map_array", "save_array",
           "save_paths"]

PATHS_FILE = "paths.json"


def array_digest(array: np.ndarray, algorithm: Digest) -> str:
    """``algorithm``'s digest of an array's raw C-order bytes."""
    flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    return algorithm.of(flat if flat.size else b"")


def save_array(folder: Path, name: str, array: np.ndarray) -> ArrayInfo:
    file = f"{name}.npy"
    with AtomicFile(folder / file) as f:
        np.save(f.file, array, allow_pickle=False)
    return ArrayInfo(file=file, dtype=str(array.dtype), shape=tuple(array.shape),
                     digest=array_digest(array, BUILD))


def _read(location: Location, file: str, what: str) -> bytes:
    try:
        return location.read_bytes(file)
    except (FileNotFoundError, RemoteError) as e:
        raise CacheCorruptError(f"{what} {location.describe(file)}, listed in the manifest, cannot be read: "
                                f"{e.strerror if isinstance(e, FileNotFoundError) else e}") from None


def load_array(location: Location, manifest: Manifest, name: str) -> np.ndarray:
    info = manifest.arrays.get(name)
    if info is None:
        raise CacheCorruptError(f"{location.describe()} has no {name!r} array (it has {sorted(manifest.arrays)})")
    if info.dtype == "str":
        return np.asarray(load_paths(location, manifest), dtype=object)
    data = _read(location, info.file, "array file")
    where = location.describe(info.file)
    try:
        arr = np.load(io.BytesIO(data), allow_pickle=False)
    except NPY_HEADER_ERRORS as e:
        raise CacheCorruptError(f"array file {where} is truncated or unreadable: {e}") from None
    if str(arr.dtype) != info.dtype or tuple(arr.shape) != info.shape:
        raise CacheCorruptError(
            f"{where} holds {arr.dtype}{list(arr.shape)}, the manifest says {info.dtype}{list(info.shape)}"
        )
    return arr


def map_array(location: Location, manifest: Manifest, name: str) -> np.ndarray:
    """``name`` memory-mapped (copy-on-write) from a local cache (the pinned folder: a rebuild renaming it aside does
    not change what is mapped); :func:`load_array` for a URL, a string array or an empty one."""
    info = manifest.arrays.get(name)
    if info is None or info.dtype == "str" or not location.is_local or 0 in info.shape:
        return load_array(location, manifest, name)
    return _map(location, info)


def load_column(location: Location, manifest: Manifest, name: str) -> np.ndarray:
    """Column ``name`` of the cache as ``manifest`` describes it: memory-mapped from a local cache, read whole
    (and checked against its digest) at a URL. The file name holds a prefix of its checksum, so a column added
    or replaced later never takes the place of the one this manifest names."""
    info = manifest.columns.get(name)
    if info is None:
        have = ", ".join(sorted(manifest.columns)) or "none"
        raise CacheCorruptError(f"{location.describe()} has no column {name!r} (its columns: {have}); add it with "
                                f"`cachebuild columns add CACHE {name} FILE`")
    if location.is_local and 0 not in info.shape:
        return _map(location, info)
    data = _read(location, info.file, "column file")
    where = location.describe(info.file)
    if manifest.digest.of(data) != info.digest:
        raise CacheCorruptError(f"column file {where} does not match the checksum its manifest records; "
                                f"re-fetch the cache or add the column again")
    try:
        arr = np.load(io.BytesIO(data), allow_pickle=False)
    except NPY_HEADER_ERRORS as e:
        raise CacheCorruptError(f"column file {where} is truncated or unreadable: {e}") from None
    if str(arr.dtype) != info.dtype or tuple(arr.shape) != info.shape:
        raise CacheCorruptError(f"{where} holds {arr.dtype}{list(arr.shape)}, the manifest says "
                                f"{info.dtype}{list(info.shape)}")
    return arr


def _map(location: Location, info: ArrayInfo | ColumnInfo) -> np.ndarray:
    where = location.describe(info.file)
    try:
        with location.open_file(info.file) as f:
            offset, shape, dtype = npy_header(f.read(4096), where)
            size = os.fstat(f.fileno()).st_size
            if str(dtype) != info.dtype or shape != info.shape:
                raise CacheCorruptError(f"{where} holds {dtype}{list(shape)}, the manifest says "
                                        f"{info.dtype}{list(info.shape)}")
            if size < offset + dtype.itemsize * int(np.prod(shape)):
                raise CacheCorruptError(f"array file {where} is truncated: {size} bytes")
            # copy-on-write: writable as an array read whole was (torch.from_numpy takes it without a warning),
            # a write stays in this process's copy of that page, and the file is never written
            mm = np.memmap(f, dtype=dtype, mode="c", offset=offset, shape=shape)
    except FileNotFoundError:
        raise CacheCorruptError(f"array file {where}, listed in the manifest, cannot be read: it is missing") from None
    return mm.view(np.ndarray)  # a plain ndarray over the map (np.memmap's slicing is slower)


def save_paths(folder: Path, paths: list[str]) -> ArrayInfo:
    """Provenance: the source path of every sample, as a JSON list (any character survives)."""
    data = json.dumps(encode_paths(paths), ensure_ascii=False).encode("utf-8")  # non-UTF-8 names too
    write_bytes_atomic(folder / PATHS_FILE, data, durable=False)
    return ArrayInfo(file=PATHS_FILE, dtype="str", shape=(len(paths),), digest=BUILD.of(data))


def load_paths(location: Location, manifest: Manifest) -> list[str]:
    info = manifest.arrays["paths"]
    where = location.describe(info.file)
    try:
        paths = json.loads(_read(location, info.file, "provenance file").decode("utf-8"))
    except ValueError as e:
        raise CacheCorruptError(f"provenance file {where} is damaged: {e}") from None
    if not isinstance(paths, list) or len(paths) != manifest.count:
        raise CacheCorruptError(f"{where} must list {manifest.count} paths")
    return decode_paths(paths, where)
