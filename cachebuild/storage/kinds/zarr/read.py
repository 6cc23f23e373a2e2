"""The read side of the ``zarr`` storage kind.

Uncompressed arrays (only the ``bytes`` codec, default chunk keys) are read like npy shards: each chunk
file *is* its C-order rows, so chunks are memory-mapped locally and read by byte range remotely
(:class:`~cachebuild.storage.kinds.rows.RowFiles`); a random sample then costs its own bytes, not a whole
chunk. Compressed arrays go through zarr-python (a ``LocalStore``, or zarr's ``FsspecStore`` for URLs)
behind :class:`StrictStore`, which turns a missing chunk into an error naming it (zarr alone would serve
the fill value: black images), retries transient failures, and keeps fetched chunks in the local block
cache when one is given. For a pinned cache (a local folder by identity, a URL by file versions:
``cachebuild.storage.remote.pinning``) whole keys are fetched through its location: after a ``--force`` rebuild
of the folder the old chunks are still read from where the old folder went, and a chunk replaced at a URL
is a ``CacheChangedError``; never another cache's pixels.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import numpy as np

from cachebuild.errors import (
    CacheChangedError,
    CacheCorruptError,
    RemoteError,
    RemoteNotFoundError,
    RemoteUnavailableError,
)
from cachebuild.storage.kinds.base import ImageStore
from cachebuild.storage.kinds.rows import RowFiles, Segment
from cachebuild.storage.kinds.zarr.write import ZARR_NAME
from cachebuild.storage.locations import Location
from cachebuild.storage.remote.block_cache import BlockCache, BlockCacheFullError

if TYPE_CHECKING:
    from zarr.abc.store import ByteRequest
    from zarr.core.buffer import Buffer, BufferPrototype

    from cachebuild.format.manifest import Manifest

__all__ = ["ZarrImages", "ZarrLayout", "chunk_name", "read_layout"]

_VERIFY_CHUNKS_BYTES = 64 << 20


def chunk_name(k: int) -> str:
    """Chunk ``k`` of the images array, relative to the cache (default v3 keys, ``/`` separator)."""
    return f"{ZARR_NAME}/c/{k}/0/0/0"


class ZarrLayout:
    """What the cache's ``images.zarr/zarr.json`` says, checked against the manifest."""

    def __init__(self, chunk: int, raw: bool) -> None:
        self.chunk = chunk
        self.raw = raw  # only the bytes codec and default "/" chunk keys: chunk files are plain rows


def read_layout(location: Location, manifest: Manifest) -> ZarrLayout:
    name = f"{ZARR_NAME}/zarr.json"
    where = location.describe(name)
    try:
        meta = json.loads(location.read_bytes(name))
    except (FileNotFoundError, RemoteError) as e:
        raise CacheCorruptError(f"zarr store {location.describe(ZARR_NAME)} cannot be opened: {e}") from None
    except ValueError as e:
        raise CacheCorruptError(f"{where} is not valid JSON: {e}") from None
    expected = [manifest.count, *manifest.shape]
    grid = meta.get("chunk_grid", {}).get("configuration", {}).get("chunk_shape")
    if (meta.get("zarr_format") != 3 or meta.get("node_type") != "array" or meta.get("shape") != expected
            or meta.get("data_type") != "uint8" or not isinstance(grid, list) or len(grid) != 4
            or grid[1:] != list(manifest.shape) or not isinstance(grid[0], int) or grid[0] < 1):
        raise CacheCorruptError(
            f"zarr store {location.describe(ZARR_NAME)} holds {meta.get('data_type')}{meta.get('shape')} in chunks "
            f"{grid}, the manifest says uint8{expected} chunked along samples"
        )
    codecs = meta.get("codecs", [])
    enc = meta.get("chunk_key_encoding", {})
    default_keys = enc.get("name") == "default" and enc.get("configuration", {}).get("separator", "/") == "/"
    if not default_keys:
        raise CacheCorruptError(f"{where}: chunk keys {enc} are not the default v3 '/' keys a cache uses")
    raw = (len(codecs) == 1 and codecs[0].get("name") == "bytes" and not meta.get("storage_transformers"))
    return ZarrLayout(int(grid[0]), raw)


