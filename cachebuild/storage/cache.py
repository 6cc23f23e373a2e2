"""A cache's own files, whatever its storage kind (the pixels are :mod:`cachebuild.storage.kinds`'): open and
verify a finished cache, local or at a URL (:class:`CacheReader`, :func:`open_cache`), and commit a staged one
(:func:`commit_cache`; :func:`write_cache` for in-memory images).

- ``manifest.json``: read and validated first, written last.
- Side arrays: ``labels.npy``, ``sizes.npy``, optional ``boxes.npy`` / ``coarse_labels.npy``, ``paths.json``, and
  columns added after the build; memory-mapped from a local cache (a reader and its DataLoader workers share one
  copy in the page cache), read whole at a URL.
- ``files.json``: the size and checksum of every file as bytes on disk, which a transfer checks file by file (a
  zarr shard's content spans many chunk files) and ``verify --quick`` by size; the manifest's ``files`` field
  holds its checksum. Caches built before it have none.
- ``source_files.json``: the per-file inputs of the source digest (path, label, size, mtime), so ``status`` says
  *what* changed, and a digest of each file's bytes as the build read them, so that a file whose mtime alone
  changed (a copy, a ``touch``) is known unchanged without decoding it.
- ``built_by``: a user and host name, nothing secret.

Written files are hashed with the build's algorithm (``format.manifest.BUILD``), read ones checked with the
manifest's (``Manifest.digest``).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import getpass
import io
import json
import os
import platform
import re
import shlex
import shutil
import socket
import sys
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from cachebuild.atomic import TEMPORARY_NAME, AtomicFile, fsync_dir, write_bytes_atomic
from cachebuild.errors import (
    CacheCorruptError,
    CacheExistsError,
    CacheNotFoundError,
    NoSuchBucketError,
    OptionError,
    RemoteError,
    RemoteNotFoundError,
)
from cachebuild.format.manifest import (
    BUILD,
    COLUMNS_DIR,
    DIGEST_VERSION,
    FORMAT_VERSION,
    MANIFEST_NAME,
    SHA256,
    SOURCE_DIGEST,
    ArrayInfo,
    ColumnInfo,
    Digest,
    Manifest,
    ShardInfo,
    check_name,
    decode_paths,
    encode_paths,
    entry_key,
    manifest_bytes,
)
from cachebuild.format.manifest import parse_manifest as parse_spec
from cachebuild.storage.kinds.base import BlockRecord, ImageStore, backend_names, digest_file, get_backend
from cachebuild.storage.kinds.npy import NPY_HEADER_ERRORS, npy_header
from cachebuild.storage.locations import Location, ReaderLock, is_url, open_location, redact, set_aside, sweep_replaced
from cachebuild.storage.remote.block_cache import BlockCache

__all__ = ["FILE_TABLE", "INPUTS_FORMAT", "PATHS_FILE", "SOURCE_INPUTS", "TABLE_FORMAT", "CacheReader", "FileEntry",
           "QuickReport", "SourceInputs", "array_digest", "built_by", "command_line", "commit_cache",
           "compute_file_table", "current_host", "current_user", "install_staged", "is_unfinished_write", "load_column",
           "load_paths", "load_source_inputs", "local_files", "map_array", "not_a_cache", "open_cache",
           "parse_file_table", "parse_manifest", "quick_check", "read_file_table", "read_manifest",
           "remove_unfinished_writes", "save_array", "save_paths", "save_side_arrays", "save_source_inputs",
           "staging_path", "tool_versions", "utc_now", "with_file_table", "write_cache"]


# ---------------------------------------------------------------- reading a cache

def parse_manifest(raw: bytes, where: str) -> Manifest:
    """Parse and validate a manifest's bytes (``cachebuild.format.manifest``), refusing a storage kind this
    release has no backend for; ``where`` names it in errors."""
    return parse_spec(raw, where, backend_names())


def read_manifest(where: str | os.PathLike[str] | Location) -> Manifest:
    """Parse and validate ``<where>/manifest.json`` (a folder or a URL); a named error for anything that is
    not a cache."""
    location = open_location(where)
    try:
        raw = location.read_bytes(MANIFEST_NAME)
    except (FileNotFoundError, NotADirectoryError, RemoteError) as e:
        hint = ""
        if location.is_local:
            root = location.local_path()
            if not os.path.lexists(root):
                raise CacheNotFoundError(f"{root} does not exist: name the folder of a cache (the one holding "
                                         f"{MANIFEST_NAME})") from None
            if root.is_dir():
                subs = sorted(p.name for p in root.iterdir()
                              if (p / MANIFEST_NAME).is_file() and ".replaced-" not in p.name)
                if subs:
                    hint = f"; it holds the caches {subs}: pass one of them, e.g. {root / subs[0]}"
                elif any(root.glob("*.partial")) or root.name.endswith(".partial"):
                    hint = "; a build into it is unfinished: rerun the same cachebuild command to resume it"
        elif isinstance(e, RemoteError) and (not isinstance(e, RemoteNotFoundError)
                                             or isinstance(e, NoSuchBucketError)):
            raise  # access denied, unreachable, no such bucket...: that, not "not a cache", is the news
        raise not_a_cache(location, hint) from None
    return parse_manifest(raw, location.describe(MANIFEST_NAME))


def not_a_cache(location: Location, hint: str = "") -> CacheNotFoundError:
    """The error for a location that holds no manifest."""
    return CacheNotFoundError(f"{location.describe()} is not a cachebuild cache (no {MANIFEST_NAME}){hint}")


class CacheReader:
    """A read-only view of one cache, local or at a URL (:func:`open_cache`)::

        from cachebuild.storage.cache import open_cache

        reader = open_cache("/caches/imagenet-224/train")  # or "s3://bucket/caches/imagenet-224/train"
        len(reader), reader.manifest.shape, reader.manifest.classes[:3]
        batch = reader.gather([3, 1, 4])  # uint8 (3, 224, 224, 3), NHWC, in that order
        labels = reader.labels[[3, 1, 4]]  # int64 class indices into manifest.classes
        assert reader.verify() == []  # every byte of the cache against its manifest

    Its surface: :attr:`manifest` (:class:`~cachebuild.format.manifest.Manifest`), ``len()``, :attr:`labels`,
    :meth:`gather`, :meth:`verify`; and what else a cache holds: :attr:`sizes` (each source image's (height,
    width)), :attr:`boxes` (``--fit pad`` only), :meth:`paths`, :meth:`array`, :meth:`column`, :attr:`location`
    (where it was opened). :attr:`images` (the storage kind's store) and :meth:`verify_arrays` serve
    cachebuild's own loaders and build.

    Opening validates the manifest and checks every shard or chunk against it (headers, sizes, a listing: no
    pixel is read), so a missing, truncated or mis-shaped file is a named error here, not a crash later in a
    DataLoader worker. A local cache is pinned to the folder it opened and holds a shared lock on it while this
    object lives: a ``--force`` rebuild of the same path leaves it reading the old cache whole. A cache at a URL
    is pinned to the versions of its files (``If-Match``): after a ``push --force`` to the same URL, a read
    raises :class:`~cachebuild.errors.CacheChangedError` instead of serving the new bytes.

    Args:
        where: a cache folder, or a URL (``s3://``, ``gs://``, ``https://``, ``file://``...).
        local_cache: a local folder (or a :class:`~cachebuild.storage.BlockCache`) for the block cache of remote
            reads, so a second epoch reads local disk; ignored for local caches.
        local_cache_bytes: the block cache's size bound.
        storage_options: passed to fsspec for URLs (credentials normally come from the store's own config).
    """

    def __init__(self, where: str | os.PathLike[str] | Location, *,
                 local_cache: str | os.PathLike[str] | BlockCache | None = None,
                 local_cache_bytes: int | None = None, storage_options: dict[str, Any] | None = None) -> None:
        location = open_location(where, storage_options)
        self._lock: ReaderLock | None = None
        if location.is_local:
            location = location.pinned() if location.local_path().is_dir() else location
            if getattr(location, "identity", None) is not None:
                self._lock = ReaderLock(location.local_path())
        else:  # every read is tied to the file versions of the cache opened now (storage.pinning)
            try:
                location = location.pinned(anchor=MANIFEST_NAME)
            except NoSuchBucketError:
                raise
            except RemoteNotFoundError:  # not "open unpinned": the manifest may appear a moment later
                raise not_a_cache(location) from None
        self.location = location
        self.manifest: Manifest = read_manifest(location)
        self.backend = get_backend(self.manifest.storage)
        self.block_cache: BlockCache | None = None
        if isinstance(local_cache, BlockCache):
            self.block_cache = local_cache
        elif local_cache is not None and not location.is_local:
            kw = {"max_bytes": int(local_cache_bytes)} if local_cache_bytes else {}
            self.block_cache = BlockCache(local_cache, **kw)
        self.images: ImageStore = self.backend.open(location, self.manifest, block_cache=self.block_cache)
        # Memory-mapped in a local folder (copy-on-write), read whole at a URL (map_array).
        self.labels: np.ndarray = map_array(location, self.manifest, "labels")
        self.sizes: np.ndarray = map_array(location, self.manifest, "sizes")
        self.boxes: np.ndarray | None = (
            map_array(location, self.manifest, "boxes") if "boxes" in self.manifest.arrays else None
        )

    @property
    def root(self) -> Path | str:
        """The folder (local caches) or URL (remote ones) this reader opened."""
        return self.location.local_path() if self.location.is_local else self.location.url

    def __len__(self) -> int:
        return self.manifest.count

    def array(self, name: str) -> np.ndarray:
        """Side array ``name`` (``labels``, ``sizes``, ``boxes``, ``coarse_labels``...)."""
        return map_array(self.location, self.manifest, name)

    def column(self, name: str) -> np.ndarray:
        """Column ``name`` (format version 3: added after the build) as the manifest opened names it."""
        return load_column(self.location, self.manifest, name)

    def paths(self) -> list[str]:
        """Provenance: the source path (relative to the source root) of every sample."""
        return load_paths(self.location, self.manifest)

    def gather(self, indices: Sequence[int] | np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Samples ``indices`` (any order) as one uint8 (N, H, W, 3) array, into ``out`` when
        given (a reused buffer of that shape); ``IndexError`` for an index outside ``[0, len)``."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if out is None:
            out = np.empty((len(idx), *self.manifest.shape), dtype=np.uint8)
        if len(idx) and (idx.min() < 0 or idx.max() >= self.manifest.count):
            raise IndexError(f"sample index out of range [0, {self.manifest.count})")
        self.images.gather(idx, out)
        return out

    def verify(self) -> list[str]:
        """Re-hash every shard and side array; return one line per mismatch (empty: intact). Remote caches
        are verified against the remote bytes, never against a local block cache."""
        damaged = self._damaged_metadata()
        if damaged:  # every sample would fail to decode: name the cause once, not each chunk
            problems = damaged + self.verify_arrays()
        else:
            images = self.images if self.block_cache is None else self.backend.open(self.location, self.manifest)
            problems = images.verify() + self.verify_arrays()
        algorithm = self.manifest.digest
        for col in self.manifest.columns.values():  # checksums of whole files, as paths.json's
            try:
                data = self.location.read_bytes(col.file)
            except (OSError, RemoteError) as e:
                problems.append(f"{col.file}: {e}")
                continue
            if len(data) != col.size or algorithm.of(data) != col.digest:
                problems.append(f"{col.file}: checksum mismatch (column)")
        return problems + self._verify_other_files(problems)

    def _damaged_metadata(self) -> list[str]:
        """The storage kind's metadata files (zarr's array metadata) that differ from the file table."""
        names = self.backend.metadata_files
        if not names:
            return []
        try:
            got = read_file_table(self.location, self.manifest)
        except CacheCorruptError:
            return []  # the file table's own problem is reported with the other files
        out = []
        for name in names:
            entry = got[0].get(name) if got is not None else None
            if entry is None:
                continue
            try:
                data = self.location.read_bytes(name)
            except (OSError, RemoteError) as e:
                out.append(f"{name}: {e}")
                continue
            if len(data) != entry.size or self.manifest.digest.of(data) != entry.digest:
                out.append(f"{name}: checksum mismatch (files.json): the metadata every sample is decoded with "
                           f"is damaged, so no sample was checked; rebuild or re-fetch the cache")
        return out

    def verify_arrays(self, names: Iterable[str] | None = None) -> list[str]:
        """Re-hash the side arrays ``names`` (None: every one); one line per mismatch."""
        problems = []
        algorithm = self.manifest.digest
        for name in self.manifest.arrays if names is None else names:
            info = self.manifest.arrays[name]
            try:
                if info.dtype == "str":
                    digest = algorithm.of(self.location.read_bytes(info.file))
                else:
                    digest = array_digest(map_array(self.location, self.manifest, name), algorithm)
            except (OSError, RemoteError, CacheCorruptError) as e:
                problems.append(f"{info.file}: {e}")
                continue
            if digest != info.digest:
                problems.append(f"{info.file}: checksum mismatch")
        return problems

    def _verify_other_files(self, named: list[str]) -> list[str]:
        """The file table against the manifest, then every file it lists that the checks above did not hash
        whole as a file (zarr chunks and metadata, side arrays' headers, ``source_files.json``) and did not
        already name in ``named``, by size and digest. With the manifest's own checksum (checked when it was
        read), every byte of the cache is covered."""
        m = self.manifest
        try:
            got = read_file_table(self.location, m)
        except CacheCorruptError as e:
            return [str(e)]
        if got is None:  # a cache built before file tables: its shards and arrays are all there is to check
            return []
        whole = {a.file for a in m.arrays.values() if a.dtype == "str"}
        if m.format_version >= 2 and self.backend.shard_digest_is_file:
            whole |= {s.file for s in m.shards}
        mentioned = {word.strip("():,") for p in named for word in p.split()}  # files already reported
        problems = []
        for name, entry in got[0].items():
            if name in whole or name in mentioned:
                continue
            try:
                data = self.location.read_bytes(name)
            except (OSError, RemoteError) as e:
                problems.append(f"{name}: {e}")
                continue
            if len(data) != entry.size:
                problems.append(f"{name}: {len(data)} bytes, files.json says {entry.size}")
            elif m.digest.of(data) != entry.digest:
                problems.append(f"{name}: checksum mismatch (files.json)")
        return problems


def open_cache(where: str | os.PathLike[str] | Location, **kw: Any) -> CacheReader:
    """Open and validate the cache at ``where`` (a folder holding ``manifest.json``, or its URL)."""
    return CacheReader(where, **kw)


# ---------------------------------------------------------------- side arrays

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


def map_array(location: Location, manifest: Manifest, name: str) -> np.ndarray:
    """Side array ``name``, memory-mapped (copy-on-write) from a local cache (the pinned folder: a rebuild renaming
    it aside does not change what is mapped), read whole at a URL; ``paths``: its decoded names."""
    info = manifest.arrays.get(name)
    if info is None:
        raise CacheCorruptError(f"{location.describe()} has no {name!r} array (it has {sorted(manifest.arrays)})")
    if info.dtype == "str":
        return np.asarray(load_paths(location, manifest), dtype=object)
    return _npy(location, info, "array file")


def load_column(location: Location, manifest: Manifest, name: str) -> np.ndarray:
    """Column ``name`` as ``manifest`` names it, as :func:`map_array` reads a side array (and checked against its
    whole-file digest when read whole). Its file name holds a prefix of its checksum, so a column added or
    replaced later never takes the place of the one this manifest names."""
    info = manifest.columns.get(name)
    if info is None:
        have = ", ".join(sorted(manifest.columns)) or "none"
        raise CacheCorruptError(f"{location.describe()} has no column {name!r} (its columns: {have}); add it with "
                                f"`cachebuild columns add CACHE {name} FILE`")
    return _npy(location, info, "column file", manifest.digest)


def _npy(location: Location, info: ArrayInfo | ColumnInfo, what: str, whole: Digest | None = None) -> np.ndarray:
    """The ``.npy`` file ``info`` names, checked against its dtype and shape: mapped locally (not an empty one),
    else read whole (and checked against ``info.digest`` by ``whole``, for columns)."""
    where = location.describe(info.file)
    if location.is_local and 0 not in info.shape:
        return _map(location, info, where)
    data = _read(location, info.file, what)
    if whole is not None and whole.of(data) != info.digest:
        raise CacheCorruptError(f"{what} {where} does not match the checksum its manifest records; re-fetch the "
                                f"cache or add the column again")
    try:
        arr = np.load(io.BytesIO(data), allow_pickle=False)
    except NPY_HEADER_ERRORS as e:
        raise CacheCorruptError(f"{what} {where} is truncated or unreadable: {e}") from None
    if str(arr.dtype) != info.dtype or tuple(arr.shape) != info.shape:
        raise CacheCorruptError(f"{where} holds {arr.dtype}{list(arr.shape)}, the manifest says "
                                f"{info.dtype}{list(info.shape)}")
    return arr


def _map(location: Location, info: ArrayInfo | ColumnInfo, where: str) -> np.ndarray:
    try:
        with location.open_file(info.file) as f:
            offset, shape, dtype = npy_header(f.read(4096), where)
            size = os.fstat(f.fileno()).st_size
            if str(dtype) != info.dtype or shape != info.shape:
                raise CacheCorruptError(f"{where} holds {dtype}{list(shape)}, the manifest says "
                                        f"{info.dtype}{list(info.shape)}")
            if size < offset + dtype.itemsize * int(np.prod(shape)):
                raise CacheCorruptError(f"array file {where} is truncated: {size} bytes")
            # copy-on-write: writable as an array read whole is (torch.from_numpy takes it without a warning), a
            # write stays in this process's copy of that page, and the file is never written
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


# ---------------------------------------------------------------- the file table

FILE_TABLE = "files.json"
TABLE_FORMAT = "cachebuild-files"
_ZARR_TMP = re.compile(r"\.[0-9a-f]{32}\.partial$")  # zarr-python's LocalStore writes "<key>.<uuid4 hex>.partial"
_UNFINISHED = re.compile(f"{TEMPORARY_NAME.pattern}|{_ZARR_TMP.pattern}")  # ours (atomic's) or zarr's


def is_unfinished_write(name: str) -> bool:
    """A temporary file of a write that never finished (ours or zarr's): never part of a cache."""
    return bool(_UNFINISHED.search(name))


@dataclass(frozen=True)
class FileEntry:
    size: int
    digest: str  # by the algorithm of the cache's manifest


def local_files(folder: Path, skip: Iterable[str] = (MANIFEST_NAME, FILE_TABLE)) -> dict[str, int]:
    """Every regular file below ``folder`` (relative name -> size), without ``skip`` and unfinished writes."""
    skipped = set(skip)
    out: dict[str, int] = {}
    for dirpath, _, names in os.walk(folder):
        rel = os.path.relpath(dirpath, folder)
        for name in names:
            full = os.path.join(dirpath, name)
            key = name if rel == "." else f"{rel}/{name}".replace(os.sep, "/")
            if key in skipped or _UNFINISHED.search(name) or not os.path.isfile(full) or os.path.islink(full):
                continue
            out[key] = os.stat(full).st_size
    return out


def compute_file_table(folder: Path, algorithm: Digest, jobs: int | None = None,
                       known: Mapping[str, str] | None = None) -> dict[str, FileEntry]:
    """Size and ``algorithm``'s digest of every file of the cache in ``folder`` (sorted by name); files in
    ``known`` (name -> digest of the file, as its writer hashed it while writing) are not read again."""
    # not the column files (an update carries them over): the manifest holds their sums, and `columns rm`
    # deletes them without rewriting this table
    sizes = {n: s for n, s in local_files(folder).items() if not n.startswith(f"{COLUMNS_DIR}/")}
    known = known or {}
    todo = sorted(n for n in sizes if n not in known)
    workers = jobs or min(16, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        digests = dict(zip(todo, pool.map(lambda n: digest_file(folder / n, algorithm), todo), strict=True))
    return {n: FileEntry(sizes[n], digests[n] if n in digests else known[n]) for n in sorted(sizes)}


def _encode(table: dict[str, FileEntry], digest: Digest, version: int) -> bytes:
    rows = [[name, e.size, e.digest] for name, e in sorted(table.items())]
    # One file per line: readable, and diffs of two tables stay small.
    body = ",\n".join(json.dumps(r, ensure_ascii=True) for r in rows)
    named = f', "digest": "{digest.name}"' if version >= DIGEST_VERSION else ""
    return f'{{"format": "{TABLE_FORMAT}"{named}, "files": [\n{body}\n]}}\n'.encode()


def with_file_table(folder: Path, manifest: Manifest) -> Manifest:
    """Write ``files.json`` for the finished cache in ``folder``; return ``manifest`` naming it. Kinds whose
    shard checksum is the file's own (npy since format 2, jpeg) are not hashed a second time."""
    known = ({s.file: s.digest for s in manifest.shards}
             if manifest.format_version >= 2 and get_backend(manifest.storage).shard_digest_is_file else None)
    digest = manifest.digest
    table = compute_file_table(folder, digest, known=known)
    data = _encode(table, digest, manifest.format_version)
    write_bytes_atomic(folder / FILE_TABLE, data, durable=False)
    ref = {"table": FILE_TABLE, "digest": digest.of(data), "count": len(table),
           "bytes": sum(e.size for e in table.values())}
    return dataclasses.replace(manifest, files=ref)


def parse_file_table(data: bytes, manifest: Manifest, where: str) -> dict[str, FileEntry]:
    """Check ``data`` against the manifest's ``files`` checksum and parse it (every name inside the cache)."""
    ref = manifest.files
    if manifest.digest.of(data) != ref["digest"]:
        raise CacheCorruptError(f"{where} does not match the checksum its manifest records: damaged or from "
                                f"another version of the cache; re-fetch or rebuild the cache")
    try:
        doc = json.loads(data.decode("utf-8"))
        if doc.get("format") != TABLE_FORMAT:
            raise ValueError(f"format is {doc.get('format')!r}, expected {TABLE_FORMAT!r}")
        if doc.get("digest", "sha256") != manifest.digest.name:
            raise ValueError(f"its digest is {doc.get('digest')!r}, the manifest's {manifest.digest.name!r}")
        table = {}
        for name, size, digest in doc["files"]:
            if not isinstance(size, int) or size < 0 or not isinstance(digest, str):
                raise ValueError(f"bad entry for {name!r}")
            table[check_name(name, "files.json name")] = FileEntry(size, digest)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        if isinstance(e, CacheCorruptError):
            raise
        raise CacheCorruptError(f"{where} is not a valid file table: {e}") from None
    if MANIFEST_NAME in table or ref["table"] in table or len(table) != ref["count"]:
        raise CacheCorruptError(f"{where} lists {len(table)} files, its manifest says {ref['count']} (and never "
                                f"{MANIFEST_NAME} or the table itself)")
    return table


def read_file_table(location: Location, manifest: Manifest) -> tuple[dict[str, FileEntry], bytes] | None:
    """(table, its bytes) of the cache at ``location``; None for a cache built before tables existed."""
    if not manifest.files:
        return None
    name = manifest.files["table"]
    try:
        data = location.read_bytes(name)
    except (FileNotFoundError, RemoteError) as e:
        raise CacheCorruptError(f"file table {location.describe(name)}, named by the manifest, cannot be read: "
                                f"{e}") from None
    return parse_file_table(data, manifest, location.describe(name)), data


# ---------------------------------------------------------------- the source table

SOURCE_INPUTS = "source_files.json"
INPUTS_FORMAT = "cachebuild-source-files"



class SourceInputs(NamedTuple):
    """The table as arrays: ``keys`` in the build's plan order and one int64 row (label, size, mtime_ns) each
    (half the memory of a dict of tuples: ~330 bytes a file while parsing, most of it the JSON); ``digests``, the
    :data:`~cachebuild.format.manifest.SOURCE_DIGEST` hex of each file's bytes as the build read them (``b""``:
    not known), or None for tables without them (earlier releases) or of another algorithm."""

    keys: list[str]
    rows: np.ndarray
    digests: np.ndarray | None = None


def save_source_inputs(folder: Path, keys: Sequence[str], labels: np.ndarray, stats: np.ndarray,
                       digests: np.ndarray | None = None) -> dict[str, Any]:
    """Write the table into ``folder`` (``digests``: one :data:`SOURCE_DIGEST` hex per key, ``b""`` where the file
    was not read); returns the manifest's ``source.inputs`` entry."""
    doc: dict[str, Any] = {"format": INPUTS_FORMAT, "keys": list(keys), "labels": np.asarray(labels).tolist(),
                           "sizes": stats[:, 0].tolist(), "mtimes_ns": stats[:, 1].tolist()}
    if digests is not None:  # an optional field: readers of earlier releases ignore it, and decode as they did
        if len(digests) != len(keys):
            raise ValueError(f"{len(digests)} digests for {len(keys)} source files: one each")
        doc["digest"] = SOURCE_DIGEST.name
        doc["digests"] = [d.decode() if d else None for d in np.asarray(digests, dtype="S").tolist()]
    data = json.dumps(doc, ensure_ascii=True).encode()  # ASCII: undecodable names survive as \udcxx escapes
    write_bytes_atomic(folder / SOURCE_INPUTS, data, durable=False)
    return {"file": SOURCE_INPUTS, entry_key(FORMAT_VERSION): BUILD.of(data)}  # a build's: format version 4


def _source_digests(doc: dict[str, Any], n: int) -> np.ndarray | None:
    """The table's digests as ``S16`` (``b""``: not known); None without them, or of an algorithm this release
    does not compute (a later one's: they cannot be compared, so every file is treated as it was before them)."""
    listed = doc.pop("digests", None)
    if listed is None or doc.get("digest") != SOURCE_DIGEST.name:
        return None
    if not isinstance(listed, list) or len(listed) != n or not set(map(type, listed)) <= {str, type(None)}:
        raise ValueError(f"digests must be a list of {n} hex strings (null: not read)")
    out = np.array([d or "" for d in listed], dtype=f"S{SOURCE_DIGEST.hex_len}")
    if n and not np.isin(np.char.str_len(out), (0, SOURCE_DIGEST.hex_len)).all():
        raise ValueError(f"each digest must be {SOURCE_DIGEST.hex_len} hex digits")
    return out


def load_source_inputs(location: Location, manifest: Manifest) -> SourceInputs | None:
    """The build's per-file inputs, or None when the cache has none (older caches, CIFAR)."""
    ref = manifest.source.get("inputs")
    if not ref:
        return None
    if not isinstance(ref, dict):
        raise CacheCorruptError(f"manifest field 'source.inputs' must be an object, got {ref!r}")
    name = check_name(ref.get("file"), "source.inputs.file")
    where = location.describe(name)
    try:
        data = location.read_bytes(name)
    except (FileNotFoundError, RemoteError) as e:
        raise CacheCorruptError(f"{where}, named by the manifest, cannot be read: {e}") from None
    if manifest.digest.of(data) != ref.get(entry_key(manifest.format_version)):
        raise CacheCorruptError(f"{where} does not match the checksum its manifest records: damaged; re-fetch "
                                f"or rebuild the cache")
    try:
        doc = json.loads(data)
        keys = doc["keys"]
        columns = [np.asarray(doc.pop(c), dtype=np.int64) for c in ("labels", "sizes", "mtimes_ns")]
        if not isinstance(keys, list) or not set(map(type, keys)) <= {str} or \
                any(c.shape != (len(keys),) for c in columns):
            raise ValueError("keys must be strings, one label, size and mtime each")
        digests = _source_digests(doc, len(keys))
        return SourceInputs(keys, np.stack(columns, axis=1) if keys else np.zeros((0, 3), np.int64), digests)
    except (ValueError, KeyError, TypeError, OverflowError) as e:
        raise CacheCorruptError(f"{where} is not a valid source table: {e}") from None


# ---------------------------------------------------------------- verify --quick

_HEAD = 4096


@dataclass
class QuickReport:
    """What ``verify --quick`` found: ``problems`` (empty: none), and how many sizes and headers it checked."""

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


# ---------------------------------------------------------------- committing a cache

def staging_path(out: Path) -> Path:
    """The build folder beside ``out`` (same filesystem, so the final rename is atomic)."""
    return out.with_name(out.name + ".partial")


def tool_versions() -> dict[str, Any]:
    from importlib.metadata import version

    import cv2

    return {"name": "cachebuild", "version": version("cachebuild"), "python": platform.python_version(),
            "numpy": np.__version__, "opencv": cv2.__version__}


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def save_side_arrays(staging: Path, labels: np.ndarray, sizes: np.ndarray, paths: list[str],
                     boxes: np.ndarray | None = None,
                     extra_labels: dict[str, np.ndarray] | None = None) -> dict[str, ArrayInfo]:
    """The per-sample arrays beside the images, in their on-disk dtypes; returns the manifest's ``arrays``."""
    arrays = {
        "labels": save_array(staging, "labels", np.asarray(labels, dtype=np.int64)),
        "sizes": save_array(staging, "sizes", np.asarray(sizes, dtype=np.int32)),
        "paths": save_paths(staging, paths),
    }
    if boxes is not None:
        arrays["boxes"] = save_array(staging, "boxes", np.asarray(boxes, dtype=np.int32))
    for name, values in (extra_labels or {}).items():
        arrays[name] = save_array(staging, name, np.asarray(values, dtype=np.int64))
    return arrays


def commit_cache(staging: Path, out: Path, manifest: Manifest, *, replace: bool = False) -> Manifest:
    """Write ``files.json`` and, last, ``manifest.json`` into ``staging`` and rename it to ``out`` (it appears only
    complete); returns the manifest as written. With ``replace``, a cache at ``out`` is renamed aside first and
    kept while jobs read it (:func:`~cachebuild.storage.locations.set_aside`)."""
    manifest.check_consistent()
    get_backend(manifest.storage).finalize_folder(staging, manifest)
    remove_unfinished_writes(staging)
    if not manifest.built_by:
        manifest = dataclasses.replace(manifest, built_by=built_by())
    manifest = with_file_table(staging, manifest)
    write_bytes_atomic(staging / MANIFEST_NAME, manifest_bytes(manifest))
    install_staged(staging, out, replace=replace)
    return manifest


def remove_unfinished_writes(staging: Path) -> None:
    """Leftovers of writers killed in an earlier run (ours and zarr's temporary files): never part of a cache."""
    for dirpath, _, names in os.walk(staging):
        for name in names:
            if is_unfinished_write(name):
                os.unlink(os.path.join(dirpath, name))


def install_staged(staging: Path, out: Path, *, replace: bool = False) -> None:
    """Rename the complete cache in ``staging`` (its manifest written) to ``out``; see :func:`commit_cache`."""
    if out.exists() or out.is_symlink():
        if not replace:
            raise CacheExistsError(f"{out} already exists; pass --force to replace it")
        if out.is_symlink() or not (out / MANIFEST_NAME).is_file():
            # --force replaces caches, never anything else (a source tree, a user's folder).
            raise CacheExistsError(f"{out} is not a cachebuild cache (no {MANIFEST_NAME}); refusing to replace it: "
                                   f"choose another output folder")
        set_aside(out)
    staging.rename(out)
    fsync_dir(out.parent)
    sweep_replaced(out)


class _ArrayOptions(NamedTuple):
    """The ``StorageParams`` of in-memory images."""

    size: int
    chunk_size: int | None
    compression: str
    quality: int
    subsampling: str


def _write_through_sinks(staging: Path, images: np.ndarray, storage: str, shard_size: int,
                         compression: str) -> list[ShardInfo]:
    from cachebuild.storage.kinds import jpeg  # its defaults, for a jpeg cache

    backend = get_backend(storage)
    sample_shape = (int(images.shape[1]), int(images.shape[2]), 3)
    opts = _ArrayOptions(sample_shape[0], min(shard_size, 64), compression, jpeg.DEFAULT_QUALITY,
                         jpeg.DEFAULT_SUBSAMPLING)
    try:
        params = backend.build_params(opts)
    except ValueError as e:  # what only the storage kind knows (npy and jpeg shards take no compression)
        raise OptionError(str(e)) from None
    block = backend.align_block(shard_size, opts)
    backend.prepare(staging, len(images), sample_shape, opts)
    records = []
    for b, lo in enumerate(range(0, len(images), block)):
        part = images[lo : lo + block]
        sink = backend.sink(staging, b, lo, len(part), sample_shape, params)
        try:
            for image in part:
                sink.next_slot()[...] = image
                sink.commit()
        except BaseException:
            sink.abort()
            raise
        file, digest = sink.close()
        records.append(BlockRecord(b, lo, len(part), len(part), file, digest, stored_bytes=sink.stored_bytes))
    shards = backend.finish(staging, records, len(images), len(images))
    backend.cleanup(staging)
    return shards


def write_cache(out: str | os.PathLike[str], images: np.ndarray, labels: np.ndarray, classes: list[str], *,
                storage: str = "npy", shard_size: int = 1024, sizes: np.ndarray | None = None,
                boxes: np.ndarray | None = None, paths: list[str] | None = None, dataset: str = "arrays",
                split: str = "train", fit: str = "crop", compression: str = "none", replace: bool = False) -> Manifest:
    """Write an in-memory (N, H, W, 3) uint8 array as a cache (tests, tools, small synthetic sets), through
    the storage kind's build path (prepare, one sink per block of ``shard_size`` samples, finish, commit):
    the files are those a build writes. jpeg: at the default quality and subsampling; zarr: chunks of
    ``min(shard_size, 64)`` samples, blocks of whole chunks."""
    out = Path(out)
    images = np.asarray(images)
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[3] != 3:
        raise OptionError(f"images must be uint8 (N, H, W, 3), got {images.dtype}{list(images.shape)}")
    n = len(images)
    sample_shape = (int(images.shape[1]), int(images.shape[2]), 3)
    staging = staging_path(out)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    shards = _write_through_sinks(staging, images, storage, shard_size, compression)
    if sizes is None:
        sizes = np.tile(np.array(sample_shape[:2], dtype=np.int32), (n, 1))
    arrays = save_side_arrays(staging, labels, sizes,
                              paths if paths is not None else [f"sample-{i}" for i in range(n)], boxes)
    key = array_digest(images, SHA256)  # identity, not a checksum: sha256 in every format version
    manifest = Manifest(dataset=dataset, split=split, count=n, shape=sample_shape, storage=storage,
                        classes=tuple(classes), fit=fit, interpolation="none",
                        source={"root": "", "fingerprint": key, "files": n},
                        build={"key": key, "writer": "write_cache", "shard_size": shard_size}, tool=tool_versions(),
                        shards=tuple(shards), arrays=arrays, created=utc_now())
    return commit_cache(staging, out, manifest, replace=replace)


# ---------------------------------------------------------------- who built it

def current_user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # a container uid without a passwd entry
        return f"uid {os.getuid()}"


def current_host() -> str:
    return socket.gethostname() or "unknown-host"


def command_line(argv: list[str] | None = None) -> str:
    """This process's command line, URLs redacted; ``python -m cachebuild ...`` shown as ``cachebuild ...``."""
    args = list(sys.argv if argv is None else argv)
    if not args:
        return ""
    head = os.path.basename(args[0])
    if head == "__main__.py":
        head = os.path.basename(os.path.dirname(args[0])) or head
    return " ".join(shlex.quote(redact(a) if is_url(a) else a) for a in [head, *args[1:]])


def built_by() -> dict[str, str]:
    """What a manifest records about who built it."""
    return {"user": current_user(), "host": current_host()}
