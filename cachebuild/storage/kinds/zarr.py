"""The ``zarr`` storage kind: one zarr v3 uint8 array (N, H, W, 3) in ``images.zarr``, chunked along samples; the
folder is also a zarr group with consolidated metadata, so ``xarray.open_zarr(cache)`` opens it. zarr-python is
the ``zarr`` extra, imported only here (a :class:`~cachebuild.errors.MissingExtraError` without it).

Workers write whole chunks into the one array from their block's plan position (blocks are whole chunks, so no
two share one); when files failed, one task moves the later blocks down afterwards (kill-safe: a marker).
Uncompressed arrays are read like npy shards (each chunk file *is* its rows: :class:`~cachebuild.storage.kinds.
npy.RowFiles`). Compressed ones go through zarr-python behind a strict store that turns a missing chunk into an
error naming it (zarr alone serves the fill value: black images), retries transient failures, keeps chunks in
the block cache, and reads a pinned cache's keys through its location: never another cache's pixels.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
from collections.abc import Callable, Collection
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
from joblib import Parallel, delayed

from cachebuild.atomic import write_json_atomic
from cachebuild.errors import (
    CacheBuildError,
    CacheChangedError,
    CacheCorruptError,
    OptionError,
    RemoteError,
    RemoteNotFoundError,
    RemoteUnavailableError,
    require_extra,
)
from cachebuild.format.manifest import BUILD, ShardInfo
from cachebuild.storage.kinds.base import Backend, BlockRecord, ImageStore, StorageParams
from cachebuild.storage.kinds.npy import RowFiles, Segment
from cachebuild.storage.locations import Location
from cachebuild.storage.remote.block_cache import BlockCache, BlockCacheFullError

if TYPE_CHECKING:
    from zarr.abc.store import ByteRequest
    from zarr.core.buffer import Buffer, BufferPrototype

    from cachebuild.format.manifest import Manifest

__all__ = ["COMPACTING", "COMPRESSIONS", "DIMENSIONS", "ZARR_CHUNK_TARGET_BYTES", "ZARR_NAME", "ZARR_WRITE_BYTES",
           "ZarrBackend", "ZarrChunkSink", "ZarrImages", "ZarrLayout", "chunk_name", "compact_zarr",
           "create_staging_zarr", "create_zarr_images", "open_zarr_for_writing", "place_zarr_blocks", "read_layout",
           "resolved_chunk", "undo_interrupted_compaction"]

log = logging.getLogger("cachebuild")

ZARR_NAME = "images.zarr"
DIMENSIONS = ("sample", "y", "x", "channel")  # zarr v3 dimension_names: xarray reads them
COMPACTING = "compacting.json"  # the marker of the moves, in the staging folder
ZARR_WRITE_BYTES = 16 << 20  # a zarr worker's write buffer (whole chunks)
ZARR_CHUNK_TARGET_BYTES = 4 << 20  # ~4 MB chunks: random reads stay cheap
COMPRESSIONS = ("none", "zstd", "blosc")
_VERIFY_CHUNKS_BYTES = 64 << 20


def zarr_module() -> ModuleType:
    """zarr-python, or the one-line error that names its extra."""
    return require_extra("zarr", "zarr", "a zarr cache (--format zarr)")


def resolved_chunk(opts: StorageParams) -> int:
    """Samples per chunk: ``chunk_size``, else about 4 MB of pixels."""
    if opts.chunk_size:
        return opts.chunk_size
    return int(min(1024, max(1, ZARR_CHUNK_TARGET_BYTES // (opts.size * opts.size * 3))))


# ---------------------------------------------------------------- write side

def create_zarr_images(path: Path, count: int, sample_shape: tuple[int, int, int], chunk: int,
                       compression: str = "none") -> Any:
    """A zarr v3 array (count, H, W, C) uint8, chunked along samples only."""
    zarr = zarr_module()
    from zarr.codecs import BloscCodec, ZstdCodec

    compressors: Any = None
    if compression == "zstd":
        compressors = ZstdCodec(level=3, checksum=True)  # a damaged chunk fails to decode, named by verify
    elif compression == "blosc":
        compressors = BloscCodec(cname="zstd", clevel=3, shuffle="bitshuffle")
    elif compression != "none":
        raise OptionError(f"unknown compression {compression!r}: expected one of {', '.join(COMPRESSIONS)}")
    # Every chunk is written, even an all-zero one: readers rely on the files being there, and zarr's emptiness
    # check costs several times the write itself.
    return zarr.create_array(store=str(path), shape=(count, *sample_shape), chunks=(max(1, chunk), *sample_shape),
                             dtype="uint8", compressors=compressors, fill_value=0, zarr_format=3,
                             dimension_names=DIMENSIONS, overwrite=True, config={"write_empty_chunks": True})


def open_zarr_for_writing(path: Path) -> Any:
    """Reopen an array made by :func:`create_zarr_images` to write whole chunks into it (``write_empty_chunks`` is
    a runtime setting, not stored with the array)."""
    zarr = zarr_module()
    with zarr.config.set({"array.write_empty_chunks": True}):
        arr = zarr.open_array(str(path), mode="r+")
    if not arr.config.write_empty_chunks:  # the setting must have been taken when the array was opened
        raise CacheBuildError(f"zarr {zarr.__version__} ignored write_empty_chunks for {path}")
    return arr


class ZarrChunkSink:
    """Samples gathered into a buffer of whole chunks (~16 MB), written to the zarr array from the block's
    plan position (its first chunk), so every write covers whole chunks but the block's last. One call
    per several chunks: zarr's per-call cost is paid per chunks written, not per sample."""

    def __init__(self, staging: Path, start: int, sample_shape: tuple[int, int, int]) -> None:
        self.array = open_zarr_for_writing(staging / ZARR_NAME)
        chunk = self.array.chunks[0]
        chunks = max(1, ZARR_WRITE_BYTES // (chunk * int(np.prod(sample_shape))))
        self.buffer = np.empty((chunk * chunks, *sample_shape), dtype=np.uint8)
        self.pos, self.fill = start, 0
        self.digest = BUILD.new()  # of the samples' pixels: zarr chunk files are not shards
        self.stored_bytes: int | None = None  # raw pixels (compressed or not, the manifest counts pixels)

    def next_slot(self) -> np.ndarray:
        return self.buffer[self.fill]

    def commit(self) -> None:
        self.digest.update(self.buffer[self.fill])
        self.fill += 1
        if self.fill == len(self.buffer):
            self._flush()

    def commit_stored(self, stored: Any) -> None:
        self.buffer[self.fill] = np.asarray(stored, dtype=np.uint8).reshape(self.buffer.shape[1:])
        self.commit()

    def _flush(self) -> None:
        if self.fill:
            self.array[self.pos : self.pos + self.fill] = self.buffer[: self.fill]
            self.pos += self.fill
            self.fill = 0

    def abort(self) -> None:
        pass  # the block's chunks are rewritten by whichever run finishes it

    def close(self) -> tuple[str, str]:
        self._flush()
        return ZARR_NAME, self.digest.hexdigest()


def create_staging_zarr(staging: Path, planned: int, sample_shape: tuple[int, int, int], chunk: int,
                        compression: str) -> None:
    """The zarr array every block writes into, one row per planned file (cut to the readable ones at the
    end); made under a temporary name and renamed, so a resumed build never finds half an array."""
    final = staging / ZARR_NAME
    if final.exists():
        return
    tmp = staging / (ZARR_NAME + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    create_zarr_images(tmp, planned, sample_shape, chunk, compression)
    tmp.rename(final)


def place_zarr_blocks(staging: Path, ordered: list[BlockRecord], count: int, planned: int) -> list[ShardInfo]:
    """Shard entries of a zarr cache: one range per block. Blocks after a failed file move down to their output
    place in one worker task (nothing moves when every file decoded). Moving in place cannot be redone after a
    kill (a move overwrites samples a later one reads), so a marker names the blocks involved first: a resumed
    build finding it unfinished decodes them again, one finding it done moves nothing twice."""
    shards, moves, pos = [], [], 0
    for r in ordered:
        if r.count:
            if r.start != pos:
                moves.append((r.start, pos, r.count))
            shards.append(ShardInfo(ZARR_NAME, pos, r.count, r.digest))
            pos += r.count
    marker = staging / COMPACTING
    if count < planned and not marker.exists():  # an existing marker here is a finished one
        first = next(r.block for r in ordered if r.count < r.planned)
        info = {"planned": planned, "redo": [r.block for r in ordered if r.block > first], "done": False}
        write_json_atomic(marker, info)
        Parallel(n_jobs=1)([delayed(compact_zarr)(str(staging), moves, count)])
        write_json_atomic(marker, {**info, "done": True})
    return shards


def undo_interrupted_compaction(staging: Path, forget_block: Callable[[int], None]) -> None:
    """After a kill while zarr blocks were being moved: ``forget_block`` each block whose samples may be
    clobbered, so it is decoded again (those up to the first failed file are untouched), and restore the
    planned length. The marker goes last: a kill in between repeats all of this."""
    marker = staging / COMPACTING
    if not marker.exists():
        return
    info = json.loads(marker.read_text())
    if info.get("done"):
        return  # every block is in place: the resumed build only has to commit
    for block in info["redo"]:
        forget_block(block)
    arr = open_zarr_for_writing(staging / ZARR_NAME)
    arr.resize((info["planned"], *arr.shape[1:]))
    log.info("the last run was stopped while moving zarr blocks: %d blocks will be decoded again", len(info["redo"]))
    marker.unlink()


def compact_zarr(staging: str, moves: list[tuple[int, int, int]], count: int) -> None:
    """Move each (plan start, output start, n) run of samples down to its output place, in order (a run only
    moves onto samples already moved), zero the rest of the last chunk, and cut the array to ``count`` samples."""
    arr = open_zarr_for_writing(Path(staging) / ZARR_NAME)
    planned = arr.shape[0]
    for src, dst, n in moves:
        arr[dst : dst + n] = arr[src : src + n]
    chunk = arr.chunks[0]
    tail_end = min(planned, -(-count // chunk) * chunk)
    if tail_end > count:
        arr[count:tail_end] = 0
    arr.resize((count, *arr.shape[1:]))


# ---------------------------------------------------------------- read side

ARRAY_METADATA = f"{ZARR_NAME}/zarr.json"


def chunk_name(k: int) -> str:
    """Chunk ``k`` of the images array, relative to the cache (default v3 keys, ``/`` separator)."""
    return f"{ZARR_NAME}/c/{k}/0/0/0"


class ZarrLayout(NamedTuple):
    """What the cache's ``images.zarr/zarr.json`` says, checked against the manifest."""

    chunk: int
    raw: bool  # only the bytes codec and default "/" chunk keys: chunk files are plain rows


def _mapping(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def read_layout(location: Location, manifest: Manifest) -> ZarrLayout:
    """The layout of the cache's array, from its metadata: checked as zarr itself parses it (codecs, their
    settings, fill value...) and against the manifest, so damaged metadata is named here, once, instead of
    every chunk failing to decode later."""
    name = ARRAY_METADATA
    where = location.describe(name)
    try:
        meta = json.loads(location.read_bytes(name))
    except (FileNotFoundError, RemoteError) as e:
        raise CacheCorruptError(f"zarr store {location.describe(ZARR_NAME)} cannot be opened: {e}") from None
    except (ValueError, RecursionError) as e:
        raise CacheCorruptError(f"{where} is not valid JSON: {e}: the zarr metadata is damaged; rebuild or "
                                f"re-fetch the cache") from None
    if not isinstance(meta, dict):
        raise CacheCorruptError(f"{where} holds a JSON {type(meta).__name__}, not zarr array metadata: damaged; "
                                f"rebuild or re-fetch the cache")
    expected = [manifest.count, *manifest.shape]
    grid = _mapping(_mapping(meta.get("chunk_grid")).get("configuration")).get("chunk_shape")
    if (meta.get("zarr_format") != 3 or meta.get("node_type") != "array" or meta.get("shape") != expected
            or meta.get("data_type") != "uint8" or not isinstance(grid, list) or len(grid) != 4
            or grid[1:] != list(manifest.shape) or not isinstance(grid[0], int) or grid[0] < 1):
        raise CacheCorruptError(
            f"zarr store {location.describe(ZARR_NAME)} holds {meta.get('data_type')}{meta.get('shape')} in chunks "
            f"{grid}, the manifest says uint8{expected} chunked along samples"
        )
    codecs = meta.get("codecs")
    enc = _mapping(meta.get("chunk_key_encoding"))
    default_keys = enc.get("name") == "default" and _mapping(enc.get("configuration")).get("separator", "/") == "/"
    if not default_keys:
        raise CacheCorruptError(f"{where}: chunk keys {enc} are not the default v3 '/' keys a cache uses")
    _check_metadata(meta, where)
    raw = (isinstance(codecs, list) and len(codecs) == 1 and _mapping(codecs[0]).get("name") == "bytes"
           and not meta.get("storage_transformers"))
    return ZarrLayout(int(grid[0]), raw)


def _check_metadata(meta: dict[str, Any], where: str) -> None:
    """Raise CacheCorruptError unless zarr parses ``meta`` (an unknown codec, a codec setting of the wrong type,
    a fill value that is not a number...): then no chunk could be decoded."""
    from zarr.core.metadata.v3 import ArrayV3Metadata

    try:
        ArrayV3Metadata.from_dict(dict(meta))
    except Exception as e:  # zarr raises its own, ValueError and TypeError for the many ways metadata is wrong
        raise CacheCorruptError(f"{where} cannot be read as zarr array metadata ({type(e).__name__}: {e}): the "
                                f"zarr metadata is damaged, so no chunk can be decoded; rebuild or re-fetch the "
                                f"cache") from None


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

    # the retry layer with it: a build that only lists this kind's names never imports it
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
            zarr = zarr_module()
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


# ---------------------------------------------------------------- the kind

class ZarrBackend(Backend):
    name = "zarr"
    # the array (and its temporary, create_staging_zarr), the compaction marker, the group metadata
    staging_names = r"images\.zarr(\.tmp)?|compacting\.json|zarr\.json"
    cache_names = frozenset({"zarr.json"})  # the group metadata that makes the folder readable by xarray
    metadata_files = (ARRAY_METADATA,)  # the array's: its codecs decode every chunk
    # each sink opens the array under zarr.config.set(...), a process-wide setting one thread's exit restores
    # under another's open (found by the threaded build: "ignored write_empty_chunks")
    threaded_sinks = False

    def align_block(self, block: int, opts: StorageParams) -> int:
        chunk = resolved_chunk(opts)  # whole chunks per block: workers never share a chunk
        return max(chunk, block // chunk * chunk)

    def build_params(self, opts: StorageParams) -> dict[str, Any]:
        zarr_module()
        if opts.compression not in COMPRESSIONS:
            raise OptionError(f"unknown compression {opts.compression!r}: expected one of {', '.join(COMPRESSIONS)}")
        return {"chunk_size": resolved_chunk(opts), "compression": opts.compression}

    def prepare(self, staging: Path, planned: int, sample_shape: tuple[int, int, int], opts: StorageParams) -> None:
        create_staging_zarr(staging, planned, sample_shape, resolved_chunk(opts), opts.compression)

    def resume(self, staging: Path, forget_block: Callable[[int], None]) -> None:
        undo_interrupted_compaction(staging, forget_block)

    def sink(self, staging: Path, block: int, start: int, planned: int,
             sample_shape: tuple[int, int, int], params: dict[str, Any]) -> ZarrChunkSink:
        return ZarrChunkSink(staging, start, sample_shape)

    def finish(self, staging: Path, ordered: list[BlockRecord], count: int, planned: int) -> list[ShardInfo]:
        return place_zarr_blocks(staging, ordered, count, planned)

    def cleanup(self, staging: Path) -> None:
        (staging / COMPACTING).unlink(missing_ok=True)

    def finalize_folder(self, staging: Path, manifest: Manifest) -> None:
        """Make the cache folder a zarr group with consolidated metadata (what ``xarray.open_zarr`` reads)."""
        array_meta = json.loads((staging / ZARR_NAME / "zarr.json").read_text(encoding="utf-8"))
        group = {
            "zarr_format": 3,
            "node_type": "group",
            "attributes": {"cachebuild": {"manifest": "manifest.json", "dataset": manifest.dataset,
                                          "split": manifest.split}},
            "consolidated_metadata": {"kind": "inline", "must_understand": False,
                                      "metadata": {ZARR_NAME: array_meta}},
        }
        write_json_atomic(staging / "zarr.json", group, durable=False)

    def open(self, location: Location, manifest: Manifest, *, block_cache: BlockCache | None = None) -> ZarrImages:
        zarr_module()
        layout = read_layout(location, manifest)
        check_chunks(location, manifest, layout)
        return ZarrImages(location, manifest, layout, block_cache)