def check_chunks(location: Location, manifest: Manifest, layout: ZarrLayout) -> None:
    """Every chunk the manifest implies must exist (and, for raw chunks, hold whole rows): zarr would read a
    missing one as zeros. Locally one stat per chunk; remotely one listing where the store can list."""
    n_chunks = -(-manifest.count // layout.chunk)
    names = [chunk_name(k) for k in range(n_chunks)]
    full = layout.chunk * manifest.sample_nbytes
    if location.is_local:
        sizes: dict[str, int] = {}
        for name in names:
            try:
                sizes[name] = location.local_path(name).stat().st_size
            except FileNotFoundError:
                continue
    else:
        try:
            listed = location.child(ZARR_NAME).list_files()
        except RemoteError:
            return  # a server that cannot list (plain HTTP): StrictStore / range reads name a missing chunk
        sizes = {f"{ZARR_NAME}/{k}": v for k, v in listed.items()}
    missing = [n for n in names if n not in sizes]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise CacheCorruptError(f"zarr chunk {location.describe(missing[0])}{more} missing: the cache is damaged "
                                f"(zarr would read it as black images); rebuild or re-fetch it")
    if layout.raw:
        for name in names:
            if sizes[name] not in (full, -1):
                raise CacheCorruptError(f"zarr chunk {location.describe(name)} holds {sizes[name]} bytes, "
                                        f"expected {full}: truncated; rebuild or re-fetch the cache")


def _strict_store_class() -> type:
    from zarr.storage import WrapperStore

    # the retry layer with it: a build that only lists this kind's names never imports it (issue 36)
    from cachebuild.storage.remote.retry import Budget, Exhausted, acall

    class StrictStore(WrapperStore):
        """A zarr store that never serves a missing chunk as fill, retries transient failures and keeps
        fetched chunks in a local block cache."""

        def __init__(self, store: Any, where: str = "", block_cache: BlockCache | None = None,
                     cache_id: str = "", pinned: Location | None = None) -> None:
            super().__init__(store)
            self.where, self.block_cache, self.cache_id = where, block_cache, cache_id
            # a cache pinned to what it opened (a local folder by identity, a URL by file versions): whole-key
            # reads go through its location, never through a path that a rebuild may have handed to another cache
            self.pinned = pinned

        def _with_store(self, store: Any) -> StrictStore:
            return type(self)(store, self.where, self.block_cache, self.cache_id, self.pinned)

        async def _get_pinned(self, key: str, prototype: BufferPrototype) -> Buffer | None:
            assert self.pinned is not None
            try:  # a URL: retried, and a replaced file (If-Match) is a CacheChangedError
                data = await asyncio.to_thread(self.pinned.read_bytes, f"{ZARR_NAME}/{key}")
            except (RemoteNotFoundError, FileNotFoundError):
                return None
            return prototype.buffer.from_bytes(data)

        async def get(self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None
                      ) -> Buffer | None:
            is_chunk = key.startswith("c/")
            cache_key = BlockCache.key(self.cache_id, key) if is_chunk and self.block_cache and byte_range is None \
                else None
            if cache_key is not None:
                hit = self.block_cache.lookup_object(cache_key)  # type: ignore[union-attr]
                if hit is not None:
                    return prototype.buffer.from_bytes(hit)
            try:
                if self.pinned is not None and byte_range is None:
                    buf = await self._get_pinned(key, prototype)
                else:
                    buf = await acall(lambda: self._store.get(key, prototype, byte_range), Budget())
            except (CacheChangedError, RemoteUnavailableError):
                raise
            except Exhausted as e:
                raise RemoteUnavailableError(f"zarr key {self.where}/{key}: cannot read it after {e.attempts} "
                                             f"attempts in {e.elapsed:.1f} s; last answer: {e}", self.where,
                                             e.status, e.attempts) from None
            except Exception as e:
                raise CacheCorruptError(f"zarr {'chunk' if is_chunk else 'key'} {self.where}/{key}: cannot read it: "
                                        f"{type(e).__name__}: {str(e)[:200]}") from None
            if buf is None and is_chunk:
                raise CacheCorruptError(f"zarr chunk {self.where}/{key} is missing: the cache is damaged (zarr "
                                        f"would read it as black images); rebuild or re-fetch it")
            if buf is not None and cache_key is not None:
                data = buf.to_bytes()
                await asyncio.to_thread(self.block_cache.store_object, cache_key, data)  # type: ignore[union-attr]
            return buf

    return StrictStore


class ZarrImages(ImageStore):
    """Read side of a zarr cache (see the module doc). Picklable: the zarr array is opened per process."""

    def __init__(self, location: Location, manifest: Manifest, layout: ZarrLayout,
                 block_cache: BlockCache | None) -> None:
        self.location = location
        self.manifest = manifest
        self.layout = layout
        self.chunk_size = layout.chunk
        self.block_cache = None if location.is_local else block_cache
        self.rows: RowFiles | None = None
        if layout.raw:
            c = layout.chunk
            segments = [Segment(chunk_name(k), k * c, c, 0) for k in range(-(-manifest.count // c))]
            self.rows = RowFiles(location, segments, manifest.shape, block_cache=block_cache,
                                 cache_id=manifest.content_id)
        self._array: Any = None
        self._pid = os.getpid()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_array": None, "_pid": -1}

    def file_bounds(self) -> np.ndarray:
        """Chunk boundaries: each chunk is one file (zarr's default chunk keys)."""
        n = self.manifest.count
        return np.r_[np.arange(0, n, self.chunk_size), n].astype(np.int64)

    def read_files_whole(self) -> None:
        if self.rows is not None:  # compressed chunks are read whole already (zarr-python)
            self.rows.read_files_whole()

    @property
    def bytes_fetched(self) -> int:
        return self.rows.bytes_fetched if self.rows is not None else 0

    def array(self) -> Any:
        """The zarr array, opened in this process behind a :class:`StrictStore`."""
        if self._array is None or self._pid != os.getpid():
            import zarr
            from zarr.storage import FsspecStore, LocalStore

            if self.location.is_local:
                store: Any = LocalStore(self.location.local_path(ZARR_NAME), read_only=True)
            else:
                from cachebuild.storage.locations.url import FsspecLocation

                loc = self.location
                opts = loc.fs_options() if isinstance(loc, FsspecLocation) else {}
                store = FsspecStore.from_url(f"{loc.url}/{ZARR_NAME}", storage_options=opts, read_only=True)
                if hasattr(store.fs, "retries"):  # s3fs's own retry loop: one try, the remote layer retries it
                    store.fs.retries = 1
            strict = _strict_store_class()(store, self.location.describe(ZARR_NAME), self.block_cache,
                                           self.manifest.content_id,
                                           self.location if self.location.is_pinned else None)
            self._array = zarr.open_array(store=strict, mode="r", zarr_format=3)
            self._pid = os.getpid()
        return self._array

    def gather(self, idx: np.ndarray, out: np.ndarray) -> None:
        if self.rows is not None:
            self.rows.gather(idx, out)
            return
        order = np.argsort(idx, kind="stable")
        # zarr reads each touched chunk once for the whole sorted selection.
        try:
            block = self.array().get_orthogonal_selection((idx[order],))
        # a full local disk, or a store failing past the retries, is not a damaged chunk
        except (CacheCorruptError, CacheChangedError, BlockCacheFullError, RemoteUnavailableError):
            raise
        except Exception as e:  # a codec's own error (zstd, blosc...): find and name the chunk
            raise self._damaged(idx, e) from None
        inv = np.empty_like(order)
        inv[order] = np.arange(len(order))
        np.take(block, inv, axis=0, out=out, mode="clip")

    def _damaged(self, idx: np.ndarray, exc: Exception) -> CacheCorruptError:
        c = self.layout.chunk
        for k in np.unique(idx // c).tolist():
            try:
                self.array()[k * c : k * c + 1]
            except Exception:
                return CacheCorruptError(f"zarr chunk {self.location.describe(chunk_name(k))} cannot be decoded "
                                         f"({type(exc).__name__}: {exc}): the cache is damaged; rebuild or re-fetch it")
        where = self.location.describe(ZARR_NAME)
        return CacheCorruptError(f"zarr read of {where} failed: {type(exc).__name__}: {exc}")

    def verify(self, shards: Collection[int] | None = None) -> list[str]:
        """Re-hash each shard range (``shards``: those starting there), chunk by chunk so a damaged chunk is named."""
        problems = []
        c = self.layout.chunk
        step = max(1, _VERIFY_CHUNKS_BYTES // (c * self.manifest.sample_nbytes)) * c
        for s in self.manifest.shards:
            if shards is not None and s.start not in shards:
                continue
            h = self.manifest.digest.new()
            bad = None
            lo = s.start
            while lo < s.start + s.count and bad is None:
                hi = min(s.start + s.count, (lo // c + 1) * c, lo + step)
                buf = np.empty((hi - lo, *self.manifest.shape), dtype=np.uint8)
                try:
                    self.gather(np.arange(lo, hi), buf)
                except (OSError, ValueError, RuntimeError) as e:
                    bad = f"{chunk_name(lo // c)}: {e}"
                    break
                h.update(memoryview(buf).cast("B"))
                lo = hi
            if bad is not None:
                problems.append(bad)
            elif h.hexdigest() != s.digest:
                first, last = chunk_name(s.start // c), chunk_name((s.start + s.count - 1) // c)
                chunks = first if first == last else f"{first} .. {last}"
                problems.append(f"{s.file} samples [{s.start}, {s.start + s.count}) (chunks {chunks}): "
                                "checksum mismatch")
        return problems
