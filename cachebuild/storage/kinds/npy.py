"""The ``npy`` storage kind: plain ``.npy`` shards of uint8 (n_k, H, W, 3), one per build block, and the reader of
fixed-size rows in files (:class:`RowFiles`) that uncompressed zarr chunks share.

A worker appends its block's samples to ``images-NNNNN.npy`` (a temporary name until the block is done) from one
reused buffer, hashing every byte it writes; a block that lost samples to bad files is shrunk in place. Since
format version 2 a shard's checksum is that of its whole file, so the file table reuses it (version 1: of the
pixel rows). Locally each file is memory-mapped once per process and a batch copies each row once into the
caller's buffer (one ``np.take`` when all rows are in one file: numpy has no gather from several arrays);
remotely the rows become byte ranges, adjacent rows coalesced, through the location and optionally a local
:class:`~cachebuild.storage.remote.block_cache.BlockCache`.
"""

from __future__ import annotations

import io
import tokenize
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from cachebuild.atomic import AtomicFile
from cachebuild.errors import CacheCorruptError, OptionError
from cachebuild.format.manifest import BUILD, Digest
from cachebuild.storage.kinds.base import (
    Backend,
    BlockRecord,
    ImageStore,
    ShardHandles,
    StorageParams,
    adopt_file,
    digest_file,
    digest_of_file,
    one_file_per_block,
)
from cachebuild.storage.locations import Location
from cachebuild.storage.remote.block_cache import BlockCache

if TYPE_CHECKING:
    from cachebuild.format.manifest import Manifest, ShardInfo

__all__ = ["DEFAULT_CHUNK_BYTES", "NPY_HEADER_ERRORS", "NpyBackend", "NpyImages", "NpyShardSink", "RowFiles", "Segment",
           "npy_header", "shard_file_name", "shrink_npy_shard"]

# Samples the chunk-aware sampler keeps together for npy caches: ~8 MB, the block size FFCV's
# quasi-random order uses.
DEFAULT_CHUNK_BYTES = 8 << 20
_VERIFY_ROWS = 256  # hash in slices: verifying a 150 GB cache never holds more than ~40 MB
_HEAD_BYTES = 4096  # every .npy header cachebuild writes is 128 bytes; numpy's are < 4 kB for our shapes


# What numpy's .npy header parser raises on damaged bytes: it tokenizes and literal_evals the header, so a
# flipped byte can surface as a syntax or tokenizer error, not only ValueError.
NPY_HEADER_ERRORS = (ValueError, EOFError, SyntaxError, tokenize.TokenError)


def npy_header(head: bytes | io.BytesIO, where: str) -> tuple[int, tuple[int, ...], np.dtype]:
    """(data offset, shape, dtype) of a ``.npy`` from its first bytes (or of the record at a stream's position,
    left after its header); a named error for anything else."""
    fmt = np.lib.format
    f = head if isinstance(head, io.BytesIO) else io.BytesIO(head)
    try:
        version = fmt.read_magic(f)
        read = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
        shape, fortran, dtype = read(f)
    except NPY_HEADER_ERRORS as e:
        raise CacheCorruptError(f"{where} is not a readable .npy file: {e}") from None
    if fortran:
        raise CacheCorruptError(f"{where} is stored in Fortran order; cache shards are C-ordered")
    return f.tell(), tuple(shape), dtype


def shard_file_name(index: int) -> str:
    return f"images-{index:05d}.npy"


