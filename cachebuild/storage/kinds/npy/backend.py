"""The ``npy`` storage kind: plain ``.npy`` shards of uint8 (n_k, H, W, 3), one per build block.

Write side: a worker appends its block's samples to ``images-NNNNN.npy`` (under a temporary name, renamed
when the block is done) with plain ``write`` calls from one reused buffer (measured 0.09 ms/sample against
0.15-0.25 ms for page-faulting a fresh memmap), hashing every byte it writes; a block that lost samples to
bad files is shrunk in place (and hashed again, a rare path).
Read side: :class:`~cachebuild.storage.kinds.rows.RowFiles` (memory maps locally, byte ranges remotely).

Checksums: since format version 2 a shard's manifest checksum is that of its whole file, header
included, so the build hashes each byte once and the file table reuses it (version 1: of the pixel rows
alone, which the commit then hashed again as a file: ~12% of a 2-process build at 224 px). The algorithm is
the manifest's (``format.digests``): a build hashes with xxh3-128 (version 4), where sha256 (versions 1-3) cost
0.087 ms of a 150 KB sample's ~1.1 ms in a worker; ``verify`` hashes with whatever the cache records.
"""

from __future__ import annotations

import io
from collections.abc import Collection
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
    StorageParams,
    adopt_file,
    digest_file,
    digest_of_file,
    one_file_per_block,
)
from cachebuild.storage.kinds.rows import RowFiles, Segment, npy_header
from cachebuild.storage.locations import Location
from cachebuild.storage.remote.block_cache import BlockCache

if TYPE_CHECKING:
    from cachebuild.format.manifest import Manifest, ShardInfo

__all__ = ["DEFAULT_CHUNK_BYTES", "NpyBackend", "NpyImages", "NpyShardSink", "shard_file_name", "shrink_npy_shard"]

# Samples the chunk-aware sampler keeps together for npy caches: ~8 MB, the block size FFCV's
# quasi-random order uses.
DEFAULT_CHUNK_BYTES = 8 << 20
_VERIFY_ROWS = 256  # hash in slices: verifying a 150 GB cache never holds more than ~40 MB
_HEAD_BYTES = 4096  # every .npy header cachebuild writes is 128 bytes; numpy's are < 4 kB for our shapes


def shard_file_name(index: int) -> str:
    return f"images-{index:05d}.npy"


def _header(count: int, sample_shape: tuple[int, ...]) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "|u1", "fortran_order": False,
                                               "shape": (count, *sample_shape)})
    return buf.getvalue()


def shrink_npy_shard(path: Path, count: int) -> None:
    """Drop the unused tail rows of a shard in place: rewrite its header for ``count`` rows and truncate.

    Rows are fixed-size and C-ordered, so the first ``count`` rows are already where a shard of ``count``
    rows keeps them; only the header's shape changes (numpy pads headers to 64 bytes, so its length
    normally stays the same; when it does not, the data is rewritten behind the new header).
    """
    with open(path, "r+b") as f:
        offset, shape, _ = npy_header(f.read(_HEAD_BYTES), str(path))
        head = _header(count, shape[1:])
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
        head = _header(planned, sample_shape)
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
