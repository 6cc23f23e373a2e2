"""Open a finished cache, local or at a URL: its manifest read and validated (against the storage kinds this
release knows), the backend's image store, side arrays, verification. Every reader of a cache (``info``,
``verify``, ``CachedImageDataset``, the benches) goes
through :class:`CacheReader`; the storage kind is the backend's business.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from cachebuild.errors import CacheCorruptError, CacheNotFoundError, RemoteError, RemoteNotFoundError
from cachebuild.format.manifest import MANIFEST_NAME, Manifest
from cachebuild.format.manifest import parse_manifest as parse_spec
from cachebuild.storage import BlockCache, ImageStore, Location, backend_names, get_backend, open_location
from cachebuild.storage.cache.file_table import read_file_table
from cachebuild.storage.kinds.side_arrays import array_digest, load_array, load_column, load_paths, map_array
from cachebuild.storage.locations.replacement import ReaderLock

__all__ = ["CacheReader", "not_a_cache", "open_cache", "parse_manifest", "read_manifest"]


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
            if root.is_dir():
                subs = sorted(p.name for p in root.iterdir()
                              if (p / MANIFEST_NAME).is_file() and ".replaced-" not in p.name)
                if subs:
                    hint = f"; it holds the caches {subs}: pass one of them, e.g. {root / subs[0]}"
                elif any(root.glob("*.partial")) or root.name.endswith(".partial"):
                    hint = "; a build into it is unfinished: rerun the same cachebuild command to resume it"
        elif isinstance(e, RemoteError) and not isinstance(e, RemoteNotFoundError):
            raise  # access denied, unreachable...: that, not "not a cache", is the news
        raise not_a_cache(location, hint) from None
    return parse_manifest(raw, location.describe(MANIFEST_NAME))


def not_a_cache(location: Location, hint: str = "") -> CacheNotFoundError:
    """The error for a location that holds no manifest."""
    return CacheNotFoundError(f"{location.describe()} is not a cachebuild cache (no {MANIFEST_NAME}){hint}")


class CacheReader:
    """A read-only view of one cache.

    Opening validates the manifest and checks every shard or chunk against it (headers, sizes, a listing:
    no pixel is read), so a missing, truncated or mis-shaped file is a named error here, not a crash later
    in a DataLoader worker. A local cache is pinned to the folder it opened and holds a shared lock on it
    while this object lives: a ``--force`` rebuild of the same path leaves it reading the old cache whole.
    A cache at a URL is pinned to the versions of its files (``If-Match``): after a ``push --force`` to the
    same URL, a read raises :class:`~cachebuild.errors.CacheChangedError` instead of serving the new bytes.

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
        # Memory-mapped in a local folder (read-only), read whole at a URL: storage.side_arrays.map_array.
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

    @property
    def chunk_size(self) -> int:
        return self.images.chunk_size

    @property
    def shard_starts(self) -> np.ndarray:
        """Start index of every shard, plus ``count`` at the end (for ``np.searchsorted``)."""
        return np.array([s.start for s in self.manifest.shards] + [self.manifest.count], dtype=np.int64)

    def array(self, name: str) -> np.ndarray:
        return load_array(self.location, self.manifest, name)

    def column(self, name: str) -> np.ndarray:
        """Column ``name`` (format version 3: added after the build) as the manifest opened names it."""
        return load_column(self.location, self.manifest, name)

    def paths(self) -> list[str]:
        """Provenance: the source path (relative to the source root) of every sample."""
        return load_paths(self.location, self.manifest)

    def read(self, indices: np.ndarray | list[int], out: np.ndarray | None = None) -> np.ndarray:
        """Samples ``indices`` (in that order) as one uint8 (N, H, W, 3) array."""
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
                    digest = array_digest(load_array(self.location, self.manifest, name), algorithm)
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