def npy_header_bytes(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    """The ``.npy`` (version 1.0) header of a C-ordered ``dtype`` array of ``shape``."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
                                               "shape": shape})
    return buf.getvalue()


def shrink_npy_shard(path: Path, count: int) -> None:
    """Drop the unused tail rows of a shard in place: the first ``count`` rows are already where a shard of
    ``count`` rows keeps them, so only the header changes (its length too, rarely: the rows are then rewritten)."""
    with open(path, "r+b") as f:
        offset, shape, _ = npy_header(f.read(_HEAD_BYTES), str(path))
        head = npy_header_bytes(np.dtype(np.uint8), (count, *shape[1:]))
        row = int(np.prod(shape[1:]))
        if len(head) == offset:
            f.seek(0)
            f.write(head)
            f.truncate(offset + count * row)
            return
    src = np.load(path, mmap_mode="r")[:count]  # header length changed (rare): rewrite behind it
    with AtomicFile(path) as out:
        np.save(out.file, np.asarray(src))


class NpyShardSink:
    """A worker's block appended to its shard file (see the module doc)."""

    def __init__(self, staging: Path, block: int, planned: int, sample_shape: tuple[int, int, int],
                 algorithm: Digest = BUILD) -> None:
        self.out = AtomicFile(staging / shard_file_name(block))
        head = npy_header_bytes(np.dtype(np.uint8), (planned, *sample_shape))
        self.out.file.write(head)
        self.algorithm = algorithm  # a build's; another only in the sink's benchmark
        self.digest = algorithm.new()  # of the file as written, while each slot is hot in cache
        self.digest.update(head)
        self.slot = np.empty(sample_shape, dtype=np.uint8)
        self.planned, self.count = planned, 0
        self.stored_bytes: int | None = None  # raw pixels

    def next_slot(self) -> np.ndarray:
        return self.slot

    def commit(self) -> None:
        self.out.file.write(self.slot)
        self.digest.update(self.slot)
        self.count += 1

    def commit_stored(self, stored: Any) -> None:
        row = memoryview(stored).cast("B")
        if row.nbytes != self.slot.nbytes:
            raise ValueError(f"a stored npy row is {self.slot.nbytes} bytes, not {row.nbytes}")
        self.out.file.write(row)
        self.digest.update(row)
        self.count += 1

    def abort(self) -> None:
        self.out.discard()

    def close(self) -> tuple[str, str]:
        self.out.file.close()
        digest = self.digest.hexdigest()
        if self.count < self.planned:  # the header changes: hash the shrunk file again
            shrink_npy_shard(self.out.tmp, self.count)
            digest = digest_file(self.out.tmp, self.algorithm)
        self.out.commit()
        return self.out.path.name, digest


class NpyImages(ImageStore):
    """Read side of an npy cache: one row file per shard."""

    def __init__(self, location: Location, manifest: Manifest, offsets: list[int],
                 block_cache: BlockCache | None) -> None:
        self.manifest = manifest
        segments = [Segment(s.file, s.start, s.count, off) for s, off in zip(manifest.shards, offsets, strict=True)]
        self.rows = RowFiles(location, segments, manifest.shape, block_cache=block_cache, cache_id=manifest.content_id)
        self.chunk_size = max(1, DEFAULT_CHUNK_BYTES // manifest.sample_nbytes)

    @property
    def bytes_fetched(self) -> int:
        return self.rows.bytes_fetched

    def read_files_whole(self) -> None:
        self.rows.read_files_whole()

    def gather(self, idx: np.ndarray, out: np.ndarray) -> None:
        self.rows.gather(idx, out)

    def local_rows(self, idx: np.ndarray) -> list[np.ndarray] | None:
        return self.rows.local_rows(idx)

    def verify(self, shards: Collection[int] | None = None) -> list[str]:
        problems = []
        algorithm = self.manifest.digest
        for s in self.manifest.shards:
            if shards is not None and s.start not in shards:
                continue
            try:
                if self.manifest.format_version >= 2:  # the whole file (see the module doc)
                    got = digest_of_file(self.rows.location, s.file, self.rows.location.size(s.file), algorithm)
                else:
                    got = self._rows_digest(s.start, s.count, algorithm)
            except (OSError, CacheCorruptError) as e:
                problems.append(f"{s.file}: {e}")
                continue
            if got != s.digest:
                problems.append(f"{s.file} samples [{s.start}, {s.start + s.count}): checksum mismatch")
        return problems

    def _rows_digest(self, start: int, count: int, algorithm: Digest) -> str:
        """Version 1 caches: the digest (sha256) of the rows' pixel bytes, read in slices."""
        h = algorithm.new()
        buf = np.empty((_VERIFY_ROWS, *self.manifest.shape), dtype=np.uint8)
        for lo in range(start, start + count, _VERIFY_ROWS):
            hi = min(lo + _VERIFY_ROWS, start + count)
            self.rows.gather(np.arange(lo, hi), buf[: hi - lo])
            h.update(memoryview(buf[: hi - lo]).cast("B"))
        return h.hexdigest()


class NpyBackend(Backend):
    name = "npy"
    shard_digest_is_file = True
    adopts_shards = True
    staging_names = r"images-\d+\.npy(\.tmp|\.shrink)?"  # shards; AtomicFile's temporary; shrink_npy_shard's

    def build_params(self, opts: StorageParams) -> dict[str, Any]:
        if opts.compression != "none":
            raise OptionError(f"compression={opts.compression!r} does not apply to npy shards, which are stored raw "
                             f"(zarr storage compresses its chunks)")
        return {"chunk_size": None, "compression": "none"}

    def sink(self, staging: Path, block: int, start: int, planned: int,
             sample_shape: tuple[int, int, int], params: dict[str, Any]) -> NpyShardSink:
        return NpyShardSink(staging, block, planned, sample_shape)

    def finish(self, staging: Path, ordered: list[BlockRecord], count: int, planned: int) -> list[ShardInfo]:
        return one_file_per_block(staging, ordered)

    def adopt_shard(self, staging: Path, block: int, location: Location,
                    shard: ShardInfo) -> tuple[str, int | None] | None:
        name = shard_file_name(block)
        return (name, None) if adopt_file(location, shard, staging / name) else None

    def open(self, location: Location, manifest: Manifest, *, block_cache: BlockCache | None = None) -> NpyImages:
        """Check every shard's header against the manifest (and, locally, its size); no pixel is read."""
        h, w, c = manifest.shape
        offsets = []
        heads = _read_heads(location, [s.file for s in manifest.shards])
        for s, head in zip(manifest.shards, heads, strict=True):
            where = location.describe(s.file)
            offset, shape, dtype = npy_header(head, where)
            if dtype != np.uint8 or shape != (s.count, h, w, c):
                raise CacheCorruptError(
                    f"shard {where} holds {dtype}{list(shape)}, the manifest says uint8{[s.count, h, w, c]}")
            if location.is_local:
                size = location.local_path(s.file).stat().st_size
                if size < offset + s.count * manifest.sample_nbytes:
                    raise CacheCorruptError(f"shard {where} is truncated: {size} bytes, expected "
                                            f"{offset + s.count * manifest.sample_nbytes}")
            offsets.append(offset)
        return NpyImages(location, manifest, offsets, block_cache)


def _read_heads(location: Location, names: list[str]) -> list[bytes]:
    """The first bytes of every shard: locally one small read each, remotely one concurrent batch of ranges."""
    try:
        return location.read_heads(names, _HEAD_BYTES)
    except FileNotFoundError as e:
        raise CacheCorruptError(f"shard {e.filename}, listed in the manifest, is missing") from None


# ---------------------------------------------------------------- rows in files

@dataclass(frozen=True)
class Segment:
    """Samples ``[start, start + rows)`` in file ``name``, row 0 at byte ``offset``."""

    name: str
    start: int
    rows: int
    offset: int


class RowFiles(ShardHandles):
    """Gather rows of ``row_shape`` uint8 from ``segments`` under ``location`` (picklable; lazy per process)."""

    def __init__(self, location: Location, segments: Sequence[Segment], row_shape: tuple[int, ...], *,
                 block_cache: BlockCache | None = None, cache_id: str = "") -> None:
        super().__init__(location, len(segments), block_cache, cache_id)
        self.segments = tuple(segments)
        self.row_shape = tuple(row_shape)
        self.row_bytes = int(np.prod(row_shape))
        self.starts = np.array([s.start for s in self.segments] + [self.segments[-1].start + self.segments[-1].rows
                                                                   if self.segments else 0], dtype=np.int64)

    def _name_and_size(self, k: int) -> tuple[str, int]:
        seg = self.segments[k]
        return seg.name, seg.offset + seg.rows * self.row_bytes

    def _open_local(self, k: int) -> np.ndarray:
        """Segment ``k`` as a (rows, *row_shape) array over its memory map."""
        seg = self.segments[k]
        path = self.location.describe(seg.name)
        try:
            with self.location.open_file(seg.name) as f:  # rename-safe (pinned)
                mm = np.memmap(f, dtype=np.uint8, mode="r", offset=seg.offset, shape=(seg.rows, *self.row_shape))
        except FileNotFoundError:
            raise CacheCorruptError(f"{path}, listed in the manifest, is missing") from None
        except ValueError as e:  # mmap length larger than the file
            raise CacheCorruptError(f"{path} is truncated: {e}") from None
        return mm.view(np.ndarray)  # plain ndarray view: np.memmap slicing is slower

    def gather(self, idx: np.ndarray, out: np.ndarray) -> None:
        """Copy samples ``idx`` (any order, in range) into ``out`` (len(idx), *row_shape), one sorted pass."""
        if not len(idx):
            return
        order = np.argsort(idx, kind="stable")
        sorted_idx = idx[order]
        seg_of = np.searchsorted(self.starts, sorted_idx, side="right") - 1
        if not self.location.is_local:
            self._gather_remote(sorted_idx, order, seg_of, out)
            return
        if seg_of[0] == seg_of[-1]:  # one file: a single C-level gather in the requested order
            k = int(seg_of[0])
            np.take(self._handle(k), idx - self.starts[k], axis=0, out=out, mode="clip")
            return
        local = (sorted_idx - self.starts[seg_of]).tolist()
        current, arr = -1, None
        for pos, k, i in zip(order.tolist(), seg_of.tolist(), local, strict=True):
            if k != current:
                current, arr = k, self._handle(k)
            out[pos] = arr[i]  # type: ignore[index]

    def local_rows(self, idx: np.ndarray) -> list[np.ndarray] | None:
        """Read-only views of rows ``idx`` over their memory maps (no copy), or None when not local (a crop in the
        loader's workers then resizes straight from the stored bytes)."""
        if not self.location.is_local:
            return None
        seg_of = np.searchsorted(self.starts, idx, side="right") - 1
        return [self._handle(k)[i - self.starts[k]] for k, i in zip(seg_of.tolist(), idx.tolist(), strict=True)]

    def _gather_remote(self, sorted_idx: np.ndarray, order: np.ndarray, seg_of: np.ndarray, out: np.ndarray) -> None:
        bounds = np.flatnonzero(np.diff(seg_of)) + 1
        flat = out.reshape(len(out), -1)
        wanted: list[tuple[int, list[tuple[int, int]]]] = []
        places = []
        for lo, hi in zip(np.r_[0, bounds], np.r_[bounds, len(sorted_idx)], strict=True):
            k = int(seg_of[lo])
            seg = self.segments[k]
            rows = sorted_idx[lo:hi] - seg.start
            # Runs of consecutive rows become one byte range each: the bytes fetched are the bytes needed.
            cut = np.flatnonzero(np.diff(rows) != 1) + 1
            runs = list(zip(np.r_[0, cut].tolist(), np.r_[cut, len(rows)].tolist(), strict=True))
            ranges = [(seg.offset + int(rows[a]) * self.row_bytes, seg.offset + (int(rows[z - 1]) + 1) * self.row_bytes)
                      for a, z in runs]
            wanted.append((k, ranges))
            places.append((runs, order[lo:hi]))
            if self.whole_files:
                self.read_whole(k)
            elif len(runs) == 1 and hi - lo > 1:  # consecutive rows: a sequential read, whose next bytes are known
                self.read_ahead(k, ranges[0][1])
        for (runs, dest), datas in zip(places, self.read_files(wanted), strict=True):
            for (a, z), data in zip(runs, datas, strict=True):
                flat[dest[a:z]] = np.frombuffer(data, dtype=np.uint8).reshape(z - a, self.row_bytes)
